// Accelerator: the few changed lines that turn a single-process libtorch loop into a data-parallel
// one, with gradient accumulation, bf16 autocast, gradient clipping, exact metrics, resumable state,
// stop signals, run records and progress (the role of Hugging Face Accelerate's Accelerator).
//
//   chorus::train::AcceleratorOptions o;
//   o.run_name = "mnist";                                   // records and state in runs/mnist/
//   o.gradient_accumulation_steps = 4;
//   chorus::train::Accelerator accelerator(o);              // process group from the environment
//   auto model = accelerator.prepare_model(net);             // DDP inside
//   torch::optim::SGD sgd(net->parameters(), 0.1);
//   auto optimizer = accelerator.prepare_optimizer(sgd);
//   auto loader = accelerator.prepare_data_loader(train_set, DataLoaderOptions(64));
//   for (int64_t epoch : accelerator.epochs(10)) {           // resumes where a killed run stopped
//     for (auto& batch : loader) {                          // epoch order advances by itself
//       optimizer.zero_grad();
//       auto loss = torch::nll_loss(model(batch.data), batch.target);
//       accelerator.backward(loss);                         // scaled by 1/k; no_sync on k-1 of k
//       optimizer.step();                                   // acts on sync steps only
//     }
//     accelerator.log({{"test_accuracy", evaluate(model)}});
//   }                                                       // state saved after every epoch
//
// Contract:
// - One Accelerator per process, on every rank, over one process group (AcceleratorOptions::group,
//   or the default group, initialised from the environment of `chorus run` / srun / mpirun /
//   chorus::spawn unless it already exists). It must outlive everything it prepared. Not
//   thread-safe: one training loop per Accelerator.
// - prepare_model is collective (it builds a ddp::DistributedDataParallel, which checks and
//   broadcasts the parameters): every rank prepares the same models in the same order. A model
//   prepared twice, or one sharing parameters with a prepared model (e.g. its sub-module), is a
//   UsageError (its gradients would be reduced twice). Prepare the models before their optimizer:
//   prepare_optimizer raises UsageError when any of the optimizer's parameters belongs to no
//   prepared model.
// - Micro-steps: every backward() is one micro-step. It synchronises gradients (allreduce, the k-th
//   micro-step since the last sync, or the last batch of a prepared loader's pass) or runs under
//   no_sync (gradients accumulate locally, nothing is communicated). The loss is divided by
//   k = gradient_accumulation_steps, as Accelerate does (also on a short accumulation at the end of
//   a pass). sync_gradients() says whether the latest backward() synchronised (true before the
//   first); the prepared optimizer's step()/zero_grad(), the prepared scheduler's step() and
//   clip_grad_norm_ act only then and do nothing otherwise. Every rank runs the same number of
//   micro-steps (a prepared loader gives every rank the same number of batches), so syncs agree.
//   A synchronising backward() is one optimizer step: global_step() counts them.
// - Step boundaries: a step ends when the loop next asks a prepared training loader for a batch
//   (or at the end of an epochs() iteration, save_state, end_training). There the Accelerator
//   writes the step's records, shows progress, saves state every checkpoint_every steps and, with
//   more than one rank, agrees on stop signals (a one-element allreduce started at one boundary
//   and read at the next, so no rank waits for it: a stop takes effect one step after the signal).
//   A loader's pass ends early once max_steps optimizer steps are done.
// - State (save_state/load_state, collective): the prepared models' parameters and buffers, the
//   prepared optimizer's full state (at most one optimizer), each prepared scheduler (its step
//   count, replayed on load, and its learning rates), every rank's CPU RNG, the optimizer step,
//   each prepared loader's epoch and position in it (mid-epoch: a resumed loader skips the batches
//   already trained on without loading them), the elapsed time and registered user objects. On the
//   collective atomic checkpoint (chorus/train/checkpoint.h) in run_dir()/state. Resuming at the
//   same world size and batch size gives the same batches, RNG draws and (with deterministic
//   kernels, e.g. one thread) the same losses as an uninterrupted run.
// - Resume policy, decided in the constructor (collective): when run_dir()/state holds a state,
//   it is loaded at the start of epochs() (or of a prepared training loader's first pass, in a
//   loop without epochs()) if `resume` is set or the launcher restarted the job
//   (CHORUS_RESTART_COUNT, TORCHELASTIC_RESTART_COUNT or SLURM_RESTART_COUNT above 0: `chorus run
//   --max-restarts` needs no flag); with `overwrite` (and no restart) it is deleted; otherwise the
//   constructor raises UsageError, so a run never silently replaces another's state.
// - Stop signals: SIGTERM, SIGUSR1 and SIGUSR2 (chorus run forwards them; Slurm sends one before
//   preemption) are recorded by a handler; at the next step boundary the ranks agree, save state
//   and, with exit_on_signal (the default), exit the process with status 0 (std::_Exit after
//   flushing stdout, stderr and the run records: code after the loop does not run and objects on
//   the stack are not destroyed). Without it the loops end and stopped() is true.
// - Run records (docs/run-records.md): config.json, metrics/rank-<r>.jsonl, metrics.jsonl (rank 0's
//   aggregate over all ranks, gathered every 25 steps), logs/rank-<r>.log and summary.json under
//   run_dir() = project_dir/run_name. A resumed run appends, dropping lines beyond the resumed step.
// - Progress on rank 0: a bar rewritten in place when stdout is a terminal (not under mpirun or
//   srun), else a plain line every log_every steps.
// - Device (docs/gpu.md): `device` "cpu", "cuda" (each rank on cuda:LOCAL_RANK modulo the GPUs it
//   sees, as Accelerate places ranks; ranks may share a GPU) or "cuda:N". prepare_model moves the
//   model there before DDP wraps it; a prepared training loader's batches (data and target) arrive
//   there; DDP's buckets live there and travel through pinned host memory.
// - Mixed precision: kBF16 runs each prepared model's forward under libtorch's autocast on the
//   device (bfloat16 for matmuls and convolutions, float32 for reductions and losses) and converts
//   a tensor output back to float32; parameters, gradients and the optimizer stay float32. kFP16
//   (CUDA only; on CPU a UsageError that says to use kBF16) runs the forward under float16
//   autocast and scales the loss with a GradScaler (chorus/train/grad_scaler.h, PyTorch's
//   behaviour): backward() scales, the prepared optimizer's step() unscales, skips the step when a
//   gradient is inf or NaN, and updates the scale; a prepared scheduler does not step after a
//   skipped step; clip_grad_norm_ unscales first. The scaler's state is part of save_state.
// - Collectives (the constructor, prepare_model, synchronising backward, step boundaries, the
//   prepared model's eval(), epochs() iteration, save_state, load_state, end_training,
//   gather_for_metrics, reduce, wait_for_everyone, main_process_first) must be called by every
//   rank in the same order. Their errors and deadlines are those of the process group
//   (ProcessGroupOptions::timeout): TimeoutError, PeerError, MismatchError.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/data/dataloader.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "chorus/comm/environment.h"
#include "chorus/comm/error.h"
#include "chorus/data/evaluation.h"
#include "chorus/data/loader.h"
#include "chorus/data/sampler.h"
#include "chorus/ddp/ddp.h"
#include "chorus/torch/distributed.h"
#include "chorus/train/grad_scaler.h"

