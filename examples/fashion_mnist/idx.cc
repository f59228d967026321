// IDX format (http://yann.lecun.com/exdb/mnist/): a big-endian header (magic 0x0000080D where 0x08
// means unsigned bytes and D the number of dimensions, then D uint32 sizes), then the data.
#include "idx.h"

#include <ATen/ATen.h>
#include <zlib.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <sys/stat.h>
#include <vector>

namespace fashion_mnist {
namespace {

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

// The whole (decompressed) content of name.gz, or of name when there is no .gz.
std::vector<uint8_t> read_maybe_gz(const std::string& dir, const std::string& name) {
  std::string path = dir + "/" + name + ".gz";
  if (!exists(path) && exists(dir + "/" + name)) path = dir + "/" + name;
  gzFile f = gzopen(path.c_str(), "rb");  // reads plain files as they are
  if (f == nullptr) {
    throw std::runtime_error("cannot open " + path + ": " + std::strerror(errno) +
                             " (install Debian's dataset-fashion-mnist, or pass --data DIR)");
  }
  std::vector<uint8_t> out;
  uint8_t buf[1 << 16];
  for (;;) {
    int n = gzread(f, buf, sizeof(buf));
    if (n < 0) {
      int err = 0;
      std::string msg = gzerror(f, &err);
      gzclose(f);
      throw std::runtime_error("cannot read " + path + ": " + msg);
    }
    if (n == 0) break;
    out.insert(out.end(), buf, buf + n);
  }
  gzclose(f);
  return out;
}

uint32_t be32(const std::vector<uint8_t>& b, size_t off) {
  return (uint32_t{b[off]} << 24) | (uint32_t{b[off + 1]} << 16) | (uint32_t{b[off + 2]} << 8) | b[off + 3];
}

// Checks the header of an IDX file of unsigned bytes with `dims` dimensions; returns the sizes.
std::vector<int64_t> idx_shape(const std::vector<uint8_t>& b, int dims, const std::string& name) {
  const size_t header = 4 + 4 * static_cast<size_t>(dims);
  if (b.size() < header || be32(b, 0) != (0x0800u | static_cast<uint32_t>(dims))) {
    throw std::runtime_error(name + ": not an IDX file of unsigned bytes with " + std::to_string(dims) +
                             " dimensions");
  }
  std::vector<int64_t> shape;
  size_t total = 1;
  for (int i = 0; i < dims; ++i) {
    shape.push_back(be32(b, 4 + 4 * static_cast<size_t>(i)));
    total *= static_cast<size_t>(shape.back());
  }
  if (b.size() != header + total) {
    throw std::runtime_error(name + ": " + std::to_string(b.size()) + " bytes, the header says " +
                             std::to_string(header + total) + " (truncated file?)");
  }
  return shape;
}

}  // namespace

Split load_split(const std::string& dir, bool train) {
  const std::string prefix = train ? "train" : "t10k";
  const std::string images_name = prefix + "-images-idx3-ubyte";
  const std::string labels_name = prefix + "-labels-idx1-ubyte";
  std::vector<uint8_t> images = read_maybe_gz(dir, images_name);
  std::vector<uint8_t> labels = read_maybe_gz(dir, labels_name);
  auto ishape = idx_shape(images, 3, images_name);
  auto lshape = idx_shape(labels, 1, labels_name);
  if (ishape[0] != lshape[0] || ishape[1] != 28 || ishape[2] != 28) {
    throw std::runtime_error(dir + ": " + std::to_string(ishape[0]) + " images of " + std::to_string(ishape[1]) +
                             "x" + std::to_string(ishape[2]) + " but " + std::to_string(lshape[0]) +
                             " labels; expected 28x28 images, one label each");
  }
  Split s;
  s.images = at::empty({ishape[0], 1, 28, 28}, at::kByte);
  std::memcpy(s.images.data_ptr(), images.data() + 16, static_cast<size_t>(s.images.numel()));
  s.labels = at::empty({lshape[0]}, at::kByte);
  std::memcpy(s.labels.data_ptr(), labels.data() + 8, static_cast<size_t>(lshape[0]));
  s.labels = s.labels.to(at::kLong);
  if (s.size() > 0 && s.labels.max().item<int64_t>() > 9) throw std::runtime_error(labels_name + ": a label > 9");
  return s;
}

at::Tensor normalise(const at::Tensor& images_uint8) {
  return images_uint8.to(at::kFloat).div_(255.0).sub_(0.1307).div_(0.3081);
}

}  // namespace fashion_mnist
