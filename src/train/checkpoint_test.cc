// Checkpoints: round trip (single process and W=2), Python's torch.load of model.pt, a model
// mismatch and a damaged file reported, and errors that reach every rank. A writer killed mid-save
// and resume: checkpoint_recovery_test.cc.
//
// All libtorch work runs in forked children (run_ranks): the gtest process itself never starts
// libtorch's thread pools, so forking stays safe.
#include "chorus/train/checkpoint.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint_test_util.h"
#include "chorus/torch/distributed.h"
#include "chorus/torch/optimizer_bytes.h"
#include "testing.h"

namespace chorus::train {
namespace {

// One training step on a fixed batch.
double train_step(Net& net, torch::optim::SGD& opt, const at::Tensor& x, const at::Tensor& y) {
  opt.zero_grad();
  at::Tensor loss = torch::cross_entropy_loss(net->forward(x), y);
  loss.backward();
  opt.step();
  return loss.item<double>();
}

TEST_F(CheckpointTest, NoCheckpointGivesNullopt) {
  const std::string dir = path("none");
  EXPECT_EQ(in_child([&] {
    Net net;
    auto opt = make_sgd(net);
    require(!load_checkpoint(dir, *net, &opt).has_value(), "missing directory gave a checkpoint");
    fs::create_directories(dir);
    require(!load_checkpoint(dir, *net, &opt).has_value(), "empty directory gave a checkpoint");
    require(!latest_checkpoint(dir).has_value(), "latest_checkpoint of an empty directory");
  }), "");
}

TEST_F(CheckpointTest, RoundTripSingleProcess) {
  const std::string dir = path("rt");
  EXPECT_EQ(in_child([&] {
    torch::manual_seed(1);
    Net net;
    auto opt = make_sgd(net);
    at::Tensor x = torch::randn({16, 4});
    at::Tensor y = torch::randint(0, 3, {16});
    for (int i = 0; i < 3; ++i) train_step(net, opt, x, y);  // momentum and running stats move
    CheckpointState st;
    st.epoch = 3;
    st.step = 17;
    st.extra = {{"note", "hello \"world\"\n"}, {"lr", "0.05"}};
    save_checkpoint(dir, *net, &opt, st);
    at::Tensor saved = flat(*net);
    at::Tensor next_random = torch::rand({5});  // what the RNG gives right after the save

    torch::manual_seed(99);
    Net other;
    auto other_opt = make_sgd(other);
    require(!at::equal(flat(*other), saved), "models already equal");
    auto got = load_checkpoint(dir, *other, &other_opt);
    require(got.has_value(), "no checkpoint loaded");
    require(got->epoch == 3 && got->step == 17 && got->extra == st.extra, "state differs");
    require(at::equal(flat(*other), saved), "parameters or buffers differ");
    require(at::equal(torch::rand({5}), next_random), "RNG state not restored");
    auto params = net->parameters();
    auto other_params = other->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      require(at::equal(momentum_of(opt, params[i]), momentum_of(other_opt, other_params[i])), "momentum differs");
    }
    // Same next step from both (eval mode: no dropout draw, BatchNorm uses running stats).
    net->eval();
    other->eval();
    train_step(net, opt, x, y);
    train_step(other, other_opt, x, y);
    require(at::equal(flat(*net), flat(*other)), "the step after loading differs");

    // Layout: `latest` names the current version; keep_last versions are kept.
    CheckpointOptions keep2;
    keep2.keep_last = 2;
    for (int i = 0; i < 3; ++i) save_checkpoint(dir, *net, &opt, st, keep2);
    int versions = 0;
    for (const auto& e : fs::directory_iterator(dir)) {
      std::string name = e.path().filename().string();
      require(name.rfind(".tmp-", 0) != 0, "temporary left behind: " + name);
      if (name.rfind("ckpt-", 0) == 0) ++versions;
    }
    require(versions == 2, "expected 2 versions, found " + std::to_string(versions));
    require(latest_checkpoint(dir) == dir + "/ckpt-000004", "latest is not ckpt-000004");
    // A version's own directory loads too.
    require(load_checkpoint(dir + "/ckpt-000003", *other, &other_opt).has_value(), "version dir did not load");

    // Without optimizer state in the checkpoint, asking for it is an error; nullptr is fine.
    save_checkpoint(dir, *net, nullptr, st);
    require(load_checkpoint(dir, *other, nullptr).has_value(), "load without optimizer");
    bool threw = false;
    try {
      load_checkpoint(dir, *other, &other_opt);
    } catch (const CheckpointError& e) {
      threw = std::string(e.what()).find("no optimizer state") != std::string::npos;
    }
    require(threw, "missing optimizer state was not reported");
  }), "");
}

TEST_F(CheckpointTest, ModelMismatchIsReported) {
  const std::string dir = path("mismatch");
  EXPECT_EQ(in_child([&] {
    Net net;
    save_checkpoint(dir, *net, nullptr, {});
    torch::nn::Sequential other(torch::nn::Linear(4, 8), torch::nn::Linear(8, 3));
    try {
      load_checkpoint(dir, *other, nullptr);
    } catch (const CheckpointError& e) {
      std::string what = e.what();
      require(what.find("missing from the checkpoint: 0.weight") != std::string::npos, what);
      require(what.find("not in the model: bn.bias, bn.num_batches_tracked") != std::string::npos, what);
      return;
    }
    throw std::runtime_error("a mismatched model loaded");
  }), "");
}

TEST_F(CheckpointTest, DamagedFileIsReported) {
  const std::string dir = path("damaged");
  EXPECT_EQ(in_child([&] {
    Net net;
    save_checkpoint(dir, *net, nullptr, {});
    const std::string model = *latest_checkpoint(dir) + "/model.pt";
    fs::resize_file(model, fs::file_size(model) - 10);
    try {
      load_checkpoint(dir, *net, nullptr);
    } catch (const CheckpointError& e) {
      require(std::string(e.what()).find("model.pt is damaged") != std::string::npos, e.what());
      return;
    }
    throw std::runtime_error("a truncated model.pt loaded");
  }), "");
}

TEST_F(CheckpointTest, PythonTorchLoadReadsModel) {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "python3-torch is not installed";
  }
  const std::string dir = path("py");
  const std::string expected = path("expected.json");
  ASSERT_EQ(in_child([&] {
    torch::manual_seed(3);
    Net net;
    auto opt = make_sgd(net);
    at::Tensor x = torch::randn({8, 4});
    at::Tensor y = torch::randint(0, 3, {8});
    for (int i = 0; i < 2; ++i) train_step(net, opt, x, y);
    save_checkpoint(dir, *net, &opt, {});
    nlohmann::json doc = nlohmann::json::object();
    auto add = [&](const std::string& name, const at::Tensor& t) {
      at::Tensor d = t.detach().reshape(-1).to(at::kDouble).contiguous();
      std::vector<double> values(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
      doc[name] = {{"shape", t.sizes().vec()}, {"dtype", std::string(c10::toString(t.scalar_type()))},
                   {"values", values}};
    };
    for (const auto& p : net->named_parameters()) add(p.key(), p.value());
    for (const auto& b : net->named_buffers()) add(b.key(), b.value());
    std::ofstream(expected) << doc.dump();
  }), "");
  const std::string model = dir + "/ckpt-000001/model.pt";
  const std::string cmd = std::string("/usr/bin/python3 ") + CHORUS_CHECKPOINT_PY + " " + model + " " + expected;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  int rc = ::pclose(p);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("OK"), std::string::npos) << out;
}

