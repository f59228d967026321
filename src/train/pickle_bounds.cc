// The pickle bounds check (pickle_bounds.h). Opcodes as in CPython's Lib/pickletools.py.

#include "pickle_bounds.h"

#include <cstdint>

#include "chorus/torch/pickle_opcodes.h"
#include "chorus/train/checkpoint.h"

namespace chorus::train::detail {
namespace {

// Walks the opcodes (chorus/torch/pickle_opcodes.h checks every argument's length) and the memo:
// an index read must have been stored, and pickle writers store them from 0 in order.
class Walker {
 public:
  Walker(const char* p, size_t n, const std::string& what) : ops_(p, n), what_(what) {}

  void run() {
    pickle::Op op;
    try {
      while (ops_.next(&op)) {
        if (op.code == '.') return;  // STOP
        if (!step(op)) return;       // not an opcode this walk follows: the unpickler decides
      }
    } catch (const pickle::FormatError& e) {
      fail(e.what());
    }
    fail("ends without STOP");
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    throw CheckpointError(what_ + " is damaged: its pickle " + why + " (at byte " + std::to_string(ops_.offset()) +
                          " of " + std::to_string(ops_.size()) + ")");
  }
  void memo_get(uint64_t id) {
    if (id >= memo_) fail("reads memo entry " + std::to_string(id) + " of " + std::to_string(memo_));
  }
  void memo_put(uint64_t id) {
    if (id > memo_) fail("stores memo entry " + std::to_string(id) + " after " + std::to_string(memo_));
    if (id == memo_) ++memo_;
  }

  // The memo's part of one opcode; false where the walk stops: an unknown opcode, or text GET and
  // PUT (their memo ids are text, which this walk does not parse).
  bool step(const pickle::Op& op) {
    switch (op.code) {
      case 0x94: ++memo_; return true;               // MEMOIZE
      case 'q': case 'r': memo_put(op.number); return true;  // BINPUT, LONG_BINPUT
      case 'h': case 'j': memo_get(op.number); return true;  // BINGET, LONG_BINGET
      case 'g': case 'p': return false;
      default: return op.kind != pickle::ArgKind::kUnknown;
    }
  }

  pickle::OpcodeReader ops_;
  const std::string& what_;
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
