// LoaderEngine: the decode threads and the in-order batch queue behind ParallelLoader.
#include "chorus/data/loader.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <sstream>
#include <thread>

#include "chorus/data/image_tensor.h"

namespace chorus::data::detail {

// One submitted batch. Its items are written by the decode threads under Shared::mutex, except the
// floats of items decoded into `buffer` (each thread its own item's slice, before `pending` drops).
struct LoaderEngine::Batch {
  int64_t pass = 0;
  int64_t epoch = 0;
  int64_t number = 0;  // position in the pass
  std::vector<size_t> indices;
  std::vector<at::Tensor> data;     // per item, once decoded (unless written into `buffer`)
  at::Tensor buffer;                // [items, C, H, W]: items decoded straight into it (ImageDecoder)
  std::array<int64_t, 3> item_shape{};  // buffer's item shape: the first decoded item's
  std::vector<char> in_buffer;      // per item: its data is buffer[item], not data[item]
  std::vector<std::string> errors;  // per item: "" or the failure
  std::vector<char> source_failed;  // per item: the failure was the storage's (SourceError), never skipped
  size_t pending = 0;               // items not yet decoded
  std::atomic<bool> cancelled{false};
  bool ready = false;  // stacked (or failed): `result` or `error` is set
  torch::data::Example<> result;
  std::string error;
  bool error_is_source = false;  // `error` is a SourceError's: thrown as one
  int64_t skipped = 0;        // items left out (skip_bad), counted when the batch is taken
  std::string first_skipped;  // the first one's message
};

struct LoaderEngine::Shared {
  explicit Shared(ImageDataset d, const LoaderOptions& o)
      : dataset(std::move(d)), options(o), direct(dataset.decode_function().target<ImageDecoder>()) {}
  ImageDataset dataset;
  LoaderOptions options;
  // image_decoder's function, when it is the dataset's: items are then decoded into their batch's
  // tensor. Points into the dataset's immutable state, which `dataset` keeps alive.
  const ImageDecoder* direct;
  // The batch tensors of the latest batches decoded into (at most kept_batches()). Fresh memory
  // costs a page fault per 4 KiB page when first written (a batch of 64 RGB images of 224 px is
  // 38 MB: on a virtual machine, faulting it in took about as long as decoding it), so a tensor
  // the loop has let go of, to which this list holds the only reference, is written again.
  std::deque<at::Tensor> recent;
  size_t kept_batches() const { return options.prefetch_batches + 3; }

  // A float tensor of `sizes` for a batch decoded into: a released one of `recent`, or a new one.
  // Called under `mutex`.
  at::Tensor batch_tensor(at::IntArrayRef sizes) {
    for (auto it = recent.begin(); it != recent.end(); ++it) {
      // Only this list refers to it (no tensor, view or autograd graph elsewhere): nobody can see it
      // being overwritten.
      if (it->use_count() == 1 && it->storage().use_count() == 1 && it->sizes() == sizes && !it->requires_grad() &&
          !it->grad().defined()) {
        at::Tensor t = std::move(*it);
        recent.erase(it);
        recent.push_back(t);
        return t;
      }
    }
    at::Tensor t = at::empty(sizes, at::kFloat);
    recent.push_back(t);
    while (recent.size() > kept_batches()) recent.pop_front();
    return t;
  }
  std::mutex mutex;
  std::condition_variable work_ready;  // decode threads wait here for items
  std::condition_variable batch_done;  // the consumer waits here for the oldest batch
  struct Item {
    std::shared_ptr<Batch> batch;
    size_t position;
  };
  std::deque<Item> items;                      // waiting to be decoded, oldest first
  std::deque<std::shared_ptr<Batch>> batches;  // submitted and not taken, in order
  int64_t pass = 0;
  int64_t epoch = 0;
  int64_t submitted = 0;  // batches submitted in this pass
  bool stop = false;
  LoaderStats stats;
  std::vector<std::thread> threads;

