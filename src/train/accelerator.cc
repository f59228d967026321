#include "chorus/train/accelerator.h"

#include <ATen/autocast_mode.h>
#include <torch/nn/utils/clip_grad.h>

#include <cmath>
#include <exception>
#include <iostream>
#include <limits>
#include <unordered_set>

namespace chorus::train {

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

namespace detail {
at::Tensor to_float32(const at::Tensor& t) {
  if (!t.defined() || !t.is_floating_point()) return t;
  const auto type = t.scalar_type();
  if (type == at::kFloat || type == at::kDouble) return t;
  return t.to(at::kFloat);
}
}  // namespace detail

void PreparedOptimizer::step() {
  if (accelerator_->sync_gradients()) optimizer_->step();
}

void PreparedOptimizer::zero_grad() {
  if (accelerator_->sync_gradients()) optimizer_->zero_grad();
}

void PreparedScheduler::step() {
  if (accelerator_->sync_gradients()) scheduler_->step();
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
  return options;
}

std::string shape_of(const at::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}
}  // namespace

Accelerator::Accelerator(AcceleratorOptions options) : options_(checked(std::move(options))) {
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
}

Accelerator::~Accelerator() = default;

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

void Accelerator::check_not_prepared(const torch::nn::Module& module) const {
  std::unordered_set<const void*> prepared;
  for (const auto& m : models_) {
    if (m.module == &module) {
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

void Accelerator::register_model(std::shared_ptr<void> owner, torch::nn::Module& module, ddp::Reducer& reducer) {
  models_.push_back({std::move(owner), &module, &reducer, module.parameters()});
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
  return PreparedOptimizer(*this, optimizer);
}

PreparedScheduler Accelerator::prepare_scheduler(torch::optim::LRScheduler& scheduler) {
  return PreparedScheduler(*this, scheduler);
}

void Accelerator::backward(const at::Tensor& loss) {
  const int k = options_.gradient_accumulation_steps;
  ++accumulated_;
  sync_ = accumulated_ >= k || end_of_pass_;
  end_of_pass_ = false;
  const at::Tensor scaled = k > 1 ? loss / k : loss;
  if (sync_) {
    accumulated_ = 0;
    scaled.backward();
    ++global_step_;
    return;
  }
  std::vector<std::unique_ptr<ddp::Reducer::NoSync>> local_only;
  for (auto& m : models_) local_only.push_back(std::make_unique<ddp::Reducer::NoSync>(*m.reducer));
  scaled.backward();
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

void Accelerator::print_line(const std::string& line) const { std::cout << line << std::endl; }

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

}  // namespace chorus::train
