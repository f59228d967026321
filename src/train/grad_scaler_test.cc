// GradScaler step for step (PyTorch's GradScaler behaviour, written out): scaling, unscaling by the
// float32 reciprocal, skipped steps on inf/NaN, backoff and growth, several optimizers, the errors,
// and the saved state. On CPU tensors: the scaler is device-generic (the CUDA path runs in
// accelerator_cuda_test against PyTorch's own GradScaler). Also the Accelerator's device choice.
#include "chorus/train/grad_scaler.h"

#include <gtest/gtest.h>
#include <torch/optim/sgd.h>
#include <torch/torch.h>

#include <limits>

#include "chorus/comm/error.h"
#include "chorus/train/accelerator.h"

namespace chorus::train {
namespace {

struct Fixture {
  torch::Tensor w = torch::ones({4}, torch::requires_grad());
  torch::optim::SGD sgd{{w}, torch::optim::SGDOptions(0.5)};

  // Sets w's gradient to `scaled` (what a backward of the scaled loss would leave).
  void grad(const std::vector<float>& scaled) { w.mutable_grad() = torch::tensor(scaled); }
};

TEST(GradScaler, ScalesUnscalesAndSteps) {
  Fixture f;
  GradScaler scaler;  // 2^16
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  EXPECT_EQ(scaler.scale(torch::tensor(1.5f)).item<float>(), 98304.0f);
  f.grad({65536.0f, -131072.0f, 32768.0f, 0.0f});
  EXPECT_TRUE(scaler.step(f.sgd));
  scaler.update();
  // Unscaled to (1, -2, 0.5, 0); w -= 0.5 * grad.
  EXPECT_TRUE(torch::equal(f.w.grad(), torch::tensor({1.0f, -2.0f, 0.5f, 0.0f})));
  EXPECT_TRUE(torch::equal(f.w.detach(), torch::tensor({0.5f, 2.0f, 0.75f, 1.0f})));
  EXPECT_EQ(scaler.growth_tracker(), 1);
  EXPECT_EQ(scaler.skipped_steps(), 0);
}

TEST(GradScaler, SkipsNonFiniteStepsAndBacksOff) {
  for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    Fixture f;
    GradScaler scaler;
    f.grad({1.0f, bad, 1.0f, 1.0f});
    EXPECT_FALSE(scaler.step(f.sgd));
    EXPECT_TRUE(scaler.last_step_skipped());
    scaler.update();
    EXPECT_TRUE(torch::equal(f.w.detach(), torch::ones({4}))) << "a skipped step changed the weights";
    EXPECT_EQ(scaler.get_scale(), 32768.0);
    EXPECT_EQ(scaler.skipped_steps(), 1);
    EXPECT_EQ(scaler.growth_tracker(), 0);
  }
}

TEST(GradScaler, GrowsAfterIntervalOfGoodSteps) {
  Fixture f;
  GradScalerOptions o;
  o.init_scale = 8.0;
  o.growth_interval = 3;
  GradScaler scaler(o);
  // good, good, inf (backoff, tracker reset), good x3 (growth on the third), good.
  const std::vector<bool> finite = {true, true, false, true, true, true, true};
  const std::vector<double> scale_after = {8, 8, 4, 4, 4, 8, 8};
  const std::vector<int64_t> tracker_after = {1, 2, 0, 1, 2, 0, 1};
  for (size_t i = 0; i < finite.size(); ++i) {
    f.grad({1.0f, finite[i] ? 1.0f : std::numeric_limits<float>::infinity(), 1.0f, 1.0f});
    EXPECT_EQ(scaler.step(f.sgd), finite[i]) << "step " << i;
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), scale_after[i]) << "step " << i;
    EXPECT_EQ(scaler.growth_tracker(), tracker_after[i]) << "step " << i;
  }
  EXPECT_EQ(scaler.skipped_steps(), 1);
}