namespace chorus::train {

enum class MixedPrecision {
  kNo,    // float32 throughout
  kBF16,  // autocast to bfloat16 around each prepared model's forward (CPU or CUDA)
  kFP16,  // CUDA autocast to float16, with dynamic loss scaling (GradScaler); UsageError on CPU
};

// "no", "bf16" or "fp16" (UsageError otherwise), for command lines.
MixedPrecision parse_mixed_precision(const std::string& name);

struct AcceleratorOptions {
  // k: backward() synchronises every k-th micro-step; the loss is divided by k.
  int gradient_accumulation_steps = 1;
  MixedPrecision mixed_precision = MixedPrecision::kNo;
  // Where the prepared models and batches live: "cpu", "cuda" (cuda:LOCAL_RANK modulo the visible
  // GPUs) or "cuda:N".
  std::string device = "cpu";
  // kFP16's loss scaler (PyTorch's defaults).
  GradScalerOptions scaler;
  // Passed to every prepared model's DistributedDataParallel (its group is replaced by `group`).
  ddp::Options ddp;
  // The training loaders' DistributedSampler (the same on every rank).
  uint64_t seed = 0;
  bool shuffle = true;
  bool drop_last = false;  // drop the dataset's tail instead of padding it to a multiple of the world
  // Training stops after this many optimizer steps in all (0: no limit).
  int64_t max_steps = 0;

