// Fuzz target: the TcpStore server's request parser (src/comm/store_protocol.h), over a stream of
// requests as one connection sends them after its handshake, applied to an in-memory map the way
// the server's execute() does (add() parses the stored value as an integer).
//
// Checked besides the sanitizers: a request that parses as complete from n bytes reports itself
// incomplete (never malformed) from any shorter prefix, since the server parses whatever has
// arrived so far.
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>

#include "chorus/comm/tcp_store.h"
#include "comm/store_internal.h"
#include "comm/store_protocol.h"

namespace sp = chorus::store_protocol;

namespace {

// Small enough that the fuzzer reaches the "value too long" refusal with short inputs.
constexpr uint32_t kMaxValue = 4096;

void check_prefixes(const char* p, size_t consumed) {
  for (size_t cut : {size_t{0}, consumed / 2, consumed - 1}) {
    if (cut >= consumed) continue;
    sp::Request req;
    size_t n = 0;
    std::string error;
    if (sp::parse_request(p, cut, kMaxValue, &req, &n, &error) != sp::Parse::kNeedMore) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char* p = reinterpret_cast<const char*>(data);
  std::map<std::string, std::string> store;
  size_t off = 0;
  while (off < size) {
    sp::Request req;
    size_t consumed = 0;
    std::string error;
    const sp::Parse parse = sp::parse_request(p + off, size - off, kMaxValue, &req, &consumed, &error);
    if (parse != sp::Parse::kOk) {
      if (parse == sp::Parse::kBad && error.empty()) std::abort();  // a refusal always says why
      break;
    }
    if (consumed == 0 || consumed > size - off) std::abort();
    check_prefixes(p + off, consumed);
    off += consumed;
    switch (req.cmd) {
      case sp::Command::kSet:
        store[req.key] = req.value;
        break;
      case sp::Command::kAdd: {
        auto it = store.find(req.key);
        int64_t result = 0;
        std::string add_error;
        if (chorus::detail::add_to_value(req.key, it == store.end() ? nullptr : &it->second, req.number, &result,
                                         &add_error)) {
          store[req.key] = std::to_string(result);
        } else if (add_error.empty()) {
          std::abort();
        }
        break;
      }
      case sp::Command::kCompareSet: {
        auto it = store.find(req.key);
        if ((it == store.end() && req.expected.empty()) || (it != store.end() && it->second == req.expected)) {
          store[req.key] = req.value;
        }
        break;
      }
      case sp::Command::kDelete:
        store.erase(req.key);
        break;
      case sp::Command::kWait:
      case sp::Command::kCheck:
        (void)chorus::detail::join_keys(req.keys);  // what a timeout message prints
        break;
      default:
        (void)chorus::detail::format_key(req.key);
        break;
    }
  }
  return 0;
}
