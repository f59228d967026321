// The pickle bounds check (pickle_bounds.h). Opcodes as in CPython's Lib/pickletools.py.

#include "pickle_bounds.h"

#include <cstdint>
#include <cstring>

#include "chorus/train/checkpoint.h"

namespace chorus::train::detail {
namespace {

class Walker {
 public:
  Walker(const char* p, size_t n, const std::string& what) : p_(p), n_(n), what_(what) {}

  void run() {
    while (at_ < n_) {
      const auto op = static_cast<unsigned char>(p_[at_++]);
      if (op == '.') return;  // STOP
      if (!step(op)) return;  // not an opcode this walk knows: the unpickler decides
    }
    fail("ends without STOP");
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    throw CheckpointError(what_ + " is damaged: its pickle " + why + " (at byte " + std::to_string(at_) + " of " +
                          std::to_string(n_) + ")");
  }

  uint64_t le(size_t bytes) {
    need(bytes);
    uint64_t v = 0;
    for (size_t i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(p_[at_ + i])) << (8 * i);
    at_ += bytes;
    return v;
  }
  void need(uint64_t bytes) {
    if (bytes > n_ - at_) fail("claims " + std::to_string(bytes) + " bytes where " + std::to_string(n_ - at_) + " are left");
  }
  void skip_counted(size_t length_bytes) {
    const uint64_t len = le(length_bytes);
    need(len);
    at_ += static_cast<size_t>(len);
  }
  void skip_line() {
    const void* nl = std::memchr(p_ + at_, '\n', n_ - at_);
    if (nl == nullptr) fail("has a text argument without its newline");
    at_ = static_cast<size_t>(static_cast<const char*>(nl) - p_) + 1;
  }
  void memo_get(uint64_t id) {
    if (id >= memo_) fail("reads memo entry " + std::to_string(id) + " of " + std::to_string(memo_));
  }
  void memo_put(uint64_t id) {
    if (id > memo_) fail("stores memo entry " + std::to_string(id) + " after " + std::to_string(memo_));
    if (id == memo_) ++memo_;
  }

  // One opcode's argument; false for an opcode this walk does not know.
  bool step(unsigned char op) {
    switch (op) {
      // No argument.
      case '(': case ']': case ')': case '}': case 'a': case 'e': case 's': case 'u': case 't':
      case 'l': case 'd': case 'o': case 0x85: case 0x86: case 0x87: case 'b': case 'R': case 0x81:
      case 'Q': case 'N': case 0x88: case 0x89: case '0': case '1': case '2': case 0x8f: case 0x90:
      case 0x91: case 0x92: case 0x93:
        return true;
      case 0x94: ++memo_; return true;  // MEMOIZE
      // Fixed-size arguments.
      case 0x80: case 'K': le(1); return true;   // PROTO, BININT1
      case 'M': le(2); return true;              // BININT2
      case 'J': le(4); return true;              // BININT
      case 0x82: le(1); return true;             // EXT1
      case 0x83: le(2); return true;             // EXT2
      case 0x84: le(4); return true;             // EXT4
      case 'G': le(8); return true;              // BINFLOAT
      case 0x95: le(8); return true;             // FRAME
      case 'q': memo_put(le(1)); return true;    // BINPUT
      case 'r': memo_put(le(4)); return true;    // LONG_BINPUT
      case 'h': memo_get(le(1)); return true;    // BINGET
      case 'j': memo_get(le(4)); return true;    // LONG_BINGET
      // Counted bytes: the count must fit in what is left.
      case 0x8a: case 'U': case 'C': case 0x8c: skip_counted(1); return true;  // LONG1, SHORT_BIN{STRING,BYTES,UNICODE}
      case 0x8b: case 'T': case 'B': case 'X': skip_counted(4); return true;   // LONG4, BINSTRING, BINBYTES, BINUNICODE
      case 0x8d: case 0x8e: skip_counted(8); return true;                      // BINUNICODE8, BINBYTES8
      // Text arguments, each up to a newline.
      case 'I': case 'L': case 'F': case 'S': case 'V': case 'P': skip_line(); return true;
      case 'c': case 'i': skip_line(); skip_line(); return true;  // GLOBAL, INST: module\nname\n
      default:  // text GET and PUT (their memo ids are text) and anything unknown
        return false;
    }
  }

