// ZeroRedundancyOptimizer: ZeRO stage 1, as PyTorch's torch.distributed.optim.ZeroRedundancyOptimizer.
// Each rank keeps optimizer state (momentum buffers, Adam's moments) only for its shard of the
// parameters, steps that shard, and then every parameter is sent from the rank that owns it.
//
//   chorus::ddp::DistributedDataParallel ddp(model);                      // gradients averaged as usual
//   chorus::ddp::ZeroRedundancyOptimizer opt(model->parameters(),
//       chorus::ddp::optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(1e-3)));
//   opt.zero_grad();
//   loss_fn(ddp.forward(x), y).backward();
//   opt.step();                                                           // every rank
//
// Contract:
// - Partition: parameter i belongs to owners()[i], by PyTorch's rule (zero_partition below), so a
//   parameter lands on the same rank as under PyTorch's ZeroRedundancyOptimizer given the same list.
// - Construction is collective: every rank passes the same number of parameters with the same
//   shapes and dtypes, each tensor once (tied weights: pass a deduplicated list), defined, dense, on
//   the CPU and contiguous; otherwise every rank raises UsageError naming the rank and what
//   differs. The factory must build the optimizer over exactly the tensors it is given. The
//   parameters should start equal on every rank (DDP's construction makes them so); the first
//   step() makes them equal in any case.
// - step() is collective: every rank calls it, in the same order relative to the group's other
//   collectives. The local optimizer steps this rank's shard only (a parameter whose .grad is
//   undefined is skipped, as the local optimizer skips it, and gets no state), then every
//   parameter is broadcast from its owner (one allgather of the flat buffer with
//   parameters_as_bucket_view). A closure runs once per step on every rank (inside the local
//   optimizer's step, so it may run collectives such as DDP's backward); optimizers that call
//   the closure a varying number of times (LBFGS) are not supported. An error in the local step
//   on one rank leaves the others waiting in the broadcast until the group's timeout, when they
//   fail with the group's usual PeerError or TimeoutError.
// - zero_grad() is local and clears every parameter's .grad, not only the shard's.
// - Memory per rank: the full parameters and gradients (ZeRO-1 shards only the optimizer state),
//   the local optimizer's state for the shard (about 1/W of the unsharded state when there are
//   many parameters of similar size; local_state_bytes()), and, on the rank that consolidated,
//   the unsharded state until the next consolidate_state_dict.
// - Threading: not thread-safe; one thread drives it. Lifetime: the parameters must outlive it.
// - Hyper-parameters: the local optimizer's param_groups carry them; an LR scheduler is attached to
//   local_optimizer() on every rank (the same schedule everywhere keeps the ranks agreeing).
//
// Saving (docs/zero.md): consolidate_state_dict(0) on every rank gathers the shards into an
// unsharded optimizer on rank 0 (the one the factory builds over all parameters), which
// torch::save or chorus::train::save_checkpoint writes like any other optimizer:
//
//   opt.consolidate_state_dict(0);                                         // every rank
//   chorus::train::save_checkpoint(dir, *model, rank == 0 ? &opt.state_dict() : nullptr, state);
//   ...
//   auto full = opt.make_unsharded_optimizer();                            // every rank
//   chorus::train::load_checkpoint(dir, *model, full.get());
//   opt.load_state_dict(*full);                                            // keeps this rank's shard
//
// The saved state is the unsharded optimizer's, indexed by parameter position, so it loads at any
// world size and into a plain (unsharded) optimizer too.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "chorus/comm/process_group.h"

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace chorus::ddp {

// The owner rank of each parameter, given their element counts: PyTorch's sorted-greedy rule.
// Parameters are taken largest first (a stable sort, so equal sizes keep their order) and each
// goes to the rank with the fewest elements so far (the lowest such rank on a tie). Pure.
std::vector<int> zero_partition(const std::vector<int64_t>& numels, int world_size);

// Builds the local optimizer over the tensors given (a shard, or every parameter for the unsharded
// optimizer of consolidate_state_dict and make_unsharded_optimizer).
using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> params)>;

// optimizer_factory<torch::optim::SGD>(torch::optim::SGDOptions(0.1).momentum(0.9)).
template <typename OptimizerType, typename OptionsType>
OptimizerFactory optimizer_factory(OptionsType options) {
  return [options](std::vector<at::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<OptimizerType>(std::move(params), options);
  };
}

struct ZeroOptions {
  ProcessGroup* group = nullptr;  // nullptr = chorus::dist's default group
  // The parameters' storage moves into one flat buffer, rank by rank (they become views of it), so
  // that step() sends them with one in-place allgather instead of one broadcast per parameter.
  // Needs every parameter in one dtype. Off by default, as in PyTorch.
  bool parameters_as_bucket_view = false;
};

class ZeroRedundancyOptimizer {
 public:
  // Collective (see the contract above).
  ZeroRedundancyOptimizer(std::vector<at::Tensor> params, OptimizerFactory make_optimizer, ZeroOptions options = {});
  ~ZeroRedundancyOptimizer();
  ZeroRedundancyOptimizer(const ZeroRedundancyOptimizer&) = delete;
  ZeroRedundancyOptimizer& operator=(const ZeroRedundancyOptimizer&) = delete;

  // Collective: steps this rank's shard, then sends every parameter from its owner.
  void step();
  // The same with a closure that recomputes the loss (run once, on every rank); returns its loss.
  at::Tensor step(const std::function<at::Tensor()>& closure);
  // Local: every parameter's .grad is zeroed (or reset to undefined with set_to_none).
  void zero_grad(bool set_to_none = false);

  // Collective: gathers every rank's shard of the optimizer state into an unsharded optimizer on
  // rank `to` (PyTorch's consolidate_state_dict). Point-to-point: each rank sends only its own
  // shard, and only `to` receives.
  void consolidate_state_dict(int to = 0);
  // Local, on the rank that consolidated: the unsharded optimizer as of the last
  // consolidate_state_dict (stale after later steps). UsageError on any other rank.
  torch::optim::Optimizer& state_dict();
  // Local: takes this rank's shard of the per-parameter state from an unsharded optimizer over
  // the same parameter list (by position; from state_dict() or make_unsharded_optimizer() after a
  // load). This rank's previous state is dropped. Hyper-parameters stay those of the factory.
  void load_state_dict(const torch::optim::Optimizer& unsharded);
  // Local: the factory's optimizer over every parameter, with no state: what a saved state loads into.
  std::unique_ptr<torch::optim::Optimizer> make_unsharded_optimizer() const;

  torch::optim::Optimizer& local_optimizer();     // this rank's shard
  const std::vector<at::Tensor>& parameters() const;
  const std::vector<int>& owners() const;         // owners()[i]: the rank that steps parameter i
  int64_t local_state_bytes() const;              // optimizer_state_bytes(local_optimizer())

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Bytes of the tensors an optimizer holds as per-parameter state (momentum buffers, Adam's
// moments, ...), summed over parameters. Exact for libtorch's SGD, Adam, AdamW, Adagrad and
// RMSprop; for other optimizers, the size of the state's serialized form.
int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer);

}  // namespace chorus::ddp
