// DistributedDataParallel's reducer, inside (ddp.cc: construction, agreement and the public calls;
// backward.cc: the gradient hooks, buckets and the end of backward; join.cc: uneven inputs).
// Internal to chorus_ddp.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/strides.h>
#include <torch/csrc/autograd/function.h>

#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "chorus/ddp/ddp.h"
#include "hook_thread.h"

namespace chorus::ddp {
namespace detail {

using Clock = std::chrono::steady_clock;

// A tensor sharing flat's memory at `offset`, shaped `sizes`, that is not an autograd view:
// optimizers call detach_() on gradients, which views refuse.
inline at::Tensor alias_of(const at::Tensor& flat, int64_t offset, at::IntArrayRef sizes) {
  at::NoGradGuard no_grad;
  at::Tensor t = at::empty({0}, flat.options());
  t.set_(flat.storage(), flat.storage_offset() + offset, sizes, c10::contiguous_strides(sizes));
  return t;
}

inline double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

struct Bucket {
  std::vector<size_t> params;    // parameter indices, in the order they were assigned
  std::vector<int64_t> offsets;  // element offset of each in flat
  at::Tensor flat;               // the gradients, back to back, in the parameters' dtype
  GradBucket view;               // what the communication hook is given (flat is its buffer)
  size_t pending = 0;            // parameters not yet ready in this backward
  std::shared_ptr<Work> work;
};

// What a join round tells every rank (Reducer::Impl::join_round).
struct JoinRound {
  int flagged = 0;       // ranks whose first value was 1 (still training; at the end: finished last)
  int highest = -1;      // the highest of them
  bool any_sync = false; // some rank still training will synchronise its backward
};

}  // namespace detail

struct Reducer::Impl {
  using Bucket = detail::Bucket;
  using JoinRound = detail::JoinRound;
  using Clock = detail::Clock;

  Options opts;
  ProcessGroup* pg = nullptr;
  int world = 1;
  std::vector<std::string> names;     // one per distinct parameter that requires a gradient
  std::vector<at::Tensor> params;
  std::vector<std::string> described;  // every distinct parameter, frozen ones too: the agreement check
  std::vector<at::Tensor> state;       // every distinct parameter: broadcast from rank 0 at construction
  std::vector<char> used;              // parameter got a gradient since the last synchronised backward
  std::vector<std::string> buffer_names;
  std::vector<at::Tensor> buffers;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;  // keeps the hooks alive
  std::vector<Bucket> buckets;
  std::vector<std::pair<size_t, size_t>> where;  // parameter -> (bucket, position in bucket)
  std::vector<bool> ready;
  size_t next_launch = 0;
  bool overlap = true;  // bucket allreduces run on the group's worker thread (Options::overlap)
  bool sync = true;
  bool in_backward = false;
  bool joining = false;  // inside join(): every forward starts with a join round
  JoinOptions join_opts;
  int divisor = 1;       // what gradients are divided by: the world size, or the ranks still training
  Clock::time_point backward_start;
  Stats stats;
  std::vector<std::vector<size_t>> assignment;
  std::shared_ptr<bool> alive = std::make_shared<bool>(true);
  std::shared_ptr<CommHook> hook = allreduce_hook();
  std::string hook_source;      // who registered the hook: "" while the default allreduce runs
  bool backward_seen = false;   // a hook may be registered only before the first backward
  bool shadowing = false;       // a join's finished rank runs the hook on zeros
  // Last: destroyed first, so that no hook task outlives the buckets or the hook it uses.
  detail::HookThread hook_thread;

  std::string me() const { return "chorus::ddp: rank " + std::to_string(pg->rank()); }

  at::Tensor slot(size_t i) {
    auto [b, k] = where[i];
    return buckets[b].flat.narrow(0, buckets[b].offsets[k], params[i].numel());
  }
  at::Tensor grad_alias(size_t i) {
    auto [b, k] = where[i];
    return detail::alias_of(buckets[b].flat, buckets[b].offsets[k], params[i].sizes());
  }

  void check_agreement();

  void broadcast_from(int root, std::vector<at::Tensor>& tensors);

  // Hands a complete bucket to the communication hook. What it throws, here or from its Work,
  // is rethrown by wait_buckets() once every bucket has been waited for.
  void launch(Bucket& b);

  // Waits for every launched bucket, in order, adding their run times to *comm_ms. Returns the
  // first error: chorus's own (a timeout, a dead peer) as it is, anything else a hook threw as an
  // Error naming the hook and the bucket.
  std::exception_ptr wait_buckets(double* comm_ms);

  // Collective: see Reducer::register_comm_hook. `source` says who registers it, for the errors.
  void register_hook(std::shared_ptr<CommHook> h, const std::string& source);

  // One allgather of two integers per rank; every rank learns who raised `flag` (still training,
  // or at the end: finished last) and whether any of them will synchronise its backward.
  JoinRound join_round(bool flag, bool will_sync);

  // A finished rank's part in a synchronised backward of the ranks still training: the same
  // allreduces in the same order, of zeros (finalize() without gradients).
  void shadow_backward();

  // The shadowing loop of a rank whose join body returned, then the final model broadcast.
  void finish_join();

  void launch_ready();

  void mark_ready(size_t i, bool has_grad);

  void on_gradient(size_t i);

  void finalize();

  // The module's distinct parameters and buffers, by identity as PyTorch's DDP dedups them: tied
  // weights registered under two names are one parameter with one .grad, so they are reduced once.
  void collect(torch::nn::Module& module);

  // The buckets of the parameters that require a gradient (assign_buckets), each with its flat
  // gradient tensor and, when compressed, the tensor that travels.
  void build_buckets();

  // Options::gradient_as_bucket_view: a defined .grad becomes a view into its bucket, so backward
  // accumulates straight into the bucket. An undefined one stays undefined until its first
  // gradient (as in PyTorch), so a parameter that is never used is never seen by the optimizer.
  void view_grads_in_buckets();

  // A hook after each parameter's gradient accumulator: on_gradient(i) while this Reducer lives.
  void install_hooks();
};

}  // namespace chorus::ddp
