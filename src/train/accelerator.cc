// The Accelerator: its construction (options checked, process group, resume policy, run records),
// prepare_* for models, optimizers and schedulers, backward with gradient accumulation, clipping,
// metrics, logging and main_process_first. The loop's hooks are in accelerator_loop.cc, the state
// in accelerator_state.cc, run_job and the process-wide settings in run_job.cc.
#include "chorus/train/accelerator.h"

#include <ATen/autocast_mode.h>
#include <torch/cuda.h>
#include <torch/nn/utils/clip_grad.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <csignal>
#include <ctime>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <unordered_set>

#include "accelerator_internal.h"
#include "chorus/comm/files.h"
#include "chorus/comm/rendezvous.h"
#include "chorus/comm/signals.h"
#include "chorus/torch/compat.h"
#include "chorus/train/checkpoint.h"

namespace chorus::train {

namespace fs = std::filesystem;


AutocastGuard::AutocastGuard(c10::DeviceType device, c10::ScalarType dtype, bool enabled)
    : enabled_(enabled), device_(device), dtype_(dtype) {
  if (!enabled_) return;
  previous_enabled_ = compat::autocast_enabled(device_);
  previous_dtype_ = compat::autocast_dtype(device_);
  compat::set_autocast_enabled(device_, true);
  compat::set_autocast_dtype(device_, dtype_);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  if (!enabled_) return;
  // As torch.autocast's __exit__: the cast weights are cached only while autocast is entered, so
  // an optimizer step in between is never hidden behind a stale bfloat16 copy.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  compat::set_autocast_enabled(device_, previous_enabled_);
  compat::set_autocast_dtype(device_, previous_dtype_);
}

namespace detail {
c10::Device resolve_device(const std::string& spec, int local_rank, int cuda_devices) {
  if (spec == "cpu") return c10::Device(c10::DeviceType::CPU);
  if (spec == "cuda" || spec.rfind("cuda:", 0) == 0) {
    if (cuda_devices <= 0) {
      throw UsageError("Accelerator: device '" + spec + "' but libtorch sees no CUDA device (a CPU-only libtorch, "
                       "or no GPU on this machine); use device \"cpu\"");
    }
    int index = std::max(local_rank, 0) % cuda_devices;
    if (spec != "cuda") {
      const std::string digits = spec.substr(5);
      if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 3) {
        throw UsageError("Accelerator: device '" + spec + "' is not cuda:N");
      }
      index = std::stoi(digits);
      if (index >= cuda_devices) {
        throw UsageError("Accelerator: device '" + spec + "' but only " + std::to_string(cuda_devices) +
                         " CUDA device(s) are visible (cuda:0 to cuda:" + std::to_string(cuda_devices - 1) + ")");
      }
    }
    return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index));
  }
  throw UsageError("Accelerator: device '" + spec + "' is not one of cpu, cuda, cuda:N");
}

int local_rank_from_environment(int rank) {
  for (const char* name : {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && *v != '\0') {
      char* end = nullptr;
      const long n = std::strtol(v, &end, 10);
      if (*end == '\0' && n >= 0 && n < 1 << 20) return static_cast<int>(n);
    }
  }
  return rank;
}
}  // namespace detail

AutocastSpec Accelerator::autocast_spec() const {
  AutocastSpec s;
  s.enabled = options_.mixed_precision != MixedPrecision::kNo;
  s.device = device_.is_cuda() ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
  s.dtype = options_.mixed_precision == MixedPrecision::kFP16 ? c10::ScalarType::Half : c10::ScalarType::BFloat16;
  return s;
}

MixedPrecision parse_mixed_precision(const std::string& name) {
  if (name == "no" || name == "fp32" || name.empty()) return MixedPrecision::kNo;
  if (name == "bf16") return MixedPrecision::kBF16;
  if (name == "fp16") return MixedPrecision::kFP16;
  throw UsageError("mixed precision '" + name + "' is not one of no, bf16, fp16");
}
namespace detail {
at::Tensor to_float32(const at::Tensor& t) {
  if (!t.defined() || !t.is_floating_point()) return t;
  const auto type = t.scalar_type();
  if (type == at::kFloat || type == at::kDouble) return t;
  return t.to(at::kFloat);
}

void add_forward_time(Accelerator& accelerator, double seconds) { accelerator.timing_->forward_s += seconds; }
void add_data_time(Accelerator& accelerator, double seconds) { accelerator.timing_->data_s += seconds; }
void begin_pass(Accelerator& accelerator) {
  accelerator.ensure_started();  // a loop without epochs(): resume (when due) before the first batch
  // A step timed across an evaluation between passes would show the evaluation as a slow step.
  if (accelerator.global_step_ == accelerator.settled_step_) accelerator.timing_->reset_step(Clock::now());
}
bool at_step_boundary(Accelerator& accelerator) { return accelerator.step_boundary(); }

int64_t LoaderState::batch_samples(int64_t index) const {
  const int64_t n = sampler->num_samples();
  return std::max<int64_t>(0, std::min(batch_size, n - index * batch_size));
}

void SharedSampler::reset(torch::optional<size_t> new_size) {
  state_->sampler->reset(new_size);
  // A resumed position: hand out the order from there without loading the batches before it.
  if (state_->skip > 0) state_->sampler->next(static_cast<size_t>(state_->skip * state_->batch_size));
}
}  // namespace detail

