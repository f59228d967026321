// SyncBatchNorm on the CPU: BatchNorm whose training statistics are those of the global batch, the
// concatenation of every rank's batch (PyTorch's torch.nn.SyncBatchNorm exists for CUDA only).
//
//   struct Net : torch::nn::Module {
//     chorus::ddp::SyncBatchNorm bn{nullptr};
//     Net() { bn = register_module("bn", chorus::ddp::SyncBatchNorm(64)); }   // not BatchNorm2d(64)
//   };
//   auto model = chorus::ddp::convert_sync_batchnorm(sequential_model);        // or convert one
//
// Contract:
// - In training mode with a world of more than one rank, forward is a collective: one allreduce
//   of 2C+1 float64 values (per-channel sum and sum of squares, and the element count per
//   channel), and backward is another: 2C values (per-channel sum(dy) and sum(dy * (x - mean))),
//   skipped when the input needs no gradient. Every rank of the group must call forward the same
//   number of times in training mode, in the same order relative to its other collectives, and
//   run backward through each of those outputs or through none. A rank whose batch is empty
//   (N = 0) still calls forward and backward; its count is 0.
// - Training normalises with the global mean and biased variance; running_var is updated with
//   the global unbiased variance (count / (count - 1)), as torch.nn.BatchNorm does on one process.
//   grad_input is exact for the sum of every rank's loss; grad_weight and grad_bias are this
//   rank's own (sum over ranks is the global gradient), as in PyTorch, so DDP then averages them.
// - In eval mode (using running statistics), with a world of one, or before chorus::dist is
//   initialised (group nullptr), it is torch::nn::BatchNorm: no communication.
// - Errors: an input of dimension < 2 or > 5, or whose size(1) is not num_features, raises
//   UsageError (locally). A global count of 0 or 1 values per channel raises UsageError on every
//   rank (all ranks see the same count, so none is left waiting). Collective errors (timeouts,
//   dead peers, a rank calling a different collective) surface as chorus::Error.
// - State names (weight, bias, running_mean, running_var, num_batches_tracked) are BatchNorm's,
//   so state dicts and checkpoints move between the two. Inputs in float16/bfloat16 (autocast) are
//   normalised in float32 and returned in their own dtype. Threading: one forward at a time.
#pragma once

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>

#include "chorus/comm/process_group.h"

namespace chorus::ddp {

// torch::nn::BatchNormOptions plus the group whose ranks share statistics.
struct SyncBatchNormOptions {
  /* implicit */ SyncBatchNormOptions(int64_t num_features) : num_features_(num_features) {}
  // The same settings as a BatchNorm's, for the converter.
  explicit SyncBatchNormOptions(const torch::nn::BatchNormOptions& batch_norm, ProcessGroup* group = nullptr);

  TORCH_ARG(int64_t, num_features);
  TORCH_ARG(double, eps) = 1e-5;
  // nullopt: cumulative moving average (1 / num_batches_tracked), as in BatchNorm.
  TORCH_ARG(c10::optional<double>, momentum) = 0.1;
  TORCH_ARG(bool, affine) = true;
  TORCH_ARG(bool, track_running_stats) = true;
  // nullptr = chorus::dist's default group, looked up at each forward (so the model may be built
  // before init_process_group). (An alias: TORCH_ARG would write `const ProcessGroup*&`.)
  using GroupPtr = ProcessGroup*;
  TORCH_ARG(GroupPtr, group) = nullptr;
};

// Tensors a SyncBatchNorm adopts instead of allocating its own (the converter passes a
// BatchNorm's, so an optimizer built before the conversion still holds the parameters).
struct SyncBatchNormState {
  torch::Tensor weight, bias, running_mean, running_var, num_batches_tracked;
};

class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  explicit SyncBatchNormImpl(SyncBatchNormOptions options);
  // Shares state's tensors (which must match the options: shapes [num_features], defined exactly
  // when affine / track_running_stats say so; otherwise UsageError).
  SyncBatchNormImpl(SyncBatchNormOptions options, SyncBatchNormState state);

  // input: (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W).
  torch::Tensor forward(const torch::Tensor& input);

  void reset() override;
  void reset_running_stats();
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;

  SyncBatchNormOptions options;
  torch::Tensor weight;               // defined when affine
  torch::Tensor bias;                 // defined when affine
  torch::Tensor running_mean;         // defined when track_running_stats
  torch::Tensor running_var;          // defined when track_running_stats
  torch::Tensor num_batches_tracked;  // defined when track_running_stats

 private:
  torch::Tensor forward_synced(const torch::Tensor& input, ProcessGroup& group, double factor);

  c10::optional<SyncBatchNormState> adopt_;  // tensors to share, consumed by the first reset()
};
TORCH_MODULE(SyncBatchNorm);

// Replaces every torch::nn::BatchNorm1d/2d/3d in module's tree (recursively) with a SyncBatchNorm
// sharing its weight, bias, running statistics and num_batches_tracked, with its options and
// training mode, and returns module (or the new SyncBatchNorm when module itself is a BatchNorm),
// like PyTorch's torch.nn.SyncBatchNorm.convert_sync_batchnorm. Not a collective.
//
// Limitation, of libtorch rather than of the converter: a C++ module calls its submodules through
// its own fields (`torch::nn::BatchNorm2d bn{nullptr}`), and nothing can make such a field point
// at another module or another type. The converter therefore updates the module tree (each
// parent's registered child) and the containers whose forward or iteration reads their own list
// (Sequential, ModuleList, ModuleDict). When a converted BatchNorm is still held anywhere else
// afterwards (a field, a copy kept by the caller), its forward would run unsynchronised, so the
// converter undoes every replacement and raises UsageError naming it and the fix: declare that
// field as chorus::ddp::SyncBatchNorm, or keep the layer inside one of those containers.
std::shared_ptr<torch::nn::Module> convert_sync_batchnorm(std::shared_ptr<torch::nn::Module> module,
                                                          ProcessGroup* group = nullptr);

}  // namespace chorus::ddp
