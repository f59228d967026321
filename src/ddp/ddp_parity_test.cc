// Parity with PyTorch 1.13's DistributedDataParallel (gloo), at W=2 and W=3: chorus's ranks train
// a model with a frozen layer whose ranks start different, a branch some ranks skip, a head no
// rank uses and a tied weight, for SGD (momentum, weight decay) and Adam (weight decay), with
// and without gradient_as_bucket_view; then ddp_parity_test.py runs PyTorch's DDP on the same
// model, data and optimizer and compares every rank's parameters and .grad fields (None where
// PyTorch leaves None). The script defines the model, the values and the data; this side mirrors it.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>

#include "chorus/ddp/ddp.h"
#include "chorus/torch/distributed.h"
#include "cuda_probe.h"
#include "parity_util.h"
#include "testing.h"

#ifndef CHORUS_DDP_PARITY_SCRIPT
#define CHORUS_DDP_PARITY_SCRIPT "src/ddp/ddp_parity_test.py"
#endif

namespace chorus::ddp {
namespace {

// The order both sides initialise the distinct parameters in (ddp_parity_test.py's NAMES).
const std::vector<std::string> kNames = {"proj",          "fc1.weight",  "fc1.bias",    "frozen.weight",
                                         "frozen.bias",   "branch.weight", "branch.bias", "head.weight",
                                         "head.bias",     "spare.weight", "spare.bias"};
constexpr int kSteps = 4;
constexpr int kPerRank = 4;
constexpr int kClasses = 4;

struct ParityNetImpl : torch::nn::Module {
  ParityNetImpl() {
    proj = register_parameter("proj", torch::zeros({8, 8}));
    register_parameter("proj_tied", proj);  // the same tensor under a second name
    fc1 = register_module("fc1", torch::nn::Linear(6, 8));
    frozen = register_module("frozen", torch::nn::Linear(8, 8));
    branch = register_module("branch", torch::nn::Linear(8, 8));
    head = register_module("head", torch::nn::Linear(8, kClasses));
    spare = register_module("spare", torch::nn::Linear(8, kClasses));  // never used by any rank
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
  }
  torch::Tensor forward(const torch::Tensor& x, bool use_branch) {
    auto h = torch::relu(fc1(x));
    h = h + frozen(h);
    if (use_branch) h = h + branch(h);
    h = torch::tanh(h.matmul(proj.t())) + 0.5 * h.matmul(proj.t());
    return head(h);
  }
  torch::Tensor proj;
  torch::nn::Linear fc1{nullptr}, frozen{nullptr}, branch{nullptr}, head{nullptr}, spare{nullptr};
};
TORCH_MODULE(ParityNet);

torch::Tensor init_value(int k, at::IntArrayRef shape, int rank, bool frozen) {
  auto v = parity::init_value(k, shape);
  return frozen ? v + 0.25 * rank : v;  // the ranks start different: DDP's broadcast must fix it
}

std::pair<torch::Tensor, torch::Tensor> batch(int step, int rank, int world) {
  return parity::batch(step, rank, world, kPerRank, kClasses);
}

bool uses_branch(int step, int rank) { return (step + rank) % 3 == 0; }

using parity::flat;

void train_rank(int rank, int world, const std::string& optimizer, bool bucket_view, const std::string& dir,
                const torch::Device& device = torch::kCPU) {
  dist::init_process_group();
  ParityNet net;
  auto params = net->named_parameters();
  {
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < kNames.size(); ++k) {
      auto& p = params[kNames[k]];
      p.copy_(init_value(static_cast<int>(k), p.sizes(), rank, kNames[k].rfind("frozen", 0) == 0));
    }
  }
  net->to(device);
  params = net->named_parameters();
  Options o;
  o.find_unused_parameters = true;
  o.gradient_as_bucket_view = bucket_view;
  o.first_bucket_mb = 0.0002;  // several buckets
  o.bucket_cap_mb = 0.0005;
  DistributedDataParallel ddp(net, o);
  // Distinct trainable floats: proj 64, fc1 56, branch 72, head 36, spare 36. The tied name adds none.
  if (ddp.stats().gradient_bytes != 264 * 4) {
    throw std::runtime_error("gradient bytes " + std::to_string(ddp.stats().gradient_bytes) +
                             ", expected 1056: the tied weight must be reduced once");
  }
  // libtorch's parameters() lists the tied tensor twice (Python's dedups): the optimizer gets it once.
  std::vector<torch::Tensor> distinct;
  for (const auto& name : kNames) distinct.push_back(params[name]);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (optimizer == "sgd") {
    opt = std::make_unique<torch::optim::SGD>(distinct,
                                              torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
  } else {
    opt = std::make_unique<torch::optim::Adam>(distinct,
                                               torch::optim::AdamOptions(0.01).weight_decay(0.01));
  }
  for (int step = 0; step < kSteps; ++step) {
    opt->zero_grad();
    auto [x, y] = batch(step, rank, world);
    x = x.to(device);
    y = y.to(device);
    torch::nn::functional::cross_entropy(ddp.forward(x, uses_branch(step, rank)), y).backward();
    opt->step();
  }
  nlohmann::json out;
  for (const auto& name : kNames) {
    const auto& p = params[name];
    out[name] = {{"values", flat(p)}, {"grad", p.grad().defined() ? flat(p.grad()) : nlohmann::json(nullptr)}};
  }
  std::ofstream(dir + "/chorus-rank" + std::to_string(rank) + ".json") << out.dump();
  dist::destroy_process_group();
}

using ParityCase = std::tuple<int, std::string, bool>;  // world, optimizer, gradient_as_bucket_view

class TorchParity : public ::testing::TestWithParam<ParityCase> {};

TEST_P(TorchParity, ParametersAndGradsMatchPyTorchDdp) {
  const auto& [world, optimizer, bucket_view] = GetParam();
  const std::string python = testing::parity_python();
  int status = 0;
  testing::run_capture(python + " -c 'import torch' >/dev/null 2>&1", &status);
  if (status != 0) GTEST_SKIP() << python << " cannot import torch (install python3-torch); no reference to compare";

  char tmpl[] = "/tmp/chorus-ddp-parity-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const std::string err = testing::run_ranks(world, [&](int r, int w, std::shared_ptr<Store>) {
    train_rank(r, w, optimizer, bucket_view, dir);
  });
  std::string output;
  if (err.empty()) {
    output = testing::run_capture(python + " " + CHORUS_DDP_PARITY_SCRIPT + " --dir " + dir + " --world " +
                             std::to_string(world) + " --optimizer " + optimizer + " --bucket-view " +
                             (bucket_view ? "1" : "0") + " 2>&1",
                         &status);
  }
  std::filesystem::remove_all(dir);
  ASSERT_EQ(err, "");
  EXPECT_EQ(status, 0) << output;
  EXPECT_NE(output.find("OK: "), std::string::npos) << output;
}

