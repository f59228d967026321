// Accelerator: the few changed lines that turn a single-process libtorch loop into a data-parallel
// one, with gradient accumulation, bf16 autocast, gradient clipping and exact metrics (the role of
// Hugging Face Accelerate's Accelerator).
//
//   chorus::train::AcceleratorOptions o;
//   o.gradient_accumulation_steps = 4;
//   o.mixed_precision = chorus::train::MixedPrecision::kBF16;
//   chorus::train::Accelerator accelerator(o);              // process group from the environment
//   auto model = accelerator.prepare_model(net);             // DDP inside
//   torch::optim::SGD sgd(net->parameters(), 0.1);
//   auto optimizer = accelerator.prepare_optimizer(sgd);
//   torch::optim::StepLR step_lr(sgd, 10, 0.5);
//   auto scheduler = accelerator.prepare_scheduler(step_lr);
//   auto loader = accelerator.prepare_data_loader(train_set.map(Stack<>()), DataLoaderOptions(64));
//   for (int epoch = 0; epoch < epochs; ++epoch) {
//     for (auto& batch : loader) {                          // epoch order advances by itself
//       optimizer.zero_grad();
//       auto loss = torch::nll_loss(model(batch.data), batch.target);
//       accelerator.backward(loss);                         // scaled by 1/k; no_sync on k-1 of k
//       accelerator.clip_grad_norm_(1.0);
//       optimizer.step();                                   // these three act on sync steps only
//       scheduler.step();
//     }
//   }
//
// Contract:
// - One Accelerator per process, on every rank, over one process group (AcceleratorOptions::group,
//   or the default group, initialised from the environment of `chorus run` / srun / mpirun /
//   chorus::spawn unless it already exists). It must outlive everything it prepared. Not
//   thread-safe: one training loop per Accelerator.
// - prepare_model is collective (it builds a ddp::DistributedDataParallel, which checks and
//   broadcasts the parameters): every rank prepares the same models in the same order. A model
//   prepared twice, or one sharing parameters with a prepared model (e.g. its sub-module), is a
//   UsageError (its gradients would be reduced twice). Prepare the models before their optimizer: prepare_optimizer
//   raises UsageError when any of the optimizer's parameters belongs to no prepared model.
// - Micro-steps: every backward() is one micro-step. It synchronises gradients (allreduce, the k-th
//   micro-step since the last sync, or the last batch of a prepared loader's pass) or runs under
//   no_sync (gradients accumulate locally, nothing is communicated). The loss is divided by
//   k = gradient_accumulation_steps, as Accelerate does (also on a short accumulation at the end of
//   a pass). sync_gradients() says whether the latest backward() synchronised (true before the
//   first); the prepared optimizer's step()/zero_grad(), the prepared scheduler's step() and
//   clip_grad_norm_ act only then and do nothing otherwise. Every rank runs the same number of
//   micro-steps (a prepared loader gives every rank the same number of batches), so syncs agree.
// - Mixed precision: kBF16 runs each prepared model's forward under libtorch's CPU autocast
//   (bfloat16 for matmuls and convolutions, float32 for reductions and losses) and converts a
//   tensor output back to float32; parameters, gradients and the optimizer stay float32. kFP16
//   needs a loss scaler and a CUDA device: on CPU it is a UsageError that says to use kBF16.
// - Collectives (prepare_model, synchronising backward, the prepared model's eval(),
//   gather_for_metrics, reduce, wait_for_everyone, main_process_first) must be called by every
//   rank in the same order. Their errors and deadlines are those of the process group
//   (ProcessGroupOptions::timeout): TimeoutError, PeerError, MismatchError.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/data/dataloader.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/data/evaluation.h"
#include "chorus/data/sampler.h"
#include "chorus/ddp/ddp.h"
#include "chorus/torch/distributed.h"

