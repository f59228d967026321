// SyncBatchNorm: the module and its autograd function. The converter is in
// sync_batch_norm_convert.cc; docs/sync_batch_norm.md has the formulas.
#include "chorus/ddp/sync_batch_norm.h"

#include <torch/autograd.h>
#include <torch/nn/functional/batchnorm.h>
#include <torch/nn/init.h>

#include <algorithm>
#include <cstdint>
#include <ostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/torch/distributed.h"

namespace chorus::ddp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::string shape_text(const torch::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

// The dimensions a channel's statistics run over: all but dimension 1.
std::vector<int64_t> reduce_dims(const torch::Tensor& x) {
  std::vector<int64_t> dims = {0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

// A [C] tensor viewed so that it broadcasts along dimension 1 of x.
torch::Tensor per_channel(const torch::Tensor& v, const torch::Tensor& x) {
  std::vector<int64_t> shape(x.dim(), 1);
  shape[1] = v.size(0);
  return v.view(shape);
}

// The group to synchronise over, or nullptr when statistics stay local: a world of one, or no
// default group yet (a single process that never called init_process_group).
ProcessGroup* sync_group(ProcessGroup* group) {
  if (group == nullptr) {
    if (!dist::is_initialized()) return nullptr;
    group = &dist::default_group();
  }
  return group->size() > 1 ? group : nullptr;
}

struct GlobalStats {
  torch::Tensor mean;  // [C], float64
  torch::Tensor var;   // [C], float64, biased (divided by count)
  int64_t count = 0;   // values per channel over all ranks
};

// One allreduce of [sum | sum of squares | count] (2C+1 float64). The local sums come from a
// Welford mean and variance (var_mean), so E[x^2] - mean^2 is formed in float64, not from float32
// squares: the cancellation costs nothing at float32 accuracy unless |mean| / std > ~1e4.
GlobalStats global_stats(const torch::Tensor& x, ProcessGroup& group) {
  const int64_t c = x.size(1);
  const int64_t n = c > 0 ? x.numel() / c : 0;
  auto packed = torch::zeros({2 * c + 1}, torch::kDouble);
  if (n > 0) {
    auto [var, mean] = torch::var_mean(x, reduce_dims(x), /*unbiased=*/false);
    auto m = mean.to(torch::kDouble);
    packed.narrow(0, 0, c).copy_(m * static_cast<double>(n));
    packed.narrow(0, c, c).copy_((var.to(torch::kDouble) + m * m) * static_cast<double>(n));
  }
  packed[2 * c] = static_cast<double>(n);
  dist::all_reduce(packed, ReduceOp::kSum, &group);
  GlobalStats s;
  s.count = static_cast<int64_t>(packed[2 * c].item<double>());
  const double count = std::max<int64_t>(s.count, 1);
  s.mean = packed.narrow(0, 0, c) / count;
  s.var = (packed.narrow(0, c, c) / count - s.mean * s.mean).clamp_min(0.0);
  return s;
}

// y = (x - mean) * invstd * weight + bias over the global statistics; backward reduces the two
// per-channel sums of batch_norm_backward_reduce over ranks (one allreduce) and applies
// batch_norm_backward_elemt. grad_weight and grad_bias stay local, as in PyTorch.
struct SyncBatchNormFunction : torch::autograd::Function<SyncBatchNormFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& weight,
                               const torch::Tensor& bias, const torch::Tensor& mean, const torch::Tensor& invstd,
                               int64_t count, ProcessGroup* group) {
    auto alpha = invstd * weight;
    auto beta = bias - mean * alpha;
    ctx->save_for_backward({x, weight, mean, invstd});
    ctx->saved_data["count"] = count;
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(group);
    return x * per_channel(alpha, x) + per_channel(beta, x);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& weight = saved[1];
    const auto& mean = saved[2];
    const auto& invstd = saved[3];
    const auto& dy = grad_outputs[0];
    const auto dims = reduce_dims(x);
    const auto xmu = x - per_channel(mean, x);
    auto sum_dy = dy.sum(dims);
    auto sum_dy_xmu = (dy * xmu).sum(dims);

    torch::Tensor grad_input, grad_weight, grad_bias;
    if (ctx->needs_input_grad(1)) grad_weight = sum_dy_xmu * invstd;
    if (ctx->needs_input_grad(2)) grad_bias = sum_dy;
    if (ctx->needs_input_grad(0)) {
      const int64_t c = x.size(1);
      auto packed = torch::cat({sum_dy, sum_dy_xmu}).to(torch::kDouble);
      auto* group = reinterpret_cast<ProcessGroup*>(ctx->saved_data["group"].toInt());
      dist::all_reduce(packed, ReduceOp::kSum, group);
      packed /= static_cast<double>(ctx->saved_data["count"].toInt());
      auto mean_dy = packed.narrow(0, 0, c).to(x.scalar_type());
      auto mean_dy_xmu = packed.narrow(0, c, c).to(x.scalar_type());
      auto scale = invstd * weight;
      grad_input = (dy - per_channel(mean_dy, x) - xmu * per_channel(invstd * invstd * mean_dy_xmu, x)) *
                   per_channel(scale, x);
    }
    return {grad_input, grad_weight, grad_bias, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

void check_state(const SyncBatchNormOptions& o, const SyncBatchNormState& s) {
  auto check = [&](const torch::Tensor& t, const char* name, bool wanted, const char* option) {
    if (t.defined() != wanted) {
      throw UsageError(std::string("SyncBatchNorm: ") + name + (wanted ? " is undefined" : " is defined") +
                       " but " + option + " is " + (wanted ? "true" : "false") + "; give tensors that match the options");
    }
    if (t.defined() && t.numel() != (std::string(name) == "num_batches_tracked" ? 1 : o.num_features())) {
      throw UsageError(std::string("SyncBatchNorm: ") + name + " has shape " + shape_text(t) + ", expected [" +
                       std::to_string(o.num_features()) + "] for num_features " + std::to_string(o.num_features()));
    }
  };
  check(s.weight, "weight", o.affine(), "affine");
  check(s.bias, "bias", o.affine(), "affine");
  check(s.running_mean, "running_mean", o.track_running_stats(), "track_running_stats");
  check(s.running_var, "running_var", o.track_running_stats(), "track_running_stats");
  check(s.num_batches_tracked, "num_batches_tracked", o.track_running_stats(), "track_running_stats");
}

}  // namespace

SyncBatchNormOptions::SyncBatchNormOptions(const torch::nn::BatchNormOptions& batch_norm, ProcessGroup* group)
    : num_features_(batch_norm.num_features()),
      eps_(batch_norm.eps()),
      momentum_(batch_norm.momentum()),
      affine_(batch_norm.affine()),
      track_running_stats_(batch_norm.track_running_stats()),
      group_(group) {}

SyncBatchNormImpl::SyncBatchNormImpl(SyncBatchNormOptions options_) : options(std::move(options_)) { reset(); }

SyncBatchNormImpl::SyncBatchNormImpl(SyncBatchNormOptions options_, SyncBatchNormState state)
    : options(std::move(options_)), adopt_(std::move(state)) {
  check_state(options, *adopt_);
  reset();
}

void SyncBatchNormImpl::reset() {
  const bool adopting = adopt_.has_value();
  SyncBatchNormState s;
  if (adopting) {
    s = std::move(*adopt_);
    adopt_.reset();
  } else {
    const int64_t c = options.num_features();
    if (options.affine()) {
      s.weight = torch::empty({c});
      s.bias = torch::empty({c});
    }
    if (options.track_running_stats()) {
      s.running_mean = torch::zeros({c});
      s.running_var = torch::ones({c});
      s.num_batches_tracked = torch::tensor(0, torch::dtype(torch::kLong));
    }
  }
  // An adopted weight keeps requires_grad as it was (a frozen BatchNorm stays frozen).
  auto grad_of = [&](const torch::Tensor& t) { return t.defined() && (!adopting || t.requires_grad()); };
  weight = register_parameter("weight", s.weight, grad_of(s.weight));
  bias = register_parameter("bias", s.bias, grad_of(s.bias));
  running_mean = register_buffer("running_mean", s.running_mean);
  running_var = register_buffer("running_var", s.running_var);
  num_batches_tracked = register_buffer("num_batches_tracked", s.num_batches_tracked);
  if (!adopting) reset_parameters();
}

void SyncBatchNormImpl::reset_running_stats() {
  if (!options.track_running_stats()) return;
  running_mean.zero_();
  running_var.fill_(1);
  num_batches_tracked.zero_();
}

void SyncBatchNormImpl::reset_parameters() {
  reset_running_stats();
  if (!options.affine()) return;
  torch::nn::init::ones_(weight);
  torch::nn::init::zeros_(bias);
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "chorus::ddp::SyncBatchNorm(" << options.num_features() << ", eps=" << options.eps() << ", momentum=";
  if (options.momentum().has_value()) {
    stream << *options.momentum();
  } else {
    stream << "None";
  }
  stream << ", affine=" << std::boolalpha << options.affine()
         << ", track_running_stats=" << options.track_running_stats() << ")";
}

torch::Tensor SyncBatchNormImpl::forward(const torch::Tensor& input) {
  if (input.dim() < 2 || input.dim() > 5) {
    throw UsageError("SyncBatchNorm: expected an input of shape (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W), got " +
                     shape_text(input));
  }
  if (input.size(1) != options.num_features()) {
    throw UsageError("SyncBatchNorm(" + std::to_string(options.num_features()) + "): input of shape " +
                     shape_text(input) + " has " + std::to_string(input.size(1)) +
                     " channels (dimension 1); expected " + std::to_string(options.num_features()));
  }
  // The running-average factor, as torch::nn::BatchNorm computes it.
  double factor = options.momentum().value_or(0.0);
  if (is_training() && options.track_running_stats() && num_batches_tracked.defined()) {
    num_batches_tracked += 1;
    factor = options.momentum().value_or(1.0 / num_batches_tracked.item<double>());
  }
  ProcessGroup* group = is_training() ? sync_group(options.group()) : nullptr;
  if (group == nullptr) {
    return torch::nn::functional::detail::batch_norm(input, running_mean, running_var, weight, bias,
                                                     is_training() || !options.track_running_stats(), factor,
                                                     options.eps());
  }
  const auto dtype = input.scalar_type();
  if (dtype == torch::kHalf || dtype == torch::kBFloat16) {
    // Statistics of 16-bit values in float32, as autocast runs batch_norm.
    return forward_synced(input.to(torch::kFloat), *group, factor).to(dtype);
  }
  return forward_synced(input, *group, factor);
}

torch::Tensor SyncBatchNormImpl::forward_synced(const torch::Tensor& input, ProcessGroup& group, double factor) {
  if (input.scalar_type() != torch::kFloat && input.scalar_type() != torch::kDouble) {
    throw UsageError(std::string("SyncBatchNorm: input dtype ") + c10::toString(input.scalar_type()) +
                     " is not supported; use float32, float64, float16 or bfloat16");
  }
  GlobalStats s;
  {
    torch::NoGradGuard no_grad;
    s = global_stats(input.detach(), group);
  }
  if (s.count <= 1) {
    throw UsageError("SyncBatchNorm: expected more than 1 value per channel when training, got " +
                     std::to_string(s.count) + " over all " + std::to_string(group.size()) + " ranks (this rank: " +
                     shape_text(input) + ")");
  }
  if (running_mean.defined()) {
    torch::NoGradGuard no_grad;
    const double unbiased = static_cast<double>(s.count) / static_cast<double>(s.count - 1);
    running_mean.mul_(1 - factor).add_(s.mean.to(running_mean.scalar_type()) * factor);
    running_var.mul_(1 - factor).add_(s.var.to(running_var.scalar_type()) * (unbiased * factor));
  }
  const auto dtype = input.scalar_type();
  auto invstd = (s.var + options.eps()).rsqrt().to(dtype);
  // A custom Function takes no undefined tensor: without affine, a constant weight 1 and bias 0.
  const auto& w = weight.defined() ? weight : torch::ones({options.num_features()}, dtype);
  const auto& b = bias.defined() ? bias : torch::zeros({options.num_features()}, dtype);
  return SyncBatchNormFunction::apply(input, w, b, s.mean.to(dtype), invstd, s.count, &group);
}

}  // namespace chorus::ddp
