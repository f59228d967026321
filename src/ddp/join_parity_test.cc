// Uneven inputs: DDP's join() against PyTorch 1.13's `with ddp.join(...)` (gloo). Each rank runs its
// own number of steps of a model with BatchNorm (buffers), SGD with momentum; join_parity_test.py
// runs PyTorch on the same model, data and schedule and compares every rank's final parameters and
// buffers. Then what needs no reference: throw_on_early_termination stops every rank with
// UnevenInputsError and leaves the group usable, join is not reentrant, and W=1 is plain training.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "chorus/ddp/ddp.h"
#include "chorus/torch/distributed.h"
#include "testing.h"

#ifndef CHORUS_JOIN_PARITY_SCRIPT
#define CHORUS_JOIN_PARITY_SCRIPT "src/ddp/join_parity_test.py"
#endif

namespace chorus::ddp {
namespace {

// join_parity_test.py's NAMES and BUFFERS, in the same order.
const std::vector<std::string> kNames = {"fc1.weight", "fc1.bias", "bn.weight", "bn.bias", "head.weight", "head.bias"};
const std::vector<std::string> kBuffers = {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"};
constexpr int kPerRank = 4;
constexpr int kClasses = 4;

struct JoinNetImpl : torch::nn::Module {
  JoinNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 8));
    bn = register_module("bn", torch::nn::BatchNorm1d(8));
    head = register_module("head", torch::nn::Linear(8, kClasses));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(torch::relu(bn(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, head{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(JoinNet);

torch::Tensor init_value(int k, at::IntArrayRef shape) {
  auto e = torch::arange(c10::multiply_integers(shape), torch::kInt64);
  return (((e * 7 + k * 5) % 13 - 6).to(torch::kFloat32) / 32.0).reshape(shape);
}

std::pair<torch::Tensor, torch::Tensor> batch(int step, int rank) {
  auto n = torch::arange(kPerRank, torch::kInt64) + rank * kPerRank;
  auto j = torch::arange(6, torch::kInt64);
  auto x = ((n.unsqueeze(1) * 5 + j.unsqueeze(0) * 3 + step * 7) % 11 - 5).to(torch::kFloat32) / 4.0;
  return {x, (n * 3 + step) % kClasses};
}

std::vector<int> parse_steps(const std::string& text) {
  std::vector<int> steps;
  std::istringstream in(text);
  for (std::string s; std::getline(in, s, ',');) steps.push_back(std::stoi(s));
  return steps;
}

struct Trained {
  JoinNet net;
  std::unique_ptr<DistributedDataParallel<JoinNetImpl>> ddp;
  std::unique_ptr<torch::optim::SGD> opt;
};

// A model initialised as join_parity_test.py does, wrapped, with its optimizer.
Trained make_model(const Options& options) {
  Trained t;
  auto params = t.net->named_parameters();
  {
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < kNames.size(); ++k) params[kNames[k]].copy_(init_value(static_cast<int>(k), params[kNames[k]].sizes()));
  }
  t.ddp = std::make_unique<DistributedDataParallel<JoinNetImpl>>(t.net.ptr(), options);
  t.opt = std::make_unique<torch::optim::SGD>(t.net->parameters(),
                                              torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
  return t;
}

void train_steps(Trained& t, int rank, int steps) {
  for (int step = 0; step < steps; ++step) {
    t.opt->zero_grad();
    auto [x, y] = batch(step, rank);
    torch::nn::functional::cross_entropy(t.ddp->forward(x), y).backward();
    t.opt->step();
  }
}

struct Case {
  std::string steps;  // per rank
  bool divide_by_initial = true;
  bool find_unused = false;
  std::string backend = "chorus";
};

void train_rank(int rank, const Case& c, const std::string& dir) {
  dist::InitOptions init;
  init.timeout = std::chrono::seconds(60);  // a stuck collective fails the test, naming itself
  dist::init_process_group(c.backend, "env://", -1, -1, init);
  Options o;
  o.find_unused_parameters = c.find_unused;
  o.first_bucket_mb = 0.0001;  // several buckets, so the finished ranks' zeros must follow their order
  o.bucket_cap_mb = 0.0002;
  Trained t = make_model(o);
  if (t.ddp->stats().buckets < 2) throw std::runtime_error("expected several buckets");
  JoinOptions jo;
  jo.divide_by_initial_world_size = c.divide_by_initial;
  const int steps = parse_steps(c.steps).at(rank);
  t.ddp->join([&] { train_steps(t, rank, steps); }, jo);
  std::map<std::string, torch::Tensor> all;
  for (const auto& item : t.net->named_parameters()) all[item.key()] = item.value();
  for (const auto& item : t.net->named_buffers()) all[item.key()] = item.value();
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [name, value] : all) {
    auto v = value.detach().to(torch::kFloat64).reshape({-1}).contiguous();
    out[name] = std::vector<double>(v.data_ptr<double>(), v.data_ptr<double>() + v.numel());
  }
  std::ofstream(dir + "/chorus-rank" + std::to_string(rank) + ".json") << out.dump();
  dist::destroy_process_group();
}

// The schedules: who finishes last (and so sends the final model), ties, both divisors, unused
// parameters, both transports. chorus runs every case, then one Python process (torch imported
// once) runs PyTorch on each and compares.
TEST(JoinParity, FinalParametersAndBuffersMatchPyTorchJoin) {
  const std::vector<Case> cases = {{"3,5", true},        {"3,5", false},
                                   {"5,2,3", true, true}, {"4,4,2", false},
                                   {"2,5,3", false, true, "tcp"}, {"3,3", true}};
  const std::string python = testing::parity_python();
  int status = 0;
  testing::run_capture(python + " -c 'import torch' >/dev/null 2>&1", &status);
  if (status != 0) GTEST_SKIP() << python << " cannot import torch (install python3-torch); no reference to compare";

  char tmpl[] = "/tmp/chorus-join-parity-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string root = tmpl;
  std::string command = python + " " + CHORUS_JOIN_PARITY_SCRIPT;
  std::string err;
  for (size_t k = 0; k < cases.size() && err.empty(); ++k) {
    const Case& c = cases[k];
    const std::string dir = root + "/" + std::to_string(k);
    std::filesystem::create_directory(dir);
    const int world = static_cast<int>(parse_steps(c.steps).size());
    err = testing::run_ranks(world, [&](int r, int, std::shared_ptr<Store>) { train_rank(r, c, dir); });
    if (!err.empty()) err = "steps " + c.steps + ": " + err;
    command += " --case " + dir + ":" + c.steps + ":" + (c.divide_by_initial ? "1" : "0") + ":" + (c.find_unused ? "1" : "0");
  }
  std::string output;
  if (err.empty()) output = testing::run_capture(command + " 2>&1", &status);
  std::filesystem::remove_all(root);
  ASSERT_EQ(err, "");
  EXPECT_EQ(status, 0) << output;
  EXPECT_EQ(output.find("MISMATCH"), std::string::npos) << output;
  size_t oks = 0;
  for (size_t at = output.find("OK: "); at != std::string::npos; at = output.find("OK: ", at + 1)) ++oks;
  EXPECT_EQ(oks, cases.size()) << output;
}

TEST(Join, ThrowOnEarlyTerminationStopsEveryRankAndLeavesTheGroupUsable) {
  const std::string err = testing::run_ranks(3, [](int rank, int world, std::shared_ptr<Store>) {
    dist::init_process_group();
    Trained t = make_model({});
    JoinOptions jo;
    jo.throw_on_early_termination = true;
    const int steps = rank == 0 ? 2 : 4;  // rank 0 runs out first
    int done = 0;
    std::string what;
    try {
      t.ddp->join(
          [&] {
            for (; done < steps; ++done) train_steps(t, rank, 1);
          },
          jo);
    } catch (const UnevenInputsError& e) {
      what = e.what();
    }
    if (what.empty()) throw std::runtime_error("rank " + std::to_string(rank) + ": no UnevenInputsError");
    // Rank 0 stops after its 2 steps; the others at the forward of their third.
    if (done != 2) throw std::runtime_error("rank " + std::to_string(rank) + " stopped after " + std::to_string(done) + " steps");
    if (what.find("rank " + std::to_string(rank)) == std::string::npos) throw std::runtime_error("message: " + what);
    auto one = torch::ones({1});
    dist::all_reduce(one);
    if (one.item<float>() != world) throw std::runtime_error("the group is unusable after the join");
    dist::destroy_process_group();
  });
  EXPECT_EQ(err, "");
}

TEST(Join, RanksThatFinishEarlyEndWithTheLastRanksModel) {
  // No reference needed: every rank must end with the parameters and buffers of rank 2, which
  // trains longest, and training must not hang while ranks 0 and 1 wait.
  const std::string err = testing::run_ranks(3, [](int rank, int, std::shared_ptr<Store>) {
    dist::init_process_group();
    Trained t = make_model({});
    t.ddp->join([&] { train_steps(t, rank, 1 + 2 * rank); });
    for (const auto& item : t.net->named_parameters()) {
      auto mine = item.value().detach().clone();
      auto last = mine.clone();
      dist::broadcast(last, 2);
      if (!torch::equal(mine, last)) throw std::runtime_error("rank " + std::to_string(rank) + ": " + item.key() + " differs");
    }
    dist::destroy_process_group();
  });
  EXPECT_EQ(err, "");
}

TEST(Join, IsNotReentrantAndWorksAlone) {
  const std::string err = testing::run_ranks(1, [](int rank, int, std::shared_ptr<Store>) {
    dist::init_process_group();
    Trained t = make_model({});
    std::string what;
    t.ddp->join([&] {
      train_steps(t, rank, 2);
      try {
        t.ddp->join([] {});
      } catch (const UsageError& e) {
        what = e.what();
      }
    });
    if (what.find("not reentrant") == std::string::npos) throw std::runtime_error("nested join: '" + what + "'");
    dist::destroy_process_group();
  });
  EXPECT_EQ(err, "");
}

}  // namespace
}  // namespace chorus::ddp