void PreparedOptimizer::step() {
  if (!accelerator_->sync_gradients()) return;
  const auto start = Clock::now();
  if (GradScaler* scaler = accelerator_->scaler()) {
    scaler->step(*optimizer_);  // skipped when a gradient is inf or NaN (the same on every rank)
    scaler->update();
  } else {
    optimizer_->step();
  }
  accelerator_->timing_->optimizer_s += std::chrono::duration<double>(Clock::now() - start).count();
}

void PreparedOptimizer::zero_grad() {
  if (accelerator_->sync_gradients()) optimizer_->zero_grad();
}

void PreparedScheduler::step() {
  if (!accelerator_->sync_gradients()) return;
  // As Accelerate: the learning rate does not move on a step the loss scaler skipped.
  if (GradScaler* scaler = accelerator_->scaler(); scaler != nullptr && scaler->last_step_skipped()) return;
  scheduler_->step();
  ++*steps_;
}

EpochRange::Iterator EpochRange::begin() { return Iterator(accelerator_, accelerator_->start_training(epochs_)); }

EpochRange::Iterator& EpochRange::Iterator::operator++() {
  accelerator_->end_epoch();
  ++epoch_;
  return *this;
}

bool EpochRange::Iterator::operator!=(const Iterator& end) const {
  return !accelerator_->training_done(epoch_, end.epoch_);
}

