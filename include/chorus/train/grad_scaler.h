// GradScaler: dynamic loss scaling for float16 training, as PyTorch's torch.amp.GradScaler.
//
//   chorus::train::GradScaler scaler;
//   scaler.scale(loss).backward();     // gradients scaled by scale()
//   scaler.step(optimizer);            // unscales; skips the step when a gradient is inf or NaN
//   scaler.update();                   // backs off after a skipped step, grows after a run of good ones
//
// Contract (PyTorch 1.13-2.x's GradScaler, step for step):
// - scale(loss) multiplies by the current scale (init_scale, 2^16 by default).
// - unscale_(optimizer) multiplies every gradient of the optimizer's parameters by the float32
//   reciprocal of the scale, once per optimizer and step (a second call before update() is a
//   UsageError), and records whether any element is inf or NaN. step(optimizer) unscales it if that
//   has not happened yet, then runs optimizer.step() only when every one of its gradients is
//   finite; it returns whether it stepped.
// - update() after the step(s): if any optimizer found inf/NaN, scale *= backoff_factor and the run
//   of good steps restarts; otherwise after growth_interval good steps in a row, scale *=
//   growth_factor.
// - Under DDP the gradients are already averaged over the ranks when step() looks at them, so every
//   rank skips the same steps without another collective.
// - Gradients must be float32 (or float64): float16 gradients cannot be unscaled safely (PyTorch
//   refuses them too); train float32 parameters under float16 autocast.
// - Disabled (Options::enabled = false) it is a pass-through: scale(loss) is loss, step() steps.
// Not thread-safe; one per training loop.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <string>

namespace chorus::train {

struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  bool enabled = true;
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  at::Tensor scale(const at::Tensor& loss) const;
  void unscale_(torch::optim::Optimizer& optimizer);
  bool step(torch::optim::Optimizer& optimizer);
  void update();

  double get_scale() const { return scale_; }
  int64_t growth_tracker() const { return growth_tracker_; }
  // Steps skipped so far because a gradient was inf or NaN.
  int64_t skipped_steps() const { return skipped_; }
  // Whether the last step() skipped the optimizer (an LR scheduler should not step either).
  bool last_step_skipped() const { return last_skipped_; }
  bool enabled() const { return options_.enabled; }
  const GradScalerOptions& options() const { return options_; }

  // The state a checkpoint keeps (scale, growth tracker, skipped steps), as JSON text.
  std::string state() const;
  void load_state(const std::string& state);

 private:
  GradScalerOptions options_;
  double scale_;
  int64_t growth_tracker_ = 0;
  int64_t skipped_ = 0;
  std::map<const torch::optim::Optimizer*, bool> found_inf_;  // unscaled since update(): inf/NaN found
  bool last_skipped_ = false;
};

}  // namespace chorus::train
