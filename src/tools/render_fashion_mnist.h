// `chorus data render-fashion-mnist`: Fashion-MNIST as image files, the fixture for image datasets
// and loaders (docs/image-data.md).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

namespace chorus::tools {

struct RenderArgs {
  std::string out_dir;
  std::string data_dir = "/usr/share/datasets/fashion-mnist";  // Debian's dataset-fashion-mnist
  int size = 28;              // 28 (as stored), or 64 / 224 (PIL-bilinear upscaled)
  std::string format = "png";  // png, jpeg or both
  int64_t limit = -1;         // first N items of each class per split; -1: all
  bool csv = false;           // also train.csv / test.csv and *_multilabel.csv
  int quality = 90;           // JPEG quality
};

void add_render_options(CLI::App& app, RenderArgs& args);
int run_render_fashion_mnist(const RenderArgs& args);

// `chorus data render-fashion-mnist-pairs`: a multi-label CSV dataset whose images hold two
// Fashion-MNIST items side by side, labelled with the union of their classes.
struct PairsArgs {
  std::string out_dir;
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  int64_t count = 6000;        // pairs (from the first 2 * count items of the training split)
  int size = 28;               // each half's side: the image is size x (2 * size)
  std::string format = "png";  // png or jpeg
  int64_t per_group = 4;       // consecutive pairs sharing one group value ("patient")
  int quality = 90;
};

void add_pairs_options(CLI::App& app, PairsArgs& args);
int run_render_fashion_mnist_pairs(const PairsArgs& args);

}  // namespace chorus::tools
