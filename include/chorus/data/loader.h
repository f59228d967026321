// ParallelLoader: batches of an ImageDataset decoded by a pool of threads, prefetched, in the
// sampler's order.
//
//   chorus::data::LoaderOptions o;
//   o.batch_size = 64;
//   o.threads = 8;
//   chorus::data::DistributedSamplerOptions so;
//   so.auto_epoch = true;
//   chorus::data::ParallelLoader loader(dataset, chorus::data::DistributedSampler(dataset.size(), so), o);
//   for (auto& batch : loader) { ... batch.data, batch.target ... }
//
// or, in an Accelerator loop, accelerator.prepare_data_loader(dataset, o) (chorus/train/accelerator.h),
// which drives a ParallelLoader with its own DistributedSampler, resumes mid-epoch and counts steps.
//
// Contract:
// - Order: the batches are the sampler's index batches (sampler.next(batch_size) until it returns
//   nullopt or an empty batch; with drop_last a short last batch is dropped), each batch's items in
//   the sampler's order: batch.data = stack of the decoded items, batch.target = stack of their
//   targets ([B] int64, or [B, classes] float for a multi-label dataset). Whatever the thread count
//   and timing, the output is that of decoding the items one by one on one thread.
// - Epoch: the decode function sees the sampler's epoch() after its reset() (a DistributedSampler,
//   or the Accelerator's), else the number of passes begun before this one.
// - Memory: the loader keeps at most prefetch_batches + 1 batches in progress (index batches taken
//   from the sampler and not yet handed out), so at most (prefetch_batches + 1) * batch_size decoded
//   items (or their stacked batches) at any time, whatever the number of threads; the batch handed
//   to the loop is then the caller's. While the loop works on a batch, the next prefetch_batches
//   are being decoded. Raw bytes: one item's per thread.
// - Decoding into the batch: when the dataset's decode function is image_decoder's
//   (chorus/data/image_tensor.h), each item is written straight into its batch's tensor: no tensor
//   per item and no stacking copy. The loader then keeps the tensors of its latest
//   prefetch_batches + 3 such batches, and writes a later batch into one the loop has let go of
//   (no tensor, view or autograd graph refers to it any more) instead of allocating fresh memory;
//   so that much memory may stay allocated after the loop has released its batches.
// - Threads: `threads` decode threads, started by the constructor and joined by the destructor.
//   Each takes the oldest waiting item: reads it from the dataset's ByteSource, decodes it, and the
//   thread that finishes a batch's last item stacks the batch (or hands over the tensor its items
//   were decoded into). The loader and its iterators are used from one thread (the consumer).
// - Passes: begin() starts a pass (sampler.reset()), cancelling the previous one. Destroying every
//   iterator of a pass, or the loader, cancels it: waiting items are dropped at once and the
//   destructor joins the threads after their current item (one decode), with no batch left alive.
//   After a cancel, up to `threads` items of the old pass may still be finishing their decode.
// - Errors: an item that cannot be read or decoded fails its batch when the loop takes that batch:
//   DataError naming the batch and the item (index, and the ByteSource's describe(key): the file),
//   then the reader's or decoder's message. The loop may go on iterating: the next batch follows.
//   With skip_bad, such items are left out of their batch instead and counted (stats()); a batch
//   whose items all fail is still an error (an empty batch has no shape, and dropping it would give
//   ranks different step counts). Items of different shapes make their batch fail the same way.
//   A failure of the storage itself (SourceError from the ByteSource: an S3 endpoint down, access
//   denied) is never skipped: its batch fails with a SourceError, whatever skip_bad says, as soon as
//   the first of its items fails (within one item's retry budget of the fault, not after every item
//   has spent its own), and the batches prefetched after it fail with a SourceError naming it
//   without being read. Items already being read when that happens finish on their threads and
//   are dropped.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/data/example.h>
#include <torch/data/iterator.h>
#include <torch/data/samplers/base.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/data/image_dataset.h"

namespace chorus::data {

struct LoaderOptions {
  size_t batch_size = 1;
  int threads = 4;              // decode threads, >= 1
  size_t prefetch_batches = 2;  // batches decoded ahead of the loop, >= 0 (the memory bound above)
  bool drop_last = false;       // drop a last batch shorter than batch_size
  bool skip_bad = false;        // leave unreadable items out of their batch and count them
};

struct LoaderStats {
  int64_t bad_items = 0;  // items skip_bad left out of the batches handed to the loop, over the loader's life
  std::string first_bad;  // the first one's error message, in the order the loop got them
};

namespace detail {
// The decode pool behind ParallelLoader: batches are submitted in order and taken in that order.
class LoaderEngine {
 public:
  LoaderEngine(ImageDataset dataset, const LoaderOptions& options);
  ~LoaderEngine();
  LoaderEngine(const LoaderEngine&) = delete;
  LoaderEngine& operator=(const LoaderEngine&) = delete;

