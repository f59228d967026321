#include "chorus/train/accelerator.h"

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <torch/nn/utils/clip_grad.h>
#include <dlfcn.h>
#include <malloc.h>
#include <torch/utils.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <unordered_set>

#include "chorus/comm/rendezvous.h"
#include "chorus/comm/signals.h"
#include "chorus/comm/spawn.h"
#include "chorus/train/checkpoint.h"
#include "run_record.h"

namespace chorus::train {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

AutocastGuard::AutocastGuard(bool enabled) : enabled_(enabled) {
  if (!enabled_) return;
  previous_enabled_ = at::autocast::is_cpu_enabled();
  previous_dtype_ = at::autocast::get_autocast_cpu_dtype();
  at::autocast::set_cpu_enabled(true);
  at::autocast::set_autocast_cpu_dtype(at::kBFloat16);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  if (!enabled_) return;
  // As torch.autocast's __exit__: the cast weights are cached only while autocast is entered, so
  // an optimizer step in between is never hidden behind a stale bfloat16 copy.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_cpu_enabled(previous_enabled_);
  at::autocast::set_autocast_cpu_dtype(previous_dtype_);
}

MixedPrecision parse_mixed_precision(const std::string& name) {
  if (name == "no" || name == "fp32" || name.empty()) return MixedPrecision::kNo;
  if (name == "bf16") return MixedPrecision::kBF16;
  if (name == "fp16") return MixedPrecision::kFP16;
  throw UsageError("mixed precision '" + name + "' is not one of no, bf16, fp16");
}

// The Accelerator's measurements of the step in progress, and of the run.
struct Accelerator::Timing {
  Clock::time_point created = Clock::now();
  Clock::time_point step_start = Clock::now();  // end of the previous step, or start of a pass
  double elapsed_offset = 0;                    // seconds of the run before this process (resumed)
  double data_s = 0, forward_s = 0, backward_s = 0, optimizer_s = 0, comm_ms = 0, comm_wait_ms = 0;
  double loss_sum = 0;
  int64_t loss_n = 0;
  double samples = 0;
  // This rank's totals since this process started training.
  double train_seconds = 0;
  double samples_total = 0;

  void reset_step(Clock::time_point now) {
    step_start = now;
    data_s = forward_s = backward_s = optimizer_s = comm_ms = comm_wait_ms = 0;
    loss_sum = 0;
    loss_n = 0;
    samples = 0;
  }
};

// The run directory's writer and rank 0's progress, with what the aggregate still needs.
struct Accelerator::Records {
  detail::RunRecorder recorder;
  detail::Progress progress{false, false, 1};
  std::vector<detail::StepRow> pending;    // this rank's rows not yet aggregated
  std::vector<nlohmann::json> pending_logs;  // rank 0's log lines, written with the aggregate in step order
  nlohmann::json last_scalars = nlohmann::json::object();
  // Aggregate totals over this process's steps (rank 0).
  int64_t steps = 0;
  double samples = 0, step_ms = 0, data_ms = 0, forward_ms = 0, backward_ms = 0, optimizer_ms = 0, comm_ms = 0,
         comm_wait_ms = 0;
  double last_loss = std::numeric_limits<double>::quiet_NaN();
  double loss_sum = 0;
  double boundary_seconds = 0;  // this rank's time in step boundaries, saves excluded
};

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
  optimizer_->step();
  accelerator_->timing_->optimizer_s += std::chrono::duration<double>(Clock::now() - start).count();
}

void PreparedOptimizer::zero_grad() {
  if (accelerator_->sync_gradients()) optimizer_->zero_grad();
}