  // Item `position` of `b`, read and decoded: into b.buffer when the decoder allows it (then
  // *in_buffer is set and the returned tensor is undefined), else into a tensor of its own. Throws
  // what the dataset throws.
  at::Tensor decode(Batch& b, size_t position, bool* in_buffer);
  // Stacks a batch whose items are all decoded (outside `mutex`: the thread that decoded the last
  // item owns them), releases the items and hands the batch to take().
  void finish(Batch& b);
  // The storage failed on item `position` of `b` (a SourceError: every later read would fail the
  // same way, so its other items are not waited for): `b` is ready with that error at once, and
  // the batches submitted after it that are not ready yet get an error naming it; their items
  // still queued are dropped, so no thread spends a retry budget on them. Items already being read
  // finish on their threads and are thrown away. Called under `mutex`; the caller notifies
  // batch_done.
  void fail_fast(Batch& b, size_t position, const std::string& error);
};

namespace {

std::string shape_of(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

// The targets of these items, stacked: [n] int64 class indices, or [n, classes] float.
at::Tensor stack_targets(const ImageDataset& dataset, const std::vector<size_t>& indices) {
  if (!dataset.multi_label()) {
    std::vector<int64_t> labels;
    labels.reserve(indices.size());
    for (size_t i : indices) labels.push_back(dataset.sample(i).label);
    return at::tensor(labels, at::TensorOptions().dtype(at::kLong));
  }
  std::vector<at::Tensor> ys;
  ys.reserve(indices.size());
  for (size_t i : indices) ys.push_back(dataset.target(i));
  return at::stack(ys);
}

}  // namespace

LoaderEngine::LoaderEngine(ImageDataset dataset, const LoaderOptions& options)
    : shared_(std::make_shared<Shared>(std::move(dataset), options)) {
  if (options.batch_size < 1) throw UsageError("ParallelLoader: batch_size must be at least 1");
  if (options.threads < 1) {
    throw UsageError("ParallelLoader: threads must be at least 1, got " + std::to_string(options.threads));
  }
  shared_->threads.reserve(static_cast<size_t>(options.threads));
  for (int t = 0; t < options.threads; ++t) shared_->threads.emplace_back([this] { work(); });
}

LoaderEngine::~LoaderEngine() {
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    shared_->stop = true;
    for (auto& b : shared_->batches) b->cancelled = true;
    shared_->items.clear();
    shared_->batches.clear();
  }
  shared_->work_ready.notify_all();
  shared_->batch_done.notify_all();
  for (auto& t : shared_->threads) t.join();
}

void LoaderEngine::start_pass(int64_t pass, int64_t epoch) {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  for (auto& b : shared_->batches) b->cancelled = true;
  shared_->items.clear();
  shared_->batches.clear();
  shared_->pass = pass;
  shared_->epoch = epoch;
  shared_->submitted = 0;
}

void LoaderEngine::cancel_pass(int64_t pass) {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  if (shared_->pass != pass) return;
  for (auto& b : shared_->batches) b->cancelled = true;
  shared_->items.clear();
  shared_->batches.clear();
}

void LoaderEngine::submit(std::vector<size_t> indices) {
  auto batch = std::make_shared<Batch>();
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    batch->pass = shared_->pass;
    batch->epoch = shared_->epoch;
    batch->number = shared_->submitted++;
    batch->indices = std::move(indices);
    batch->data.resize(batch->indices.size());
    batch->errors.resize(batch->indices.size());
    batch->in_buffer.resize(batch->indices.size());
    batch->source_failed.resize(batch->indices.size());
    batch->pending = batch->indices.size();
    for (size_t p = 0; p < batch->indices.size(); ++p) shared_->items.push_back({batch, p});
    shared_->batches.push_back(std::move(batch));
  }
  shared_->work_ready.notify_all();
}

size_t LoaderEngine::in_progress() const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  return shared_->batches.size();
}

torch::data::Example<> LoaderEngine::take() {
  std::shared_ptr<Batch> batch;
  {
    std::unique_lock<std::mutex> lock(shared_->mutex);
    if (shared_->batches.empty()) throw UsageError("ParallelLoader: no batch in progress to take");
    batch = shared_->batches.front();
    shared_->batch_done.wait(lock, [&] { return batch->ready || shared_->stop; });
    if (shared_->stop) throw UsageError("ParallelLoader: the loader was destroyed while a batch was awaited");
    shared_->batches.pop_front();
    // Counted here, in the loop's order, so that first_bad is the first in the sampler's order.
    if (batch->skipped > 0) {
      if (shared_->stats.bad_items == 0) shared_->stats.first_bad = batch->first_skipped;
      shared_->stats.bad_items += batch->skipped;
    }
  }
  if (!batch->error.empty()) {
    if (batch->error_is_source) throw SourceError(batch->error);
    throw DataError(batch->error);
  }
  return std::move(batch->result);
}

LoaderStats LoaderEngine::stats() const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  return shared_->stats;
}

at::Tensor LoaderEngine::Shared::decode(Batch& b, size_t position, bool* in_buffer) {
  const size_t index = b.indices[position];
  if (direct == nullptr) return dataset.get(index, b.epoch).data;
  // Decoded straight into the batch's tensor, allocated by the first item to get there with that
  // item's shape; an item of another shape gets a tensor of its own (and fails the batch in
  // finish(), as stacking it would).
  at::Tensor data;
  dataset.read_item(index, b.epoch, [&](const std::vector<uint8_t>& bytes, const ItemInfo& info) {
    direct->decode_into(bytes, info, [&](const std::array<int64_t, 3>& shape) -> float* {
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (!b.buffer.defined()) {
          b.buffer = batch_tensor({static_cast<int64_t>(b.indices.size()), shape[0], shape[1], shape[2]});
          b.item_shape = shape;
        }
        if (shape == b.item_shape) {
          *in_buffer = true;
          return b.buffer.data_ptr<float>() + static_cast<int64_t>(position) * shape[0] * shape[1] * shape[2];
        }
      }
      data = at::empty({shape[0], shape[1], shape[2]}, at::kFloat);
      return data.data_ptr<float>();
    });
  });
  return data;
}

