// FNV-1a, 64 bit: a fast hash for checksums of files and names derived from text (ports, segment
// tags). Not for secrets, and not a defence against tampering: only against damage and accidents.
#pragma once

#include <cstdint>
#include <string_view>

namespace chorus {

constexpr uint64_t fnv1a64(std::string_view bytes) {
  uint64_t h = 14695981039346656037ull;  // offset basis
  for (char c : bytes) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;  // FNV prime
  }
  return h;
}

}  // namespace chorus
