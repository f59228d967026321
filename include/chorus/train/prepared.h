// What Accelerator::prepare_* returns (chorus/train/accelerator.h): the prepared model, optimizer,
// scheduler and data loader, and the epoch range of Accelerator::epochs(). Each refers to the
// Accelerator that made it, which must outlive it; each acts as the Accelerator's contract says
// (sync steps, step boundaries, resumable positions). Include chorus/train/accelerator.h to use
// them: their member functions call the Accelerator, defined there.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/data/dataloader.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "chorus/data/loader.h"
#include "chorus/data/sampler.h"
#include "chorus/ddp/ddp.h"

namespace chorus::train {

// Enables autocast on `device` (to `dtype`) for its lifetime when `enabled`, as torch.autocast does,
// and restores the previous state after. Thread-local, like autocast itself. The bool form is CPU
// bfloat16.
class AutocastGuard {
 public:
  explicit AutocastGuard(bool enabled) : AutocastGuard(c10::DeviceType::CPU, c10::ScalarType::BFloat16, enabled) {}
  AutocastGuard(c10::DeviceType device, c10::ScalarType dtype, bool enabled = true);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool enabled_;
  c10::DeviceType device_;
  c10::ScalarType dtype_;
  bool previous_enabled_ = false;
  c10::ScalarType previous_dtype_ = c10::ScalarType::BFloat16;
};

// What a prepared model's forward runs under.
struct AutocastSpec {
  bool enabled = false;
  c10::DeviceType device = c10::DeviceType::CPU;
  c10::ScalarType dtype = c10::ScalarType::BFloat16;
};

class Accelerator;

namespace detail {
// A reduced-precision floating tensor back to float32; anything else unchanged.
at::Tensor to_float32(const at::Tensor& t);

// AcceleratorOptions::device to a device: "cpu"; "cuda" is cuda:(local_rank mod cuda_devices);
// "cuda:N". UsageError for anything else, a CUDA device when there is none, or N out of range. Pure.
c10::Device resolve_device(const std::string& spec, int local_rank, int cuda_devices);
// This process's rank on its machine: LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK or SLURM_LOCALID, else `rank`.
int local_rank_from_environment(int rank);

// Timing hooks of the prepared objects (defined where Accelerator is complete).
void add_forward_time(Accelerator& accelerator, double seconds);
void add_data_time(Accelerator& accelerator, double seconds);
void begin_pass(Accelerator& accelerator);
bool at_step_boundary(Accelerator& accelerator);  // true: the training loop should stop

// A prepared training loader's position, shared by the loader (and its sampler) and the
// Accelerator (which saves and restores it).
struct LoaderState {
  std::shared_ptr<data::DistributedSampler> sampler;
  int64_t batch_size = 1;
  int64_t batches_per_epoch = 0;
  int64_t position = 0;         // batches of the current pass handed to the loop
  int64_t skip = 0;             // batches the next pass skips (a resumed position)
  bool pass_completed = false;  // the current pass reached its end: the next one is the next epoch
  // Samples in batch `index` of a pass on this rank.
  int64_t batch_samples(int64_t index) const;
  // The epoch and position a resumed run continues at.
  int64_t resume_epoch() const { return sampler->epoch() + (pass_completed ? 1 : 0); }
  int64_t resume_position() const { return pass_completed ? 0 : position; }
};

// A torch Sampler over a LoaderState's DistributedSampler: the data loader keeps a copy of its
// sampler, and this lets the prepared loader still set the epoch and skip resumed batches.
class SharedSampler : public torch::data::samplers::Sampler<> {
 public:
  explicit SharedSampler(std::shared_ptr<LoaderState> state) : state_(std::move(state)) {}
  void reset(torch::optional<size_t> new_size = torch::nullopt) override;
  torch::optional<std::vector<size_t>> next(size_t batch_size) override { return state_->sampler->next(batch_size); }
  void save(torch::serialize::OutputArchive& archive) const override { state_->sampler->save(archive); }
  void load(torch::serialize::InputArchive& archive) override { state_->sampler->load(archive); }
  // The pass's epoch, for a data::ParallelLoader's decode function.
  int64_t epoch() const { return state_->sampler->epoch(); }

 private:
  std::shared_ptr<LoaderState> state_;
};
}  // namespace detail

// A model wrapped in DistributedDataParallel. Calling it runs the forward under the accelerator's
// autocast; in training mode through DDP (a collective when buffers are broadcast), in eval mode
// straight on the module, so that ranks may evaluate different numbers of batches (exact
// evaluation, chorus/data/evaluation.h). Copies share the same DDP.
template <typename ModuleType>
class PreparedModel {
 public:
  PreparedModel(Accelerator& accelerator, std::shared_ptr<ddp::DistributedDataParallel<ModuleType>> ddp,
                AutocastSpec autocast)
      : accelerator_(&accelerator), ddp_(std::move(ddp)), autocast_(autocast) {}

