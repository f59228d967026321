// chorus::printable (chorus/comm/error.h): outside bytes made safe to print in a message.
#include "chorus/comm/error.h"

#include <cstdint>

namespace chorus {
namespace {

// The length of the well-formed UTF-8 sequence of a code point from U+00A0 up (no C1 controls,
// no overlong forms, no surrogates, nothing past U+10FFFF) at s[i], or 0.
size_t utf8_sequence(const std::string& s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char lead = byte(i);
  size_t n = 0;
  uint32_t cp = 0;
  if (lead >= 0xc2 && lead <= 0xdf) {
    n = 2, cp = lead & 0x1f;
  } else if (lead >= 0xe0 && lead <= 0xef) {
    n = 3, cp = lead & 0x0f;
  } else if (lead >= 0xf0 && lead <= 0xf4) {
    n = 4, cp = lead & 0x07;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((byte(i + k) & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (byte(i + k) & 0x3f);
  }
  static constexpr uint32_t kSmallest[] = {0, 0, 0xa0, 0x800, 0x10000};
  if (cp < kSmallest[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
  return n;
}

}  // namespace

std::string printable(const std::string& bytes, size_t max_shown) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  size_t i = 0;
  while (i < bytes.size() && i < max_shown) {
    const unsigned char c = static_cast<unsigned char>(bytes[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out.push_back(static_cast<char>(c));
      ++i;
    } else if (c == '\\') {
      out += "\\\\";
      ++i;
    } else if (const size_t n = utf8_sequence(bytes, i); n > 0 && i + n <= max_shown) {
      out.append(bytes, i, n);
      i += n;
    } else {
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
      ++i;
    }
  }
  if (i < bytes.size()) out += "...(" + std::to_string(bytes.size()) + " bytes)";
  return out;
}

}  // namespace chorus