  // Cancels the current pass and starts pass `pass` at `epoch`.
  void start_pass(int64_t pass, int64_t epoch);
  // Drops the waiting items and batches of pass `pass`, if it is the current one.
  void cancel_pass(int64_t pass);
  // Queues one batch's items for decoding.
  void submit(std::vector<size_t> indices);
  size_t in_progress() const;
  // Waits for the oldest submitted batch and hands it out; throws its DataError.
  torch::data::Example<> take();
  LoaderStats stats() const;

 private:
  struct Batch;
  struct Shared;
  void work();
  std::shared_ptr<Shared> shared_;
};

template <typename S, typename = void>
struct HasEpoch : std::false_type {};
template <typename S>
struct HasEpoch<S, std::void_t<decltype(std::declval<const S&>().epoch())>> : std::true_type {};
}  // namespace detail

// Sampler: any torch::data::samplers::Sampler<> (chorus::data::DistributedSampler, torch's
// SequentialSampler / RandomSampler, the Accelerator's). Movable; not copyable.
template <typename Sampler>
class ParallelLoader {
 public:
  using BatchType = torch::data::Example<>;

  // Throws UsageError for batch_size 0 or threads < 1.
  ParallelLoader(ImageDataset dataset, Sampler sampler, LoaderOptions options)
      : core_(std::make_shared<Core>(std::move(dataset), std::move(sampler), options)) {}

  // Starts a pass (see the contract). Iterators are torch's, as from torch::data::make_data_loader.
  torch::data::Iterator<BatchType> begin() {
    Core& c = *core_;
    const int64_t pass = ++c.passes;
    c.sampler.reset();
    int64_t epoch = pass - 1;
    if constexpr (detail::HasEpoch<Sampler>::value) epoch = static_cast<int64_t>(c.sampler.epoch());
    c.engine.start_pass(pass, epoch);
    c.exhausted = false;
    auto guard = std::make_shared<PassGuard>(core_, pass);
    return torch::data::Iterator<BatchType>(
        std::make_unique<torch::data::detail::ValidIterator<BatchType>>([guard]() { return guard->next(); }));
  }
  torch::data::Iterator<BatchType> end() {
    return torch::data::Iterator<BatchType>(std::make_unique<torch::data::detail::SentinelIterator<BatchType>>());
  }

  Sampler& sampler() { return core_->sampler; }
  const LoaderOptions& options() const { return core_->options; }
  LoaderStats stats() const { return core_->engine.stats(); }

 private:
  struct Core {
    Core(ImageDataset dataset, Sampler s, const LoaderOptions& o)
        : options(o), sampler(std::move(s)), engine(std::move(dataset), o) {}
    LoaderOptions options;
    Sampler sampler;
    detail::LoaderEngine engine;
    int64_t passes = 0;
    bool exhausted = false;
  };

  // Shared by the copies of one pass's iterator; the last one gone cancels the pass.
  struct PassGuard {
    PassGuard(const std::shared_ptr<Core>& core, int64_t pass) : core(core), pass(pass) {}
    ~PassGuard() {
      if (auto c = core.lock()) c->engine.cancel_pass(pass);
    }
    torch::optional<BatchType> next() {
      auto c = core.lock();
      if (!c) throw UsageError("ParallelLoader: an iterator was used after its loader was destroyed");
      if (c->passes != pass) throw UsageError("ParallelLoader: an iterator of an earlier pass was used after begin()");
      // Keep prefetch_batches + 1 batches in progress: the one about to be taken and those after it.
      while (!c->exhausted && c->engine.in_progress() < c->options.prefetch_batches + 1) {
        auto indices = c->sampler.next(c->options.batch_size);
        if (!indices || indices->empty() || (c->options.drop_last && indices->size() < c->options.batch_size)) {
          c->exhausted = true;
          break;
        }
        c->engine.submit(std::move(*indices));
      }
      if (c->engine.in_progress() == 0) return torch::nullopt;
      return c->engine.take();
    }
    std::weak_ptr<Core> core;
    int64_t pass;
  };

  std::shared_ptr<Core> core_;
};

template <typename Sampler>
ParallelLoader(ImageDataset, Sampler, LoaderOptions) -> ParallelLoader<Sampler>;

}  // namespace chorus::data
