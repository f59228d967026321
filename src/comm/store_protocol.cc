// The TcpStore's wire format in code (store_protocol.h, docs/store.md): the server's incremental
// parser of requests, which checks every length against its limit before allocating anything, and
// the two messages the client and the server both write (a value over the limit, an address).
#include "store_protocol.h"

#include <string>
#include <vector>

#include "store_internal.h"

namespace chorus::store_protocol {
namespace {

// Reads fields from the front of a buffer that may hold only part of a message. Every length is
// checked against its limit as soon as its prefix arrives, before anything is allocated for it.
// With copy = false it only measures, so a message arriving in many pieces is copied once.
class Reader {
 public:
  Reader(const char* data, size_t n, bool copy) : p_(data), n_(n), copy_(copy) {}

  bool u8(uint8_t* v) {
    if (!have(1)) return false;
    *v = static_cast<uint8_t>(p_[pos_]);
    pos_ += 1;
    return true;
  }
  bool u32(uint32_t* v) {
    if (!have(4)) return false;
    *v = get_u32(p_ + pos_);
    pos_ += 4;
    return true;
  }
  bool i64(int64_t* v) {
    if (!have(8)) return false;
    *v = get_i64(p_ + pos_);
    pos_ += 8;
    return true;
  }
  bool str(std::string* s, uint32_t limit, const char* what) {
    uint32_t len = 0;
    if (!u32(&len)) return false;
    if (len > limit) {
      return fail(std::string(what) + " length " + std::to_string(len) + " exceeds the limit of " +
                  std::to_string(limit) + " bytes");
    }
    if (!have(len)) return false;
    if (copy_) s->assign(p_ + pos_, len);
    pos_ += len;
    return true;
  }
  bool keys(std::vector<std::string>* keys) {
    uint32_t count = 0;
    if (!u32(&count)) return false;
    if (count > kMaxKeysPerRequest) {
      return fail("key count " + std::to_string(count) + " exceeds the limit of " +
                  std::to_string(kMaxKeysPerRequest));
    }
    const size_t start = pos_;
    if (copy_) keys->resize(count);
    std::string skipped;
    for (uint32_t i = 0; i < count; ++i) {
      if (!str(copy_ ? &(*keys)[i] : &skipped, kMaxKeyBytes, "key")) return false;
      if (pos_ - start > kMaxKeyListBytes) {
        return fail("key list exceeds the limit of " + std::to_string(kMaxKeyListBytes) + " bytes");
      }
    }
    return true;
  }
  bool fail(std::string error) {
    error_ = std::move(error);
    return false;
  }
  bool bad() const { return !error_.empty(); }
  const std::string& error() const { return error_; }
  size_t consumed() const { return pos_; }

 private:
  bool have(size_t n) const { return n_ - pos_ >= n; }
  const char* p_;
  size_t n_;
  bool copy_;
  size_t pos_ = 0;
  std::string error_;
};

bool read_request(Reader& r, Request* req, uint32_t max_value) {
  uint8_t cmd = 0;
  if (!r.u8(&cmd)) return false;
  req->cmd = static_cast<Command>(cmd);
  switch (req->cmd) {
    case Command::kSet:
      return r.str(&req->key, kMaxKeyBytes, "key") && r.str(&req->value, max_value, "value");
    case Command::kGet:
      return r.i64(&req->number) && r.str(&req->key, kMaxKeyBytes, "key");
    case Command::kAdd:
      return r.str(&req->key, kMaxKeyBytes, "key") && r.i64(&req->number);
    case Command::kCompareSet:
      return r.str(&req->key, kMaxKeyBytes, "key") &&
             r.str(&req->expected, max_value, "expected value") &&
             r.str(&req->value, max_value, "desired value");
    case Command::kWait:
      return r.i64(&req->number) && r.keys(&req->keys);
    case Command::kCheck:
      return r.keys(&req->keys);
    case Command::kDelete:
      return r.str(&req->key, kMaxKeyBytes, "key");
    case Command::kNumKeys:
      return true;
  }
  return r.fail("unknown command " + std::to_string(cmd));
}

}  // namespace

Parse parse_request(const char* data, size_t n, uint32_t max_value, Request* req, size_t* consumed,
                    std::string* error) {
  Reader measure(data, n, /*copy=*/false);
  Request scratch;
  if (!read_request(measure, &scratch, max_value)) {
    if (!measure.bad()) return Parse::kNeedMore;
    *error = measure.error();
    return Parse::kBad;
  }
  Reader r(data, n, /*copy=*/true);
  read_request(r, req, max_value);
  *consumed = r.consumed();
  return Parse::kOk;
}

std::string value_too_large(const std::string& who, const std::string& key, uint64_t size, uint64_t limit,
                            const char* option) {
  return who + ": the value for key '" + detail::format_key(key) + "' has " + std::to_string(size) +
         " bytes, more than " + option + " = " + std::to_string(limit) +
         "; raise that option (on the server and the clients) or keep large data out of the store";
}

std::string host_port(const std::string& host, int port) {
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

}  // namespace chorus::store_protocol
