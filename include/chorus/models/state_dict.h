// PyTorch state dicts for any torch::nn::Module: the same keys in the same order as Python's
// nn.Module.state_dict(), read from and written to files that torch.save / torch.load use.
//
//   auto result = chorus::models::load_state_dict(*model, "resnet18.pt");  // strict by default
//   chorus::models::save_state_dict(*model, "mine.pt");  // Python: m.load_state_dict(torch.load(f))
//
// Contract:
// - Order: module by module in registration order (pre-order), each module's own parameters then
//   its own buffers, as Python lists them. Undefined tensors (a Conv2d without bias) are skipped.
// - load_state_dict copies values into the module's tensors in place (dtype converted as by
//   copy_), without recording autograd and keeping requires_grad. It checks everything before
//   copying anything: on error the module is unchanged.
//   strict (the default): any missing or unexpected key is an error. Non-strict: the keys both
//   have are loaded; missing and unexpected ones are returned. A key whose shape differs is an
//   error in both modes, as in PyTorch. The error (StateDictError) lists every missing,
//   unexpected and mis-shaped key, the last with both shapes, and says how to fix it.
// - Files: read_state_dict reads what Python's torch.save(dict_of_tensors, f) writes (the zip
//   format, PyTorch >= 1.6; an OrderedDict keeps its order). save_state_dict writes the same
//   format; torch.load returns a dict that nn.Module.load_state_dict accepts.
// - Local: no communication. To give every rank rank 0's weights, load on rank 0 and wrap the model
//   in chorus::ddp::DistributedDataParallel, whose construction broadcasts parameters and buffers.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "chorus/comm/error.h"

namespace torch::nn {
class Module;
}

namespace chorus::models {

// A state dict file or its contents do not fit the module, or the file cannot be read or written.
class StateDictError : public Error {
 public:
  using Error::Error;
};

// (key, tensor) in Python's order.
using StateDict = std::vector<std::pair<std::string, at::Tensor>>;

// The module's state: its tensors themselves (detached aliases; writing to them writes the module).
StateDict state_dict(const torch::nn::Module& module);

struct LoadOptions {
  bool strict = true;
};

struct LoadResult {
  std::vector<std::string> missing;     // in the module, not in the state dict (non-strict only)
  std::vector<std::string> unexpected;  // in the state dict, not in the module (non-strict only)
};

LoadResult load_state_dict(torch::nn::Module& module, const StateDict& state, const LoadOptions& options = {});
// Reads `path` (read_state_dict) and loads it; errors name the file.
LoadResult load_state_dict(torch::nn::Module& module, const std::string& path, const LoadOptions& options = {});

StateDict read_state_dict(const std::string& path);
void save_state_dict(const StateDict& state, const std::string& path);
void save_state_dict(const torch::nn::Module& module, const std::string& path);

}  // namespace chorus::models
