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

}  // namespace chorus::tools
