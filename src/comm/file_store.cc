// FileStore: an append-only log of records in one file, shared by every process that opens it.
// See docs/store.md for the format.
//
// Each process keeps the map the log describes and the offset up to which it has applied it; an
// operation first applies what others appended since. Writers hold flock(LOCK_EX) from catching up
// to appending, so read-modify-write operations (add, compare_set) are atomic across processes;
// readers take LOCK_SH only when the file has grown. Threads of one process serialise on a mutex,
// because flock locks belong to the open file, which the threads share.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "chorus/comm/error.h"
#include "chorus/comm/store.h"
#include "socket.h"
#include "store_internal.h"

namespace chorus {
namespace {

constexpr char kFileHeader[8] = {'C', 'H', 'R', 'S', 'F', 'S', '1', '\n'};
constexpr size_t kRecordHeadBytes = 9;  // u8 type | u32 key_len | u32 value_len
constexpr uint8_t kRecordSet = 1;
constexpr uint8_t kRecordDelete = 2;

std::string errno_text(int err) {
  return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")";
}

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

// flock(2) held for a scope.
class FileLock {
 public:
  FileLock(int fd, int operation, const std::string& store) : fd_(fd) {
    while (::flock(fd, operation) != 0) {
      if (errno == EINTR) continue;
      throw Error(store + ": flock failed: " + errno_text(errno) +
                  "; the filesystem must support flock(2) for a FileStore");
    }
  }
  ~FileLock() { ::flock(fd_, LOCK_UN); }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  int fd_;
};

}  // namespace

struct FileStore::State {
  std::mutex mu;  // serialises this object's threads; guards everything below
  std::string path;
  std::string name;  // describe()
  net::Fd fd;
  pid_t pid = -1;       // the process that opened `fd`
  uint64_t offset = 0;  // bytes of the file already applied to `map`
  std::unordered_map<std::string, std::string> map;

  void open() {
    net::Fd f(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666));
    if (!f.valid()) {
      throw Error(name + ": cannot open " + path + ": " + errno_text(errno) +
                  "; check that the directory exists and every rank can write to it");
    }
    fd = std::move(f);
    pid = ::getpid();
    offset = 0;
    map.clear();
  }

  // A child forked after the store was opened shares the parent's open file, and with it the
  // parent's flock; it gets a file of its own so that the lock excludes the parent again.
  void ensure_own_file() {
    if (pid != ::getpid()) open();
  }