namespace chorus::train {

enum class MixedPrecision {
  kNo,    // float32 throughout
  kBF16,  // CPU autocast to bfloat16 around each prepared model's forward
  kFP16,  // float16 with a loss scaler: CUDA only, not available yet (UsageError on CPU)
};

struct AcceleratorOptions {
  // k: backward() synchronises every k-th micro-step; the loss is divided by k.
  int gradient_accumulation_steps = 1;
  MixedPrecision mixed_precision = MixedPrecision::kNo;
  // Passed to every prepared model's DistributedDataParallel (its group is replaced by `group`).
  ddp::Options ddp;
  // The training loaders' DistributedSampler (the same on every rank).
  uint64_t seed = 0;
  bool shuffle = true;
  bool drop_last = false;  // drop the dataset's tail instead of padding it to a multiple of the world
  // nullptr: chorus::dist's default group, initialised with the three below unless it exists.
  ProcessGroup* group = nullptr;
  std::string backend = "chorus";
  std::string init_method = "env://";
  dist::InitOptions init;
};

enum class Reduction { kSum, kMean };

// Enables CPU autocast (bfloat16) for its lifetime when `enabled`, as torch.autocast("cpu") does,
// and restores the previous state after. Thread-local, like autocast itself.
class AutocastGuard {
 public:
  explicit AutocastGuard(bool enabled);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool enabled_;
  bool previous_enabled_ = false;
  c10::ScalarType previous_dtype_ = c10::ScalarType::BFloat16;
};

namespace detail {
// A reduced-precision floating tensor back to float32; anything else unchanged.
at::Tensor to_float32(const at::Tensor& t);

// A torch Sampler that shares one DistributedSampler with its owner: the data loader keeps a copy
// of its sampler, and this lets the prepared loader still set the epoch of the one it uses.
class SharedSampler : public torch::data::samplers::Sampler<> {
 public:
  explicit SharedSampler(std::shared_ptr<data::DistributedSampler> sampler) : sampler_(std::move(sampler)) {}
  void reset(torch::optional<size_t> new_size = torch::nullopt) override { sampler_->reset(new_size); }
  torch::optional<std::vector<size_t>> next(size_t batch_size) override { return sampler_->next(batch_size); }
  void save(torch::serialize::OutputArchive& archive) const override { sampler_->save(archive); }
  void load(torch::serialize::InputArchive& archive) override { sampler_->load(archive); }

 private:
  std::shared_ptr<data::DistributedSampler> sampler_;
};
}  // namespace detail

class Accelerator;

// A model wrapped in DistributedDataParallel. Calling it runs the forward under the accelerator's
// autocast; in training mode through DDP (a collective when buffers are broadcast), in eval mode
// straight on the module, so that ranks may evaluate different numbers of batches (exact
// evaluation, chorus/data/evaluation.h). Copies share the same DDP.
template <typename ModuleType>
class PreparedModel {
 public:
  PreparedModel(std::shared_ptr<ddp::DistributedDataParallel<ModuleType>> ddp, bool autocast)
      : ddp_(std::move(ddp)), autocast_(autocast) {}

  template <typename... Args>
  auto forward(Args&&... args) {
    AutocastGuard guard(autocast_);
    auto out = ddp_->module()->is_training() ? ddp_->forward(std::forward<Args>(args)...)
                                             : ddp_->module()->forward(std::forward<Args>(args)...);
    if constexpr (std::is_same_v<decltype(out), at::Tensor>) {
      return detail::to_float32(out);
    } else {
      return out;
    }
  }
  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  // Training mode. Local.
  void train() { ddp_->module()->train(); }
  // Eval mode, and (collective, when Options::broadcast_buffers) rank 0's buffers on every rank,
  // so that BatchNorm statistics agree during evaluation.
  void eval() {
    ddp_->module()->eval();
    ddp_->reducer().prepare_forward();
  }

  ModuleType* operator->() { return ddp_->module().get(); }
  // The unwrapped module (parameter names without a `module.` prefix, for checkpoints).
  const std::shared_ptr<ModuleType>& module() const { return ddp_->module(); }
  ddp::DistributedDataParallel<ModuleType>& ddp() { return *ddp_; }

 private:
  std::shared_ptr<ddp::DistributedDataParallel<ModuleType>> ddp_;
  bool autocast_;
};

// The optimizer, stepping and zeroing only on sync steps. Refers to the optimizer it was made from.
class PreparedOptimizer {
 public:
  PreparedOptimizer(Accelerator& accelerator, torch::optim::Optimizer& optimizer)
      : accelerator_(&accelerator), optimizer_(&optimizer) {}
  void step();
  void zero_grad();
  torch::optim::Optimizer& optimizer() { return *optimizer_; }

 private:
  Accelerator* accelerator_;
  torch::optim::Optimizer* optimizer_;
};

// The LR scheduler, advancing only on sync steps (one step per optimizer step).
class PreparedScheduler {
 public:
  PreparedScheduler(Accelerator& accelerator, torch::optim::LRScheduler& scheduler)
      : accelerator_(&accelerator), scheduler_(&scheduler) {}
  void step();
  torch::optim::LRScheduler& scheduler() { return *scheduler_; }

