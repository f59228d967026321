// ParallelLoader: sampler order whatever the threads, the memory bound, shutdown, bad items, W=2.
#include "chorus/data/loader.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <random>
#include <set>
#include <thread>

#include "chorus/data/image_folder.h"
#include "chorus/data/sampler.h"
#include "data_test_util.h"

namespace chorus::data {
namespace {

using testing::NumberSet;
using testing::write_file;
using Clock = std::chrono::steady_clock;

DistributedSampler sampler(size_t n, int world = 1, int rank = 0, bool shuffle = true) {
  DistributedSamplerOptions o;
  o.num_replicas = world;
  o.rank = rank;
  o.shuffle = shuffle;
  o.seed = 7;
  o.auto_epoch = true;
  return DistributedSampler(static_cast<int64_t>(n), o);
}

// What loading the sampler's batches one item at a time on this thread gives.
std::vector<torch::data::Example<>> reference(const ImageDataset& ds, DistributedSampler s, int64_t epoch, size_t batch) {
  s.set_epoch(epoch);
  const auto order = s.indices();
  std::vector<torch::data::Example<>> out;
  for (size_t b = 0; b < order.size(); b += batch) {
    std::vector<at::Tensor> xs, ys;
    for (size_t i = b; i < std::min(order.size(), b + batch); ++i) {
      auto e = ds.get(static_cast<size_t>(order[i]), epoch);
      xs.push_back(e.data);
      ys.push_back(e.target);
    }
    out.push_back({at::stack(xs), at::stack(ys)});
  }
  return out;
}

TEST(ParallelLoader, SameBatchesAsSequentialForAnyThreadCount) {
  const size_t n = 103, batch = 8;
  NumberSet set(n);
  const auto ds = set.dataset(/*max_sleep_us=*/2000);
  const auto ref0 = reference(ds, sampler(n), 0, batch);
  const auto ref1 = reference(ds, sampler(n), 1, batch);
  ASSERT_EQ(ref0.size(), 13u);
  ASSERT_FALSE(ref0[0].data.equal(ref1[0].data));  // epochs differ in order and in the epoch seen by decode
  for (int threads : {1, 2, 4}) {
    for (size_t prefetch : {0u, 1u, 3u}) {
      LoaderOptions o;
      o.batch_size = batch;
      o.threads = threads;
      o.prefetch_batches = prefetch;
      ParallelLoader loader(ds, sampler(n), o);
      for (const auto* ref : {&ref0, &ref1}) {  // two passes: epochs 0 and 1 (auto_epoch)
        size_t b = 0;
        for (auto& got : loader) {
          ASSERT_LT(b, ref->size());
          EXPECT_TRUE(got.data.equal((*ref)[b].data)) << "threads " << threads << " batch " << b;
          EXPECT_TRUE(got.target.equal((*ref)[b].target));
          ++b;
        }
        EXPECT_EQ(b, ref->size()) << "threads " << threads << " prefetch " << prefetch;
      }
    }
  }
}

TEST(ParallelLoader, DropLastDropsTheShortBatch) {
  NumberSet set(20);
  LoaderOptions o;
  o.batch_size = 8;
  o.drop_last = true;
  ParallelLoader loader(set.dataset(0), sampler(20), o);
  size_t batches = 0;
  for (auto& b : loader) {
    EXPECT_EQ(b.data.size(0), 8);
    ++batches;
  }
  EXPECT_EQ(batches, 2u);
}

TEST(ParallelLoader, DecodedItemsStayWithinTheBound) {
  const size_t n = 96, batch = 4, prefetch = 2;
  NumberSet set(n);
  LoaderOptions o;
  o.batch_size = batch;
  o.threads = 8;  // more threads than the window holds items: the bound must not depend on them
  o.prefetch_batches = prefetch;
  {
    ParallelLoader loader(set.dataset(300), sampler(n), o);
    size_t seen = 0;
    for (auto& b : loader) {
      seen += static_cast<size_t>(b.data.size(0));
      std::this_thread::sleep_for(std::chrono::milliseconds(3));  // the loop is slower: the window fills
    }
    EXPECT_EQ(seen, n);
  }
  EXPECT_LE(set.counter->max_alive.load(), static_cast<int64_t>((prefetch + 1) * batch));
  EXPECT_GT(set.counter->max_alive.load(), static_cast<int64_t>(batch));  // it did prefetch
  EXPECT_EQ(set.counter->alive.load(), 0);
}

TEST(ParallelLoader, DestroyingMidEpochStopsPromptly) {
  const size_t n = 400;
  NumberSet set(n);
  LoaderOptions o;
  o.batch_size = 4;
  o.threads = 3;
  o.prefetch_batches = 8;
  const auto ds = set.dataset(/*max_sleep_us=*/100000);  // up to 100 ms per item: 400 items take > 10 s
  {
    // Destroying the iterator cancels its pass; a new pass starts from the sampler's next epoch.
    ParallelLoader loader(ds, sampler(n), o);
    {
      auto it = loader.begin();
      EXPECT_EQ(it->data.size(0), 4);
    }
    auto it = loader.begin();
    EXPECT_EQ(it->data.select(1, 2)[0].item<float>(), 1.0f);  // epoch 1
    ++it;
    const auto start = Clock::now();
    // `it` is still alive: destroying the loader under it, with batches in flight, must not wait for them.
    auto destroy = std::make_unique<ParallelLoader<DistributedSampler>>(ds, sampler(n), o);
    auto other = destroy->begin();
    EXPECT_EQ(other->data.size(0), 4);
    destroy.reset();
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    EXPECT_LT(seconds, 1.5);  // the first batch (<= 0.4 s when one thread drew 4 slow items) + one decode
    EXPECT_THROW(++other, UsageError);  // its loader is gone
  }
  EXPECT_EQ(set.counter->alive.load(), 0);  // nothing leaked
}

TEST(ParallelLoader, BadItemFailsItsBatchNamingTheFile) {
  const size_t n = 40;
  NumberSet set(n);
  write_file(set.path(13), "oops");
  LoaderOptions o;
  o.batch_size = 8;
  o.threads = 4;
  ParallelLoader loader(set.dataset(1000), sampler(n, 1, 0, /*shuffle=*/false), o);
  auto it = loader.begin();
  EXPECT_EQ(it->data[0][0].item<float>(), 0.0f);  // batch 0 is fine
  try {
    ++it;
    FAIL() << "no error for batch 1";
  } catch (const DataError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("batch 1 of epoch 0, item 5 (dataset index 13): " + set.path(13) + ": not a number: 'oops'"),
              std::string::npos)
        << what;
  }
  // The loop may go on: the next batch follows.
  ++it;
  EXPECT_EQ(it->data[0][0].item<float>(), 16.0f);
}

TEST(ParallelLoader, SkipBadLeavesOutAndCountsBadItems) {
  const size_t n = 40;
  NumberSet set(n);
  write_file(set.path(3), "bad");
  write_file(set.path(13), "bad");
  write_file(set.path(14), "");
  std::filesystem::remove(set.path(20));  // listed, then gone: a read error
  LoaderOptions o;
  o.batch_size = 8;
  o.threads = 4;
  o.skip_bad = true;
  ParallelLoader loader(set.dataset(500), sampler(n, 1, 0, false), o);
  std::set<int> values;
  size_t batches = 0;
  for (auto& b : loader) {
    for (int64_t r = 0; r < b.data.size(0); ++r) values.insert(static_cast<int>(b.data[r][0].item<float>()));
    ++batches;
  }
  EXPECT_EQ(batches, 5u);
  EXPECT_EQ(values.size(), n - 4);
  for (int bad : {3, 13, 14, 20}) EXPECT_EQ(values.count(bad), 0u);
  EXPECT_EQ(loader.stats().bad_items, 4);
  EXPECT_NE(loader.stats().first_bad.find(set.path(3)), std::string::npos) << loader.stats().first_bad;

  // A batch whose items all fail is still an error: items 14 and 15 form batch 7.
  write_file(set.path(15), "bad");
  o.batch_size = 2;
  ParallelLoader pairs(set.dataset(0), sampler(n, 1, 0, false), o);
  try {
    for (auto& b : pairs) (void)b;
    FAIL() << "no error";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("batch 7 of epoch 0: all 2 items failed"), std::string::npos) << e.what();
  }
}

