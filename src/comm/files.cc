#include "chorus/comm/files.h"

#include <ftw.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>

namespace chorus {

namespace {

thread_local int first_errno = 0;

int remove_entry(const char* path, const struct stat* /*st*/, int type, struct FTW* /*ftw*/) {
  if (type == FTW_DNR) {  // a directory we cannot read: its entries stay, and so will it
    if (first_errno == 0) first_errno = EACCES;
    return 0;
  }
  if (std::remove(path) != 0 && errno != ENOENT && first_errno == 0) first_errno = errno;
  return 0;  // go on: remove what can be removed
}

}  // namespace

void remove_tree(const std::string& path, std::error_code& ec) {
  ec.clear();
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno != ENOENT) ec.assign(errno, std::generic_category());
    return;
  }
  first_errno = 0;
  if (::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS) != 0 && first_errno == 0) first_errno = errno;
  if (first_errno != 0) ec.assign(first_errno, std::generic_category());
}

}  // namespace chorus
