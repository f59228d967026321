// Parity with PyTorch 1.13's ZeroRedundancyOptimizer under DistributedDataParallel (gloo), at W=2
// and W=3, for SGD with momentum and for Adam: chorus's ranks train with chorus's DDP and
// ZeroRedundancyOptimizer and write JSON; then one run of zero_parity_test.py (torch imported once
// for every case) runs PyTorch on the same model, data and optimizer and compares the owner of
// each parameter, every rank's parameters and the state consolidated on rank 0. The script defines
// the model, the values and the data; this side mirrors it.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>

#include "chorus/ddp/ddp.h"
#include "chorus/ddp/zero.h"
#include "chorus/torch/compat.h"
#include "chorus/torch/distributed.h"
#include "parity_util.h"
#include "testing.h"

#ifndef CHORUS_ZERO_PARITY_SCRIPT
#define CHORUS_ZERO_PARITY_SCRIPT "src/ddp/zero_parity_test.py"
#endif

namespace chorus::ddp {
namespace {

// The order both sides pass the parameters to the optimizer (zero_parity_test.py's NAMES).
const std::vector<std::string> kNames = {"fc1.weight",    "fc1.bias",    "fc2.weight", "fc2.bias",
                                         "frozen.weight", "frozen.bias", "head.weight", "head.bias",
                                         "spare.weight",  "spare.bias"};
constexpr int kSteps = 4;
constexpr int kPerRank = 4;
constexpr int kClasses = 4;

struct ParityNetImpl : torch::nn::Module {
  ParityNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 16));
    frozen = register_module("frozen", torch::nn::Linear(16, 16));
    head = register_module("head", torch::nn::Linear(16, kClasses));
    spare = register_module("spare", torch::nn::Linear(16, kClasses));  // never used by any rank
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(fc1(x));
    h = h + frozen(h);
    return head(torch::tanh(fc2(h)));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, frozen{nullptr}, head{nullptr}, spare{nullptr};
};
TORCH_MODULE(ParityNet);

using parity::flat;

// The consolidated state of one parameter under PyTorch's keys; null when it has none.
nlohmann::json state_json(const torch::optim::Optimizer& o, const torch::Tensor& p) {
  auto it = o.state().find(compat::optimizer_state_key(o, p));
  if (it == o.state().end()) return nullptr;
  if (auto* s = dynamic_cast<const torch::optim::SGDParamState*>(it->second.get())) {
    return {{"momentum_buffer", flat(s->momentum_buffer())}};
  }
  auto& a = dynamic_cast<const torch::optim::AdamParamState&>(*it->second);
  return {{"exp_avg", flat(a.exp_avg())}, {"exp_avg_sq", flat(a.exp_avg_sq())}, {"step", {a.step()}}};
}

void train_rank(int rank, int world, const std::string& optimizer, const std::string& dir) {
  torch::set_num_threads(1);
  dist::init_process_group();
  ParityNet net;
  auto named = net->named_parameters();
  std::vector<torch::Tensor> ordered;
  {
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < kNames.size(); ++k) {
      auto& p = named[kNames[k]];
      p.copy_(parity::init_value(static_cast<int>(k), p.sizes()));
      ordered.push_back(p);
    }
  }
  Options o;
  o.find_unused_parameters = true;
  DistributedDataParallel ddp(net, o);
  auto factory = optimizer == "sgd"
                     ? optimizer_factory<torch::optim::SGD>(torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01))
                     : optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(0.01).weight_decay(0.01));
  ZeroRedundancyOptimizer zero(ordered, factory);
  for (int step = 0; step < kSteps; ++step) {
    zero.zero_grad();
    auto [x, y] = parity::batch(step, rank, world, kPerRank, kClasses);
    torch::nn::functional::cross_entropy(ddp.forward(x), y).backward();
    zero.step();
  }
  zero.consolidate_state_dict(0);
  nlohmann::json out;
  out["owners"] = zero.owners();
  for (size_t k = 0; k < kNames.size(); ++k) out["params"][kNames[k]] = flat(ordered[k]);
  if (rank == 0) {
    out["state"] = nlohmann::json::object();
    for (size_t k = 0; k < kNames.size(); ++k) {
      auto s = state_json(zero.state_dict(), ordered[k]);
      if (!s.is_null()) out["state"][std::to_string(k)] = s;
    }
  }
  std::ofstream(dir + "/chorus-rank" + std::to_string(rank) + ".json") << out.dump();
  dist::destroy_process_group();
}

TEST(ZeroParity, MatchesPyTorchsZeroRedundancyOptimizer) {
  const std::string python = testing::parity_python();
  int status = 0;
  testing::run_capture(python + " -c 'import torch' >/dev/null 2>&1", &status);
  if (status != 0) GTEST_SKIP() << python << " cannot import torch (install python3-torch); no reference to compare";

  char tmpl[] = "/tmp/chorus-zero-parity-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  std::vector<std::string> cases;
  std::string err;
  for (int world : {2, 3}) {
    for (std::string optimizer : {"sgd", "adam"}) {
      const std::string name = "W" + std::to_string(world) + "_" + optimizer;
      std::filesystem::create_directory(dir + "/" + name);
      err = testing::run_ranks(world, [&](int r, int w, std::shared_ptr<Store>) {
        train_rank(r, w, optimizer, dir + "/" + name);
      });
      if (!err.empty()) break;
      cases.push_back(name);
    }
    if (!err.empty()) break;
  }
  std::string output;
  if (err.empty()) {
    std::string command = python + " " + CHORUS_ZERO_PARITY_SCRIPT + " --dir " + dir;
    for (const auto& c : cases) command += " " + c;
    output = testing::run_capture(command + " 2>&1", &status);
  }
  std::filesystem::remove_all(dir);
  ASSERT_EQ(err, "");
  EXPECT_EQ(status, 0) << output;
  for (const auto& c : cases) EXPECT_NE(output.find("OK: " + c + ","), std::string::npos) << output;
  std::printf("%s", output.c_str());
}

}  // namespace
}  // namespace chorus::ddp
