// DistributedDataParallel for any torch::nn::Module.
//
//   chorus::dist::init_process_group();
//   auto model = std::make_shared<Net>();
//   chorus::ddp::DistributedDataParallel ddp(model);        // checks and broadcasts parameters
//   auto loss = loss_fn(ddp.forward(x), y);                 // instead of model->forward(x)
//   loss.backward();                                        // grads are averaged over ranks here
//   optimizer.step();
//
// Contract:
// - Construction is collective: every rank wraps a model with the same parameters (count, names,
//   shapes, dtypes, which are frozen; otherwise every rank raises UsageError listing the differing
//   names). Rank 0's parameters (frozen ones too) and buffers are then broadcast to all. A tensor
//   registered under several names (tied weights) is one parameter, reduced once.
// - Gradients are grouped into buckets (reverse registration order; a small first bucket, then
//   bucket_cap_mb). Each parameter's gradient hook marks it ready; a bucket's allreduce starts as
//   soon as its last gradient is ready, while the rest of backward still runs. When backward()
//   returns, every parameter's .grad holds the average over ranks (or what a communication hook,
//   register_comm_hook, made of it: compressed, PowerSGD; see comm_hook.h).
// - Every rank must run backward on the same number of iterations, and (without
//   find_unused_parameters) every parameter must get a gradient on every iteration; otherwise the
//   end of backward raises UsageError naming the parameters that got none and the option to set.
//   With find_unused_parameters, a parameter that no rank used keeps its .grad as it was (an
//   undefined .grad stays undefined, so optimizers skip it), as in PyTorch.
// - Threading: one backward at a time per DDP object. Errors from the collectives (timeouts, dead
//   peers) surface as chorus::Error from backward() or the next forward().
// - Uneven inputs: inside join() ranks may run different numbers of iterations (see join below).
#pragma once

#include <torch/nn/module.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/comm/process_group.h"
#include "chorus/ddp/comm_hook.h"

namespace chorus::ddp {

enum class Compression {
  kNone,      // gradients travel in their own dtype
  kFloat16,   // cast to float16 for the allreduce, back after (halves the bytes)
  kBFloat16,  // cast to bfloat16 (same range as float32, fewer mantissa bits)
};

struct Options {
  double first_bucket_mb = 1.0;    // the first bucket (the last layers) is small so it starts early
  double bucket_cap_mb = 25.0;     // later buckets
  bool find_unused_parameters = false;
  bool broadcast_buffers = true;   // rank 0's buffers (e.g. BatchNorm statistics) before each forward
  // Installs fp16_compress_hook / bf16_compress_hook (comm_hook.h) at construction.
  Compression compression = Compression::kNone;
  // .grad tensors alias the buckets: backward accumulates straight into them, and no gradient is
  // copied in or out (PyTorch's default is false; here the aliases are plain tensors, not autograd
  // views, so optimizers' detach_() works and there is no reason to pay the copies). It cut the
  // MLP's step time by about 10% in bench/compare-ddp. Set false for .grad tensors of their own.
  bool gradient_as_bucket_view = true;
  // Whether a bucket's allreduce runs on the group's worker thread while backward goes on
  // (kAlways, the default), or in the backward thread as soon as the bucket is ready (kNever:
  // no second busy thread per rank, for hosts where every core computes and the allreduce is
  // CPU work; measured here it was no faster, so it is not the default).
  enum class Overlap { kAlways, kNever };
  Overlap overlap = Overlap::kAlways;
  ProcessGroup* group = nullptr;   // nullptr = chorus::dist's default group
};

// Uneven inputs (PyTorch's `with ddp.join(...)`): see Reducer::join.
struct JoinOptions {
  // true: gradients are divided by the world size the job started with, the ranks that have
  // finished contributing zeros (PyTorch's default). false: divided by the number of ranks still
  // training, so each step's gradient is the mean over the ranks that had data for it.
  bool divide_by_initial_world_size = true;
  // true: once any rank runs out of data, every rank throws UnevenInputsError at its next step
  // (the ranks still training from forward(), the finished ones from join()), instead of going on.
  bool throw_on_early_termination = false;
};

// Thrown on every rank of a join() with throw_on_early_termination once one rank ran out of data.
// The group is still usable: every rank stopped after the same collective.
class UnevenInputsError : public Error {
 public:
  using Error::Error;
};

// Statistics of the last synchronised backward, for benchmarks and tuning.
struct Stats {
  int buckets = 0;
  int64_t gradient_bytes = 0;      // bytes of gradients synchronised per step
  int64_t bucket_bytes = 0;        // bytes held in bucket buffers (the extra gradient copy)
  int64_t shared_bytes = 0;        // bucket memory every rank maps (shared memory): allreduced in place
  double backward_ms = 0;          // from the first gradient hook to the end of backward
  double comm_ms = 0;              // time the bucket allreduces ran, in total
  double comm_wait_ms = 0;         // time the end of backward waited for them: the exposed part
  // Share of the allreduce time hidden behind backward: 1 - comm_wait_ms / comm_ms.
  double hidden_fraction() const { return comm_ms > 0 ? std::max(0.0, 1.0 - comm_wait_ms / comm_ms) : 1.0; }
};

// The libtorch-independent part of DDP: the reducer over a module's parameters.
class Reducer {
 public:
  Reducer(torch::nn::Module& module, Options options);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Called before each forward: broadcasts buffers when asked, re-arms the hooks.
  void prepare_forward();
  // What runs on each bucket instead of the default allreduce (comm_hook.h; PyTorch's
  // register_comm_hook). Collective: every rank registers a hook of the same describe(), before
  // the first backward, at most once (Options::compression counts as one); otherwise every rank
  // raises UsageError saying which rank differs or what was wrong. Calls hook->prepare.
  void register_comm_hook(std::shared_ptr<CommHook> hook);
  // While the guard lives, backward accumulates gradients locally (no communication).
  class NoSync {
   public:
    explicit NoSync(Reducer& r);
    ~NoSync();

