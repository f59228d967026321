// Internal: the `chorus` tool's IDX reader (Fashion-MNIST's files, gzipped or plain), without
// libtorch; examples/fashion_mnist/idx.cc reads the same files into tensors. fuzz/idx.cc feeds it
// files.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace chorus::tools {

// An IDX file of unsigned bytes: its sizes and data.
struct Idx {
  std::vector<uint32_t> shape;
  std::vector<uint8_t> data;
};

// Reads <dir>/<name>.gz, else <dir>/<name>: an IDX file of unsigned bytes with `dims` dimensions
// (1 or 3; items of 28x28 when 3, at most 10^6 items). Throws chorus::Error naming the file when it
// cannot be read, its header is not that, or its length differs from what the header says.
Idx read_idx(const std::string& dir, const std::string& name, int dims);

}  // namespace chorus::tools
