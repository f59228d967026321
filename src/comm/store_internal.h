// Internal: pieces shared by the Store implementations (defined in store.cc).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "socket.h"

namespace chorus::detail {

// Keys are arbitrary bytes: printable ones as they are, the rest escaped, long ones cut.
std::string format_key(const std::string& key);
std::string join_keys(const std::vector<std::string>& keys);
// The message of a wait that timed out: the store, the keys, the missing ones, the time waited.
std::string wait_timeout_message(const std::string& store, const std::vector<std::string>& keys,
                                 const std::vector<std::string>& missing,
                                 net::Clock::duration waited, const std::string& hint);
// add(): parses *current (nullptr = missing = 0), adds delta; false with *error if not an integer.
bool add_to_value(const std::string& key, const std::string* current, int64_t delta,
                  int64_t* result, std::string* error);

}  // namespace chorus::detail
