// An optimizer's whole state as bytes and back: the one form in which ZeroRedundancyOptimizer
// sends a shard's state between ranks (consolidate_state_dict) and a checkpoint stores an
// optimizer (chorus/train/checkpoint.h). The bytes are libtorch's own archive of
// Optimizer::save: each parameter's state (Adam's step and moments, SGD's momentum buffer, ...).
// An optimizer of the same type over parameters of the same shapes loads them; its options (lr,
// ...) stay its own, as libtorch 1.13 restores states and not options, so build it as the saved
// one was. Anything else fails in libtorch's load with its own error.
#pragma once

#include <string>

namespace torch::optim {
class Optimizer;
}

namespace chorus::dist {

std::string optimizer_to_bytes(const torch::optim::Optimizer& optimizer);
void optimizer_from_bytes(const std::string& bytes, torch::optim::Optimizer& optimizer);

}  // namespace chorus::dist