TEST(ParallelLoader, TwoRanksCoverEveryItemOncePerEpoch) {
  const size_t n = 100, batch = 6;
  NumberSet set(n);
  const auto ds = set.dataset(1000);
  std::vector<std::vector<std::vector<int>>> seen(2, std::vector<std::vector<int>>(3));  // [rank][epoch]
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.emplace_back([&, rank] {
      LoaderOptions o;
      o.batch_size = batch;
      o.threads = 2;
      ParallelLoader loader(ds, sampler(n, 2, rank), o);
      for (int epoch = 0; epoch < 3; ++epoch) {
        for (auto& b : loader) {
          for (int64_t r = 0; r < b.data.size(0); ++r) {
            seen[rank][epoch].push_back(static_cast<int>(b.data[r][0].item<float>()));
            EXPECT_EQ(b.data[r][2].item<float>(), static_cast<float>(epoch));
          }
        }
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int epoch = 0; epoch < 3; ++epoch) {
    std::multiset<int> all(seen[0][epoch].begin(), seen[0][epoch].end());
    all.insert(seen[1][epoch].begin(), seen[1][epoch].end());
    EXPECT_EQ(all.size(), n);
    for (int i = 0; i < static_cast<int>(n); ++i) EXPECT_EQ(all.count(i), 1u) << "item " << i << " epoch " << epoch;
    for (int rank = 0; rank < 2; ++rank) {  // in the sampler's order
      auto s = sampler(n, 2, rank);
      s.set_epoch(epoch);
      std::vector<int> want;
      for (int64_t i : s.indices()) want.push_back(static_cast<int>(i));
      EXPECT_EQ(seen[rank][epoch], want);
    }
  }
  EXPECT_NE(seen[0][0], seen[0][1]);
}

TEST(ParallelLoader, RejectsBadOptions) {
  NumberSet set(4);
  LoaderOptions o;
  o.batch_size = 0;
  EXPECT_THROW(ParallelLoader(set.dataset(0), sampler(4), o), UsageError);
  o.batch_size = 1;
  o.threads = 0;
  EXPECT_THROW(ParallelLoader(set.dataset(0), sampler(4), o), UsageError);
}

}  // namespace
}  // namespace chorus::data
