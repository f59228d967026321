// The `chorus` tool's IDX reader (idx_reader.h). IDX (http://yann.lecun.com/exdb/mnist/): a
// big-endian header (magic 0x0000080D, 0x08 for unsigned bytes and D dimensions, then D uint32
// sizes), then the data.
#include "idx_reader.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>

#include "chorus/comm/error.h"

namespace chorus::tools {
namespace {

namespace fs = std::filesystem;

uint32_t be32(const uint8_t* b) {
  return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | b[3];
}

}  // namespace

Idx read_idx(const std::string& dir, const std::string& name, int dims) {
  std::string path = dir + "/" + name + ".gz";
  if (!fs::exists(path)) path = dir + "/" + name;
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) {
    throw Error("cannot open " + path + ": " + std::strerror(errno) +
                " (install Debian's dataset-fashion-mnist, or pass --data DIR)");
  }
  std::unique_ptr<gzFile_s, int (*)(gzFile)> guard(f, gzclose);
  auto read = [&](uint8_t* out, size_t n) {
    size_t got = 0;
    while (got < n) {
      const int k = gzread(f, out + got, static_cast<unsigned>(std::min<size_t>(n - got, 1u << 30)));
      if (k < 0) {
        int err = 0;
        throw Error("cannot read " + path + ": " + gzerror(f, &err));
      }
      if (k == 0) break;
      got += static_cast<size_t>(k);
    }
    return got;
  };
  uint8_t header[16];
  const size_t header_bytes = 4 + 4 * static_cast<size_t>(dims);
  if (read(header, header_bytes) != header_bytes || be32(header) != (0x0800u | static_cast<uint32_t>(dims))) {
    throw Error(path + ": not an IDX file of unsigned bytes with " + std::to_string(dims) + " dimensions");
  }
  Idx idx;
  size_t total = 1;
  for (int i = 0; i < dims; ++i) {
    idx.shape.push_back(be32(header + 4 + 4 * i));
    total *= idx.shape.back();
  }
  if (idx.shape[0] > 1000000 || (dims == 3 && (idx.shape[1] != 28 || idx.shape[2] != 28))) {
    throw Error(path + ": unexpected sizes in the header; damaged, or not Fashion-MNIST");
  }
  idx.data.resize(total);
  uint8_t extra = 0;
  if (read(idx.data.data(), total) != total || read(&extra, 1) != 0) {
    throw Error(path + ": length differs from what its header says; truncated or damaged file?");
  }
  return idx;
}

}  // namespace chorus::tools