   private:
    Reducer& r_;
    bool previous_;
  };
  NoSync no_sync() { return NoSync(*this); }

  // Runs `body` (this rank's training loop over its own data) in a join: ranks may run different
  // numbers of iterations. Collective: every rank calls join at the same point. While some ranks
  // are still training, a rank whose body has returned shadows their steps: it answers each
  // forward's round (one allgather of two integers per forward, on every rank, while inside join),
  // the buffers' broadcast, and each synchronised backward's bucket allreduces with zeros. Once
  // every body has returned, the parameters and buffers of the last rank to finish (the highest
  // rank among those that finished last) are broadcast to all, so every rank ends with the same model.
  // Within join, buffers are broadcast from the highest rank still training rather than rank 0
  // (rank 0 may have finished). As in PyTorch, a rank that has finished takes part in the others'
  // gradient allreduces through its own buckets, so its .grad fields (with gradient_as_bucket_view)
  // hold the others' averages afterwards; its optimizer is not stepped.
  // Every iteration of the body must run forward() then, when synchronising, backward(); a
  // forward without its backward desynchronises the ranks (MismatchError or a timeout, as
  // outside join). An exception from the body propagates at once: the others then fail at their
  // next collective with the usual PeerError or timeout. Not reentrant.
  void join(const std::function<void()>& body, JoinOptions options = {});

  const Stats& stats() const;
  ProcessGroup& group();
  const std::vector<std::vector<size_t>>& bucket_assignment() const;  // parameter indices per bucket
  const std::vector<std::string>& parameter_names() const;            // what the indices refer to

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

template <typename ModuleType>
class DistributedDataParallel {
 public:
  explicit DistributedDataParallel(std::shared_ptr<ModuleType> module, Options options = {})
      : module_(std::move(module)), reducer_(std::make_unique<Reducer>(*module_, std::move(options))) {}
  // Module holders (TORCH_MODULE(Net)) work too.
  template <typename Holder, typename = decltype(std::declval<Holder>().ptr())>
  explicit DistributedDataParallel(Holder holder, Options options = {})
      : DistributedDataParallel(holder.ptr(), std::move(options)) {}

  template <typename... Args>
  auto forward(Args&&... args) {
    reducer_->prepare_forward();
    return module_->forward(std::forward<Args>(args)...);
  }
  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  ModuleType* operator->() { return module_.get(); }
  const std::shared_ptr<ModuleType>& module() const { return module_; }
  Reducer::NoSync no_sync() { return reducer_->no_sync(); }
  // See Reducer::register_comm_hook.
  void register_comm_hook(std::shared_ptr<CommHook> hook) { reducer_->register_comm_hook(std::move(hook)); }
  // See Reducer::join: `ddp.join([&] { for (auto& batch : my_batches) step(batch); });`
  void join(const std::function<void()>& body, JoinOptions options = {}) { reducer_->join(body, options); }
  Reducer& reducer() { return *reducer_; }
  const Stats& stats() const { return reducer_->stats(); }

 private:
  std::shared_ptr<ModuleType> module_;
  std::unique_ptr<Reducer> reducer_;
};

template <typename Holder, typename = decltype(std::declval<Holder>().ptr())>
DistributedDataParallel(Holder, Options = {}) -> DistributedDataParallel<typename Holder::ContainedType>;
template <typename ModuleType>
DistributedDataParallel(std::shared_ptr<ModuleType>, Options = {}) -> DistributedDataParallel<ModuleType>;

}  // namespace chorus::ddp
