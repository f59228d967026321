// ByteSource: where a dataset's items come from, by key: a local directory (LocalByteSource) or an
// S3 bucket (S3ByteSource, chorus/data/s3_source.h; open_source picks by the location).
//
//   auto source = std::make_shared<chorus::data::LocalByteSource>("/data/imagenet/train");
//   std::vector<uint8_t> bytes = source->read("n01440764/n01440764_10026.JPEG");
//
// Keys are relative to the source's root and use '/' between path components, whatever the storage.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "chorus/comm/error.h"

namespace chorus::data {

// A dataset item that cannot be read or decoded, or a dataset description (CSV, folder tree) that
// is malformed. The message names the file (and line and column where it applies).
class DataError : public Error {
 public:
  using Error::Error;
};

// The storage behind a ByteSource failed as a whole (an endpoint down, timeouts, access denied),
// rather than one item being missing or bad: ParallelLoader never skips it (LoaderOptions::skip_bad),
// since every later item would fail the same way.
class SourceError : public DataError {
 public:
  using DataError::DataError;
};

class ByteSource {
 public:
  virtual ~ByteSource() = default;

  // The bytes of `key`. Thread-safe: a loader's decode threads call it concurrently. Throws
  // DataError naming describe(key) and the system's reason when the object cannot be read
  // (SourceError when the storage as a whole failed).
  virtual std::vector<uint8_t> read(const std::string& key) = 0;

  // Every key that starts with `prefix` ("" lists everything), in no particular order: each object
  // by its key and, where the storage has directories, each directory as its key followed by '/'
  // (the form of S3's folder markers), so that an empty directory is still seen. Throws DataError.
  virtual std::vector<std::string> list(const std::string& prefix) = 0;

  // Where `key` lives, for messages: a path, or s3://bucket/key.
  virtual std::string describe(const std::string& key) const = 0;
};

// Files under a local directory. list() walks the tree as Python's os.walk(root, followlinks=True)
// does: symbolic links to directories are followed (their contents listed under the link's name),
// every other entry (a file, a link to a file, a broken link) is an object. Unlike os.walk, which
// ignores them, an unreadable directory or a directory that contains itself through a link is a
// DataError naming it. Thread-safe.
class LocalByteSource : public ByteSource {
 public:
  // Throws DataError when `root` is not a directory.
  explicit LocalByteSource(std::string root);

  std::vector<uint8_t> read(const std::string& key) override;
  std::vector<std::string> list(const std::string& prefix) override;
  std::string describe(const std::string& key) const override;
  const std::string& root() const { return root_; }

 private:
  std::string root_;
};

}  // namespace chorus::data
