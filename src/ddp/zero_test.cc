// ZeroRedundancyOptimizer: PyTorch's partition rule (pure), the errors on every rank, sharded
// training equal to unsharded training (parameters and consolidated state, bit for bit), a
// checkpoint round trip across world sizes, and optimizer-state memory per rank. The comparison
// with PyTorch's own ZeroRedundancyOptimizer is zero_parity_test.
#include "chorus/ddp/zero.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <tuple>

#include "agreement.h"
#include "chorus/comm/error.h"
#include "chorus/ddp/ddp.h"
#include "chorus/models/resnet.h"
#include "chorus/torch/compat.h"
#include "chorus/torch/distributed.h"
#include "chorus/train/checkpoint.h"
#include "testing.h"

namespace chorus::ddp {
namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

// fc1 and fc2 biases tie in size, as do head and spare: the partition's order of equal sizes matters.
struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 16));
    head = register_module("head", torch::nn::Linear(16, 4));
    spare = register_module("spare", torch::nn::Linear(16, 4));  // never used: its .grad stays undefined
    torch::NoGradGuard no_grad;
    int k = 0;
    for (auto& p : parameters()) {
      auto e = torch::arange(p.numel(), torch::kInt64);
      p.copy_((((e * 7 + k++ * 5) % 13 - 6).to(torch::kFloat32) / 32.0).reshape(p.sizes()));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(torch::tanh(fc2(torch::relu(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, head{nullptr}, spare{nullptr};
};
TORCH_MODULE(Mlp);

constexpr int kPerRank = 4;

// The global batch of a step: every rank builds all of it.
std::pair<torch::Tensor, torch::Tensor> global_batch(int step, int rows) {
  auto n = torch::arange(rows, torch::kInt64);
  auto j = torch::arange(6, torch::kInt64);
  auto x = ((n.unsqueeze(1) * 5 + j.unsqueeze(0) * 3 + step * 7) % 11 - 5).to(torch::kFloat32) / 4.0;
  return {x, (n * 3 + step) % 4};
}

OptimizerFactory factory(const std::string& kind) {
  if (kind == "sgd") return optimizer_factory<torch::optim::SGD>(torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
  return optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(0.01).weight_decay(0.01));
}

// The per-parameter state as tensors (Adam's step count as a tensor too); empty when there is none.
std::vector<torch::Tensor> state_of(const torch::optim::Optimizer& o, const torch::Tensor& p) {
  auto it = o.state().find(compat::optimizer_state_key(o, p));
  if (it == o.state().end()) return {};
  if (auto* s = dynamic_cast<const torch::optim::SGDParamState*>(it->second.get())) return {s->momentum_buffer()};
  if (auto* a = dynamic_cast<const torch::optim::AdamParamState*>(it->second.get())) {
    return {a->exp_avg(), a->exp_avg_sq(), torch::tensor(a->step())};
  }
  throw std::runtime_error("unexpected optimizer state type");
}

bool same_state(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}

// ---- the partition rule (pure) ----------------------------------------------------------------

TEST(ZeroPartition, PyTorchsSortedGreedyRule) {
  // Largest first, equal sizes in list order (#1 before #2), each to the first least-loaded rank.
  EXPECT_EQ(zero_partition({5, 7, 7, 3}, 1), (std::vector<int>{0, 0, 0, 0}));
  EXPECT_EQ(zero_partition({5, 7, 7, 3}, 2), (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(zero_partition({5, 7, 7, 3}, 3), (std::vector<int>{2, 0, 1, 2}));
  EXPECT_EQ(zero_partition({4, 4}, 3), (std::vector<int>{0, 1}));  // rank 2 owns nothing
  EXPECT_EQ(zero_partition({}, 2), (std::vector<int>{}));
  EXPECT_EQ(zero_partition({0, 0, 6}, 2), (std::vector<int>{1, 1, 0}));
  EXPECT_THROW(zero_partition({1}, 0), UsageError);
}

TEST(ZeroPartition, EqualSizesSpreadEvenly) {
  for (int world : {1, 2, 3, 4, 5, 8}) {
    auto owners = zero_partition(std::vector<int64_t>(40, 100), world);
    std::vector<int> count(static_cast<size_t>(world), 0);
    for (int r : owners) ++count[static_cast<size_t>(r)];
    EXPECT_LE(*std::max_element(count.begin(), count.end()) - *std::min_element(count.begin(), count.end()), 1)
        << "W=" << world;
  }
}

TEST(ZeroAgreement, DifferencesFromRank0) {
  EXPECT_TRUE(differences_from_rank0({{"a", "b"}, {"a", "b"}}).empty());
  EXPECT_EQ(differences_from_rank0({{"a", "b"}, {"a"}, {"a", "c"}}),
            (std::vector<std::string>{"#1: rank 0 has b, rank 1 has (none)", "#1: rank 0 has b, rank 2 has c"}));
  EXPECT_EQ(differences_from_rank0({{"a", "b", "c"}, {"x", "y", "z"}}, 2).size(), 2u);
}

// ---- errors -----------------------------------------------------------------------------------

// Runs make() on 2 ranks; every rank must raise UsageError containing `expected`.
void expect_usage_error_everywhere(const std::function<void(int rank)>& make, const std::string& expected) {
  std::string err = testing::run_ranks(2, [&](int rank, int, std::shared_ptr<Store>) {
    dist::init_process_group();
    const std::string what = testing::usage_error([&] { make(rank); });
    require(what.find(expected) != std::string::npos, "rank " + std::to_string(rank) + ": " + what);
    dist::destroy_process_group();
  });
  EXPECT_EQ(err, "");
}

TEST(ZeroErrors, DifferentCountOnEveryRank) {
  expect_usage_error_everywhere(
      [](int rank) {
        std::vector<torch::Tensor> ps{torch::zeros({4, 4}), torch::zeros({4})};
        if (rank == 1) ps.pop_back();
        ZeroRedundancyOptimizer zero(ps, factory("sgd"));
      },
      "#1: rank 0 has [4] Float, rank 1 has (none)");
}

TEST(ZeroErrors, DifferentShapeOnEveryRank) {
  expect_usage_error_everywhere(
      [](int rank) {
        ZeroRedundancyOptimizer zero({torch::zeros({4, rank == 0 ? 4 : 5})}, factory("adam"));
      },
      "#0: rank 0 has [4, 4] Float, rank 1 has [4, 5] Float");
}

TEST(ZeroErrors, OneRanksDuplicateFailsEveryRank) {
  expect_usage_error_everywhere(
      [](int rank) {
        auto w = torch::zeros({3});
        std::vector<torch::Tensor> ps{w, rank == 1 ? w : torch::zeros({3})};
        ZeroRedundancyOptimizer zero(ps, factory("sgd"));
      },
      "rank 1: parameter #1 appears earlier in the list too (tied weights");
}

TEST(ZeroErrors, BucketViewNeedsOneDtype) {
  expect_usage_error_everywhere(
      [](int) {
        ZeroOptions o;
        o.parameters_as_bucket_view = true;
        ZeroRedundancyOptimizer zero({torch::zeros({3}), torch::zeros({3}, torch::kFloat64)}, factory("sgd"), o);
      },
      "parameters_as_bucket_view needs one dtype");
}

TEST(ZeroErrors, StateDictNeedsConsolidateOnThisRank) {
  std::string err = testing::run_ranks(2, [](int rank, int, std::shared_ptr<Store>) {
    dist::init_process_group();
    ZeroRedundancyOptimizer zero({torch::zeros({3}), torch::zeros({2})}, factory("sgd"));
    std::string what = testing::usage_error([&] { zero.state_dict(); });
    require(what.find("call consolidate_state_dict(" + std::to_string(rank) + ") on every rank first") !=
                std::string::npos, what);
    zero.consolidate_state_dict(1);
    what = testing::usage_error([&] { zero.state_dict(); });
    require((rank == 1) == (what == "(no UsageError)"), "rank " + std::to_string(rank) + ": " + what);
    what = testing::usage_error([&] { zero.consolidate_state_dict(2); });
    require(what.find("`to` must be a rank of the group (0..1)") != std::string::npos, what);
    dist::destroy_process_group();
  });
  EXPECT_EQ(err, "");
}

// ---- sharded equals unsharded -------------------------------------------------------------------

using TrainCase = std::tuple<int, std::string, bool>;  // world, optimizer, parameters_as_bucket_view

// DDP + ZeroRedundancyOptimizer and DDP + the plain optimizer on the same data: every parameter,
// and every parameter's state (consolidated on the last rank), equal bit for bit.
void sharded_vs_plain(int rank, int world, const std::string& kind, bool bucket_view) {
  torch::set_num_threads(1);
  dist::init_process_group();
  Options ddp_options;
  ddp_options.find_unused_parameters = true;
  Mlp sharded, plain;
  DistributedDataParallel ddp_sharded(sharded, ddp_options), ddp_plain(plain, ddp_options);
  ZeroOptions zo;
  zo.parameters_as_bucket_view = bucket_view;
  ZeroRedundancyOptimizer zero(sharded->parameters(), factory(kind), zo);
  auto reference = factory(kind)(plain->parameters());
  for (int step = 0; step < 4; ++step) {
    auto [x, y] = global_batch(step, kPerRank * world);
    x = x.narrow(0, rank * kPerRank, kPerRank);
    y = y.narrow(0, rank * kPerRank, kPerRank);
    zero.zero_grad();
    reference->zero_grad();
    torch::nn::functional::cross_entropy(ddp_sharded.forward(x), y).backward();
    torch::nn::functional::cross_entropy(ddp_plain.forward(x), y).backward();
    zero.step();
    reference->step();
  }
  const auto ps = sharded->parameters(), qs = plain->parameters();
  for (size_t i = 0; i < ps.size(); ++i) {
    require(torch::equal(ps[i], qs[i]), "parameter #" + std::to_string(i) + " differs from unsharded training");
  }
  // spare (the last two) got no gradient: no state, on any rank.
  for (size_t i = ps.size() - 2; i < ps.size(); ++i) require(state_of(zero.local_optimizer(), ps[i]).empty(), "spare has state");
  // The shards are disjoint and complete: their bytes add up to the unsharded optimizer's.
  auto bytes = torch::tensor({zero.local_state_bytes()});
  dist::all_reduce(bytes);
  require(bytes.item<int64_t>() == optimizer_state_bytes(*reference),
          "state bytes " + std::to_string(bytes.item<int64_t>()) + " over all ranks, unsharded " +
              std::to_string(optimizer_state_bytes(*reference)));
  const int to = world - 1;
  zero.consolidate_state_dict(to);
  if (rank == to) {
    for (size_t i = 0; i < ps.size(); ++i) {
      require(same_state(state_of(zero.state_dict(), ps[i]), state_of(*reference, qs[i])),
              "consolidated state of parameter #" + std::to_string(i) + " differs from the unsharded optimizer's");
    }
  }
  dist::destroy_process_group();
}

class ZeroTraining : public ::testing::TestWithParam<TrainCase> {};

TEST_P(ZeroTraining, EqualsUnshardedOptimizerOnEveryRank) {
  const auto& [world, kind, bucket_view] = GetParam();
  EXPECT_EQ(testing::run_ranks(world, [&](int r, int w, std::shared_ptr<Store>) { sharded_vs_plain(r, w, kind, bucket_view); }),
            "");
}

INSTANTIATE_TEST_SUITE_P(Cases, ZeroTraining,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Values(std::string("sgd"), std::string("adam")),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return "W" + std::to_string(std::get<0>(info.param)) + "_" + std::get<1>(info.param) +
                                  (std::get<2>(info.param) ? "_bucket_view" : "");
                         });

// ---- checkpoint round trip ----------------------------------------------------------------------

// Every rank computes the gradient of the whole global batch, so the run does not depend on the
// world size and a run resumed at another world size must equal the uninterrupted one exactly.
void train_steps(Mlp& net, ZeroRedundancyOptimizer& zero, int from, int to) {
  for (int step = from; step < to; ++step) {
    auto [x, y] = global_batch(step, 12);
    zero.zero_grad();
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    zero.step();
  }
}

class ZeroCheckpoint : public ::testing::TestWithParam<int> {};

TEST_P(ZeroCheckpoint, SaveAtW2ResumeAtAnotherWorldSizeEqualsUninterrupted) {
  const int resume_world = GetParam();
  char tmpl[] = "/tmp/chorus-zero-ckpt-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  train::CheckpointOptions co;
  co.fsync = false;
  std::string err = testing::run_ranks(2, [&](int rank, int, std::shared_ptr<Store>) {
    torch::set_num_threads(1);
    dist::init_process_group();
    Mlp whole, part;
    ZeroRedundancyOptimizer zero_whole(whole->parameters(), factory("adam"));
    train_steps(whole, zero_whole, 0, 6);
    if (rank == 0) torch::save(whole->parameters(), dir + "/uninterrupted.pt");
    ZeroRedundancyOptimizer zero(part->parameters(), factory("adam"));
    train_steps(part, zero, 0, 3);
    zero.consolidate_state_dict(0);
    train::save_checkpoint(dir + "/ckpt", *part, rank == 0 ? &zero.state_dict() : nullptr, {0, 3, {}}, co);
    dist::destroy_process_group();
  });
  ASSERT_EQ(err, "");
  err = testing::run_ranks(resume_world, [&](int, int, std::shared_ptr<Store>) {
    torch::set_num_threads(1);
    dist::init_process_group();
    Mlp net;
    ZeroOptions zo;
    zo.parameters_as_bucket_view = true;  // the layout in memory is no part of the saved state
    ZeroRedundancyOptimizer zero(net->parameters(), factory("adam"), zo);
    auto full = zero.make_unsharded_optimizer();
    auto state = train::load_checkpoint(dir + "/ckpt", *net, full.get(), co);
    require(state && state->step == 3, "no checkpoint");
    zero.load_state_dict(*full);
    full.reset();
    train_steps(net, zero, 3, 6);
    std::vector<torch::Tensor> expected;
    torch::load(expected, dir + "/uninterrupted.pt");
    const auto ps = net->parameters();
    require(expected.size() == ps.size(), "parameter count");
    for (size_t i = 0; i < ps.size(); ++i) {
      require(torch::equal(ps[i], expected[i]), "parameter #" + std::to_string(i) + " differs from the uninterrupted run");
    }
    dist::destroy_process_group();
  });
  std::filesystem::remove_all(dir);
  EXPECT_EQ(err, "");
}

INSTANTIATE_TEST_SUITE_P(ResumeWorld, ZeroCheckpoint, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

// ---- memory -------------------------------------------------------------------------------------

// Adam over 12 parameters of equal size: each rank holds exactly 1/W of the state.
TEST(ZeroMemory, EachRankHoldsOneWthOfTheState) {
  for (int world : {2, 3, 4}) {
    std::string err = testing::run_ranks(world, [](int, int w, std::shared_ptr<Store>) {
      dist::init_process_group();
      std::vector<torch::Tensor> ps, qs;
      for (int i = 0; i < 12; ++i) {
        ps.push_back(torch::zeros({64, 64}, torch::requires_grad()));
        qs.push_back(torch::zeros({64, 64}, torch::requires_grad()));
        ps.back().mutable_grad() = torch::ones({64, 64});
        qs.back().mutable_grad() = torch::ones({64, 64});
      }
      ZeroRedundancyOptimizer zero(ps, factory("adam"));
      auto plain = factory("adam")(qs);
      zero.step();
      plain->step();
      const int64_t total = optimizer_state_bytes(*plain);
      require(total == 12 * 64 * 64 * 4 * 2, "unsharded Adam state " + std::to_string(total));
      require(zero.local_state_bytes() * w == total,
              "this rank holds " + std::to_string(zero.local_state_bytes()) + " bytes of " + std::to_string(total));
      dist::destroy_process_group();
    });
    EXPECT_EQ(err, "") << "W=" << world;
  }
}

// ResNet-18 (11.7M parameters in 62 tensors, sizes far from equal): the largest shard stays within
// 10% of 1/W. Prints the bytes per rank that docs/zero.md reports.
TEST(ZeroMemory, ResNet18StatePerRank) {
  for (int world : {2, 4}) {
    std::string err = testing::run_ranks(world, [](int rank, int w, std::shared_ptr<Store>) {
      torch::set_num_threads(1);
      dist::init_process_group();
      models::ResNet net;
      for (auto& p : net->parameters()) p.mutable_grad() = torch::full_like(p, 1e-3);
      for (const std::string kind : {"sgd", "adam"}) {
        ZeroRedundancyOptimizer zero(net->parameters(), factory(kind));
        zero.step();
        auto all = torch::zeros({w}, torch::kInt64);
        all[rank] = zero.local_state_bytes();
        dist::all_reduce(all);
        const int64_t total = all.sum().item<int64_t>(), largest = all.max().item<int64_t>();
        if (rank == 0) {
          std::printf("ResNet-18 %s W=%d: unsharded %.1f MB, per rank", kind.c_str(), w, total / 1e6);
          for (int r = 0; r < w; ++r) std::printf(" %.1f", all[r].item<int64_t>() / 1e6);
          std::printf(" MB, largest %.3f of 1/W\n", static_cast<double>(largest) * w / total);
        }
        require(largest * w <= total * 1.1, "largest shard " + std::to_string(largest) + " of " + std::to_string(total));
      }
      dist::destroy_process_group();
    });
    EXPECT_EQ(err, "") << "W=" << world;
  }
}

}  // namespace
}  // namespace chorus::ddp
