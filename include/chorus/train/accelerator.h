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
#include "chorus/train/prepared.h"  // PreparedModel, PreparedOptimizer, ..., EpochRange, AutocastGuard
#include "chorus/train/run_job.h"   // run_job, set_num_threads, tune_malloc_for_training

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

}  // namespace chorus::train
