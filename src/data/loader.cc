// LoaderEngine: the decode threads and the in-order batch queue behind ParallelLoader.
#include "chorus/data/loader.h"

#include <ATen/ATen.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <sstream>
#include <thread>

namespace chorus::data::detail {

// One submitted batch. Its items are written by the decode threads under Shared::mutex.
struct LoaderEngine::Batch {
  int64_t pass = 0;
  int64_t epoch = 0;
  int64_t number = 0;  // position in the pass
  std::vector<size_t> indices;
  std::vector<at::Tensor> data;     // per item, once decoded
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
  explicit Shared(ImageDataset d, const LoaderOptions& o) : dataset(std::move(d)), options(o) {}
  ImageDataset dataset;
  LoaderOptions options;
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
};

namespace {

std::string shape_of(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
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
    const size_t index = b.indices[item.position];
    at::Tensor data;
    std::string error;
    bool source_failed = false;
    try {
      data = s.dataset.get(index, b.epoch).data;
    } catch (const SourceError& e) {
      error = e.what();
      source_failed = true;
    } catch (const std::exception& e) {
      error = e.what();
    }
    bool last = false;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      b.data[item.position] = std::move(data);
      b.errors[item.position] = std::move(error);
      b.source_failed[item.position] = source_failed;
      last = --b.pending == 0;
    }
    if (!last || b.cancelled) continue;

    // This thread finished the batch: stack it (outside the lock) and release the items.
    std::string failure;
    bool failure_is_source = false;
    torch::data::Example<> result;
    std::vector<at::Tensor> xs, ys;
    int64_t skipped = 0;
    std::string first_skipped;
    const std::string batch_name =
        "ParallelLoader: batch " + std::to_string(b.number) + " of epoch " + std::to_string(b.epoch);
    for (size_t p = 0; p < b.indices.size() && failure.empty(); ++p) {
      if (b.errors[p].empty()) {
        xs.push_back(std::move(b.data[p]));
        ys.push_back(s.dataset.target(b.indices[p]));
        continue;
      }
      const std::string what = batch_name + ", item " + std::to_string(p) + " (dataset index " +
                               std::to_string(b.indices[p]) + "): " + b.errors[p];
      if (!s.options.skip_bad || b.source_failed[p]) {
        failure = what;
        failure_is_source = b.source_failed[p] != 0;
      } else {
        if (skipped++ == 0) first_skipped = what;
      }
    }
    if (failure.empty() && xs.empty()) {
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
        result = {at::stack(xs), at::stack(ys)};
      } catch (const std::exception& e) {
        failure = batch_name + ": stacking its items failed: " + e.what();
      }
    }
    xs.clear();
    ys.clear();
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      for (auto& t : b.data) t = at::Tensor();
      b.result = std::move(result);
      b.error = std::move(failure);
      b.error_is_source = failure_is_source;
      b.ready = true;
      b.skipped = skipped;
      b.first_skipped = std::move(first_skipped);
    }
    s.batch_done.notify_all();
  }
}

}  // namespace chorus::data::detail