// The same on one GPU shared by both ranks (buckets on the device, staged collectives), against
// PyTorch's DDP on the same GPU (gloo with CUDA tensors). Skipped where libtorch sees no CUDA device.
class CudaParity : public ::testing::TestWithParam<std::tuple<std::string, bool>> {};

TEST_P(CudaParity, ParametersAndGradsMatchPyTorchDdpOnTheGpu) {
  const auto& [optimizer, bucket_view] = GetParam();
  const int world = 2;
  const std::string why = testing::cuda_unavailable_reason();
  if (!why.empty()) GTEST_SKIP() << why;
  const std::string python = testing::parity_python();
  int status = 0;
  testing::run_capture(python + " -c 'import torch; assert torch.cuda.is_available()' >/dev/null 2>&1", &status);
  if (status != 0) GTEST_SKIP() << python << " cannot use torch.cuda; no reference to compare";

  char tmpl[] = "/tmp/chorus-ddp-cuda-parity-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const std::string err = testing::run_ranks(world, [&](int r, int w, std::shared_ptr<Store>) {
    train_rank(r, w, optimizer, bucket_view, dir, torch::Device(torch::kCUDA, 0));
  }, std::chrono::seconds(120));
  std::string output;
  if (err.empty()) {
    output = testing::run_capture(python + " " + CHORUS_DDP_PARITY_SCRIPT + " --dir " + dir + " --world 2 --optimizer " +
                                      optimizer + " --bucket-view " + (bucket_view ? "1" : "0") + " --device cuda 2>&1",
                                  &status);
  }
  std::filesystem::remove_all(dir);
  ASSERT_EQ(err, "");
  EXPECT_EQ(status, 0) << output;
  EXPECT_NE(output.find("OK: "), std::string::npos) << output;
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaParity,
                         ::testing::Combine(::testing::Values(std::string("sgd"), std::string("adam")), ::testing::Bool()),
                         [](const auto& info) {
                           return std::get<0>(info.param) + (std::get<1>(info.param) ? "_views" : "_copies");
                         });

INSTANTIATE_TEST_SUITE_P(
    Cases, TorchParity,
    ::testing::Combine(::testing::Values(2, 3), ::testing::Values(std::string("sgd"), std::string("adam")),
                       ::testing::Bool()),
    [](const auto& info) {
      return "W" + std::to_string(std::get<0>(info.param)) + "_" + std::get<1>(info.param) +
             (std::get<2>(info.param) ? "_views" : "_copies");
    });

}  // namespace
}  // namespace chorus::ddp
