// The S3 client's local cache: one file per object, LRU by bytes, use order kept in the files' mtimes.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>

#include "s3_internal.h"

namespace chorus::data::s3_detail {
namespace {

constexpr const char* kTempPrefix = ".tmp-";

bool write_all(int fd, const std::uint8_t* p, std::size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

}  // namespace

DiskCache::DiskCache(std::string dir, std::uint64_t max_bytes) : dir_(std::move(dir)), max_bytes_(max_bytes) {
  ::mkdir(dir_.c_str(), 0755);  // EEXIST is fine; any other failure shows as misses
  // Adopt what earlier runs left, oldest use first; temporary files of dead writers are removed.
  struct Found {
    std::string name;
    std::uint64_t size;
    struct timespec mtime;
  };
  std::vector<Found> found;
  if (DIR* d = ::opendir(dir_.c_str())) {
    while (struct dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      std::string path = dir_ + "/" + name;
      struct stat st;
      if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
      if (name.rfind(kTempPrefix, 0) == 0) {
        // Another live process may be writing it: only remove those an hour old.
        if (::time(nullptr) - st.st_mtim.tv_sec > 3600) ::unlink(path.c_str());
        continue;
      }
      found.push_back({name, static_cast<std::uint64_t>(st.st_size), st.st_mtim});
    }
    ::closedir(d);
  }
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) {
    return a.mtime.tv_sec != b.mtime.tv_sec ? a.mtime.tv_sec < b.mtime.tv_sec : a.mtime.tv_nsec < b.mtime.tv_nsec;
  });
  std::lock_guard<std::mutex> lock(mu_);
  for (const Found& f : found) {
    Entry e{f.size, next_tick_++};
    entries_[f.name] = e;
    by_use_[e.tick] = f.name;
    total_ += f.size;
  }
  while (total_ > max_bytes_ && !by_use_.empty()) erase_locked(by_use_.begin()->second);
}

std::optional<std::vector<std::uint8_t>> DiskCache::get(const std::string& name, std::int64_t expected_size) {
  std::string path = dir_ + "/" + name;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    std::lock_guard<std::mutex> lock(mu_);
    if (entries_.count(name)) erase_locked(name);  // evicted by another process
    return std::nullopt;
  }
  struct stat st;
  std::vector<std::uint8_t> bytes;
  bool ok = ::fstat(fd, &st) == 0;
  if (ok) {
    bytes.resize(static_cast<std::size_t>(st.st_size));
    std::size_t got = 0;
    while (got < bytes.size()) {
      ssize_t r = ::read(fd, bytes.data() + got, bytes.size() - got);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) break;
      got += static_cast<std::size_t>(r);
    }
    ok = got == bytes.size() && (expected_size < 0 || static_cast<std::int64_t>(got) == expected_size);
  }
  if (ok) ::futimens(fd, nullptr);  // mtime = now: the use order survives a restart
  ::close(fd);
  std::lock_guard<std::mutex> lock(mu_);
  if (!ok) {
    if (entries_.count(name)) erase_locked(name);
    ::unlink(path.c_str());
    return std::nullopt;
  }
  auto it = entries_.find(name);
  if (it == entries_.end()) {  // written by another process since we scanned
    Entry e{bytes.size(), next_tick_++};
    entries_[name] = e;
    by_use_[e.tick] = name;
    total_ += e.size;
  } else {
    touch_locked(name, it->second);
  }
  return bytes;
}

void DiskCache::put(const std::string& name, const std::vector<std::uint8_t>& bytes) {
  if (bytes.size() > max_bytes_) return;
  static std::atomic<std::uint64_t> counter{0};
  std::string temp = dir_ + "/" + kTempPrefix + std::to_string(::getpid()) + "-" +
                     std::to_string(counter.fetch_add(1)) + "-" + name;
  int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return;
  bool ok = write_all(fd, bytes.data(), bytes.size());
  ok = ::close(fd) == 0 && ok;
  if (!ok) {
    ::unlink(temp.c_str());
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (entries_.count(name)) erase_locked(name);
  while (total_ + bytes.size() > max_bytes_ && !by_use_.empty()) erase_locked(by_use_.begin()->second);
  if (::rename(temp.c_str(), (dir_ + "/" + name).c_str()) != 0) {
    ::unlink(temp.c_str());
    return;
  }
  Entry e{bytes.size(), next_tick_++};
  entries_[name] = e;
  by_use_[e.tick] = name;
  total_ += e.size;
}

std::uint64_t DiskCache::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return total_;
}

void DiskCache::touch_locked(const std::string& name, Entry& e) {
  by_use_.erase(e.tick);
  e.tick = next_tick_++;
  by_use_[e.tick] = name;
}

void DiskCache::erase_locked(std::string name) {
  auto it = entries_.find(name);
  if (it == entries_.end()) return;
  ::unlink((dir_ + "/" + name).c_str());
  by_use_.erase(it->second.tick);
  total_ -= it->second.size;
  entries_.erase(it);
}

}  // namespace chorus::data::s3_detail
