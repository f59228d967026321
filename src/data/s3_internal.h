// The pure parts of the S3 client, apart so that s3_test can check them without a server:
// AWS URI encoding, the XML answers (libexpat) and the local cache directory.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "chorus/data/s3.h"

namespace chorus::data::s3_detail {

// RFC 3986 percent-encoding as SigV4 wants it: A-Z a-z 0-9 - _ . ~ stay, everything else is %XX
// (upper-case hex); with keep_slash, '/' stays too (object keys in paths).
std::string uri_encode(const std::string& s, bool keep_slash);
// Inverse of S3's encoding-type=url ('+' is a space there).
std::string url_decode(const std::string& s);
std::string sha256_hex(const void* data, std::size_t size);

struct ListPage {
  std::vector<S3Object> objects;
  bool is_truncated = false;
  std::string next_continuation_token;
};
// A ListObjectsV2 answer. Entities (&amp; &#x41; ...) are decoded by expat; keys are also
// URL-decoded when the answer says <EncodingType>url</EncodingType>. Throws S3Error(kProtocol)
// on XML that does not parse or a page with IsTruncated but no NextContinuationToken.
ListPage parse_list_page(const std::string& xml);

struct ErrorBody {
  std::string code;     // <Code>, "" when the body is not an S3 error document
  std::string message;  // <Message>
};
ErrorBody parse_error_body(const std::string& xml);

// ListObjectsV2's query, sorted by name as SigV4's canonical request needs (curl 7.88 signs the
// query string as given).
std::string list_query(const std::string& prefix, int max_keys, const std::string& continuation_token);

// Files in one directory, bounded in bytes, least recently used evicted first. Thread-safe.
class DiskCache {
 public:
  DiskCache(std::string dir, std::uint64_t max_bytes);
  // The bytes stored under name; nullopt when absent, unreadable, or not expected_size long
  // (expected_size < 0: any). A hit marks the file used (mtime = now).
  std::optional<std::vector<std::uint8_t>> get(const std::string& name, std::int64_t expected_size);
  // Stores bytes under name (temporary file, then rename), evicting the least recently used files
  // to stay within max_bytes. Larger than max_bytes: not stored. I/O errors: not stored, no throw
  // (a cache must not fail a read that succeeded).
  void put(const std::string& name, const std::vector<std::uint8_t>& bytes);
  std::uint64_t bytes() const;

 private:
  struct Entry {
    std::uint64_t size;
    std::uint64_t tick;
  };
  void touch_locked(const std::string& name, Entry& e);
  void erase_locked(std::string name);  // by value: callers pass names held in by_use_

  std::string dir_;
  std::uint64_t max_bytes_;
  mutable std::mutex mu_;
  std::uint64_t total_ = 0;
  std::uint64_t next_tick_ = 0;
  std::unordered_map<std::string, Entry> entries_;
  std::map<std::uint64_t, std::string> by_use_;  // tick -> name, oldest first
};

}  // namespace chorus::data::s3_detail
