// Python's pickle format at the level of opcodes: which argument each opcode carries and how long
// it is, in one place, for chorus's two readers of torch.save's data.pkl (models' state_dict
// machine, docs/models.md; train's bounds check before libtorch's unpickler, train/pickle_bounds.h).
// Opcodes as in CPython's Lib/pickletools.py, protocols 0-5. Internal to chorus: not a stable API.
//
// OpcodeReader hands out one opcode at a time with its argument, every length checked against the
// bytes left before anything is read or allocated; what the opcodes mean is the caller's. Pure: no
// libtorch, no I/O.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace chorus::pickle {

// How an opcode's argument is laid out after it.
enum class ArgKind : uint8_t {
  kNone,      // STOP, MARK, EMPTY_LIST, ...
  kFixed,     // `width` bytes, little-endian (BINFLOAT's 8 are big-endian: read `bytes`)
  kCounted,   // a `width`-byte little-endian count, then that many bytes (BINUNICODE, LONG1, ...)
  kLine,      // text up to a newline (INT, STRING, text GET and PUT, ...)
  kTwoLines,  // two such lines (GLOBAL and INST: module, then name)
  kUnknown,   // not a pickle opcode
};

struct ArgLayout {
  ArgKind kind = ArgKind::kUnknown;
  uint8_t width = 0;  // kFixed: the argument's bytes; kCounted: the count's bytes
};

// The layout of opcode `code`'s argument: the one table both readers use.
ArgLayout arg_layout(uint8_t code);

// One opcode as read. `bytes` and `second_line` point into the pickle.
struct Op {
  uint8_t code = 0;
  size_t offset = 0;         // of the opcode byte
  ArgKind kind = ArgKind::kUnknown;
  uint64_t number = 0;       // kFixed: the little-endian value; kCounted: the count
  std::string_view bytes;    // kFixed: its raw bytes; kCounted: the counted bytes; kLine(s): the first line
  std::string_view second_line;  // kTwoLines: the second line
};

// A pickle that cannot be read as opcodes: an argument runs past the end. what() says why and where.
class FormatError : public std::runtime_error {
 public:
  FormatError(const std::string& why, size_t offset) : std::runtime_error(why), offset_(offset) {}
  size_t offset() const { return offset_; }  // where the opcode that failed starts

 private:
  size_t offset_;
};

class OpcodeReader {
 public:
  OpcodeReader(const char* data, size_t size) : data_(data), size_(size) {}

  // The next opcode into *op; false at the end of the data. An unknown opcode is returned with kind
  // kUnknown and no argument (the reader cannot know where the next one starts: stop there).
  // Throws FormatError when the argument does not fit in what is left ("claims N bytes where M are
  // left", "has a text argument without its newline").
  bool next(Op* op);

  size_t offset() const { return at_; }  // of the next opcode
  size_t size() const { return size_; }

 private:
  const char* data_;
  size_t size_;
  size_t at_ = 0;
};

}  // namespace chorus::pickle