// ---- W = 2 --------------------------------------------------------------------------------------

TEST_F(CheckpointTest, RoundTripTwoRanks) {
  const std::string dir = path("w2");
  EXPECT_EQ(testing::run_ranks(2, [&](int rank, int, std::shared_ptr<Store>) {
    torch::set_num_threads(1);
    dist::init_process_group();
    torch::manual_seed(5);
    Net net;
    auto opt = make_sgd(net);
    at::Tensor x = torch::randn({16, 4});
    at::Tensor y = torch::randint(0, 3, {16});
    for (int i = 0; i < 2; ++i) train_step(net, opt, x, y);
    torch::manual_seed(100 + rank);  // per-rank RNG streams, as for dropout
    // Only rank 0 touches the filesystem: the others pass a path that does not exist.
    const std::string my_dir = rank == 0 ? dir : dir + "-rank" + std::to_string(rank) + "/nowhere";
    save_checkpoint(my_dir, *net, &opt, CheckpointState{2, 40, {{"k", "v"}}});
    require(rank == 0 || !fs::exists(dir + "-rank" + std::to_string(rank)), "rank 1 wrote files");
    at::Tensor saved = flat(*net);
    at::Tensor next_random = torch::rand({4});

    torch::manual_seed(1000);
    Net other;
    auto other_opt = make_sgd(other);
    auto got = load_checkpoint(my_dir, *other, &other_opt);
    require(got && got->epoch == 2 && got->step == 40 && got->extra.at("k") == "v", "state");
    require(at::equal(flat(*other), saved), "model differs on rank " + std::to_string(rank));
    require(at::equal(torch::rand({4}), next_random), "RNG of rank " + std::to_string(rank) + " not restored");
    dist::destroy_process_group();
  }), "");
}

