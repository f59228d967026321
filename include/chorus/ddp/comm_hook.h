// Communication hooks: what DDP does with a bucket of gradients (PyTorch's register_comm_hook).
//
//   auto hook = std::make_shared<chorus::ddp::PowerSGDHook>(chorus::ddp::PowerSGDOptions{});
//   ddp.register_comm_hook(hook);      // collective, before the first backward, once
//
// Contract:
// - The reducer calls CommHook::run once per bucket and synchronised backward, in bucket order,
//   from the thread that completed the bucket (the backward thread), as soon as the bucket is
//   complete. run() starts the bucket's communication and returns a Work; once that Work's wait()
//   returns, GradBucket::buffer must hold what .grad should become (the average, or its
//   decompressed approximation). The reducer waits on the Works in bucket order at the end of
//   backward, so a hook that returns before its communication is done overlaps it with the rest
//   of backward.
// - A hook whose work needs several dependent steps (PowerSGD: allreduce P, compute Q from it,
//   allreduce Q) runs them with GradBucket::run_async: one background thread per reducer, tasks
//   in submission order, so every rank still issues its collectives in the same order.
// - Every rank registers a hook of the same type and settings (CommHook::describe, compared across
//   ranks at registration) and every rank runs it on every bucket: a hook must issue the same
//   collectives in the same order on every rank. In a join(), a rank whose data ran out runs the
//   hook on a bucket of zeros (GradBucket::joined), as PyTorch's DDP does.
// - An exception from run() or from its Work surfaces from backward() (or join()) as a
//   chorus::Error naming the hook and the bucket; errors of the collectives themselves keep their
//   type (TimeoutError, PeerError). The other ranks then fail in their next collective.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "chorus/comm/process_group.h"

namespace chorus::ddp {

class Reducer;
namespace detail {
class HookThread;
}

// One bucket as a hook sees it.
struct GradBucket {
  size_t index = 0;   // 0 for the first bucket launched (the last layers)
  size_t count = 0;   // buckets in all
  bool is_last() const { return index + 1 == count; }  // the last bucket of a backward
  // The bucket's gradients, back to back, in the parameters' dtype. The hook leaves the result here.
  at::Tensor buffer;
  std::vector<size_t> parameters;             // the reducer's parameter indices (Reducer::parameter_names)
  std::vector<int64_t> offsets;               // element offset of each in buffer
  std::vector<std::vector<int64_t>> shapes;   // each parameter's shape
  ProcessGroup* group = nullptr;
  // What the sum over ranks is divided by for the average: the world size, or in a join with
  // divide_by_initial_world_size = false the number of ranks still training.
  int divisor = 1;
  bool joined = false;  // this rank's join body has returned: buffer holds zeros, shadowing the others

  // buffer's pieces, shaped like the parameters (views: writing them writes buffer).
  std::vector<at::Tensor> gradients() const;
  // Runs fn on the reducer's hook thread (one thread, tasks in submission order); the Work
  // completes when fn returns and rethrows what it threw.
  std::shared_ptr<Work> run_async(std::function<void()> fn) const;

 private:
  friend class Reducer;
  detail::HookThread* thread_ = nullptr;
};

// Extra memory a hook holds, added to the reducer's Stats.
struct HookMemory {
  int64_t bytes = 0;         // e.g. a compressed copy of every bucket
  int64_t shared_bytes = 0;  // of which every rank maps (ProcessGroup::allocate_buffer over shared memory)
};

class CommHook {
 public:
  virtual ~CommHook() = default;
  // The hook's type and settings, compared across ranks at registration.
  virtual std::string describe() const = 0;
  // Called once at registration on every rank, in the same order, with the buckets the hook will
  // be given (buffer included): may allocate per-bucket state and call collectives such as
  // ProcessGroup::allocate_buffer.
  virtual void prepare(const std::vector<GradBucket>& /*buckets*/, HookMemory& /*memory*/) {}
  // Starts the bucket's communication; see the contract above.
  virtual std::shared_ptr<Work> run(GradBucket& bucket) = 0;
};

// The default: allreduce and divide by GradBucket::divisor (PyTorch's allreduce_hook).
std::shared_ptr<CommHook> allreduce_hook();
// Divide by the divisor in the bucket's dtype, cast to float16 (bfloat16), allreduce the sum,
// cast back: half the bytes on the wire. Dividing first keeps float16 from overflowing where the
// average fits. Buckets of other than float32/float64 travel uncompressed. Options::compression
// installs these.
std::shared_ptr<CommHook> fp16_compress_hook();
std::shared_ptr<CommHook> bf16_compress_hook();

// PowerSGD (Vogels et al., 2019) as PyTorch 1.13's powerSGD_hook: see docs/ddp.md.
struct PowerSGDOptions {
  int64_t matrix_approximation_rank = 1;
  int64_t start_powerSGD_iter = 1000;   // plain allreduce for the iterations before this one
  double min_compression_rate = 2;      // compress a matrix only if (n + m) r * this < n m
  bool use_error_feedback = true;       // add what compression lost last time to the next gradient
  bool warm_start = true;               // start from the previous iteration's Q
  double orthogonalization_epsilon = 0; // added to column norms in Gram-Schmidt (e.g. 1e-8)
  uint32_t random_seed = 0;             // seeds of the initial Qs: numpy.random.RandomState(seed), as PyTorch
  bool batch_tensors_with_same_shape = false;
};

class PowerSGDHook final : public CommHook {
 public:
  // Throws UsageError for options PyTorch refuses (error feedback or warm start with
  // start_powerSGD_iter <= 1, a rank < 1).
  explicit PowerSGDHook(PowerSGDOptions options = {});
  std::string describe() const override;
  std::shared_ptr<Work> run(GradBucket& bucket) override;

  int64_t iteration() const { return iter_.load(); }
  // (numel before / numel after, numel before, numel after) over every compressed step so far.
  struct CompressionStats {
    double rate = 0;
    int64_t numel_before = 0;
    int64_t numel_after = 0;
  };
  CompressionStats compression_stats() const;

 private:
  void compress(GradBucket& bucket);  // on the hook thread
  void maybe_increase_iter(const GradBucket& bucket);

  PowerSGDOptions opts_;
  std::shared_ptr<CommHook> allreduce_ = allreduce_hook();
  std::atomic<int64_t> iter_{0};
  std::mt19937 rng_;  // numpy's RandomState(seed) is this generator
  std::map<size_t, at::Tensor> error_, p_memory_, q_memory_;  // per bucket index
  std::atomic<int64_t> numel_before_{0}, numel_after_{0};
};

// numpy.random.RandomState's randint(high) for 0 < high <= 2^32 on an MT19937 seeded like
// RandomState(seed): the smallest all-ones mask over high - 1, draws rejected above it.
// PowerSGD draws its seeds with it, as PyTorch's hook does. Pure.
int64_t numpy_randint(std::mt19937& rng, int64_t high);

}  // namespace chorus::ddp
