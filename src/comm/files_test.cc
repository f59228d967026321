// chorus::remove_tree (include/chorus/comm/files.h): what std::filesystem::remove_all does, by nftw.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "chorus/comm/files.h"

namespace chorus {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/chorus-files-test-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    remove_tree(path, ec);
  }
};

TEST(RemoveTree, RemovesNestedDirectoriesAndFiles) {
  TempDir t;
  const fs::path top = fs::path(t.path) / "run";
  fs::create_directories(top / "a" / "b" / "c");
  std::ofstream(top / "a" / "f1") << "x";
  std::ofstream(top / "a" / "b" / "c" / "f2") << "y";
  std::ofstream(top / ".hidden") << "z";
  std::error_code ec;
  remove_tree(top.string(), ec);
  EXPECT_FALSE(ec) << ec.message();
  EXPECT_FALSE(fs::exists(top));
  EXPECT_TRUE(fs::exists(t.path));  // only what was named
}

TEST(RemoveTree, RemovesLinksNotWhatTheyPointTo) {
  TempDir t;
  const fs::path keep = fs::path(t.path) / "keep";
  fs::create_directories(keep);
  std::ofstream(keep / "precious") << "data";
  const fs::path top = fs::path(t.path) / "run";
  fs::create_directories(top);
  fs::create_directory_symlink(keep, top / "to-dir");
  fs::create_symlink(keep / "precious", top / "to-file");
  std::error_code ec;
  remove_tree(top.string(), ec);
  EXPECT_FALSE(ec) << ec.message();
  EXPECT_FALSE(fs::exists(top));
  EXPECT_TRUE(fs::exists(keep / "precious"));

  // A link named directly is removed itself.
  fs::create_directory_symlink(keep, fs::path(t.path) / "link");
  remove_tree((fs::path(t.path) / "link").string(), ec);
  EXPECT_FALSE(ec) << ec.message();
  EXPECT_FALSE(fs::is_symlink(fs::path(t.path) / "link"));
  EXPECT_TRUE(fs::exists(keep / "precious"));
}

TEST(RemoveTree, AFileAndAMissingPath) {
  TempDir t;
  const fs::path file = fs::path(t.path) / "single";
  std::ofstream(file) << "1";
  std::error_code ec;
  remove_tree(file.string(), ec);
  EXPECT_FALSE(ec) << ec.message();
  EXPECT_FALSE(fs::exists(file));
  remove_tree((fs::path(t.path) / "never-there").string(), ec);
  EXPECT_FALSE(ec) << ec.message();
}

TEST(RemoveTree, ReportsWhatItCouldNotRemove) {
  TempDir t;
  // A path through a regular file: lstat fails with ENOTDIR, which is reported (not "missing").
  const fs::path file = fs::path(t.path) / "plain";
  std::ofstream(file) << "1";
  std::error_code ec;
  remove_tree((file / "below").string(), ec);
  EXPECT_EQ(ec, std::errc::not_a_directory) << ec.message();
  // A read-only parent: its entries stay, and the error says why (root may write anyway: skip).
  if (::geteuid() == 0) GTEST_SKIP() << "root ignores directory permissions";
  const fs::path locked = fs::path(t.path) / "locked";
  fs::create_directories(locked / "inner");
  fs::permissions(locked, fs::perms::owner_read | fs::perms::owner_exec);
  remove_tree(locked.string(), ec);
  EXPECT_TRUE(ec);
  EXPECT_TRUE(fs::exists(locked / "inner"));
  fs::permissions(locked, fs::perms::owner_all);
}

}  // namespace
}  // namespace chorus
