// IDX format (http://yann.lecun.com/exdb/mnist/): a big-endian header (magic 0x0000080D where 0x08
// means unsigned bytes and D the number of dimensions, then D uint32 sizes), then the data.
#include "idx.h"

#include <ATen/ATen.h>
#include <zlib.h>

#include <algorithm>
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

// Bounds on what a header may claim. Fashion-MNIST has 60000 + 10000 items; a header beyond these
// is damaged or hostile, and is refused before any of its data is decompressed.
constexpr uint32_t kMaxItems = 1000000;
constexpr uint32_t kMaxSide = 28;

class IdxReader {
 public:
  IdxReader(const std::string& dir, const std::string& name) {
    path_ = dir + "/" + name + ".gz";
    if (!exists(path_) && exists(dir + "/" + name)) path_ = dir + "/" + name;
    f_ = gzopen(path_.c_str(), "rb");  // reads plain files as they are
    if (f_ == nullptr) {
      throw std::runtime_error("cannot open " + path_ + ": " + std::strerror(errno) +
                               " (install Debian's dataset-fashion-mnist, or pass --data DIR)");
    }
  }
  ~IdxReader() { gzclose(f_); }
  IdxReader(const IdxReader&) = delete;
  IdxReader& operator=(const IdxReader&) = delete;

  const std::string& path() const { return path_; }

  // Reads up to n bytes into out; returns how many (fewer only at the end of the file).
  size_t read(uint8_t* out, size_t n) {
    size_t got = 0;
    while (got < n) {
      const unsigned chunk = static_cast<unsigned>(std::min<size_t>(n - got, 1u << 30));
      const int k = gzread(f_, out + got, chunk);
      if (k < 0) {
        int err = 0;
        throw std::runtime_error("cannot read " + path_ + ": " + gzerror(f_, &err));
      }
      if (k == 0) break;
      got += static_cast<size_t>(k);
    }
    return got;
  }

 private:
  std::string path_;
  gzFile f_ = nullptr;
};

uint32_t be32(const uint8_t* b) {
  return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | b[3];
}

}  // namespace

// Reads an IDX file of unsigned bytes with `dims` dimensions into a uint8 tensor of its shape. The
// header is checked first (magic, item count, 28x28 items), so a file that claims more than it
// should, or a gzip bomb, costs no more than the header; the data must be exactly as long as the
// header says, and reading stops one byte past that.
at::Tensor read_idx(const std::string& dir, const std::string& name, int dims) {
  IdxReader in(dir, name);
  uint8_t header[16];
  const size_t header_bytes = 4 + 4 * static_cast<size_t>(dims);
  if (in.read(header, header_bytes) != header_bytes || be32(header) != (0x0800u | static_cast<uint32_t>(dims))) {
    throw std::runtime_error(in.path() + ": not an IDX file of unsigned bytes with " + std::to_string(dims) +
                             " dimensions");
  }
  std::vector<int64_t> shape;
  for (int i = 0; i < dims; ++i) shape.push_back(be32(header + 4 + 4 * i));
  if (shape[0] > kMaxItems) {
    throw std::runtime_error(in.path() + ": the header claims " + std::to_string(shape[0]) + " items, more than " +
                             std::to_string(kMaxItems) + "; the file is damaged or not Fashion-MNIST");
  }
  for (int i = 1; i < dims; ++i) {
    if (shape[static_cast<size_t>(i)] != kMaxSide) {
      throw std::runtime_error(in.path() + ": items of " + std::to_string(shape[1]) + "x" +
                               std::to_string(shape[2]) + " pixels; Fashion-MNIST's are 28x28");
    }
  }
  at::Tensor out = at::empty(shape, at::kByte);
  const size_t want = static_cast<size_t>(out.numel());
  const size_t got = in.read(out.data_ptr<uint8_t>(), want);
  uint8_t extra = 0;
  if (got != want || in.read(&extra, 1) != 0) {
    throw std::runtime_error(in.path() + ": " + (got != want ? "shorter" : "longer") + " than its header says (" +
                             std::to_string(header_bytes + want) + " bytes); truncated or damaged file?");
  }
  return out;
}

Split load_split(const std::string& dir, bool train) {
  const std::string prefix = train ? "train" : "t10k";
  const std::string labels_name = prefix + "-labels-idx1-ubyte";
  Split s;
  s.images = read_idx(dir, prefix + "-images-idx3-ubyte", 3).unsqueeze(1);
  s.labels = read_idx(dir, labels_name, 1);
  if (s.images.size(0) != s.labels.size(0)) {
    throw std::runtime_error(dir + ": " + std::to_string(s.images.size(0)) + " " + prefix + " images but " +
                             std::to_string(s.labels.size(0)) + " labels; expected one label per image");
  }
  if (s.images.size(0) == 0) {
    throw std::runtime_error(dir + ": the " + std::string(train ? "training" : "test") +
                             " set has no images; nothing to " + (train ? "train on" : "evaluate"));
  }
  s.labels = s.labels.to(at::kLong);
  if (s.labels.max().item<int64_t>() > 9) throw std::runtime_error(labels_name + ": a label > 9");
  return s;
}

at::Tensor normalise(const at::Tensor& images_uint8) {
  return images_uint8.to(at::kFloat).div_(255.0).sub_(0.1307).div_(0.3081);
}

torch::data::Example<> Dataset::get_batch(c10::ArrayRef<size_t> indices) {
  std::vector<int64_t> idx(indices.begin(), indices.end());
  const at::Tensor rows = at::tensor(idx, at::kLong);
  return {normalise(split_.images.index_select(0, rows)), split_.labels.index_select(0, rows)};
}

}  // namespace fashion_mnist
