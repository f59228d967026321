// The optimizer's bytes (chorus/torch/optimizer_bytes.h): libtorch's archive of Optimizer::save.
#include "chorus/torch/optimizer_bytes.h"

#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <sstream>

namespace chorus::dist {

std::string optimizer_to_bytes(const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

void optimizer_from_bytes(const std::string& bytes, torch::optim::Optimizer& optimizer) {
  torch::serialize::InputArchive archive;
  archive.load_from(bytes.data(), bytes.size());
  optimizer.load(archive);
}

}  // namespace chorus::dist