 private:
  Accelerator* accelerator_;
  torch::optim::LRScheduler* scheduler_;
};

// A data loader over this rank's DistributedSampler share of a dataset. Each pass (begin() to
// end()) yields the same number of batches on every rank; a pass that reached its end moves the
// next one to the next epoch (a pass broken off early is repeated from its start, same epoch).
// The last batch of a pass makes its backward() a sync step.
template <typename Dataset>
class PreparedDataLoader {
 public:
  using Loader = torch::data::StatelessDataLoader<Dataset, detail::SharedSampler>;
  using Batch = typename Dataset::BatchType;

  class Iterator {
   public:
    Iterator(PreparedDataLoader* owner, torch::data::Iterator<Batch> inner, bool is_end)
        : owner_(owner), inner_(std::move(inner)), is_end_(is_end) {}
    Batch& operator*() {
      if (!is_end_ && noted_ != position_) {
        noted_ = position_;
        owner_->on_batch(position_);
      }
      return *inner_;
    }
    Batch* operator->() { return &**this; }
    Iterator& operator++() {
      ++inner_;
      ++position_;
      return *this;
    }
    bool operator==(const Iterator& other) const {
      const bool equal = inner_ == other.inner_;
      if (equal && !is_end_ && other.is_end_) owner_->pass_completed_ = true;
      return equal;
    }
    bool operator!=(const Iterator& other) const { return !(*this == other); }

   private:
    PreparedDataLoader* owner_;
    torch::data::Iterator<Batch> inner_;
    bool is_end_;
    int64_t position_ = 0;
    int64_t noted_ = -1;
  };

  PreparedDataLoader(Accelerator& accelerator, std::shared_ptr<data::DistributedSampler> sampler,
                     std::unique_ptr<Loader> loader, int64_t batches_per_epoch)
      : accelerator_(&accelerator),
        sampler_(std::move(sampler)),
        loader_(std::move(loader)),
        batches_per_epoch_(batches_per_epoch) {}

  Iterator begin() {
    if (pass_completed_) sampler_->set_epoch(sampler_->epoch() + 1);
    pass_completed_ = false;
    return Iterator(this, loader_->begin(), false);
  }
  Iterator end() { return Iterator(this, loader_->end(), true); }

  // The epoch of the current (or next) pass. set_epoch pins the next pass to `epoch`.
  int64_t epoch() const { return sampler_->epoch(); }
  void set_epoch(int64_t epoch) {
    sampler_->set_epoch(epoch);
    pass_completed_ = false;
  }
  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  data::DistributedSampler& sampler() { return *sampler_; }

 private:
  void on_batch(int64_t position);

  Accelerator* accelerator_;
  std::shared_ptr<data::DistributedSampler> sampler_;
  std::unique_ptr<Loader> loader_;
  int64_t batches_per_epoch_;
  bool pass_completed_ = false;
};

class Accelerator {
 public:
  // Throws UsageError for gradient_accumulation_steps < 1 or kFP16 (before any communication);
  // initialises the default process group when `group` is null and none exists.
  explicit Accelerator(AcceleratorOptions options = {});
  ~Accelerator();
  Accelerator(const Accelerator&) = delete;
  Accelerator& operator=(const Accelerator&) = delete;

