// Fuzz target: the Fashion-MNIST example's IDX reader (examples/fashion_mnist/idx.h, read_idx into
// a uint8 tensor), as fuzz/idx.cc does for the `chorus` tool's: first byte 1 or 3 dimensions, the
// rest the file (gzipped or plain). Damaged files must raise std::runtime_error.
#include <cstdint>
#include <cstdlib>
#include <stdexcept>

#include "fuzz_files.h"
#include "idx.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int dims = (data[0] & 1) ? 3 : 1;
  chorus_fuzz::write_input("idx-ubyte", data + 1, size - 1);
  try {
    const at::Tensor t = fashion_mnist::read_idx(chorus_fuzz::scratch_dir(), "idx-ubyte", dims);
    if (t.dim() != dims || t.scalar_type() != at::kByte) std::abort();
  } catch (const std::runtime_error&) {
  }
  return 0;
}
