// Internal: the TcpStore's request format, the server's parser of it (docs/store.md), apart from
// the server's sockets so that fuzz/store_request.cc can feed it bytes, and the encoding and the
// messages that the client (tcp_store_client.cc) and the server (tcp_store_server.cc,
// tcp_store_requests.cc) share. Defined in store_protocol.cc.
//
// request: u8 command, then its fields; reply: u8 status, then the command's fields. Strings are u32
// length + bytes, numbers i64, lists u32 count + strings; all little-endian.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
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

// Builds a request or a reply: little-endian numbers, u32-length-prefixed strings and lists.
class Writer {
 public:
  Writer& u8(uint8_t v) {
    out_.push_back(static_cast<char>(v));
    return *this;
  }
  Writer& u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    return *this;
  }
  Writer& i64(int64_t v) {
    uint64_t u = static_cast<uint64_t>(v);
    for (int i = 0; i < 8; ++i) out_.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
    return *this;
  }
  Writer& str(const std::string& s) {
    u32(static_cast<uint32_t>(s.size()));
    out_ += s;
    return *this;
  }
  Writer& keys(const std::vector<std::string>& keys) {
    u32(static_cast<uint32_t>(keys.size()));
    for (const auto& k : keys) str(k);
    return *this;
  }
  std::string& bytes() { return out_; }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

inline uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}
inline int64_t get_i64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return static_cast<int64_t>(v);
}

// The message of a value over max_value_bytes, naming `who` (the client or the server), the key,
// its size and the `option` that sets the limit.
std::string value_too_large(const std::string& who, const std::string& key, uint64_t size, uint64_t limit,
                            const char* option);

// "host:port", or "[host]:port" for an IPv6 address: how the store and its server name themselves.
std::string host_port(const std::string& host, int port);

}  // namespace chorus::store_protocol