  const AcceleratorOptions& options() const { return options_; }
  ProcessGroup& group() { return *group_; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  bool is_main_process() const { return rank_ == 0; }

  // Collective. Wraps `model` in DistributedDataParallel with options().ddp.
  template <typename ModuleType>
  PreparedModel<ModuleType> prepare_model(std::shared_ptr<ModuleType> model) {
    if (!model) throw UsageError(who() + ": prepare_model got a null model");
    check_not_prepared(*model);
    ddp::Options o = options_.ddp;
    o.group = group_;
    auto wrapped = std::make_shared<ddp::DistributedDataParallel<ModuleType>>(model, o);
    register_model(wrapped, *model, wrapped->reducer());
    return PreparedModel<ModuleType>(std::move(wrapped), autocast_enabled());
  }
  template <typename Holder, typename = decltype(std::declval<Holder>().ptr())>
  auto prepare_model(Holder holder) {
    return prepare_model(holder.ptr());
  }

  // Local. UsageError when a parameter of `optimizer` belongs to no prepared model.
  PreparedOptimizer prepare_optimizer(torch::optim::Optimizer& optimizer);
  // Local.
  PreparedScheduler prepare_scheduler(torch::optim::LRScheduler& scheduler);

  // Local. A loader over this rank's DistributedSampler share (options().seed, shuffle, drop_last)
  // of a sized batch dataset (e.g. dataset.map(torch::data::transforms::Stack<>())).
  template <typename Dataset>
  PreparedDataLoader<Dataset> prepare_data_loader(Dataset dataset, torch::data::DataLoaderOptions loader_options) {
    const int64_t size = dataset_size(dataset.size());
    data::DistributedSamplerOptions so;
    so.num_replicas = world_size_;
    so.rank = rank_;
    so.shuffle = options_.shuffle;
    so.seed = options_.seed;
    so.drop_last = options_.drop_last;
    auto sampler = std::make_shared<data::DistributedSampler>(size, so);
    const int64_t per_rank = sampler->num_samples();
    const auto batch = static_cast<int64_t>(loader_options.batch_size());
    if (batch < 1) throw UsageError(who() + ": prepare_data_loader needs a batch_size of at least 1");
    const int64_t batches = loader_options.drop_last() ? per_rank / batch : (per_rank + batch - 1) / batch;
    auto loader = torch::data::make_data_loader(std::move(dataset), detail::SharedSampler(sampler),
                                                std::move(loader_options));
    return PreparedDataLoader<Dataset>(*this, std::move(sampler), std::move(loader), batches);
  }

  // Local. A loader over this rank's block of evaluation_indices (every item once, ranks may get
  // different numbers of batches): its per-item results go to gather_for_metrics.
  template <typename Dataset>
  auto prepare_eval_loader(Dataset dataset, torch::data::DataLoaderOptions loader_options) {
    const int64_t size = dataset_size(dataset.size());
    return torch::data::make_data_loader(std::move(dataset), data::EvaluationSampler(size, world_size_, rank_),
                                         std::move(loader_options));
  }

  // One micro-step: (loss / k).backward(), synchronising or under no_sync (see the contract).
  void backward(const at::Tensor& loss);
  // Whether the latest backward() synchronised the gradients (true before the first).
  bool sync_gradients() const { return sync_; }
  // Synchronised backward passes so far: the number of optimizer steps.
  int64_t global_step() const { return global_step_; }

  // On a sync step: clips the (averaged, so equal on every rank) gradients of every prepared model
  // to total norm max_norm and returns their norm before clipping, the same on every rank. On
  // other micro-steps it does nothing and returns NaN (clipping a partial sum would differ from
  // the large-batch step).
  double clip_grad_norm_(double max_norm, double norm_type = 2.0);

  // Collective. Per-item results of this rank's evaluation_indices (rows in order) to all
  // dataset_size rows in dataset order, on every rank; each item exactly once, no padding.
  at::Tensor gather_for_metrics(const at::Tensor& local_results, int64_t dataset_size);
  // Collective. The element-wise sum or mean over ranks, on every rank (a new tensor; the mean of
  // an integer tensor is floating).
  at::Tensor reduce(const at::Tensor& tensor, Reduction reduction = Reduction::kSum);

  // Writes the arguments and a newline to stdout on rank 0 only.
  template <typename... Args>
  void print(const Args&... args) const {
    if (rank_ != 0) return;
    std::ostringstream out;
    (out << ... << args);
    print_line(out.str());
  }
  // Collective: returns once every rank has called it.
  void wait_for_everyone();
  // Collective: rank 0 runs fn, then the others run it (e.g. rank 0 fills a dataset cache the
  // others then read). If fn throws on rank 0, every other rank raises Error naming it and does
  // not run fn.
  void main_process_first(const std::function<void()>& fn);

  // The forward's autocast, for code outside a prepared model.
  bool autocast_enabled() const { return options_.mixed_precision == MixedPrecision::kBF16; }

 private:
  template <typename Dataset>
  friend class PreparedDataLoader;

  std::string who() const;
  int64_t dataset_size(torch::optional<size_t> size) const;
  void check_not_prepared(const torch::nn::Module& module) const;
  void register_model(std::shared_ptr<void> owner, torch::nn::Module& module, ddp::Reducer& reducer);
  void print_line(const std::string& line) const;
  void on_last_batch_of_pass() { end_of_pass_ = true; }

  struct PreparedRecord {
    std::shared_ptr<void> owner;  // keeps the DDP (and its reducer) alive
    const torch::nn::Module* module;
    ddp::Reducer* reducer;
    std::vector<at::Tensor> parameters;
  };

  AcceleratorOptions options_;
  ProcessGroup* group_ = nullptr;
  int rank_ = 0;
  int world_size_ = 1;
  std::vector<PreparedRecord> models_;
  int accumulated_ = 0;      // micro-steps since the last sync
  bool sync_ = true;         // whether the latest backward() synchronised
  bool end_of_pass_ = false; // the batch of the coming backward() is the last of a pass
  int64_t global_step_ = 0;
};

template <typename Dataset>
void PreparedDataLoader<Dataset>::on_batch(int64_t position) {
  if (position + 1 >= batches_per_epoch_) accelerator_->on_last_batch_of_pass();
}

}  // namespace chorus::train