namespace {
AcceleratorOptions checked(AcceleratorOptions options) {
  if (options.gradient_accumulation_steps < 1) {
    throw UsageError("Accelerator: gradient_accumulation_steps must be at least 1, got " +
                     std::to_string(options.gradient_accumulation_steps));
  }
  if (options.mixed_precision == MixedPrecision::kFP16 && options.device.rfind("cuda", 0) != 0) {
    throw UsageError(
        "Accelerator: mixed_precision fp16 runs on a CUDA device (AcceleratorOptions::device \"cuda\"), with "
        "loss scaling; on the CPU use MixedPrecision::kBF16 (bfloat16 autocast, same range as float32, no loss "
        "scaling needed)");
  }
  if (options.max_steps < 0 || options.checkpoint_every < 0) {
    throw UsageError("Accelerator: max_steps and checkpoint_every must be 0 (off) or positive");
  }
  if (options.keep_last < 1) throw UsageError("Accelerator: keep_last must be at least 1");
  if (options.log_every < 1) throw UsageError("Accelerator: log_every must be at least 1");
  if (options.resume && options.overwrite) {
    throw UsageError("Accelerator: resume and overwrite exclude each other: continue from the saved state, or "
                     "delete it and start afresh");
  }
  if (options.run_name.empty()) options.run_name = program_invocation_short_name;
  if (options.run_name.empty() || options.run_name == "." || options.run_name == ".." ||
      options.run_name.find('/') != std::string::npos) {
    throw UsageError("Accelerator: run_name '" + options.run_name +
                     "' is not a plain directory name (no '/', not '.' or '..')");
  }
  if (!options.config.is_null() && !options.config.is_object()) {
    throw UsageError("Accelerator: config must be a JSON object (or left empty)");
  }
  return options;
}

std::string shape_of(const at::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

std::string now_iso8601() {
  std::time_t t = std::time(nullptr);
  struct tm tm {};
  ::gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::vector<std::string> command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::vector<std::string> argv;
  std::string arg;
  while (std::getline(in, arg, '\0')) argv.push_back(arg);
  return argv;
}

std::string hostname() {
  char buf[256] = {};
  ::gethostname(buf, sizeof(buf) - 1);
  return buf;
}

nlohmann::json ddp_json(const ddp::Options& o) {
  const char* compression = o.compression == ddp::Compression::kFloat16    ? "fp16"
                            : o.compression == ddp::Compression::kBFloat16 ? "bf16"
                                                                            : "none";
  return {{"first_bucket_mb", o.first_bucket_mb},
          {"bucket_cap_mb", o.bucket_cap_mb},
          {"find_unused_parameters", o.find_unused_parameters},
          {"broadcast_buffers", o.broadcast_buffers},
          {"compression", compression},
          {"gradient_as_bucket_view", o.gradient_as_bucket_view},
          {"overlap", o.overlap == ddp::Options::Overlap::kAlways ? "always" : "never"}};
}
}  // namespace

Accelerator::Accelerator(AcceleratorOptions options)
    : options_(checked(std::move(options))), timing_(std::make_unique<Timing>()), records_(std::make_unique<Records>()) {
  // The environment, read once into a value that the decisions below take (rendezvous, inside
  // init_process_group, and restart_count read their own variables).
  const Environment env = current_environment();
  if (options_.tune_malloc) tune_malloc_for_training(env);
  if (options_.group) {
    group_ = options_.group;
  } else {
    if (!dist::is_initialized()) {
      dist::init_process_group(options_.backend, options_.init_method, -1, -1, options_.init);
    }
    group_ = &dist::default_group();
  }
  rank_ = group_->rank();
  world_size_ = group_->size();
  device_ = detail::resolve_device(options_.device, detail::local_rank_from_environment(rank_),
                                   options_.device == "cpu" ? 0 : static_cast<int>(torch::cuda::device_count()));
  if (options_.mixed_precision == MixedPrecision::kFP16) scaler_ = std::make_unique<GradScaler>(options_.scaler);
  restart_count_ = restart_count();
  run_dir_ = (fs::path(options_.project_dir) / options_.run_name).string();
  state_dir_ = run_dir_ + "/state";

  // The resume policy, the same on every rank (prepare_checkpoint_dir answers rank 0's view).
  const CheckpointOptions co = checkpoint_options();
  auto existing = prepare_checkpoint_dir(state_dir_, co);
  if (existing) {
    const std::string where = " (step " + std::to_string(existing->step) + ", epoch " +
                              std::to_string(existing->epoch) + ")";
    if (options_.resume || restart_count_ > 0) {
      resume_ = true;
    } else if (options_.overwrite) {
      if (rank_ == 0) {
        std::error_code ec;
        remove_tree(state_dir_, ec);
        if (ec) throw CheckpointError("cannot delete " + state_dir_ + " (overwrite): " + ec.message());
      }
      prepare_checkpoint_dir(state_dir_, co);
    } else {
      throw UsageError(who() + ": " + state_dir_ + " holds the state of an earlier run" + where +
                       "; resume it (AcceleratorOptions::resume, e.g. --resume), delete it and start afresh "
                       "(overwrite, e.g. --overwrite), or choose another run_name");
    }
  }

  if (options_.records) {
    try {
      records_->recorder = detail::RunRecorder(run_dir_, rank_, !resume_);
    } catch (const std::exception& e) {
      throw UsageError(who() + ": " + e.what());
    }
  }
  records_->progress = detail::Progress(rank_ == 0 && options_.progress,
                                        stdout_rewrites_in_place(env, ::isatty(1) != 0), options_.log_every);
  watch_signals({SIGTERM, SIGUSR1, SIGUSR2});

  if (rank_ == 0) {
    const char* precision = options_.mixed_precision == MixedPrecision::kBF16 ? "bf16" : "no";
    nlohmann::json config = {
        {"run_name", options_.run_name},
        {"world_size", world_size_},
        {"attempt", restart_count_},
        {"resumed", resume_},
        {"started", now_iso8601()},
        {"host", hostname()},
        {"transport", group_->transport()},
        {"command", command_line()},
        {"accelerator",
         {{"gradient_accumulation_steps", options_.gradient_accumulation_steps},
          {"mixed_precision", precision},
          {"seed", options_.seed},
          {"shuffle", options_.shuffle},
          {"drop_last", options_.drop_last},
          {"max_steps", options_.max_steps},
          {"checkpoint_each_epoch", options_.checkpoint_each_epoch},
          {"checkpoint_every", options_.checkpoint_every},
          {"keep_last", options_.keep_last}}},
        {"ddp", ddp_json(options_.ddp)},
        {"config", options_.config.is_null() ? nlohmann::json::object() : options_.config},
    };
    records_->recorder.write_json("config.json", config);
  }
}

Accelerator::~Accelerator() {
  if (signal_work_) {  // training was not ended: finish the outstanding check, ignoring its outcome
    try {
      signal_work_->wait();
    } catch (const std::exception&) {
    }
  }
  records_->progress.close();
  records_->recorder.flush();
}

std::string Accelerator::who() const {
  return "Accelerator (rank " + std::to_string(rank_) + " of " + std::to_string(world_size_) + ")";
}

int64_t Accelerator::dataset_size(torch::optional<size_t> size) const {
  if (!size) {
    throw UsageError(who() + ": the dataset has no size(); a DistributedSampler needs the number of items "
                             "to split them over the ranks");
  }
  return static_cast<int64_t>(*size);
}

std::shared_ptr<detail::LoaderState> Accelerator::make_loader_state(int64_t size, int64_t batch, bool drop_last_batch) {
  data::DistributedSamplerOptions so;
  so.num_replicas = world_size_;
  so.rank = rank_;
  so.shuffle = options_.shuffle;
  so.seed = options_.seed;
  so.drop_last = options_.drop_last;
  auto state = std::make_shared<detail::LoaderState>();
  state->sampler = std::make_shared<data::DistributedSampler>(size, so);
  state->batch_size = batch;
  const int64_t per_rank = state->sampler->num_samples();
  state->batches_per_epoch = drop_last_batch ? per_rank / batch : (per_rank + batch - 1) / batch;
  loaders_.push_back(state);
  return state;
}

void Accelerator::check_not_prepared(const torch::nn::Module& module) const {
  std::unordered_set<const void*> prepared;
  for (const auto& m : models_) {
    if (m.module.get() == &module) {
      throw UsageError(who() + ": this model (" + module.name() +
                       ") was prepared already; prepare each model once and use the PreparedModel "
                       "prepare_model returned (a second DistributedDataParallel would reduce every gradient twice)");
    }
    for (const auto& p : m.parameters) prepared.insert(p.unsafeGetTensorImpl());
  }
  size_t shared = 0;
  for (const auto& p : module.parameters()) shared += prepared.count(p.unsafeGetTensorImpl());
  if (shared > 0) {
    throw UsageError(who() + ": " + std::to_string(shared) + " of this model's (" + module.name() +
                     ") parameters belong to a model prepared already (a sub-module of it, or one sharing "
                     "tensors with it); their gradients would be reduced twice. Prepare only the outer model");
  }
}

void Accelerator::register_model(std::shared_ptr<void> owner, std::shared_ptr<torch::nn::Module> module,
                                 ddp::Reducer& reducer) {
  auto parameters = module->parameters();
  models_.push_back({std::move(owner), std::move(module), &reducer, std::move(parameters)});
}

PreparedOptimizer Accelerator::prepare_optimizer(torch::optim::Optimizer& optimizer) {
  std::unordered_set<const void*> prepared;
  for (const auto& m : models_) {
    for (const auto& p : m.parameters) prepared.insert(p.unsafeGetTensorImpl());
  }
  std::vector<std::string> foreign;
  size_t total = 0;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      ++total;
      if (!prepared.count(p.unsafeGetTensorImpl())) foreign.push_back(shape_of(p));
    }
  }
  if (!foreign.empty()) {
    std::ostringstream out;
    out << who() << ": prepare_optimizer: " << foreign.size() << " of the optimizer's " << total
        << " parameters belong to no prepared model (shapes:";
    for (size_t i = 0; i < foreign.size() && i < 10; ++i) out << ' ' << foreign[i];
    if (foreign.size() > 10) out << " ...";
    out << "). Their gradients would never be averaged over the ranks. Prepare the model first "
        << "(accelerator.prepare_model(net)) and build the optimizer on that model's parameters "
        << "(net->parameters()), not on a copy or another model";
    if (models_.empty()) out << " (no model is prepared yet)";
    throw UsageError(out.str());
  }
  for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    const double lr = optimizer.param_groups()[g].options().get_lr();
    if (!std::isfinite(lr) || lr < 0) {
      throw UsageError(who() + ": prepare_optimizer: parameter group " + std::to_string(g) + " has learning rate " +
                       std::to_string(lr) + "; it must be a finite number >= 0 (check the value passed in)");
    }
  }
  optimizers_.push_back(&optimizer);
  return PreparedOptimizer(*this, optimizer);
}

