// Fuzz target: the pickle opcode reader (chorus/torch/pickle_opcodes.h) that chorus's state_dict
// machine and checkpoint bounds check both read data.pkl through. Input: any bytes, read as a
// pickle opcode by opcode. Checks: every argument lies inside the input, offsets only grow, the
// reader stops at the end, at an unknown opcode, or with a FormatError, never anything else.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "chorus/torch/pickle_opcodes.h"

namespace pickle = chorus::pickle;

namespace {

bool inside(std::string_view part, const char* data, size_t size) {
  return part.empty() || (part.data() >= data && part.data() + part.size() <= data + size);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  const char* data = reinterpret_cast<const char*>(bytes);
  pickle::OpcodeReader reader(data, size);
  pickle::Op op;
  size_t last = 0, count = 0;
  try {
    while (reader.next(&op)) {
      if (count++ > 0 && op.offset <= last) std::abort();  // no progress
      last = op.offset;
      if (op.offset >= size || reader.offset() > size) std::abort();
      if (!inside(op.bytes, data, size) || !inside(op.second_line, data, size)) std::abort();
      if (op.kind == pickle::ArgKind::kCounted && op.bytes.size() != op.number) std::abort();
      if (op.kind == pickle::ArgKind::kUnknown) break;
    }
  } catch (const pickle::FormatError& e) {
    if (e.offset() >= size) std::abort();
  }
  return 0;
}
