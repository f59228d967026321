// A frozen backbone under chorus's DDP is identical on every rank: only rank 0 loads the pretrained
// weights (the others start from their own random init and random head), the backbone is frozen,
// and wrapping in DistributedDataParallel must give every rank rank 0's parameters (frozen ones,
// requires_grad false) and buffers (BatchNorm running statistics, num_batches_tracked). Then a few
// training steps in train mode: the backbone stays exactly the pretrained one on every rank (frozen
// BatchNorms do not update their statistics), the head trains and stays identical across ranks.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <string>

#include "chorus/ddp/ddp.h"
#include "chorus/models/resnet.h"
#include "chorus/models/state_dict.h"
#include "chorus/models/transfer.h"
#include "chorus/torch/distributed.h"
#include "testing.h"

namespace chorus::models {
namespace {

constexpr int kSteps = 3;
constexpr int64_t kPretrainedClasses = 5;
constexpr int64_t kClasses = 3;

ResNetOptions options() {
  ResNetOptions o;
  o.depth = 18;
  o.num_classes = kPretrainedClasses;
  return o;
}

std::string where(int rank, const std::string& what) { return "rank " + std::to_string(rank) + ": " + what; }

// Every tensor of the model equals rank 0's (broadcast), bit for bit. Collective.
void expect_same_as_rank0(ResNet& model, int rank, const std::string& when) {
  for (const auto& [key, tensor] : state_dict(*model)) {
    torch::Tensor theirs = tensor.clone();
    dist::broadcast(theirs, 0);
    if (!torch::equal(theirs, tensor)) throw std::runtime_error(where(rank, key + " differs from rank 0's " + when));
  }
}

// The backbone (every key but fc's) equals the pretrained file's, bit for bit.
void expect_pretrained_backbone(ResNet& model, const StateDict& pretrained, int rank, const std::string& when) {
  const StateDict ours = state_dict(*model);
  for (size_t i = 0; i + 2 < ours.size(); ++i) {
    if (ours[i].first != pretrained[i].first || !torch::equal(ours[i].second, pretrained[i].second)) {
      throw std::runtime_error(where(rank, ours[i].first + " is not the pretrained value " + when));
    }
  }
}

void run_rank(int rank, int world, const std::string& file) {
  dist::init_process_group();
  torch::set_num_threads(1);
  torch::manual_seed(100 + rank);  // every rank's own init: only DDP can make them agree
  ResNet model(options());
  if (rank == 0) load_state_dict(*model, file);
  model->replace_head(kClasses);
  freeze_backbone(*model);
  model->train();
  const StateDict pretrained = read_state_dict(file);  // for the checks only
  if (rank != 0 && torch::equal(model->conv1->weight, pretrained[0].second)) {
    throw std::runtime_error(where(rank, "starts with the pretrained weights: the test would prove nothing"));
  }

  ddp::DistributedDataParallel ddp(model);
  expect_same_as_rank0(model, rank, "after wrapping");
  expect_pretrained_backbone(model, pretrained, rank, "after wrapping");
  for (const auto& p : backbone_parameters(*model)) {
    if (p.requires_grad()) throw std::runtime_error(where(rank, "a backbone parameter requires grad after wrapping"));
  }
  const torch::Tensor head_start = model->fc->weight.clone();

  torch::optim::SGDOptions head(0.1);
  head.momentum(0.9);
  torch::optim::SGD opt(backbone_and_head_groups(*model, head, 0.01), head);
  for (int step = 0; step < kSteps; ++step) {
    auto gen = at::detail::createCPUGenerator(1000 + 10 * step + rank);  // each rank its own shard
    auto x = at::randn({4, 3, 32, 32}, gen);
    auto y = at::randint(0, kClasses, {4}, gen);
    opt.zero_grad();
    torch::nn::functional::cross_entropy(ddp.forward(x), y).backward();
    opt.step();
  }
  expect_same_as_rank0(model, rank, "after training");
  expect_pretrained_backbone(model, pretrained, rank, "after training");
  for (const auto& p : backbone_parameters(*model)) {
    if (p.grad().defined()) throw std::runtime_error(where(rank, "a frozen parameter got a gradient"));
  }
  if (torch::equal(model->fc->weight, head_start)) throw std::runtime_error(where(rank, "the head did not train"));
  dist::destroy_process_group();
}

class FrozenBackboneDdp : public ::testing::TestWithParam<int> {};

TEST_P(FrozenBackboneDdp, LoadedOnRankZeroOnlyIsIdenticalEverywhereAndStaysSo) {
  char tmpl[] = "/tmp/chorus-frozen-ddp-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const std::string file = dir + "/pretrained.pt";
  {
    torch::manual_seed(7);
    ResNet source(options());
    torch::NoGradGuard no_grad;
    for (const auto& m : source->modules()) {
      if (auto* bn = m->as<FreezableBatchNorm2dImpl>()) {
        bn->running_mean.uniform_(-0.5, 0.5);
        bn->running_var.uniform_(0.5, 2.0);
        bn->weight.uniform_(0.5, 1.5);
        bn->num_batches_tracked.fill_(42);
      }
    }
    save_state_dict(*source, file);
  }
  const std::string err = testing::run_ranks(GetParam(), [&](int r, int w, std::shared_ptr<Store>) { run_rank(r, w, file); });
  std::filesystem::remove_all(dir);
  EXPECT_EQ(err, "");
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, FrozenBackboneDdp, ::testing::Values(2, 3),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

}  // namespace
}  // namespace chorus::models