  template <typename... Args>
  auto forward(Args&&... args) {
    const bool training = ddp_->module()->is_training();
    const auto start = std::chrono::steady_clock::now();
    AutocastGuard guard(autocast_.device, autocast_.dtype, autocast_.enabled);
    auto out = training ? ddp_->forward(std::forward<Args>(args)...)
                        : ddp_->module()->forward(std::forward<Args>(args)...);
    if (training) {
      detail::add_forward_time(*accelerator_,
                               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
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
  Accelerator* accelerator_;
  std::shared_ptr<ddp::DistributedDataParallel<ModuleType>> ddp_;
  AutocastSpec autocast_;
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
  PreparedScheduler(Accelerator& accelerator, torch::optim::LRScheduler& scheduler, std::shared_ptr<int64_t> steps)
      : accelerator_(&accelerator), scheduler_(&scheduler), steps_(std::move(steps)) {}
  void step();
  torch::optim::LRScheduler& scheduler() { return *scheduler_; }
  // The step() calls that advanced the scheduler (saved with the state, replayed on load).
  int64_t steps() const { return *steps_; }

 private:
  Accelerator* accelerator_;
  torch::optim::LRScheduler* scheduler_;
  std::shared_ptr<int64_t> steps_;
};

// A data loader over this rank's DistributedSampler share of a dataset. Each pass (begin() to
// end()) yields the same number of batches on every rank; a pass that reached its end moves the
// next one to the next epoch (a pass broken off early is repeated from its start, same epoch,
// unless the Accelerator ended it: then the next pass continues where it stopped). The last batch
// of a pass makes its backward() a sync step. Loader: libtorch's StatelessDataLoader, or a
// data::ParallelLoader (prepare_data_loader's ImageDataset overload).
template <typename Dataset, typename Loader = torch::data::StatelessDataLoader<Dataset, detail::SharedSampler>>
class PreparedDataLoader {
 public:
  using Batch = typename Loader::BatchType;

  class Iterator {
   public:
    Iterator(PreparedDataLoader* owner, torch::data::Iterator<Batch> inner, bool is_end, int64_t position)
        : owner_(owner), inner_(std::move(inner)), is_end_(is_end), position_(position) {}
    Batch& operator*() {
      if (!is_end_ && noted_ != position_) {
        noted_ = position_;
        owner_->on_batch(position_);
        owner_->to_device(*inner_);
      }
      return *inner_;
    }
    Batch* operator->() { return &**this; }
    Iterator& operator++() {
      const auto start = std::chrono::steady_clock::now();
      ++inner_;
      ++position_;
      detail::add_data_time(*owner_->accelerator_,
                            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      return *this;
    }
    // The loop's test for its end is the step boundary: records, progress, checkpoints, signals.
    bool operator==(const Iterator& other) const {
      if (!is_end_ && other.is_end_ && detail::at_step_boundary(*owner_->accelerator_)) {
        owner_->state_->skip = owner_->state_->position;  // stopped: the next pass continues here
        return true;
      }
      const bool equal = inner_ == other.inner_;
      if (equal && !is_end_ && other.is_end_) owner_->state_->pass_completed = true;
      return equal;
    }
    bool operator!=(const Iterator& other) const { return !(*this == other); }

   private:
    PreparedDataLoader* owner_;
    torch::data::Iterator<Batch> inner_;
    bool is_end_;
    int64_t position_;
    int64_t noted_ = -1;
  };

  PreparedDataLoader(Accelerator& accelerator, std::shared_ptr<detail::LoaderState> state,
                     std::unique_ptr<Loader> loader)
      : accelerator_(&accelerator), state_(std::move(state)), loader_(std::move(loader)) {}

  Iterator begin() {
    detail::begin_pass(*accelerator_);  // resumes first when due; steps are timed from here
    auto& s = *state_;
    s.sampler->set_epoch(s.pass_completed ? s.sampler->epoch() + 1 : s.sampler->epoch());
    s.pass_completed = false;
    s.position = s.skip;
    const auto start = std::chrono::steady_clock::now();
    auto inner = loader_->begin();  // resets the sampler, which skips s.skip batches
    detail::add_data_time(*accelerator_,
                          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    const int64_t first = s.skip;
    s.skip = 0;
    return Iterator(this, std::move(inner), false, first);
  }
  Iterator end() { return Iterator(this, loader_->end(), true, 0); }

  // The epoch of the current (or next) pass. set_epoch pins the next pass to `epoch`, from its start.
  int64_t epoch() const { return state_->sampler->epoch(); }
  void set_epoch(int64_t epoch) {
    state_->sampler->set_epoch(epoch);
    state_->pass_completed = false;
    state_->skip = 0;
  }
  int64_t batches_per_epoch() const { return state_->batches_per_epoch; }
  data::DistributedSampler& sampler() { return *state_->sampler; }

 private:
  void on_batch(int64_t position);
  void to_device(Batch& batch);

  Accelerator* accelerator_;
  std::shared_ptr<detail::LoaderState> state_;
  std::unique_ptr<Loader> loader_;
};

// `for (int64_t epoch : accelerator.epochs(n))`: the epochs left of n, from the resumed one. Its
// begin() loads the state when resuming (see the contract); each iteration's end saves state
// (checkpoint_each_epoch) and agrees on stop signals; the range ends early at max_steps or a stop,
// and its end runs end_training().
class EpochRange {
 public:
  class Iterator {
   public:
    Iterator(Accelerator* accelerator, int64_t epoch) : accelerator_(accelerator), epoch_(epoch) {}
    int64_t operator*() const { return epoch_; }
    Iterator& operator++();
    bool operator!=(const Iterator& end) const;
    bool operator==(const Iterator& end) const { return !(*this != end); }

   private:
    Accelerator* accelerator_;
    int64_t epoch_;
  };
  EpochRange(Accelerator& accelerator, int64_t epochs) : accelerator_(&accelerator), epochs_(epochs) {}
  Iterator begin();
  Iterator end() { return Iterator(accelerator_, epochs_); }

 private:
  Accelerator* accelerator_;
  int64_t epochs_;
};

}  // namespace chorus::train