TEST_F(CheckpointTest, ErrorsReachEveryRank) {
  const std::string blocker = path("a-file");
  std::ofstream(blocker) << "not a directory";
  const std::string bad = blocker + "/ckpt";  // mkdir fails (ENOTDIR), even as root
  const std::string good = path("good");
  EXPECT_EQ(testing::run_ranks(2, [&](int rank, int, std::shared_ptr<Store>) {
    torch::set_num_threads(1);
    dist::init_process_group();
    Net net;
    auto opt = make_sgd(net);
    try {
      save_checkpoint(bad, *net, &opt, {});
      throw std::runtime_error("save into " + bad + " succeeded");
    } catch (const CheckpointError& e) {
      std::string what = e.what();
      require(rank == 0 || what.find("rank 0 failed to write") != std::string::npos, what);
    }
    // Rank 0 cannot read: every rank raises.
    fs::create_directories(good);
    if (rank == 0) std::ofstream(good + "/latest") << "garbage\n";
    dist::barrier();
    try {
      load_checkpoint(good, *net, &opt);
      throw std::runtime_error("load of a bad 'latest' succeeded");
    } catch (const CheckpointError& e) {
      std::string what = e.what();
      require(what.find("not a version name") != std::string::npos, what);
    }
    // Rank 1's model differs: both ranks raise, rank 0 naming rank 1.
    if (rank == 0) fs::remove(good + "/latest");
    dist::barrier();
    save_checkpoint(good, *net, &opt, {});
    torch::nn::Sequential wrong(torch::nn::Linear(2, 2));
    try {
      if (rank == 0) {
        load_checkpoint(good, *net, &opt);
      } else {
        load_checkpoint(good, *wrong, nullptr);
      }
      throw std::runtime_error("mismatched load succeeded");
    } catch (const CheckpointError& e) {
      std::string what = e.what();
      require(rank == 1 || what.find("rank 1 failed to apply it") != std::string::npos, what);
    }
    // The group is still usable afterwards.
    at::Tensor t = at::ones({3});
    dist::all_reduce(t);
    require(at::all(t == 2).item<bool>(), "group broken after checkpoint errors");
    dist::destroy_process_group();
  }), "");
}

// The optimizer's bytes (one form for ZeRO's shards and checkpoints): Adam's per-parameter state
// (step, both moments) survives the round trip into a fresh optimizer built with the same options,
// which then takes the same step as the original. The options are the loader's own: libtorch 1.13
// restores states, not options. Bytes of another optimizer type are refused.
TEST(OptimizerBytes, AdamStateRoundTripsAndStepsTheSame) {
  torch::manual_seed(3);
  auto make = [] { return std::vector<at::Tensor>{torch::randn({4, 3}).requires_grad_(), torch::randn({3}).requires_grad_()}; };
  auto a = make();
  std::vector<at::Tensor> b;
  for (auto& t : a) b.push_back(t.detach().clone().requires_grad_());
  torch::optim::Adam adam_a(a, torch::optim::AdamOptions(0.01).weight_decay(0.1));
  for (int step = 0; step < 3; ++step) {
    for (auto& t : a) t.mutable_grad() = torch::full_like(t, 0.5 * (step + 1));
    adam_a.step();
  }
  for (size_t i = 0; i < a.size(); ++i) b[i].detach().copy_(a[i].detach());
  torch::optim::Adam adam_b(b, torch::optim::AdamOptions(0.01).weight_decay(0.1));
  torch::optim::Adam other_lr(make(), torch::optim::AdamOptions(1.0));
  dist::optimizer_from_bytes(dist::optimizer_to_bytes(adam_a), adam_b);
  dist::optimizer_from_bytes(dist::optimizer_to_bytes(adam_a), other_lr);
  EXPECT_DOUBLE_EQ(static_cast<torch::optim::AdamOptions&>(other_lr.param_groups()[0].options()).lr(), 1.0);
  for (auto* p : {&a, &b}) {
    for (auto& t : *p) t.mutable_grad() = torch::full_like(t, -0.25);
  }
  adam_a.step();
  adam_b.step();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << i;

  torch::optim::SGD sgd(make(), torch::optim::SGDOptions(0.1).momentum(0.9));
  EXPECT_ANY_THROW(dist::optimizer_from_bytes(dist::optimizer_to_bytes(adam_a), sgd));
}

}  // namespace
}  // namespace chorus::train
