// PowerSGD against PyTorch 1.13's powerSGD_hook (gloo), at W=2 and W=3: chorus's ranks train an
// MLP under DDP with PowerSGDHook (plain allreduce for the first steps, then PowerSGD with error
// feedback; Gram-Schmidt and QR ranks; with and without warm start and batching of same-shaped
// matrices); then powersgd_parity_test.py, in one run for every case, trains the same with
// PyTorch's hook and compares every rank's parameters, the last step's .grad (the decompressed
// average) and the compression counts. The initial Qs are PyTorch's own: numpy's
// RandomState(seed).randint and torch.manual_seed + randn, reproduced in C++ (numpy_randint).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "chorus/ddp/ddp.h"
#include "chorus/torch/distributed.h"
#include "parity_util.h"
#include "testing.h"

#ifndef CHORUS_POWERSGD_PARITY_SCRIPT
#define CHORUS_POWERSGD_PARITY_SCRIPT "src/ddp/powersgd_parity_test.py"
#endif

namespace chorus::ddp {
namespace {

// powersgd_parity_test.py's NAMES, STEPS, START.
const std::vector<std::string> kNames = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias",
                                         "fc3.weight", "fc3.bias", "head.weight", "head.bias"};
constexpr int kSteps = 6;
constexpr int kStart = 3;
constexpr int kPerRank = 4;
constexpr int kClasses = 4;

struct ParityNetImpl : torch::nn::Module {
  ParityNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 24));
    fc2 = register_module("fc2", torch::nn::Linear(24, 24));
    fc3 = register_module("fc3", torch::nn::Linear(24, 24));
    head = register_module("head", torch::nn::Linear(24, kClasses));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(fc1(x));
    h = torch::tanh(fc2(h));
    h = torch::relu(fc3(h));
    return head(h);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr}, head{nullptr};
};
TORCH_MODULE(ParityNet);

struct Case {
  int world;
  PowerSGDOptions options;
  std::string name() const {
    return "W" + std::to_string(world) + "_r" + std::to_string(options.matrix_approximation_rank) + "_b" +
           (options.batch_tensors_with_same_shape ? "1" : "0") + "_ws" + (options.warm_start ? "1" : "0") + "_s" +
           std::to_string(options.random_seed);
  }
};

void train_rank(int rank, int world, const PowerSGDOptions& options, const std::string& dir) {
  torch::set_num_threads(1);
  dist::init_process_group();
  ParityNet net;
  auto params = net->named_parameters();
  {
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < kNames.size(); ++k) {
      params[kNames[k]].copy_(parity::init_value(static_cast<int>(k), params[kNames[k]].sizes()));
    }
  }
  DistributedDataParallel ddp(net);
  auto hook = std::make_shared<PowerSGDHook>(options);
  ddp.register_comm_hook(hook);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    auto [x, y] = parity::batch(step, rank, world, kPerRank, kClasses);
    torch::nn::functional::cross_entropy(ddp.forward(x), y).backward();
    opt.step();
  }
  nlohmann::json out;
  for (const auto& name : kNames) {
    out[name] = {{"values", parity::flat(params[name])}, {"grad", parity::flat(params[name].grad())}};
  }
  const auto stats = hook->compression_stats();
  out["compressed"] = {stats.numel_before, stats.numel_after};
  std::ofstream(dir + "/chorus-rank" + std::to_string(rank) + ".json") << out.dump();
  dist::destroy_process_group();
}

TEST(PowerSGDParity, MatchesPyTorchsPowerSGDHook) {
  const std::string python = testing::parity_python();
  int status = 0;
  testing::run_capture(python + " -c 'import torch' >/dev/null 2>&1", &status);
  if (status != 0) GTEST_SKIP() << python << " cannot import torch (install python3-torch); no reference to compare";

  std::vector<Case> cases;
  auto add = [&](int world, int64_t approx_rank, bool batch_same, bool warm_start, uint32_t seed) {
    Case c{world, {}};
    c.options.matrix_approximation_rank = approx_rank;
    c.options.start_powerSGD_iter = kStart;
    c.options.batch_tensors_with_same_shape = batch_same;
    c.options.warm_start = warm_start;
    c.options.random_seed = seed;
    cases.push_back(c);
  };
  add(2, 1, false, true, 0);   // Gram-Schmidt, every weight compressed
  add(3, 2, true, true, 7);    // fc2 and fc3 batched; head too small to compress at rank 2
  add(2, 3, false, true, 42);  // QR; fc1 too small to compress at rank 3
  add(3, 1, false, false, 1);  // a fresh random Q every step

  char tmpl[] = "/tmp/chorus-powersgd-parity-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  std::string err;
  for (const auto& c : cases) {
    std::filesystem::create_directory(dir + "/" + c.name());
    err = testing::run_ranks(c.world, [&](int r, int w, std::shared_ptr<Store>) {
      train_rank(r, w, c.options, dir + "/" + c.name());
    });
    if (!err.empty()) break;
  }
  std::string output;
  if (err.empty()) {
    std::string command = python + " " + CHORUS_POWERSGD_PARITY_SCRIPT + " --dir " + dir;
    for (const auto& c : cases) command += " " + c.name();
    output = testing::run_capture(command + " 2>&1", &status);
  }
  std::filesystem::remove_all(dir);
  ASSERT_EQ(err, "");
  EXPECT_EQ(status, 0) << output;
  for (const auto& c : cases) EXPECT_NE(output.find("OK: " + c.name() + ","), std::string::npos) << output;
  std::printf("%s", output.c_str());
}

}  // namespace
}  // namespace chorus::ddp
