// The Accelerator on a GPU (docs/gpu.md): W=2 ranks sharing the one GPU train a small network with
// device "cuda", in float32 and in float16 autocast with loss scaling (and bfloat16 autocast);
// accelerator_cuda_parity.py runs PyTorch's DDP (gloo on CUDA tensors) with torch.autocast and
// torch.amp.GradScaler on the same model, data and scaler settings, and checks: the same steps
// skipped and the same scale after every step as PyTorch's GradScaler, losses equal to PyTorch's,
// and the float16 loss curve within a few percent of float32's. Skipped (one line saying why)
// where libtorch sees no CUDA device.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "chorus/torch/distributed.h"
#include "chorus/train/accelerator.h"
#include "cuda_probe.h"
#include "parity_util.h"
#include "testing.h"

#ifndef CHORUS_ACCELERATOR_CUDA_SCRIPT
#define CHORUS_ACCELERATOR_CUDA_SCRIPT "src/train/accelerator_cuda_parity.py"
#endif

namespace chorus::train {
namespace {

constexpr int kSteps = 40;
constexpr int kPerRank = 8;
constexpr int kClasses = 4;
// A high first scale and a short growth interval: the first steps overflow float16 and are
// skipped, and the scale keeps growing into overflows again, so skips recur.
constexpr double kInitScale = 1 << 20;
constexpr int kGrowthInterval = 3;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, kClasses));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

void train_rank(int rank, int world, const std::string& precision, const std::string& dir) {
  dist::init_process_group();
  AcceleratorOptions o;
  o.device = "cuda";
  o.mixed_precision = parse_mixed_precision(precision);
  o.scaler.init_scale = kInitScale;
  o.scaler.growth_interval = kGrowthInterval;
  o.project_dir = dir;
  o.run_name = "run-" + precision;
  o.records = false;
  o.progress = false;
  o.fsync = false;
  o.tune_malloc = false;
  Accelerator accelerator(o);
  if (accelerator.device() != torch::Device(torch::kCUDA, 0)) throw std::runtime_error("not on cuda:0");
  Net net;
  {
    torch::NoGradGuard no_grad;
    int k = 0;
    auto params = net->named_parameters();
    for (const char* name : {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}) {
      auto& p = params[name];
      p.copy_(ddp::parity::init_value(k++, p.sizes()));
    }
  }
  auto model = accelerator.prepare_model(net);
  if (!net->fc1->weight.is_cuda()) throw std::runtime_error("prepare_model left the model on the CPU");
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05));
  auto optimizer = accelerator.prepare_optimizer(sgd);
  nlohmann::json losses = nlohmann::json::array(), scales = nlohmann::json::array(),
                 skipped = nlohmann::json::array(), diag = nlohmann::json::array();
  // For the report when the skipped steps differ: each parameter's largest |gradient| as backward
  // hands it over (this rank's own, scaled) and as the optimizer sees it (averaged, still scaled).
  std::vector<double> local(4, 0.0);
  {
    int k = 0;
    for (auto& p : net->parameters()) {
      p.register_hook([&local, k](const torch::Tensor& g) { local[k] = g.abs().max().item<double>(); });
      ++k;
    }
  }
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = ddp::parity::batch(step, rank, world, kPerRank, kClasses);
    optimizer.zero_grad();
    torch::Tensor out = model(x.to(accelerator.device()));
    if (out.scalar_type() != torch::kFloat) throw std::runtime_error("the prepared forward did not return float32");
    torch::Tensor loss = torch::nn::functional::cross_entropy(out, y.to(accelerator.device()));
    accelerator.backward(loss);
    nlohmann::json reduced = nlohmann::json::array();
    for (auto& p : net->parameters()) reduced.push_back(p.grad().abs().max().item<double>());
    diag.push_back({{"local", local}, {"reduced", reduced}});
    optimizer.step();
    losses.push_back(loss.item<double>());
    if (GradScaler* s = accelerator.scaler()) {
      scales.push_back(s->get_scale());
      skipped.push_back(s->last_step_skipped());
    }
  }
  if (precision == "fp16") {
    std::ofstream(dir + "/chorus-fp16-rank" + std::to_string(rank) + ".json")
        << nlohmann::json{{"skipped", skipped}, {"scales", scales}, {"diag", diag}}.dump();
  }
  if (rank == 0) {
    nlohmann::json out = {{"losses", losses}, {"scales", scales}, {"skipped", skipped},
                          {"fc2.weight", ddp::parity::flat(net->fc2->weight.cpu())}};
    std::ofstream(dir + "/chorus-" + precision + ".json") << out.dump();
  }
  accelerator.end_training();
  dist::destroy_process_group();
}

using testing::cuda_unavailable_reason;

TEST(AcceleratorCuda, Fp16LossScalingAsPyTorchAndCloseToFp32) {
  const std::string why = cuda_unavailable_reason();
  if (!why.empty()) GTEST_SKIP() << why;
  const std::string python = testing::parity_python();
  int status = 0;
  testing::run_capture(python + " -c 'import torch; assert torch.cuda.is_available()' >/dev/null 2>&1", &status);
  if (status != 0) GTEST_SKIP() << python << " cannot use torch.cuda; no reference to compare";

  char tmpl[] = "/tmp/chorus-accelerator-cuda-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  std::string err;
  for (const std::string precision : {"no", "fp16", "bf16"}) {
    err = testing::run_ranks(2, [&](int r, int w, std::shared_ptr<Store>) { train_rank(r, w, precision, dir); },
                             std::chrono::seconds(180));
    if (!err.empty()) {
      err = precision + ": " + err;
      break;
    }
  }
  std::string output;
  if (err.empty()) {
    output = testing::run_capture(python + " " + CHORUS_ACCELERATOR_CUDA_SCRIPT + " --dir " + dir + " --world 2 --steps " +
                                      std::to_string(kSteps) + " --init-scale " + std::to_string(kInitScale) +
                                      " --growth-interval " + std::to_string(kGrowthInterval) + " 2>&1",
                                  &status);
  }
  std::filesystem::remove_all(dir);
  ASSERT_EQ(err, "");
  EXPECT_EQ(status, 0) << output;
  EXPECT_NE(output.find("OK: "), std::string::npos) << output;
  std::cout << output;
}

}  // namespace
}  // namespace chorus::train