void LoaderEngine::Shared::fail_fast(Batch& b, size_t position, const std::string& error) {
  const std::string name = "ParallelLoader: batch " + std::to_string(b.number) + " of epoch " + std::to_string(b.epoch);
  b.error = name + ", item " + std::to_string(position) + " (dataset index " + std::to_string(b.indices[position]) +
            "): " + error;
  b.error_is_source = true;
  b.ready = true;
  b.cancelled = true;
  bool after = false;
  for (auto& later : batches) {
    if (later.get() == &b) {
      after = true;
      continue;
    }
    if (!after || later->ready) continue;
    later->error = "ParallelLoader: batch " + std::to_string(later->number) + " of epoch " +
                   std::to_string(later->epoch) + " was not read: the storage failed on an earlier batch: " + b.error;
    later->error_is_source = true;
    later->ready = true;
    later->cancelled = true;
  }
  items.erase(std::remove_if(items.begin(), items.end(), [](const Item& i) { return i.batch->cancelled.load(); }),
              items.end());
}

void LoaderEngine::Shared::finish(Batch& b) {
  std::string failure;
  bool failure_is_source = false;
  torch::data::Example<> result;
  std::vector<at::Tensor> xs;
  std::vector<size_t> kept;  // dataset indices of xs
  int64_t skipped = 0;
  std::string first_skipped;
  const std::string batch_name =
      "ParallelLoader: batch " + std::to_string(b.number) + " of epoch " + std::to_string(b.epoch);
  bool whole_buffer = true;  // every item decoded into `buffer`: it is the batch, as it is
  for (char in : b.in_buffer) whole_buffer = whole_buffer && in;
  for (size_t p = 0; p < b.indices.size() && failure.empty() && !whole_buffer; ++p) {
    if (b.errors[p].empty()) {
      xs.push_back(b.in_buffer[p] ? b.buffer[static_cast<int64_t>(p)] : std::move(b.data[p]));
      kept.push_back(b.indices[p]);
      continue;
    }
    const std::string what = batch_name + ", item " + std::to_string(p) + " (dataset index " +
                             std::to_string(b.indices[p]) + "): " + b.errors[p];
    if (!options.skip_bad || b.source_failed[p]) {
      failure = what;
      failure_is_source = b.source_failed[p] != 0;
    } else {
      if (skipped++ == 0) first_skipped = what;
    }
  }
  if (failure.empty() && xs.empty() && !whole_buffer) {
    failure = batch_name + ": all " + std::to_string(b.indices.size()) +
              " items failed (skip_bad leaves out bad items, not whole batches); the first: " + first_skipped;
  }
  if (failure.empty()) {
    for (size_t p = 1; p < xs.size() && failure.empty(); ++p) {
      if (xs[p].sizes() != xs[0].sizes() || xs[p].scalar_type() != xs[0].scalar_type()) {
        failure = batch_name + ": its items decode to different shapes or types (" + shape_of(xs[0]) + " " +
                  std::string(c10::toString(xs[0].scalar_type())) + " and " + shape_of(xs[p]) + " " +
                  std::string(c10::toString(xs[p].scalar_type())) +
                  "), so they cannot be stacked; make the transform resize every item to one shape";
      }
    }
  }
  if (failure.empty()) {
    try {
      result = whole_buffer ? torch::data::Example<>{b.buffer, stack_targets(dataset, b.indices)}
                            : torch::data::Example<>{at::stack(xs), stack_targets(dataset, kept)};
    } catch (const std::exception& e) {
      failure = batch_name + ": stacking its items failed: " + e.what();
    }
  }
  xs.clear();
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (auto& t : b.data) t = at::Tensor();
    b.buffer = at::Tensor();
    b.result = std::move(result);
    b.error = std::move(failure);
    b.error_is_source = failure_is_source;
    b.ready = true;
    b.skipped = skipped;
    b.first_skipped = std::move(first_skipped);
  }
  batch_done.notify_all();
}

void LoaderEngine::work() {
  Shared& s = *shared_;
  while (true) {
    Shared::Item item;
    {
      std::unique_lock<std::mutex> lock(s.mutex);
      s.work_ready.wait(lock, [&] { return s.stop || !s.items.empty(); });
      if (s.stop) return;
      item = std::move(s.items.front());
      s.items.pop_front();
    }
    Batch& b = *item.batch;
    if (b.cancelled) continue;
    at::Tensor data;
    bool in_buffer = false;
    std::string error;
    bool source_failed = false;
    try {
      data = s.decode(b, item.position, &in_buffer);
    } catch (const SourceError& e) {
      error = e.what();
      source_failed = true;
    } catch (const std::exception& e) {
      error = e.what();
    }
    bool last = false;
    bool failed_now = false;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      if (source_failed && !b.ready && !b.cancelled) {
        s.fail_fast(b, item.position, error);
        failed_now = true;
      }
      b.data[item.position] = std::move(data);
      b.in_buffer[item.position] = in_buffer && error.empty();
      b.errors[item.position] = std::move(error);
      b.source_failed[item.position] = source_failed;
      last = --b.pending == 0;
    }
    if (failed_now) s.batch_done.notify_all();
    if (!last || b.cancelled) continue;
    s.finish(b);  // this thread finished the batch: stack it and release the items
  }
}

}  // namespace chorus::data::detail
