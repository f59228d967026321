// Pieces shared by the Store implementations: how keys appear in error messages, the wording of a
// wait that timed out, and the integer values that add() keeps. Declared in store_internal.h.
#include <charconv>
#include <cstdint>
#include <string>
#include <vector>

#include "chorus/comm/error.h"
#include "socket.h"
#include "store_internal.h"

namespace chorus::detail {

// Keys are arbitrary bytes: show printable ones as they are, escape the rest, cut long ones.
std::string format_key(const std::string& key) { return printable(key); }

// "a, b, c" with at most 16 keys shown.
std::string join_keys(const std::vector<std::string>& keys) {
  constexpr size_t kShown = 16;
  std::string out;
  for (size_t i = 0; i < keys.size() && i < kShown; ++i) {
    if (i > 0) out += ", ";
    out += format_key(keys[i]);
  }
  if (keys.size() > kShown) out += ", ... (" + std::to_string(keys.size() - kShown) + " more)";
  return out;
}

// "TcpStore(127.0.0.1:4242): timed out after 1.002 s waiting for keys [a, b] (missing: b); <hint>"
std::string wait_timeout_message(const std::string& store, const std::vector<std::string>& keys,
                                 const std::vector<std::string>& missing,
                                 net::Clock::duration waited, const std::string& hint) {
  return store + ": timed out after " + net::format_duration(waited) + " waiting for keys [" +
         join_keys(keys) + "] (missing: " + join_keys(missing) + "); " + hint;
}

// add() keeps decimal text, as PyTorch's stores do, so get() of a counter reads naturally.
// On success sets *result to the new value; otherwise sets *error (no store name: callers prefix
// it).
bool add_to_value(const std::string& key, const std::string* current, int64_t delta,
                  int64_t* result, std::string* error) {
  int64_t value = 0;
  if (current != nullptr) {
    const char* begin = current->data();
    const char* end = begin + current->size();
    auto [ptr, ec] = std::from_chars(begin, end, value);
    if (current->empty() || ec != std::errc() || ptr != end) {
      *error = "add('" + format_key(key) + "') needs an integer value, but the key holds '" +
               format_key(*current) + "'; use a separate key for counters";
      return false;
    }
  }
  if (__builtin_add_overflow(value, delta, result)) {
    *error = "add('" + format_key(key) + "', " + std::to_string(delta) +
             ") overflows int64 (current value " + std::to_string(value) + ")";
    return false;
  }
  return true;
}

}  // namespace chorus::detail