void PreparedScheduler::step() {
  if (!accelerator_->sync_gradients()) return;
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
  if (options.mixed_precision == MixedPrecision::kFP16) {
    throw UsageError(
        "Accelerator: mixed_precision fp16 needs a loss scaler on a CUDA device, and chorus runs on the CPU; "
        "use MixedPrecision::kBF16 (bfloat16 autocast, same range as float32, no loss scaling needed)");
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

const char* signal_name(int sig) {
  switch (sig) {
    case SIGTERM: return "SIGTERM";
    case SIGUSR1: return "SIGUSR1";
    case SIGUSR2: return "SIGUSR2";
    case SIGINT: return "SIGINT";
    case SIGHUP: return "SIGHUP";
    default: return "a signal";
  }
}

std::string to_hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

std::string from_hex(const std::string& hex) {
  auto value = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  std::string out(hex.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(value(hex[2 * i]) << 4 | value(hex[2 * i + 1]));
  return out;
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

double seconds_between(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }
}  // namespace

Accelerator::Accelerator(AcceleratorOptions options)
    : options_(checked(std::move(options))), timing_(std::make_unique<Timing>()), records_(std::make_unique<Records>()) {
  if (options_.tune_malloc) tune_malloc_for_training();
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
        fs::remove_all(state_dir_, ec);
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
  records_->progress = detail::Progress(rank_ == 0 && options_.progress, stdout_rewrites_in_place(),
                                        options_.log_every);
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
  const at::Tensor scaled = k > 1 ? loss / k : loss;
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

// ---- The loop's hooks ----

void Accelerator::ensure_started() {
  if (started_) return;
  started_ = true;
  if (resume_) load_state();
  first_step_ = global_step_;
  nlohmann::json event = {{"type", "event"}, {"event", global_step_ > 0 ? "resume" : "start"},
                          {"step", global_step_}, {"epoch", epoch()}, {"time", elapsed()},
                          {"attempt", restart_count_}};
  records_->recorder.line(event, rank_ == 0);
  records_->recorder.flush();
}

int64_t Accelerator::start_training(int64_t epochs) {
  if (epochs < 0) throw UsageError(who() + ": epochs(" + std::to_string(epochs) + "): the number of epochs is negative");
  ensure_started();
  epochs_ = epochs;
  const int64_t first = loaders_.empty() ? 0 : loaders_.front()->resume_epoch();
  planned_steps_ = 0;
  if (!loaders_.empty()) {
    const auto& l = *loaders_.front();
    const int64_t k = options_.gradient_accumulation_steps;
    const int64_t per_epoch = (l.batches_per_epoch + k - 1) / k;
    const int64_t done_in_epoch = (l.resume_position() + k - 1) / k;
    planned_steps_ = global_step_ + std::max<int64_t>(0, (epochs - first) * per_epoch - done_in_epoch);
  }
  if (options_.max_steps > 0) {
    planned_steps_ = planned_steps_ > 0 ? std::min(planned_steps_, options_.max_steps) : options_.max_steps;
  }
  {
    std::ostringstream line;
    line << "training: " << world_size_ << " rank(s) over " << group_->transport() << ", epochs " << first + 1 << ".."
         << epochs;
    if (planned_steps_ > 0) line << ", " << planned_steps_ - global_step_ << " optimizer step(s)";
    if (options_.records) line << ", records in " << run_dir_;
    notice(line.str());
  }
  timing_->reset_step(Clock::now());
  return first;
}

void Accelerator::begin_epoch(int64_t epoch) {
  for (auto& l : loaders_) {
    if (l->resume_epoch() == epoch) continue;  // already there (resumed mid-epoch, or the next pass)
    l->sampler->set_epoch(epoch);
    l->pass_completed = false;
    l->skip = 0;
  }
}

void Accelerator::end_epoch() {
  settle_step();
  if (options_.checkpoint_each_epoch && saved_step_ != global_step_) save_state();
  if (const int sig = agree_on_signal()) stop(sig);
}

bool Accelerator::training_done(int64_t epoch, int64_t epochs) {
  const bool done = epoch >= epochs || stopped_ || (options_.max_steps > 0 && global_step_ >= options_.max_steps);
  if (done) {
    end_training();
    return true;
  }
  begin_epoch(epoch);
  return false;
}

bool Accelerator::step_boundary() {
  settle_step();
  return stopped_ || (options_.max_steps > 0 && global_step_ >= options_.max_steps);
}

void Accelerator::settle_step() {
  if (global_step_ == settled_step_) return;
  settled_step_ = global_step_;
  finish_step();
}

void Accelerator::finish_step() {
  auto& t = *timing_;
  const auto now = Clock::now();
  struct BoundaryTimer {  // the boundary's own cost (records, progress, aggregate, signal check)
    Clock::time_point start;
    double* total;
    ~BoundaryTimer() { *total += seconds_between(start, Clock::now()); }
  } boundary_timer{now, &records_->boundary_seconds};
  detail::StepRow row;
  row.step = global_step_;
  row.epoch = epoch();
  row.time = elapsed();
  row.loss = t.loss_n > 0 ? t.loss_sum / static_cast<double>(t.loss_n) : std::numeric_limits<double>::quiet_NaN();
  row.lr = optimizers_.empty() || optimizers_.front()->param_groups().empty()
               ? 0.0
               : optimizers_.front()->param_groups().front().options().get_lr();
  row.samples = t.samples;
  row.step_ms = 1e3 * seconds_between(t.step_start, now);
  row.data_ms = 1e3 * t.data_s;
  row.forward_ms = 1e3 * t.forward_s;
  row.backward_ms = 1e3 * t.backward_s;
  row.optimizer_ms = 1e3 * t.optimizer_s;
  row.comm_ms = t.comm_ms;
  row.comm_wait_ms = t.comm_wait_ms;
  t.train_seconds += row.step_ms / 1e3;
  t.samples_total += row.samples;
  t.reset_step(now);

  auto& r = *records_;
  r.recorder.step(row);
  r.pending.push_back(row);
  const int64_t done = global_step_ - first_step_;
  const double samples_per_s = t.train_seconds > 0 ? static_cast<double>(world_size_) * t.samples_total / t.train_seconds : 0;
  const double eta = planned_steps_ > 0 && done > 0
                         ? static_cast<double>(planned_steps_ - global_step_) * t.train_seconds / static_cast<double>(done)
                         : -1;
  r.progress.step(global_step_, planned_steps_, row.epoch, epochs_, row.loss, samples_per_s, eta);
  if (global_step_ % options_.log_every == 0) {  // every rank's log, whatever stdout shows
    char line[160];
    std::snprintf(line, sizeof(line), "step %lld  epoch %lld  loss %.4f  %.0f samples/s (this rank x %d)",
                  static_cast<long long>(global_step_), static_cast<long long>(row.epoch + 1), row.loss,
                  samples_per_s, world_size_);
    r.recorder.log_line(line);
  }
  if (global_step_ % 25 == 0) flush_aggregate();
  if (const int sig = poll_signal()) {
    stop(sig);
  } else if (options_.checkpoint_every > 0 && global_step_ % options_.checkpoint_every == 0) {
    const auto save_start = Clock::now();
    save_state();
    records_->boundary_seconds -= seconds_between(save_start, Clock::now());  // a save is no bookkeeping
  }
}

void Accelerator::flush_aggregate() {
  auto& r = *records_;
  if (!options_.records) return;
  const int64_t n = static_cast<int64_t>(r.pending.size());  // the same on every rank: steps agree
  if (n == 0) return;
  const int64_t f = detail::StepRow::kFields;
  at::Tensor mine = at::empty({n * f}, at::kDouble);
  for (int64_t i = 0; i < n; ++i) r.pending[static_cast<size_t>(i)].to_doubles(mine.data_ptr<double>() + i * f);
  at::Tensor all = at::empty({world_size_ * n * f}, at::kDouble);
  dist::all_gather_into_tensor(all, mine, group_);
  r.pending.clear();
  if (rank_ != 0) {
    r.recorder.flush();
    return;
  }
  const double* data = all.data_ptr<double>();
  size_t next_log = 0;
  for (int64_t i = 0; i < n; ++i) {
    std::vector<detail::StepRow> rows;
    for (int w = 0; w < world_size_; ++w) rows.push_back(detail::StepRow::from_doubles(data + (w * n + i) * f));
    const detail::StepRow agg = detail::aggregate_rows(rows);
    // User scalars logged before this step ended come first, in the order they were logged.
    while (next_log < r.pending_logs.size() && r.pending_logs[next_log]["step"].get<int64_t>() < agg.step) {
      r.recorder.aggregate_line(r.pending_logs[next_log++]);  // in rank 0's own file since log()
    }
    r.recorder.aggregate(agg);
    ++r.steps;
    r.samples += agg.samples;
    r.step_ms += agg.step_ms;
    r.data_ms += agg.data_ms;
    r.forward_ms += agg.forward_ms;
    r.backward_ms += agg.backward_ms;
    r.optimizer_ms += agg.optimizer_ms;
    r.comm_ms += agg.comm_ms;
    r.comm_wait_ms += agg.comm_wait_ms;
    r.last_loss = agg.loss;
    r.loss_sum += agg.loss;
  }
  const int64_t last_step = r.pending_logs.empty() ? 0 : global_step_;  // every row up to it is written now
  while (next_log < r.pending_logs.size() && r.pending_logs[next_log]["step"].get<int64_t>() <= last_step) {
    r.recorder.aggregate_line(r.pending_logs[next_log++]);
  }
  r.pending_logs.erase(r.pending_logs.begin(), r.pending_logs.begin() + static_cast<std::ptrdiff_t>(next_log));
  r.recorder.flush();
}

int Accelerator::finish_signal_check() {
  if (!signal_work_) return 0;
  auto work = std::move(signal_work_);
  work->wait();
  return static_cast<int>(signal_value_.item<int64_t>());
}

int Accelerator::poll_signal() {
  if (world_size_ == 1) return pending_signal();
  // The check started at the previous boundary has long finished (a step ran since), so waiting
  // for it costs nothing; the ranks agree one step after the signal arrived.
  if (const int agreed = finish_signal_check()) return agreed;
  signal_value_ = at::tensor({static_cast<int64_t>(pending_signal())}, at::kLong);
  signal_work_ = dist::all_reduce(signal_value_, ReduceOp::kMax, group_, /*async_op=*/true);
  return 0;
}

int Accelerator::agree_on_signal() {
  int64_t sig = pending_signal();
  if (world_size_ > 1) {
    if (const int agreed = finish_signal_check()) return agreed;
    at::Tensor t = at::tensor({sig}, at::kLong);
    dist::all_reduce(t, ReduceOp::kMax, group_);
    sig = t.item<int64_t>();
  }
  return static_cast<int>(sig);
}

void Accelerator::stop(int sig) {
  stopped_ = true;
  notice(std::string("stopping at step ") + std::to_string(global_step_) + " on " + signal_name(sig) +
         ": saving the state in " + state_dir_);
  save_state();
  end_training();
  if (!options_.exit_on_signal) return;
  notice("state saved; the next run with --resume (or a restart by the launcher) continues from step " +
         std::to_string(global_step_));
  records_->progress.close();
  records_->recorder.flush();
  dist::barrier(group_);  // no rank leaves while another still needs it
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(0);
}

void Accelerator::end_training() {
  if (ended_) return;
  ended_ = true;
  settle_step();
  if (const int sig = finish_signal_check(); sig != 0 && !stopped_) {
    notice(std::string("a ") + signal_name(sig) + " arrived as training ended; the state is saved below");
  }
  if (options_.checkpoint_each_epoch && global_step_ > 0 && saved_step_ != global_step_) save_state();
  flush_aggregate();
  auto& r = *records_;
  for (const auto& line : r.pending_logs) r.recorder.aggregate_line(line);  // logged after the last step
  r.pending_logs.clear();
  const double wall = elapsed();
  nlohmann::json event = {{"type", "event"}, {"event", stopped_ ? "stop" : "finish"}, {"step", global_step_},
                          {"epoch", epoch()}, {"time", wall}};
  if (stopped_) event["signal"] = pending_signal();
  r.recorder.line(event, rank_ == 0);
  // All ranks' samples over rank 0's training time (its steps, evaluations and saves excluded):
  // the ranks step together, so this is the job's rate. (The slowest rank's time per step,
  // summed, would count every step's jitter on either rank as lost time.)
  const double train_s = timing_->train_seconds;
  const double samples_per_s = train_s > 0 ? r.samples / train_s : 0;
  if (rank_ == 0) {
    auto mean = [&](double total) { return r.steps > 0 ? total / static_cast<double>(r.steps) : 0.0; };
    nlohmann::json summary = {
        {"run_name", options_.run_name},
        {"world_size", world_size_},
        {"status", stopped_ ? "stopped" : "finished"},
        {"steps", global_step_},
        {"steps_this_attempt", global_step_ - first_step_},
        {"epochs_completed", loaders_.empty() ? 0 : loaders_.front()->resume_epoch()},
        {"samples", r.samples},
        {"samples_per_s", samples_per_s},
        {"train_seconds", train_s},
        {"wall_seconds", wall},
        {"loss", std::isnan(r.last_loss) ? nlohmann::json(nullptr) : nlohmann::json(r.last_loss)},
        {"last", r.last_scalars},
        // Rank 0's time in step boundaries (records, progress, the aggregate's gather, the signal
        // check; saves excluded) as a share of its training time: the bookkeeping's cost.
        {"boundary_share", timing_->train_seconds > 0 ? r.boundary_seconds / timing_->train_seconds : 0.0},
        {"step_ms_mean",
         {{"step", mean(r.step_ms)},
          {"data", mean(r.data_ms)},
          {"forward", mean(r.forward_ms)},
          {"backward", mean(r.backward_ms)},
          {"optimizer", mean(r.optimizer_ms)},
          {"comm", mean(r.comm_ms)},
          {"comm_wait", mean(r.comm_wait_ms)}}},
    };
    r.recorder.write_json("summary.json", summary);
  }
  if (!stopped_) {
    char line[256];
    std::snprintf(line, sizeof(line), "done: %lld steps, %.0f samples/s, train loss %.4f (mean), %.1f s%s%s",
                  static_cast<long long>(global_step_ - first_step_), samples_per_s,
                  r.steps > 0 ? r.loss_sum / static_cast<double>(r.steps) : 0.0, wall,
                  options_.records ? "; records in " : "", options_.records ? run_dir_.c_str() : "");
    notice(line);
  }
  r.recorder.flush();
}

// ---- State ----

namespace {

int64_t extra_int(const CheckpointState& st, const std::string& key, int64_t fallback) {
  auto it = st.extra.find(key);
  return it == st.extra.end() ? fallback : std::stoll(it->second);
}
}  // namespace

// The module save_checkpoint gets: the one prepared model, or a holder of several under "0", "1"...
std::shared_ptr<torch::nn::Module> Accelerator::state_module(const std::vector<PreparedRecord>& models) {
  if (models.size() == 1) return models.front().module;
  auto holder = std::make_shared<torch::nn::Module>("PreparedModels");
  for (size_t i = 0; i < models.size(); ++i) holder->register_module(std::to_string(i), models[i].module);
  return holder;
}

CheckpointOptions Accelerator::checkpoint_options() const {
  CheckpointOptions co;
  co.group = group_;
  co.keep_last = options_.keep_last;
  co.fsync = options_.fsync;
  return co;
}

void Accelerator::register_for_checkpointing(const std::string& name, std::function<std::string()> save,
                                             std::function<void(const std::string&)> load) {
  if (name.empty() || !save || !load) throw UsageError(who() + ": register_for_checkpointing needs a name, save and load");
  for (const auto& u : user_objects_) {
    if (u.name == name) throw UsageError(who() + ": an object named '" + name + "' is registered already");
  }
  user_objects_.push_back({name, std::move(save), std::move(load)});
}

std::string Accelerator::save_state() {
  if (accumulated_ != 0) {
    throw UsageError(who() + ": save_state after micro-step " + std::to_string(accumulated_) + " of " +
                     std::to_string(options_.gradient_accumulation_steps) +
                     " of an accumulation: the accumulated gradients are not part of the state, so a resumed run "
                     "would differ. Save after a sync step (when sync_gradients() is true)");
  }
  if (models_.empty()) throw UsageError(who() + ": save_state: no model is prepared");
  if (optimizers_.size() > 1) {
    throw UsageError(who() + ": save_state keeps one prepared optimizer's state, and " +
                     std::to_string(optimizers_.size()) + " are prepared; save the others with "
                     "register_for_checkpointing (e.g. torch::save into a string)");
  }
  settle_step();
  flush_aggregate();
  CheckpointState st;
  st.step = global_step_;
  st.epoch = loaders_.empty() ? 0 : loaders_.front()->resume_epoch();
  st.extra["accelerator.world_size"] = std::to_string(world_size_);
  char elapsed_text[64];
  std::snprintf(elapsed_text, sizeof(elapsed_text), "%.17g", elapsed());
  st.extra["accelerator.elapsed"] = elapsed_text;
  st.extra["accelerator.loaders"] = std::to_string(loaders_.size());
  for (size_t i = 0; i < loaders_.size(); ++i) {
    const auto& l = *loaders_[i];
    const std::string p = "loader." + std::to_string(i) + ".";
    st.extra[p + "epoch"] = std::to_string(l.resume_epoch());
    st.extra[p + "position"] = std::to_string(l.resume_position());
    st.extra[p + "batch_size"] = std::to_string(l.batch_size);
    st.extra[p + "dataset_size"] = std::to_string(l.sampler->dataset_size());
  }
  for (size_t i = 0; i < schedulers_.size(); ++i) {
    st.extra["scheduler." + std::to_string(i) + ".steps"] = std::to_string(*schedulers_[i].steps);
  }
  if (!optimizers_.empty()) {
    nlohmann::json lrs = nlohmann::json::array();
    for (auto& group : optimizers_.front()->param_groups()) lrs.push_back(group.options().get_lr());
    st.extra["optimizer.0.lrs"] = lrs.dump();
  }
  for (const auto& u : user_objects_) st.extra["user." + u.name] = to_hex(u.save());

  auto module = state_module(models_);
  save_checkpoint(state_dir_, *module, optimizers_.empty() ? nullptr : optimizers_.front(), st, checkpoint_options());
  saved_step_ = global_step_;
  const std::string path = latest_checkpoint(state_dir_).value_or(state_dir_);
  records_->recorder.line({{"type", "event"}, {"event", "save"}, {"step", global_step_}, {"epoch", st.epoch},
                           {"time", elapsed()}, {"path", path}},
                          rank_ == 0);
  records_->recorder.log_line("state saved at step " + std::to_string(global_step_) + " in " + path);
  records_->recorder.flush();
  return path;
}

bool Accelerator::load_state(const std::string& dir) {
  if (models_.empty()) throw UsageError(who() + ": load_state: prepare the model(s) first, then load");
  if (optimizers_.size() > 1) {
    throw UsageError(who() + ": load_state restores one prepared optimizer's state, and " +
                     std::to_string(optimizers_.size()) + " are prepared");
  }
  const std::string from = dir.empty() ? state_dir_ : dir;
  auto module = state_module(models_);
  auto st = load_checkpoint(from, *module, optimizers_.empty() ? nullptr : optimizers_.front(), checkpoint_options());
  if (!st) {
    notice("no saved state in " + from + ": starting afresh");
    return false;
  }
  global_step_ = st->step;
  settled_step_ = saved_step_ = global_step_;
  first_step_ = global_step_;
  accumulated_ = 0;
  sync_ = true;
  if (auto it = st->extra.find("accelerator.elapsed"); it != st->extra.end()) {
    timing_->elapsed_offset = std::stod(it->second) - seconds_between(timing_->created, Clock::now());
  }
  const int64_t saved_world = extra_int(*st, "accelerator.world_size", world_size_);
  const int64_t saved_loaders = extra_int(*st, "accelerator.loaders", 0);
  for (size_t i = 0; i < loaders_.size() && static_cast<int64_t>(i) < saved_loaders; ++i) {
    auto& l = *loaders_[i];
    const std::string p = "loader." + std::to_string(i) + ".";
    int64_t epoch = extra_int(*st, p + "epoch", 0);
    int64_t position = extra_int(*st, p + "position", 0);
    const int64_t saved_batch = extra_int(*st, p + "batch_size", l.batch_size);
    if (saved_world != world_size_ || saved_batch != l.batch_size) {
      // Batch b of an epoch covers the first (b+1) x batch x world positions of the epoch's
      // shuffled order, at any world size: resume at the last batch boundary before the samples
      // not yet trained on.
      const int64_t done = position * saved_batch * saved_world;
      position = done / (l.batch_size * world_size_);
      notice("note: the state was saved by " + std::to_string(saved_world) + " rank(s) x batch " +
             std::to_string(saved_batch) + ", this run has " + std::to_string(world_size_) + " x " +
             std::to_string(l.batch_size) + ": loader " + std::to_string(i) + " resumes epoch " +
             std::to_string(epoch + 1) + " at batch " + std::to_string(position) + " (" +
             std::to_string(done - position * l.batch_size * world_size_) +
             " sample(s) trained on again), and each rank's batches differ from the original run's");
    }
    if (position >= l.batches_per_epoch) {
      ++epoch;
      position = 0;
    }
    l.sampler->set_epoch(epoch);
    l.pass_completed = false;
    l.skip = position;
    l.position = position;
  }
  for (size_t i = 0; i < schedulers_.size(); ++i) {
    const int64_t steps = extra_int(*st, "scheduler." + std::to_string(i) + ".steps", 0);
    for (int64_t s = 0; s < steps; ++s) schedulers_[i].scheduler->step();  // its step count, from the start
    *schedulers_[i].steps = steps;
  }
  if (auto it = st->extra.find("optimizer.0.lrs"); it != st->extra.end() && !optimizers_.empty()) {
    auto lrs = nlohmann::json::parse(it->second, nullptr, false);
    auto& groups = optimizers_.front()->param_groups();
    if (lrs.is_array() && lrs.size() == groups.size()) {
      for (size_t g = 0; g < groups.size(); ++g) groups[g].options().set_lr(lrs[g].get<double>());
    }
  }
  for (const auto& u : user_objects_) {
    if (auto it = st->extra.find("user." + u.name); it != st->extra.end()) u.load(from_hex(it->second));
  }
  if (options_.records) {
    records_->recorder.rewind(global_step_);
  }
  const std::string path = latest_checkpoint(from).value_or(from);
  notice("resumed from " + path + " at epoch " + std::to_string(epoch() + 1) + ", step " + std::to_string(global_step_));
  return true;
}

// ---- Running a job ----

namespace {
std::string one_line(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  std::string message = c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
  while (!message.empty() && message.back() == '\n') message.pop_back();
  return message;
}

int report(const char* program, const std::string& who, const std::exception& e) {
  const std::string message = one_line(e);
  record_fatal_error(e, message);
  std::fflush(stdout);
  std::fprintf(stderr, "%s: %s: error: %s\n", program, who.c_str(), message.c_str());
  return dynamic_cast<const UsageError*>(&e) != nullptr ? 2 : 1;
}
}  // namespace

void set_num_threads(int threads) {
  if (threads < 1) throw UsageError("set_num_threads: " + std::to_string(threads) + " threads; at least 1");
  torch::set_num_threads(threads);
  using SetThreads = void (*)(int);
  if (auto f = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) f(threads);
}

bool tune_malloc_for_training() {
  for (const char* name : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"}) {
    if (std::getenv(name) != nullptr) return false;
  }
  if (const char* v = std::getenv("CHORUS_MALLOC_TUNING"); v != nullptr && std::string(v) == "0") return false;
  // 32 MiB is the largest mmap threshold glibc accepts (HEAP_MAX_SIZE / 2 on 64-bit); setting it
  // also stops glibc's own adjustment of it.
  const bool mmap_set = ::mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1;
  const bool trim_set = ::mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1;
  return mmap_set && trim_set;
}

int run_job(const char* program, int nproc, const std::function<void()>& train) {
  if (std::string rank; launched_job(&rank)) {
    // Errors before the process group exists are recorded too (connect_process_group installs
    // the same file again, with the rank it checked).
    if (const std::string file = error_file_from_environment(); !file.empty()) {
      char* end = nullptr;
      const long r = std::strtol(rank.c_str(), &end, 10);
      install_error_file_handler(file.c_str(), end != rank.c_str() && *end == '\0' && r >= 0 && r < (1L << 30) ? static_cast<int>(r) : -1);
    }
    if (nproc > 0) {
      std::fprintf(stderr,
                   "%s: error: this process is rank %s of a job started by a launcher (chorus run, torchrun, srun or "
                   "mpirun), so it cannot start ranks itself; drop --nproc\n",
                   program, rank.c_str());
      return 2;
    }
    try {
      train();
    } catch (const std::exception& e) {
      return report(program, "rank " + rank, e);
    }
    return 0;
  }
  // Start the ranks here. The parent only waits: it must not touch libtorch before forking.
  try {
    spawn(std::max(nproc, 1), [&](int, int) {
      try {
        train();
      } catch (const c10::Error& e) {
        throw std::runtime_error(e.what_without_backtrace());  // spawn reports what(): one line
      }
    });
  } catch (const std::exception& e) {
    return report(program, "job", e);
  }
  return 0;
}

}  // namespace chorus::train
