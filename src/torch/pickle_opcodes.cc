// The pickle opcode table and reader (chorus/torch/pickle_opcodes.h).

#include "chorus/torch/pickle_opcodes.h"

#include <cstring>

namespace chorus::pickle {

ArgLayout arg_layout(uint8_t code) {
  switch (code) {
    // No argument.
    case '(': case '.': case '0': case '1': case '2': case 'N': case 'R': case 'a': case 'b': case 'd':
    case '}': case 'e': case 'l': case ']': case 'o': case 's': case 't': case ')': case 'u': case 'Q':
    case 0x81: case 0x85: case 0x86: case 0x87: case 0x88: case 0x89: case 0x8f: case 0x90: case 0x91:
    case 0x92: case 0x93: case 0x94: case 0x97: case 0x98:
      return {ArgKind::kNone, 0};
    case 0x80: case 'K': case 0x82: case 'q': case 'h':  // PROTO, BININT1, EXT1, BINPUT, BINGET
      return {ArgKind::kFixed, 1};
    case 'M': case 0x83:  // BININT2, EXT2
      return {ArgKind::kFixed, 2};
    case 'J': case 0x84: case 'r': case 'j':  // BININT, EXT4, LONG_BINPUT, LONG_BINGET
      return {ArgKind::kFixed, 4};
    case 'G': case 0x95:  // BINFLOAT, FRAME
      return {ArgKind::kFixed, 8};
    case 0x8a: case 'U': case 'C': case 0x8c:  // LONG1, SHORT_BINSTRING, SHORT_BINBYTES, SHORT_BINUNICODE
      return {ArgKind::kCounted, 1};
    case 0x8b: case 'T': case 'B': case 'X':  // LONG4, BINSTRING, BINBYTES, BINUNICODE
      return {ArgKind::kCounted, 4};
    case 0x8d: case 0x8e: case 0x96:  // BINUNICODE8, BINBYTES8, BYTEARRAY8
      return {ArgKind::kCounted, 8};
    case 'I': case 'L': case 'F': case 'S': case 'V': case 'P': case 'g': case 'p':
      return {ArgKind::kLine, 0};  // INT, LONG, FLOAT, STRING, UNICODE, PERSID, GET, PUT
    case 'c': case 'i':  // GLOBAL, INST: module\nname\n
      return {ArgKind::kTwoLines, 0};
    default:
      return {ArgKind::kUnknown, 0};
  }
}

namespace {

uint64_t little_endian(const char* p, size_t bytes) {
  uint64_t v = 0;
  for (size_t i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

}  // namespace

bool OpcodeReader::next(Op* op) {
  if (at_ >= size_) return false;
  const size_t start = at_;
  auto need = [&](uint64_t bytes) {
    if (bytes > size_ - at_) {
      throw FormatError("claims " + std::to_string(bytes) + " bytes where " + std::to_string(size_ - at_) + " are left",
                        start);
    }
  };
  auto line = [&] {
    const void* nl = std::memchr(data_ + at_, '\n', size_ - at_);
    if (nl == nullptr) throw FormatError("has a text argument without its newline", start);
    const size_t end = static_cast<size_t>(static_cast<const char*>(nl) - data_);
    std::string_view text(data_ + at_, end - at_);
    at_ = end + 1;
    return text;
  };
  *op = Op{};
  op->code = static_cast<uint8_t>(data_[at_++]);
  op->offset = start;
  const ArgLayout layout = arg_layout(op->code);
  op->kind = layout.kind;
  switch (layout.kind) {
    case ArgKind::kNone:
    case ArgKind::kUnknown:
      break;
    case ArgKind::kFixed:
      need(layout.width);
      op->number = little_endian(data_ + at_, layout.width);
      op->bytes = std::string_view(data_ + at_, layout.width);
      at_ += layout.width;
      break;
    case ArgKind::kCounted:
      need(layout.width);
      op->number = little_endian(data_ + at_, layout.width);
      at_ += layout.width;
      need(op->number);
      op->bytes = std::string_view(data_ + at_, static_cast<size_t>(op->number));
      at_ += static_cast<size_t>(op->number);
      break;
    case ArgKind::kLine:
      op->bytes = line();
      break;
    case ArgKind::kTwoLines:
      op->bytes = line();
      op->second_line = line();
      break;
  }
  return true;
}

}  // namespace chorus::pickle