  const char* p_;
  size_t n_;
  const std::string& what_;
  size_t at_ = 0;
  uint64_t memo_ = 0;  // entries stored so far
};

uint64_t le_at(const char* p, size_t bytes) {
  uint64_t v = 0;
  for (size_t i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

// The uncompressed size in a central directory entry's zip64 extra field, or `fallback`.
uint64_t zip64_size(const char* extra, size_t n, uint64_t fallback) {
  for (size_t at = 0; at + 4 <= n;) {
    const uint64_t id = le_at(extra + at, 2), len = le_at(extra + at + 2, 2);
    if (at + 4 + len > n) break;
    if (id == 1 && len >= 8) return le_at(extra + at + 4, 8);
    at += 4 + len;
  }
  return fallback;
}

}  // namespace

void check_zip_sizes(const char* zip, size_t size, const std::string& what) {
  constexpr size_t kEocd = 22, kEntry = 46;
  if (size < kEocd) return;
  // The end-of-central-directory record: the last signature within 64 KiB + 22 bytes of the end.
  size_t eocd = size - kEocd + 1;
  const size_t lowest = size > kEocd + 65535 ? size - kEocd - 65535 : 0;
  do {
    --eocd;
    if (le_at(zip + eocd, 4) == 0x06054b50) break;
  } while (eocd > lowest);
  if (le_at(zip + eocd, 4) != 0x06054b50) return;
  uint64_t entries = le_at(zip + eocd + 10, 2), dir = le_at(zip + eocd + 16, 4);
  // As miniz (libtorch's zip reader) does: when a zip64 locator sits right before the end record
  // and points at a zip64 end record, the entry count and directory offset come from that record,
  // whatever the plain end record says (torch.save writes both).
  constexpr size_t kLocator = 20, kEocd64 = 56;
  if (eocd >= kLocator && size >= kEocd64 && le_at(zip + eocd - kLocator, 4) == 0x07064b50) {
    const uint64_t eocd64 = le_at(zip + eocd - kLocator + 8, 8);
    if (eocd64 <= size - kEocd64 && le_at(zip + eocd64, 4) == 0x06064b50) {
      entries = le_at(zip + eocd64 + 32, 8);
      dir = le_at(zip + eocd64 + 48, 8);
    }
  }
  size_t at = static_cast<size_t>(dir);
  for (uint64_t e = 0; e < entries; ++e) {
    if (dir >= size || at > size || size - at < kEntry || le_at(zip + at, 4) != 0x02014b50) return;
    const uint64_t method = le_at(zip + at + 10, 2);
    const uint64_t name = le_at(zip + at + 28, 2), extra = le_at(zip + at + 30, 2), comment = le_at(zip + at + 32, 2);
    if (size - at - kEntry < name + extra + comment) return;
    uint64_t claimed = le_at(zip + at + 24, 4);
    if (claimed == 0xffffffffu) claimed = zip64_size(zip + at + kEntry + name, static_cast<size_t>(extra), claimed);
    const uint64_t most = static_cast<uint64_t>(size) * (method == 0 ? 1 : 1032);
    if (claimed > most) {
      throw CheckpointError(what + " is damaged: its zip entry '" + std::string(zip + at + kEntry, static_cast<size_t>(name)) +
                            "' claims " + std::to_string(claimed) + " bytes in an archive of " + std::to_string(size));
    }
    at += kEntry + static_cast<size_t>(name + extra + comment);
  }
}

void check_pickle_bounds(const char* pickle, size_t size, const std::string& what) { Walker(pickle, size, what).run(); }

}  // namespace chorus::train::detail