  uint64_t file_size() {
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) throw Error(name + ": fstat failed: " + errno_text(errno));
    return static_cast<uint64_t>(st.st_size);
  }

  // Applies the complete records appended since `offset`; the caller holds a flock. Returns the
  // file size, which exceeds `offset` afterwards only by a record a crashed writer left unfinished.
  uint64_t catch_up() {
    uint64_t size = file_size();
    if (size < offset) {  // truncated by hand: start over
      offset = 0;
      map.clear();
    }
    if (size == offset) return size;
    std::string buf(size - offset, '\0');
    size_t got = 0;
    while (got < buf.size()) {
      ssize_t k = ::pread(fd.get(), &buf[got], buf.size() - got, static_cast<off_t>(offset + got));
      if (k < 0 && errno == EINTR) continue;
      if (k < 0) throw Error(name + ": read failed: " + errno_text(errno));
      if (k == 0) break;
      got += static_cast<size_t>(k);
    }
    buf.resize(got);
    size_t pos = 0;
    if (offset == 0) {
      if (buf.size() < sizeof(kFileHeader)) return size;
      if (std::memcmp(buf.data(), kFileHeader, sizeof(kFileHeader)) != 0) {
        throw Error(name + ": " + path + " is not a chorus FileStore file (bad header); " +
                    "delete it or choose another path");
      }
      pos = sizeof(kFileHeader);
    }
    while (buf.size() - pos >= kRecordHeadBytes) {
      const uint8_t type = static_cast<uint8_t>(buf[pos]);
      const uint64_t key_len = get_u32(&buf[pos + 1]);
      const uint64_t value_len = get_u32(&buf[pos + 5]);
      if (type != kRecordSet && type != kRecordDelete) {
        throw Error(name + ": corrupt record at offset " + std::to_string(offset + pos) +
                    " (type " + std::to_string(type) +
                    "); was the file written by another program? " +
                    "delete it and restart the job");
      }
      if (buf.size() - pos - kRecordHeadBytes < key_len + value_len) break;  // unfinished record
      const char* key = &buf[pos + kRecordHeadBytes];
      if (type == kRecordSet) {
        map[std::string(key, key_len)].assign(key + key_len, value_len);
      } else {
        map.erase(std::string(key, key_len));
      }
      pos += kRecordHeadBytes + key_len + value_len;
    }
    offset += pos;
    return size;
  }

  // Appends one record; the caller holds LOCK_EX and `map` reflects the whole file.
  void append(uint8_t type, const std::string& key, const std::string& value, uint64_t size) {
    if (key.size() > UINT32_MAX || value.size() > UINT32_MAX) {
      throw UsageError(name + ": keys and values must be shorter than 4 GiB");
    }
    if (size > offset && ::ftruncate(fd.get(), static_cast<off_t>(offset)) != 0) {
      throw Error(name + ": cannot drop an unfinished record: " + errno_text(errno));
    }
    std::string record;
    record.reserve(sizeof(kFileHeader) + kRecordHeadBytes + key.size() + value.size());
    if (offset == 0) record.append(kFileHeader, sizeof(kFileHeader));
    record.push_back(static_cast<char>(type));
    put_u32(record, static_cast<uint32_t>(key.size()));
    put_u32(record, static_cast<uint32_t>(value.size()));
    record += key;
    record += value;
    size_t done = 0;
    while (done < record.size()) {
      ssize_t k = ::pwrite(fd.get(), record.data() + done, record.size() - done,
                           static_cast<off_t>(offset + done));
      if (k < 0 && errno == EINTR) continue;
      // A partial record left behind is dropped by the next writer.
      if (k < 0) throw Error(name + ": write to " + path + " failed: " + errno_text(errno));
      done += static_cast<size_t>(k);
    }
    offset += record.size();
    if (type == kRecordSet) {
      map[key] = value;
    } else {
      map.erase(key);
    }
  }

  // Brings `map` up to date; takes the shared lock only when the file has changed.
  void refresh() {
    ensure_own_file();
    if (file_size() == offset) return;
    FileLock lock(fd.get(), LOCK_SH, name);
    catch_up();
  }

  std::vector<std::string> missing(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    for (const auto& k : keys) {
      if (map.count(k) == 0) out.push_back(k);
    }
    return out;
  }

  // Polls the file with a backoff from 1 ms to 50 ms until every key exists. With `value`, returns
  // keys[0]'s value read under the same lock.
  void poll(const std::vector<std::string>& keys, std::chrono::milliseconds timeout,
            std::string* value) {
    const auto start = net::Clock::now();
    const net::Deadline deadline = net::deadline_after(timeout);
    auto backoff = std::chrono::milliseconds(1);
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu);
        refresh();
        std::vector<std::string> absent = missing(keys);
        if (absent.empty()) {
          if (value != nullptr) *value = map.at(keys[0]);
          return;
        }
        const auto now = net::Clock::now();
        if (now >= deadline) {
          throw TimeoutError(detail::wait_timeout_message(
              name, keys, absent, now - start,
              "check that every rank reached this point and uses the same file"));
        }
      }
      std::this_thread::sleep_for(
          std::min<net::Clock::duration>(backoff, deadline - net::Clock::now()));
      backoff = std::min(backoff * 2, std::chrono::milliseconds(50));
    }
  }
};

FileStore::FileStore(std::string path, std::chrono::milliseconds timeout)
    : path_(std::move(path)), state_(std::make_unique<State>()) {
  if (path_.empty()) throw UsageError("FileStore needs a file path");
  set_timeout(timeout);
  state_->path = path_;
  state_->name = describe();
  state_->open();
}

FileStore::~FileStore() = default;

void FileStore::set(const std::string& key, const std::string& value) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->ensure_own_file();
  FileLock flock(state_->fd.get(), LOCK_EX, state_->name);
  uint64_t size = state_->catch_up();
  state_->append(kRecordSet, key, value, size);
}

std::string FileStore::get(const std::string& key) {
  std::string value;
  state_->poll({key}, timeout(), &value);
  return value;
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->ensure_own_file();
  FileLock flock(state_->fd.get(), LOCK_EX, state_->name);
  uint64_t size = state_->catch_up();
  auto it = state_->map.find(key);
  int64_t result = 0;
  std::string error;
  if (!detail::add_to_value(key, it == state_->map.end() ? nullptr : &it->second, delta, &result,
                            &error)) {
    throw UsageError(state_->name + ": " + error);
  }
  state_->append(kRecordSet, key, std::to_string(result), size);
  return result;
}

std::string FileStore::compare_set(const std::string& key, const std::string& expected,
                                   const std::string& desired) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->ensure_own_file();
  FileLock flock(state_->fd.get(), LOCK_EX, state_->name);
  uint64_t size = state_->catch_up();
  auto it = state_->map.find(key);
  if (it == state_->map.end()) {
    if (!expected.empty()) return expected;
  } else if (it->second != expected) {
    return it->second;
  }
  state_->append(kRecordSet, key, desired, size);
  return desired;
}

void FileStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  state_->poll(keys, timeout, nullptr);
}

bool FileStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->refresh();
  return state_->missing(keys).empty();
}

bool FileStore::delete_key(const std::string& key) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->ensure_own_file();
  FileLock flock(state_->fd.get(), LOCK_EX, state_->name);
  uint64_t size = state_->catch_up();
  if (state_->map.count(key) == 0) return false;
  state_->append(kRecordDelete, key, "", size);
  return true;
}

int64_t FileStore::num_keys() {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->refresh();
  return static_cast<int64_t>(state_->map.size());
}

}  // namespace chorus