  // The run directory: project_dir/run_name, relative to the working directory. An empty run_name
  // is the program's file name.
  std::string project_dir = "runs";
  std::string run_name;
  bool records = true;              // metrics, logs, config and summary (state is saved regardless)
  nlohmann::json config;            // the user's configuration, stored in config.json
  bool resume = false;              // continue from run_dir()/state when it holds a state
  bool overwrite = false;           // delete a state left in run_dir() and start afresh
  bool checkpoint_each_epoch = true;  // save_state after every epochs() iteration and at the end
  int64_t checkpoint_every = 0;     // also save_state every N optimizer steps (0: never)
  int keep_last = 2;                // state versions kept on disk
  bool fsync = true;                // false: no fsync of state files (tests on tmpfs)
  bool exit_on_signal = true;       // after a stop signal's save: exit the process with status 0
  bool progress = true;             // rank 0's progress bar or lines on stdout
  bool tune_malloc = true;          // tune_malloc_for_training() when constructed (see there)
  int64_t log_every = 50;           // plain progress line every N steps when stdout is no terminal

  // nullptr: chorus::dist's default group, initialised with the three below unless it exists.
  ProcessGroup* group = nullptr;
  std::string backend = "chorus";
  std::string init_method = "env://";
  dist::InitOptions init;
};

enum class Reduction { kSum, kMean };

struct CheckpointOptions;  // chorus/train/checkpoint.h

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

class Accelerator;

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

class Accelerator {
 public:
  // Collective. Throws UsageError for bad options (before any communication) and for a state left
  // in the run directory that this run may not resume or replace (see the contract); initialises
  // the default process group when `group` is null and none exists; writes config.json.
  explicit Accelerator(AcceleratorOptions options = {});
  ~Accelerator();
  Accelerator(const Accelerator&) = delete;
  Accelerator& operator=(const Accelerator&) = delete;