PreparedScheduler Accelerator::prepare_scheduler(torch::optim::LRScheduler& scheduler) {
  auto steps = std::make_shared<int64_t>(0);
  schedulers_.push_back({&scheduler, steps});
  return PreparedScheduler(*this, scheduler, std::move(steps));
}

int64_t Accelerator::epoch() const { return loaders_.empty() ? 0 : loaders_.front()->sampler->epoch(); }

void Accelerator::on_batch(detail::LoaderState& loader, int64_t position) {
  loader.position = position + 1;
  timing_->samples += static_cast<double>(loader.batch_samples(position));
  if (position + 1 >= loader.batches_per_epoch) end_of_pass_ = true;
}

void Accelerator::backward(const at::Tensor& loss) {
  const auto start = Clock::now();
  const int k = options_.gradient_accumulation_steps;
  if (global_step_ != settled_step_) settle_step();  // a loop without a prepared loader
  ++accumulated_;
  sync_ = accumulated_ >= k || end_of_pass_;
  end_of_pass_ = false;
  timing_->loss_sum += loss.detach().item<double>();
  ++timing_->loss_n;
  at::Tensor scaled = k > 1 ? loss / k : loss;
  if (scaler_) scaled = scaler_->scale(scaled);
  if (sync_) {
    accumulated_ = 0;
    scaled.backward();
    ++global_step_;
    for (const auto& m : models_) {
      timing_->comm_ms += m.reducer->stats().comm_ms;
      timing_->comm_wait_ms += m.reducer->stats().comm_wait_ms;
    }
  } else {
    std::vector<std::unique_ptr<ddp::Reducer::NoSync>> local_only;
    for (auto& m : models_) local_only.push_back(std::make_unique<ddp::Reducer::NoSync>(*m.reducer));
    scaled.backward();
  }
  timing_->backward_s += seconds_between(start, Clock::now());
}

