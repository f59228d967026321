// Accelerator::prepare_data_loader over an ImageDataset (a data::ParallelLoader): at W=2 every item
// is trained on once per epoch across the ranks, in the sampler's order, and a run resumed
// mid-epoch continues with the same batches as an uninterrupted run; the evaluation loader gives
// each rank its block of evaluation_indices.
//
// Libtorch work runs in forked ranks (run_ranks) only, so the gtest process can fork safely.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>
#include <sstream>

#include "../data/data_test_util.h"
#include "chorus/train/accelerator.h"
#include "testing.h"

namespace chorus::train {
namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

constexpr size_t kItems = 42;  // W=2, batch 4: 21 items a rank, 6 batches (the last short)

// The items (decoded values) of every batch the loop saw, per epoch.
using Trace = std::vector<std::vector<std::vector<int64_t>>>;

Trace train(const data::ImageDataset& dataset, AcceleratorOptions o, int64_t epochs) {
  o.progress = false;
  o.fsync = false;
  o.seed = 5;
  Accelerator accelerator(o);
  torch::manual_seed(1);
  torch::nn::Linear net(3, 2);
  auto model = accelerator.prepare_model(net);
  torch::optim::SGD sgd(net->parameters(), 1e-6);
  auto optimizer = accelerator.prepare_optimizer(sgd);
  data::LoaderOptions lo;
  lo.batch_size = 4;
  lo.threads = 3;
  auto loader = accelerator.prepare_data_loader(dataset, lo);
  Trace trace(static_cast<size_t>(epochs));
  for (int64_t epoch : accelerator.epochs(epochs)) {
    for (auto& batch : loader) {
      optimizer.zero_grad();
      std::vector<int64_t> items;
      for (int64_t r = 0; r < batch.data.size(0); ++r) {
        items.push_back(static_cast<int64_t>(batch.data[r][0].item<float>()));
        require(batch.data[r][2].item<float>() == static_cast<float>(epoch), "the decode function saw another epoch");
      }
      trace[static_cast<size_t>(epoch)].push_back(items);
      auto loss = torch::cross_entropy_loss(model(batch.data / 1000), batch.target);
      accelerator.backward(loss);
      optimizer.step();
    }
  }
  // Evaluation: this rank's block of the items, each once, in order.
  std::vector<int64_t> evaluated;
  for (auto& batch : accelerator.prepare_eval_loader(dataset, lo)) {
    for (int64_t r = 0; r < batch.data.size(0); ++r) evaluated.push_back(static_cast<int64_t>(batch.data[r][0].item<float>()));
  }
  require(evaluated == data::evaluation_indices(static_cast<int64_t>(dataset.size())),
          "the evaluation loader did not give this rank's evaluation_indices");
  return trace;
}

TEST(ImageLoaderAccelerator, EveryItemOncePerEpochAndMidEpochResume) {
  data::testing::NumberSet set(kItems);
  data::testing::TempDir runs;
  EXPECT_EQ(testing::run_ranks(2, [&](int rank, int world, std::shared_ptr<Store>) {
    torch::set_num_threads(1);
    const auto dataset = set.dataset(/*max_sleep_us=*/2000);
    AcceleratorOptions full;
    full.project_dir = runs.path;
    full.run_name = "full";
    const Trace whole = train(dataset, full, 2);

    // Across the ranks, each epoch covers every item exactly once; each rank in its sampler's order.
    for (size_t epoch = 0; epoch < whole.size(); ++epoch) {
      std::vector<int64_t> mine;
      for (const auto& b : whole[epoch]) mine.insert(mine.end(), b.begin(), b.end());
      data::DistributedSamplerOptions so;
      so.num_replicas = world;
      so.rank = rank;
      so.seed = 5;
      data::DistributedSampler sampler(kItems, so);
      sampler.set_epoch(static_cast<int64_t>(epoch));
      require(mine == sampler.indices(), "epoch " + std::to_string(epoch) + ": not the sampler's order");
      std::multiset<int64_t> all;
      std::string text;
      for (int64_t i : mine) text += std::to_string(i) + " ";
      for (const auto& items : dist::all_gather_object(text)) {
        std::istringstream in(items);
        for (int64_t i; in >> i;) all.insert(i);
      }
      require(all.size() == kItems, "epoch " + std::to_string(epoch) + ": " + std::to_string(all.size()) + " items");
      for (int64_t i = 0; i < static_cast<int64_t>(kItems); ++i) {
        require(all.count(i) == 1, "item " + std::to_string(i) + " seen " + std::to_string(all.count(i)) + " times");
      }
    }

    // Saved after step 8 (epoch 1, batch 2), stopped after step 10, resumed: the same batches from step 9 on.
    AcceleratorOptions first;
    first.project_dir = runs.path;
    first.run_name = "part";
    first.checkpoint_each_epoch = false;
    first.checkpoint_every = 8;
    first.max_steps = 10;
    const Trace before = train(dataset, first, 2);
    require(before[1].size() == 4 && before[1] == Trace::value_type(whole[1].begin(), whole[1].begin() + 4),
            "the interrupted run's batches differ");
    AcceleratorOptions second = first;
    second.max_steps = 0;
    second.resume = true;
    const Trace after = train(dataset, second, 2);
    require(after[0].empty(), "the resumed run trained epoch 0 again");
    require(after[1] == Trace::value_type(whole[1].begin() + 2, whole[1].end()),
            "the resumed run's batches differ from the uninterrupted run's");
  }), "");
}

}  // namespace
}  // namespace chorus::train
