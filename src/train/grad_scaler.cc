#include "chorus/train/grad_scaler.h"

#include <ATen/ATen.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "chorus/comm/error.h"

namespace chorus::train {

GradScaler::GradScaler(GradScalerOptions options) : options_(options), scale_(options.init_scale) {
  if (!(options_.init_scale > 0) || !std::isfinite(options_.init_scale)) {
    throw UsageError("GradScaler: init_scale must be positive and finite, got " + std::to_string(options_.init_scale));
  }
  if (!(options_.growth_factor > 1.0)) throw UsageError("GradScaler: growth_factor must be above 1");
  if (!(options_.backoff_factor > 0.0 && options_.backoff_factor < 1.0)) {
    throw UsageError("GradScaler: backoff_factor must be in (0, 1)");
  }
  if (options_.growth_interval < 1) throw UsageError("GradScaler: growth_interval must be at least 1");
}

at::Tensor GradScaler::scale(const at::Tensor& loss) const {
  if (!options_.enabled) return loss;
  // As PyTorch: the scale is a float32 tensor multiplied into the loss.
  return loss * at::full({}, scale_, loss.options().dtype(at::kFloat));
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled) return;
  if (found_inf_.count(&optimizer) != 0) {
    throw UsageError("GradScaler: unscale_ was already called for this optimizer since the last update() (call "
                     "it once per step, before step())");
  }
  // The float32 reciprocal of the scale, as PyTorch computes it (double, then float).
  const float inv = static_cast<float>(1.0 / scale_);
  at::Tensor nonfinite;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const at::Tensor& g = p.grad();
      if (!g.defined()) continue;
      if (g.scalar_type() == at::kHalf) {
        throw UsageError("GradScaler: cannot unscale float16 gradients; keep the parameters in float32 and run "
                         "the forward under float16 autocast (MixedPrecision::kFP16)");
      }
      at::Tensor grad = g;
      grad.mul_(inv);
      at::Tensor bad = grad.isfinite().logical_not().any();
      nonfinite = nonfinite.defined() ? nonfinite.logical_or(bad) : bad;
    }
  }
  found_inf_[&optimizer] = nonfinite.defined() && nonfinite.item<bool>();  // one device sync per step
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled) {
    optimizer.step();
    last_skipped_ = false;
    return true;
  }
  if (found_inf_.count(&optimizer) == 0) unscale_(optimizer);
  last_skipped_ = found_inf_[&optimizer];
  if (last_skipped_) {
    ++skipped_;
    return false;
  }
  optimizer.step();
  return true;
}

void GradScaler::update() {
  if (!options_.enabled) return;
  if (found_inf_.empty()) return;  // nothing looked at the gradients since the last update
  bool found = false;
  for (const auto& [optimizer, inf] : found_inf_) found = found || inf;
  if (found) {
    scale_ *= options_.backoff_factor;
    growth_tracker_ = 0;
  } else if (++growth_tracker_ == options_.growth_interval) {
    const double grown = scale_ * options_.growth_factor;
    if (std::isfinite(static_cast<float>(grown))) scale_ = grown;  // the scale stays a finite float32
    growth_tracker_ = 0;
  }
  found_inf_.clear();
}

std::string GradScaler::state() const {
  return nlohmann::json{{"scale", scale_}, {"growth_tracker", growth_tracker_}, {"skipped_steps", skipped_}}.dump();
}

void GradScaler::load_state(const std::string& state) {
  try {
    const auto j = nlohmann::json::parse(state);
    scale_ = j.at("scale").get<double>();
    growth_tracker_ = j.at("growth_tracker").get<int64_t>();
    skipped_ = j.at("skipped_steps").get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    throw UsageError(std::string("GradScaler: the saved state is not a scaler's: ") + e.what());
  }
  found_inf_.clear();
}

}  // namespace chorus::train
