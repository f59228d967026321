// Internal: the TcpStore's request format and the server's parser of it (docs/store.md), apart from
// the server's sockets so that fuzz/store_request.cc can feed it bytes.
//
// request: u8 command, then its fields; reply: u8 status, then the command's fields. Strings are u32
// length + bytes, numbers i64, lists u32 count + strings; all little-endian.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace chorus::store_protocol {

enum class Command : uint8_t {
  kSet = 1,         // key, value                    -> OK
  kGet = 2,         // timeout_ms, key               -> OK value | TIMEOUT missing
  kAdd = 3,         // key, delta                    -> OK i64 | ERROR message
  kCompareSet = 4,  // key, expected, desired        -> OK value
  kWait = 5,        // timeout_ms, keys              -> OK | TIMEOUT missing
  kCheck = 6,       // keys                          -> OK u8
  kDelete = 7,      // key                           -> OK u8
  kNumKeys = 8,     //                               -> OK i64
};

enum class Status : uint8_t { kOk = 0, kTimeout = 1, kError = 2 };

constexpr uint32_t kMaxKeyBytes = 64 * 1024;
constexpr uint32_t kMaxKeysPerRequest = 64 * 1024;
constexpr uint64_t kMaxKeyListBytes = 16u << 20;  // all keys of one wait or check together

struct Request {
  Command cmd = Command::kNumKeys;
  std::string key;
  std::string value;     // set's value; compare_set's desired value
  std::string expected;  // compare_set
  int64_t number = 0;    // add's delta; get's and wait's timeout in ms
  std::vector<std::string> keys;
};

enum class Parse { kNeedMore, kOk, kBad };

// Parses one request from the front of [data, data + n), which may hold only part of it: kNeedMore
// until it is complete, then kOk with *req and *consumed (its length), or kBad with *error as soon
// as a length or the command is wrong. Values longer than max_value are refused before anything is
// allocated for them.
Parse parse_request(const char* data, size_t n, uint32_t max_value, Request* req, size_t* consumed,
                    std::string* error);

}  // namespace chorus::store_protocol