TEST(GradScaler, EveryOptimizerUnscaledOnceAndAnyInfBacksOff) {
  Fixture a, b;
  GradScaler scaler;
  a.grad({65536.0f, 65536.0f, 65536.0f, 65536.0f});
  b.grad({1.0f, std::numeric_limits<float>::infinity(), 1.0f, 1.0f});
  scaler.unscale_(a.sgd);  // as clip_grad_norm_ does before step
  EXPECT_THROW(scaler.unscale_(a.sgd), UsageError);
  EXPECT_TRUE(scaler.step(a.sgd));
  EXPECT_TRUE(torch::equal(a.w.grad(), torch::ones({4}))) << "unscaled twice";
  EXPECT_FALSE(scaler.step(b.sgd));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 32768.0) << "one optimizer's inf backs off the shared scale";
}

TEST(GradScaler, RefusesHalfGradientsAndBadOptions) {
  torch::Tensor w = torch::ones({2}, torch::TensorOptions().dtype(torch::kHalf).requires_grad(true));
  torch::optim::SGD sgd({w}, torch::optim::SGDOptions(0.1));
  w.mutable_grad() = torch::ones({2}, torch::kHalf);
  GradScaler scaler;
  try {
    scaler.unscale_(sgd);
    FAIL() << "no UsageError for float16 gradients";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("float16"), std::string::npos) << e.what();
  }
  GradScalerOptions bad;
  bad.backoff_factor = 1.5;
  EXPECT_THROW(GradScaler{bad}, UsageError);
  bad = GradScalerOptions();
  bad.init_scale = 0;
  EXPECT_THROW(GradScaler{bad}, UsageError);
}

TEST(GradScaler, DisabledPassesThrough) {
  Fixture f;
  GradScalerOptions o;
  o.enabled = false;
  GradScaler scaler(o);
  EXPECT_EQ(scaler.scale(torch::tensor(3.0f)).item<float>(), 3.0f);
  f.grad({2.0f, 2.0f, 2.0f, 2.0f});
  EXPECT_TRUE(scaler.step(f.sgd));
  scaler.update();
  EXPECT_TRUE(torch::equal(f.w.detach(), torch::zeros({4})));
}

TEST(GradScaler, StateRoundTrips) {
  Fixture f;
  GradScalerOptions o;
  o.growth_interval = 2;
  GradScaler a(o);
  f.grad({1.0f, std::numeric_limits<float>::infinity(), 1.0f, 1.0f});
  a.step(f.sgd);
  a.update();
  f.grad({1.0f, 1.0f, 1.0f, 1.0f});
  a.step(f.sgd);
  a.update();
  GradScaler b(o);
  b.load_state(a.state());
  EXPECT_EQ(b.get_scale(), a.get_scale());
  EXPECT_EQ(b.growth_tracker(), 1);
  EXPECT_EQ(b.skipped_steps(), 1);
  EXPECT_THROW(b.load_state("{\"scale\": 2}"), UsageError);
}

TEST(AcceleratorDevice, ResolvesTheDeviceSpec) {
  using detail::resolve_device;
  EXPECT_TRUE(resolve_device("cpu", 3, 0).is_cpu());
  EXPECT_EQ(resolve_device("cuda", 0, 1), c10::Device(c10::DeviceType::CUDA, 0));
  EXPECT_EQ(resolve_device("cuda", 3, 2), c10::Device(c10::DeviceType::CUDA, 1));  // local rank mod GPUs
  EXPECT_EQ(resolve_device("cuda", 2, 1), c10::Device(c10::DeviceType::CUDA, 0));  // ranks share one GPU
  EXPECT_EQ(resolve_device("cuda:1", 0, 2), c10::Device(c10::DeviceType::CUDA, 1));
  auto message = [](const std::string& spec, int gpus) {
    try {
      resolve_device(spec, 0, gpus);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("(no UsageError)");
  };
  EXPECT_NE(message("cuda", 0).find("no CUDA device"), std::string::npos);
  EXPECT_NE(message("cuda:2", 2).find("only 2 CUDA device"), std::string::npos);
  EXPECT_NE(message("cuda:x", 2).find("not cuda:N"), std::string::npos);
  EXPECT_NE(message("tpu", 2).find("not one of cpu, cuda"), std::string::npos);
}

}  // namespace
}  // namespace chorus::train
