// Fashion-MNIST from IDX files (gzipped, as Debian's dataset-fashion-mnist ships them).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/data/datasets/base.h>
#include <torch/data/example.h>

#include <string>

namespace fashion_mnist {

struct Split {
  at::Tensor images;  // uint8 [N, 1, 28, 28], raw pixel values; normalise per batch
  at::Tensor labels;  // int64 [N], classes 0..9
  int64_t size() const { return labels.size(0); }
};

// Reads <dir>/train-*-ubyte.gz (train) or <dir>/t10k-*-ubyte.gz; plain (not gzipped) files work
// too. Throws std::runtime_error naming the file and what is wrong with it.
Split load_split(const std::string& dir, bool train);

// One IDX file of unsigned bytes with `dims` dimensions (1 or 3): <dir>/<name>.gz, else <dir>/<name>,
// as a uint8 tensor of its shape. Checks the header first (at most 10^6 items of 28x28) and the
// length; throws std::runtime_error naming the file. (load_split's reader; fuzz/idx_example.cc.)
at::Tensor read_idx(const std::string& dir, const std::string& name, int dims);

// Pixels to the network's input, as PyTorch's MNIST example: (x / 255 - 0.1307) / 0.3081.
at::Tensor normalise(const at::Tensor& images_uint8);

// A split as a torch batch dataset: a batch of indices becomes normalised images and their labels
// in one index_select, with no tensor per item (what torchvision's MNIST gives, batched).
class Dataset : public torch::data::datasets::BatchDataset<Dataset, torch::data::Example<>> {
 public:
  explicit Dataset(Split split) : split_(std::move(split)) {}
  torch::data::Example<> get_batch(c10::ArrayRef<size_t> indices) override;
  torch::optional<size_t> size() const override { return static_cast<size_t>(split_.size()); }

 private:
  Split split_;
};

}  // namespace fashion_mnist
