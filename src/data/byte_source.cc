// LocalByteSource: files under a directory, listed as os.walk(root, followlinks=True) sees them.
#include "chorus/data/byte_source.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>
#include <utility>

namespace chorus::data {
namespace {

std::string errno_text(int error) { return std::string(std::strerror(error)); }

// Lists directory `path` (key prefix `rel`, "" or ending in '/') and below into `keys`. `parents`
// holds the (device, inode) of the directories on the way down, to refuse a link cycle.
void walk(const std::string& path, const std::string& rel, std::set<std::pair<dev_t, ino_t>>& parents,
          std::vector<std::string>& keys) {
  struct stat self {};
  if (::stat(path.c_str(), &self) != 0) {
    throw DataError(path + ": cannot list the directory: " + errno_text(errno));
  }
  const auto id = std::make_pair(self.st_dev, self.st_ino);
  if (!parents.insert(id).second) {
    throw DataError(path + ": a symbolic link makes this directory contain itself; the listing would never end. "
                           "Remove the link or point it outside the tree");
  }
  DIR* dir = ::opendir(path.c_str());
  if (dir == nullptr) throw DataError(path + ": cannot list the directory: " + errno_text(errno));
  std::vector<std::string> names;
  errno = 0;
  while (dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
    errno = 0;
  }
  const int read_error = errno;
  ::closedir(dir);
  if (read_error != 0) throw DataError(path + ": cannot list the directory: " + errno_text(read_error));
  for (const auto& name : names) {
    const std::string child = path + "/" + name;
    struct stat st {};
    // stat follows links, as os.walk's entry.is_dir() does: a broken link is a file.
    const bool is_dir = ::stat(child.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
    if (is_dir) {
      keys.push_back(rel + name + "/");
      walk(child, rel + name + "/", parents, keys);
    } else {
      keys.push_back(rel + name);
    }
  }
  parents.erase(id);
}

}  // namespace

LocalByteSource::LocalByteSource(std::string root) : root_(std::move(root)) {
  while (root_.size() > 1 && root_.back() == '/') root_.pop_back();
  struct stat st {};
  if (::stat(root_.c_str(), &st) != 0) {
    throw DataError("LocalByteSource: " + root_ + ": " + errno_text(errno));
  }
  if (!S_ISDIR(st.st_mode)) throw DataError("LocalByteSource: " + root_ + " is not a directory");
}

std::string LocalByteSource::describe(const std::string& key) const {
  return key.empty() ? root_ : root_ + "/" + key;
}

std::vector<uint8_t> LocalByteSource::read(const std::string& key) {
  const std::string path = describe(key);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw DataError(path + ": cannot open: " + errno_text(errno));
  std::vector<uint8_t> bytes;
  struct stat st {};
  if (::fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
    ::close(fd);
    throw DataError(path + ": is a directory, not a file");
  }
  if (st.st_size > 0) bytes.reserve(static_cast<size_t>(st.st_size));
  uint8_t buffer[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int error = errno;
      ::close(fd);
      throw DataError(path + ": cannot read: " + errno_text(error));
    }
    if (n == 0) break;
    bytes.insert(bytes.end(), buffer, buffer + n);
  }
  ::close(fd);
  return bytes;
}

std::vector<std::string> LocalByteSource::list(const std::string& prefix) {
  // Walk the deepest directory the prefix names, then keep the keys that start with the prefix.
  const auto slash = prefix.rfind('/');
  const std::string dir_rel = slash == std::string::npos ? "" : prefix.substr(0, slash + 1);
  std::vector<std::string> keys;
  std::set<std::pair<dev_t, ino_t>> parents;
  const std::string start = dir_rel.empty() ? root_ : root_ + "/" + dir_rel.substr(0, dir_rel.size() - 1);
  struct stat st {};
  if (!dir_rel.empty() && (::stat(start.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))) return keys;
  walk(start, dir_rel, parents, keys);
  std::vector<std::string> out;
  for (auto& k : keys) {
    if (k.compare(0, prefix.size(), prefix) == 0) out.push_back(std::move(k));
  }
  return out;
}

}  // namespace chorus::data
