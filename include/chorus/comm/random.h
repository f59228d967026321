// Fresh random tokens, from OpenSSL's RAND_bytes.
#pragma once

#include <string>

namespace chorus {

// 32 hex digits (128 random bits): job tokens for handshakes, unique names for temporary files
// and segments. Throws chorus::Error when the system has no randomness to give.
std::string random_token();

}  // namespace chorus
