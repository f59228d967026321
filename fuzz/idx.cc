// Fuzz target: the `chorus` tool's IDX reader (src/tools/idx_reader.h), on a file holding the input
// after its first byte, which picks the dimensions (1: labels, 3: images). The file is read through
// zlib's gzopen as the real ones are, so an input starting with gzip's magic is decompressed.
// Damaged files must raise chorus::Error; a header claiming more than the file holds must cost no
// more than the file.
#include <cstdint>
#include <cstdlib>

#include "chorus/comm/error.h"
#include "fuzz_files.h"
#include "tools/idx_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int dims = (data[0] & 1) ? 3 : 1;
  chorus_fuzz::write_input("idx-ubyte", data + 1, size - 1);
  try {
    const chorus::tools::Idx idx = chorus::tools::read_idx(chorus_fuzz::scratch_dir(), "idx-ubyte", dims);
    size_t total = 1;
    for (uint32_t s : idx.shape) total *= s;
    if (idx.shape.size() != static_cast<size_t>(dims) || idx.data.size() != total) std::abort();
  } catch (const chorus::Error&) {
  }
  return 0;
}