  const AcceleratorOptions& options() const { return options_; }
  ProcessGroup& group() { return *group_; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  bool is_main_process() const { return rank_ == 0; }
  // project_dir/run_name.
  const std::string& run_dir() const { return run_dir_; }

  // Collective. Wraps `model` in DistributedDataParallel with options().ddp.
  template <typename ModuleType>
  PreparedModel<ModuleType> prepare_model(std::shared_ptr<ModuleType> model) {
    if (!model) throw UsageError(who() + ": prepare_model got a null model");
    check_not_prepared(*model);
    model->to(device_);  // before DDP: its buckets and broadcasts are on the model's device
    ddp::Options o = options_.ddp;
    o.group = group_;
    auto wrapped = std::make_shared<ddp::DistributedDataParallel<ModuleType>>(model, o);
    register_model(wrapped, model, wrapped->reducer());
    return PreparedModel<ModuleType>(*this, std::move(wrapped), autocast_spec());
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
    const auto batch = static_cast<int64_t>(loader_options.batch_size());
    if (batch < 1) throw UsageError(who() + ": prepare_data_loader needs a batch_size of at least 1");
    auto state = make_loader_state(size, batch, loader_options.drop_last());
    auto loader = torch::data::make_data_loader(std::move(dataset), detail::SharedSampler(state),
                                                std::move(loader_options));
    return PreparedDataLoader<Dataset>(*this, std::move(state), std::move(loader));
  }

  // Local. The same over an ImageDataset, loaded by a data::ParallelLoader (decode threads,
  // prefetch, skip_bad: chorus/data/loader.h) that draws its index batches from this rank's
  // DistributedSampler; a resumed pass skips the trained batches without reading them.
  using ImageLoader = data::ParallelLoader<detail::SharedSampler>;
  PreparedDataLoader<data::ImageDataset, ImageLoader> prepare_data_loader(data::ImageDataset dataset,
                                                                          data::LoaderOptions loader_options) {
    const auto size = static_cast<int64_t>(dataset.size());
    const auto batch = static_cast<int64_t>(loader_options.batch_size);
    if (batch < 1) throw UsageError(who() + ": prepare_data_loader needs a batch_size of at least 1");
    auto state = make_loader_state(size, batch, loader_options.drop_last);
    auto loader = std::make_unique<ImageLoader>(std::move(dataset), detail::SharedSampler(state), loader_options);
    return PreparedDataLoader<data::ImageDataset, ImageLoader>(*this, std::move(state), std::move(loader));
  }

  // Local. A loader over this rank's block of evaluation_indices (every item once, ranks may get
  // different numbers of batches): its per-item results go to gather_for_metrics.
  template <typename Dataset>
  auto prepare_eval_loader(Dataset dataset, torch::data::DataLoaderOptions loader_options) {
    const int64_t size = dataset_size(dataset.size());
    return torch::data::make_data_loader(std::move(dataset), data::EvaluationSampler(size, world_size_, rank_),
                                         std::move(loader_options));
  }

  // Local. The same over an ImageDataset, loaded by a data::ParallelLoader.
  data::ParallelLoader<data::EvaluationSampler> prepare_eval_loader(data::ImageDataset dataset,
                                                                   data::LoaderOptions loader_options) {
    const auto size = static_cast<int64_t>(dataset.size());
    return data::ParallelLoader<data::EvaluationSampler>(std::move(dataset),
                                                         data::EvaluationSampler(size, world_size_, rank_), loader_options);
  }

  // The training loop's epochs (see EpochRange).
  EpochRange epochs(int64_t epochs) { return EpochRange(*this, epochs); }

  // One micro-step: (loss / k).backward(), synchronising or under no_sync (see the contract).
  void backward(const at::Tensor& loss);
  // Whether the latest backward() synchronised the gradients (true before the first).
  bool sync_gradients() const { return sync_; }
  // Synchronised backward passes so far (across resumes): the number of optimizer steps.
  int64_t global_step() const { return global_step_; }
  // The first prepared training loader's epoch (0 without one).
  int64_t epoch() const;

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

  // Local. Records user scalars (an object of numbers) at the current step in this rank's metrics
  // (rank 0's also in the aggregate, and the latest of each in summary.json).
  void log(const nlohmann::json& scalars);

  // Writes the arguments and a newline to stdout on rank 0 only (and to its log file).
  template <typename... Args>
  void print(const Args&... args) {
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

  // Collective. Saves the state (see the contract) as a new version in run_dir()/state; returns
  // the version's path. UsageError between the micro-steps of an accumulation (the accumulated
  // gradients are not part of the state): call it after a sync step.
  std::string save_state();
  // Collective. Loads the current state of run_dir()/state (or of `dir`, a state directory or one
  // version of it) into everything prepared; false (on every rank) when there is none. Loaders
  // resume mid-epoch; at another world size or batch size the position is converted to the first
  // batch holding samples not yet trained on, with a notice.
  bool load_state(const std::string& dir = {});
  // Local. An object saved with the state as the bytes `save` returns, given back to `load` when
  // a state is loaded (a name saved but not registered is ignored; one registered but missing
  // from the state is not loaded). Register on every rank before epochs() begins.
  void register_for_checkpointing(const std::string& name, std::function<std::string()> save,
                                  std::function<void(const std::string&)> load);

  // Collective, once (epochs() calls it at its end; later calls do nothing): records the last step,
  // saves state when checkpoint_each_epoch and the last save is older, writes summary.json and
  // prints the closing line.
  void end_training();
  // Whether a stop signal ended training (only visible with exit_on_signal = false).
  bool stopped() const { return stopped_; }

  // The forward's autocast, for code outside a prepared model.
  bool autocast_enabled() const { return options_.mixed_precision != MixedPrecision::kNo; }
  AutocastSpec autocast_spec() const;
  // Where the prepared models and batches live (AcceleratorOptions::device, resolved).
  const c10::Device& device() const { return device_; }
  // kFP16's loss scaler; nullptr otherwise.
  GradScaler* scaler() { return scaler_.get(); }

 private:
  template <typename Dataset, typename Loader>
  friend class PreparedDataLoader;
  friend class PreparedOptimizer;
  friend class EpochRange;
  friend void detail::add_forward_time(Accelerator&, double);
  friend void detail::add_data_time(Accelerator&, double);
  friend void detail::begin_pass(Accelerator&);
  friend bool detail::at_step_boundary(Accelerator&);

  struct PreparedRecord {
    std::shared_ptr<void> owner;  // keeps the DDP (and its reducer) alive
    std::shared_ptr<torch::nn::Module> module;
    ddp::Reducer* reducer;
    std::vector<at::Tensor> parameters;
  };
  struct SchedulerRecord {
    torch::optim::LRScheduler* scheduler;
    std::shared_ptr<int64_t> steps;
  };
  struct UserObject {
    std::string name;
    std::function<std::string()> save;
    std::function<void(const std::string&)> load;
  };
  struct Timing;
  struct Records;

  std::string who() const;
  static std::shared_ptr<torch::nn::Module> state_module(const std::vector<PreparedRecord>& models);
  CheckpointOptions checkpoint_options() const;
  int64_t dataset_size(torch::optional<size_t> size) const;
  std::shared_ptr<detail::LoaderState> make_loader_state(int64_t dataset_size, int64_t batch, bool drop_last_batch);
  void check_not_prepared(const torch::nn::Module& module) const;
  void register_model(std::shared_ptr<void> owner, std::shared_ptr<torch::nn::Module> module, ddp::Reducer& reducer);
  void print_line(const std::string& line);
  void notice(const std::string& line);  // every rank's log, rank 0's stdout
  void on_batch(detail::LoaderState& loader, int64_t position);

  // The loop's hooks.
  void ensure_started();  // once: the resume policy's load_state and the start event
  int64_t start_training(int64_t epochs);
  void begin_epoch(int64_t epoch);
  void end_epoch();
  bool training_done(int64_t epoch, int64_t epochs);
  bool step_boundary();
  void settle_step();
  void finish_step();
  void flush_aggregate();
  int agree_on_signal();      // blocking: the largest pending signal number over the ranks
  int poll_signal();          // at step boundaries: the agreement started one boundary earlier
  int finish_signal_check();  // waits for the outstanding asynchronous check; its outcome
  [[noreturn]] void stop_and_exit(int signal);
  void stop(int signal);
  double elapsed() const;

  AcceleratorOptions options_;
  c10::Device device_{c10::DeviceType::CPU};
  std::unique_ptr<GradScaler> scaler_;  // kFP16 only
  ProcessGroup* group_ = nullptr;
  int rank_ = 0;
  int world_size_ = 1;
  std::string run_dir_;
  std::string state_dir_;
  bool resume_ = false;  // load the state at the start of epochs()
  int restart_count_ = 0;
  std::vector<PreparedRecord> models_;
  std::vector<torch::optim::Optimizer*> optimizers_;
  std::vector<SchedulerRecord> schedulers_;
  std::vector<std::shared_ptr<detail::LoaderState>> loaders_;
  std::vector<UserObject> user_objects_;
  int accumulated_ = 0;       // micro-steps since the last sync
  bool sync_ = true;          // whether the latest backward() synchronised
  bool end_of_pass_ = false;  // the batch of the coming backward() is the last of a pass
  int64_t global_step_ = 0;
  int64_t settled_step_ = 0;   // the last step whose boundary ran
  int64_t saved_step_ = -1;    // the step of the latest save_state
  bool started_ = false;
  bool ended_ = false;
  bool stopped_ = false;
  int64_t epochs_ = 0;         // epochs() of the current loop
  int64_t planned_steps_ = 0;  // optimizer steps the loop will run (0: unknown)
  int64_t first_step_ = 0;     // global_step_ when this process started training
  dist::WorkPtr signal_work_;  // the outstanding asynchronous signal check
  at::Tensor signal_value_;
  std::unique_ptr<Timing> timing_;
  std::unique_ptr<Records> records_;
};

template <typename Dataset, typename Loader>
void PreparedDataLoader<Dataset, Loader>::on_batch(int64_t position) {
  accelerator_->on_batch(*state_, position);
}

template <typename Dataset, typename Loader>
void PreparedDataLoader<Dataset, Loader>::to_device(Batch& batch) {
  const c10::Device& device = accelerator_->device();
  if (device.is_cpu()) return;
  if constexpr (std::is_same_v<Batch, torch::data::Example<>>) {
    batch.data = batch.data.to(device, /*non_blocking=*/true);
    batch.target = batch.target.to(device, /*non_blocking=*/true);
  }
}

// Whether stdout shows a line rewritten in place: a terminal, not TERM=dumb, and not a rank of
// mpirun or srun (they relay a pseudo-terminal's output line by line into logs, where "\r" and
// escape codes arrive as garbage; a relay's variable counts when set, even to ""). The
// Accelerator's progress bar is drawn only then. Pure: decided from `env` and whether stdout is a
// terminal.
bool stdout_rewrites_in_place(const Environment& env, bool stdout_is_terminal);
// The same for this process: its environment (current_environment()) and isatty(1).
bool stdout_rewrites_in_place();

// Intra-op threads of this process: torch::set_num_threads, and OpenBLAS's own pool when OpenBLAS
// is the BLAS in use (Debian's libblas.so.3 alternative; it otherwise runs a thread per core, so
// two ranks on two cores would run four BLAS threads).
void set_num_threads(int threads);

// glibc's malloc set for a training loop: blocks up to 32 MiB come from the heap, not from a fresh
// mmap() each, and freed memory stays in the process (the top of the heap is given back to the
// kernel only beyond 1 GiB). With glibc's defaults a step's activations and gradients above the
// mmap threshold (128 KiB at first; it rises only when such a block is freed) are mapped afresh
// and unmapped every step, and every first touch of their pages is a page fault: ResNet-18 at 64 px
// trained 3-4x slower on this project's machine (docs/accelerator.md). Memory then stays at the
// loop's peak instead of falling between steps. Process-wide; the Accelerator calls it, with its
// snapshot of the environment, unless AcceleratorOptions::tune_malloc is false. Returns false and
// changes nothing when `env` has CHORUS_MALLOC_TUNING=0, or MALLOC_MMAP_THRESHOLD_ or
// MALLOC_TRIM_THRESHOLD_ set, even to "" (the user's own settings, which glibc read at startup,
// win); true when applied (again: idempotent).
bool tune_malloc_for_training(const Environment& env);
// The same with this process's environment (current_environment()).
bool tune_malloc_for_training();

// Runs `train` as one rank of a job and returns main()'s exit status. In a process a launcher
// started as one rank (chorus run or torchrun set RANK; mpirun with more than one rank sets
// OMPI_COMM_WORLD_RANK; srun with more than one task sets SLURM_PROCID in a job step) it runs here;
// otherwise in `nproc` local processes started by chorus::spawn (0: one). A launched rank given an
// nproc above 0 is a usage error (status 2): the launcher decides the ranks. An exception
// is printed on one line (libtorch's without its backtrace) as "<program>: rank R: error: ...",
// recorded for chorus run's report, and gives status 2 for a UsageError, else 1.
int run_job(const char* program, int nproc, const std::function<void()>& train);

}  // namespace chorus::train