double Accelerator::clip_grad_norm_(double max_norm, double norm_type) {
  if (!sync_) return std::numeric_limits<double>::quiet_NaN();
  if (scaler_) {
    for (auto* o : optimizers_) scaler_->unscale_(*o);  // the norm of the true gradients
  }
  std::vector<at::Tensor> params;
  for (const auto& m : models_) {
    for (const auto& p : m.parameters) {
      if (p.grad().defined()) params.push_back(p);
    }
  }
  return torch::nn::utils::clip_grad_norm_(params, max_norm, norm_type);
}

at::Tensor Accelerator::gather_for_metrics(const at::Tensor& local_results, int64_t dataset_size) {
  return data::gather_evaluation(local_results, dataset_size, group_);
}

at::Tensor Accelerator::reduce(const at::Tensor& tensor, Reduction reduction) {
  if (!tensor.defined()) throw UsageError(who() + ": reduce got an undefined tensor");
  at::Tensor out = tensor.contiguous().clone();
  dist::all_reduce(out, ReduceOp::kSum, group_);
  if (reduction == Reduction::kMean) out = out / world_size_;
  return out;
}

void Accelerator::log(const nlohmann::json& scalars) {
  if (!scalars.is_object()) throw UsageError(who() + ": log takes an object of named numbers, e.g. {{\"accuracy\", 0.9}}");
  nlohmann::json line = {{"type", "log"}, {"step", global_step_}, {"epoch", epoch()}, {"time", elapsed()}};
  for (const auto& [key, value] : scalars.items()) {
    if (!value.is_number() && !value.is_boolean()) {
      throw UsageError(who() + ": log: '" + key + "' is not a number (" + value.dump() + ")");
    }
    if (line.contains(key)) throw UsageError(who() + ": log: '" + key + "' is a reserved key");
    line[key] = value;
  }
  records_->recorder.line(line, false);
  if (rank_ != 0) return;
  records_->pending_logs.push_back(line);
  for (const auto& [key, value] : scalars.items()) records_->last_scalars[key] = value;
}

void Accelerator::print_line(const std::string& line) {
  records_->progress.line(line);
  records_->recorder.log_line(line);
}

void Accelerator::notice(const std::string& line) {
  if (rank_ == 0) {
    print_line(line);
  } else {
    records_->recorder.log_line(line);
  }
}

void Accelerator::wait_for_everyone() { dist::barrier(group_); }

void Accelerator::main_process_first(const std::function<void()>& fn) {
  std::string failure;
  std::exception_ptr error;
  if (rank_ == 0) {
    try {
      fn();
    } catch (const std::exception& e) {
      error = std::current_exception();
      failure = e.what();
      if (failure.empty()) failure = "an exception with no message";
    } catch (...) {
      error = std::current_exception();
      failure = "an exception that is not a std::exception";
    }
  }
  // The others wait here for rank 0's outcome, so its error reaches them instead of a timeout.
  failure = dist::broadcast_object(failure, 0, group_);
  if (rank_ == 0) {
    if (error) std::rethrow_exception(error);
    return;
  }
  if (!failure.empty()) {
    throw Error(who() + ": main_process_first: the function failed on rank 0, so this rank does not run it: " +
                failure);
  }
  fn();
}

double Accelerator::elapsed() const { return timing_->elapsed_offset + seconds_between(timing_->created, Clock::now()); }

}  // namespace chorus::train
