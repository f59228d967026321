// DistributedSampler: the index math (lengths, padding, drop_last, epochs), the torch Sampler
// interface (auto_epoch, data loader, save/load), argument errors, and (SamplerParity, run as its
// own ctest sampler_parity_test) exact parity with PyTorch's DistributedSampler.
#include "chorus/data/sampler.h"

#include <gtest/gtest.h>
#include <torch/data.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "chorus/comm/error.h"
#include "testing.h"

namespace chorus::data {
namespace {

DistributedSampler make(int64_t n, int replicas, int rank, bool shuffle = true, uint64_t seed = 0,
                        bool drop_last = false, bool auto_epoch = false) {
  DistributedSamplerOptions o;
  o.num_replicas = replicas;
  o.rank = rank;
  o.shuffle = shuffle;
  o.seed = seed;
  o.drop_last = drop_last;
  o.auto_epoch = auto_epoch;
  return DistributedSampler(n, o);
}

// The list every rank's indices were cut from: position i came from rank i % R, slot i / R.
std::vector<int64_t> interleave(int64_t n, int replicas, bool shuffle, uint64_t seed, bool drop_last, int64_t epoch) {
  std::vector<std::vector<int64_t>> per_rank;
  for (int r = 0; r < replicas; ++r) {
    auto s = make(n, replicas, r, shuffle, seed, drop_last);
    s.set_epoch(epoch);
    per_rank.push_back(s.indices());
    EXPECT_EQ(static_cast<int64_t>(per_rank.back().size()), s.num_samples());
  }
  std::vector<int64_t> all;
  const size_t per = per_rank[0].size();
  for (size_t i = 0; i < per; ++i) {
    for (int r = 0; r < replicas; ++r) all.push_back(per_rank[static_cast<size_t>(r)].at(i));
  }
  return all;
}

const int64_t kSizes[] = {0, 1, 2, 3, 5, 7, 10, 16, 101};
const int kReplicas[] = {1, 2, 3, 4, 5, 8};

TEST(DistributedSampler, LengthsFollowPyTorch) {
  for (int64_t n : kSizes) {
    for (int r : kReplicas) {
      auto keep = make(n, r, 0, true, 0, false);
      EXPECT_EQ(keep.num_samples(), (n + r - 1) / r) << n << " " << r;
      EXPECT_EQ(keep.total_size(), keep.num_samples() * r);
      auto drop = make(n, r, r - 1, true, 0, true);
      EXPECT_EQ(drop.num_samples(), n / r) << n << " " << r;  // 0 when the dataset is smaller than the world
      EXPECT_EQ(drop.total_size(), n / r * r);
    }
  }
}

TEST(DistributedSampler, PaddingRepeatsTheLeadingIndicesAndNothingElse) {
  for (int64_t n : kSizes) {
    for (int r : kReplicas) {
      for (bool shuffle : {false, true}) {
        auto all = interleave(n, r, shuffle, 7, /*drop_last=*/false, 2);
        ASSERT_EQ(static_cast<int64_t>(all.size()), (n + r - 1) / r * r);
        // The first n positions are a permutation of the dataset ...
        std::vector<int64_t> head(all.begin(), all.begin() + n);
        std::sort(head.begin(), head.end());
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(head[static_cast<size_t>(i)], i);
        // ... and the padding repeats its leading indices, cyclically.
        for (size_t i = static_cast<size_t>(n); i < all.size(); ++i) {
          ASSERT_EQ(all[i], all[i % static_cast<size_t>(n)]) << "n=" << n << " r=" << r << " i=" << i;
        }
        if (!shuffle) {
          for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], static_cast<int64_t>(i % static_cast<size_t>(n)));
        }
      }
    }
  }
}

TEST(DistributedSampler, DropLastCutsTheTailWithoutDuplicates) {
  for (int64_t n : kSizes) {
    for (int r : kReplicas) {
      auto all = interleave(n, r, true, 3, /*drop_last=*/true, 1);
      ASSERT_EQ(static_cast<int64_t>(all.size()), n / r * r);
      std::set<int64_t> unique(all.begin(), all.end());
      EXPECT_EQ(unique.size(), all.size());
      for (int64_t i : all) EXPECT_TRUE(i >= 0 && i < n);
      // The kept indices are the head of the epoch's permutation (the order without drop_last).
      auto padded = interleave(n, r, true, 3, /*drop_last=*/false, 1);
      EXPECT_TRUE(std::equal(all.begin(), all.end(), padded.begin()));
    }
  }
}

TEST(DistributedSampler, MatchesPyTorchOnKnownCases) {
  // From Python: DistributedSampler(range(10), num_replicas=3, rank=r, seed=0), epoch 0, and with
  // drop_last at epoch 1; range(7) over 4 ranks without shuffling.
  EXPECT_EQ(make(10, 3, 0).indices(), (std::vector<int64_t>{4, 5, 0, 2}));
  EXPECT_EQ(make(10, 3, 1).indices(), (std::vector<int64_t>{1, 3, 8, 4}));
  EXPECT_EQ(make(10, 3, 2).indices(), (std::vector<int64_t>{7, 9, 6, 1}));
  auto s = make(10, 3, 1, true, 0, true);
  s.set_epoch(1);
  EXPECT_EQ(s.indices(), (std::vector<int64_t>{6, 0, 3}));
  EXPECT_EQ(make(7, 4, 3, false).indices(), (std::vector<int64_t>{3, 0}));
}

TEST(DistributedSampler, EpochAndSeedChangeTheOrderOnlyWhenShuffling) {
  auto s = make(1000, 2, 1, true, 5);
  auto e0 = s.indices();
  EXPECT_EQ(s.indices(), e0);  // deterministic
  s.set_epoch(1);
  auto e1 = s.indices();
  EXPECT_NE(e0, e1);
  EXPECT_EQ(s.epoch(), 1);
  EXPECT_NE(make(1000, 2, 1, true, 6).indices(), e0);
  // seed + epoch is what seeds the generator, as in PyTorch.
  EXPECT_EQ(make(1000, 2, 1, true, 6).indices(), e1);

  auto fixed = make(1000, 2, 1, false, 5);
  auto f0 = fixed.indices();
  fixed.set_epoch(9);
  EXPECT_EQ(fixed.indices(), f0);
}

std::vector<size_t> drain(DistributedSampler& s, size_t batch) {
  std::vector<size_t> out;
  while (auto b = s.next(batch)) {
    EXPECT_LE(b->size(), batch);
    EXPECT_FALSE(b->empty());
    out.insert(out.end(), b->begin(), b->end());
  }
  return out;
}

std::vector<size_t> as_size_t(const std::vector<int64_t>& v) { return std::vector<size_t>(v.begin(), v.end()); }

std::vector<int64_t> at_epoch(DistributedSampler s, int64_t epoch) {
  s.set_epoch(epoch);
  return s.indices();
}

TEST(DistributedSampler, NextHandsOutThePassInBatches) {
  auto s = make(101, 3, 2, true, 11);
  s.reset();
  auto got = drain(s, 4);
  EXPECT_EQ(got, as_size_t(s.indices()));
  EXPECT_FALSE(s.next(4).has_value());
  s.reset();
  EXPECT_EQ(drain(s, 100), as_size_t(s.indices()));  // same epoch without auto_epoch
  EXPECT_EQ(s.epoch(), 0);

  // next() before any reset() starts a pass at the current epoch.
  auto fresh = make(10, 2, 0, true, 1);
  EXPECT_EQ(drain(fresh, 3), as_size_t(fresh.indices()));

  // reset(new_size) replaces the dataset size.
  s.reset(20);
  EXPECT_EQ(s.dataset_size(), 20);
  EXPECT_EQ(s.num_samples(), 7);
  EXPECT_EQ(drain(s, 5), as_size_t(make(20, 3, 2, true, 11).indices()));
}

TEST(DistributedSampler, AutoEpochAdvancesOnEveryResetAfterTheFirst) {
  auto s = make(50, 2, 0, true, 4, false, /*auto_epoch=*/true);
  const auto reference = make(50, 2, 0, true, 4);
  for (int64_t expected = 0; expected < 3; ++expected) {
    s.reset();
    EXPECT_EQ(s.epoch(), expected);
    EXPECT_EQ(drain(s, 8), as_size_t(at_epoch(reference, expected)));
  }
  // set_epoch pins the next pass; the one after advances again.
  s.set_epoch(10);
  s.reset();
  EXPECT_EQ(s.epoch(), 10);
  EXPECT_EQ(drain(s, 8), as_size_t(at_epoch(reference, 10)));
  s.reset();
  EXPECT_EQ(s.epoch(), 11);
}

// A dataset whose item i is i, so the loader's batches show the sampler's order.
class IndexDataset : public torch::data::datasets::Dataset<IndexDataset, int64_t> {
 public:
  explicit IndexDataset(size_t n) : n_(n) {}
  int64_t get(size_t index) override { return static_cast<int64_t>(index); }
  torch::optional<size_t> size() const override { return n_; }

 private:
  size_t n_;
};

TEST(DistributedSampler, PlugsIntoTheLibtorchDataLoader) {
  const int64_t n = 23;
  auto loader = torch::data::make_data_loader(IndexDataset(n), make(n, 3, 1, true, 9, false, /*auto_epoch=*/true),
                                              torch::data::DataLoaderOptions().batch_size(2));
  const auto reference = make(n, 3, 1, true, 9);
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    std::vector<int64_t> seen;
    for (auto& batch : *loader) seen.insert(seen.end(), batch.begin(), batch.end());
    EXPECT_EQ(seen, at_epoch(reference, epoch)) << "pass " << epoch;
  }
}

TEST(DistributedSampler, SaveAndLoadResumeMidPass) {
  auto s = make(40, 2, 1, true, 8, false, /*auto_epoch=*/true);
  s.reset();
  s.reset();  // epoch 1
  auto first = s.next(5);
  ASSERT_TRUE(first.has_value());
  torch::serialize::OutputArchive out;
  s.save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  auto rest = drain(s, 3);

  // Rank 0's sampler can load rank 1's archive: epoch and position are the same on every rank.
  auto t = make(40, 2, 1, true, 8, false, /*auto_epoch=*/true);
  torch::serialize::InputArchive in;
  std::istringstream read(bytes.str());
  in.load_from(read);
  t.load(in);
  EXPECT_EQ(t.epoch(), 1);
  EXPECT_EQ(drain(t, 3), rest);
  t.reset();
  EXPECT_EQ(t.epoch(), 2);

  auto other_seed = make(40, 2, 1, true, 9);
  std::istringstream read2(bytes.str());
  torch::serialize::InputArchive in2;
  in2.load_from(read2);
  try {
    other_seed.load(in2);
    FAIL() << "no UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("seed"), std::string::npos) << e.what();
  }
}

using testing::usage_error;

TEST(DistributedSampler, BadArgumentsGetClearErrors) {
  EXPECT_NE(usage_error([] { make(10, 2, 2); }).find("rank 2 is outside [0, 1]"), std::string::npos);
  EXPECT_NE(usage_error([] { make(10, 2, -3); }).find("rank -3"), std::string::npos);
  EXPECT_NE(usage_error([] { make(10, 0, 0); }).find("num_replicas is 0"), std::string::npos);
  EXPECT_NE(usage_error([] { make(-1, 2, 0); }).find("dataset_size is -1"), std::string::npos);
  EXPECT_NE(usage_error([] { DistributedSampler s(10); }).find("init_process_group"), std::string::npos);
  DistributedSamplerOptions only_rank;
  only_rank.num_replicas = 4;
  EXPECT_NE(usage_error([&] { DistributedSampler s(10, only_rank); }).find("init_process_group"), std::string::npos);
}

// ---- parity with PyTorch (ctest sampler_parity_test) ----

#ifndef CHORUS_SAMPLER_PARITY_SCRIPT
#define CHORUS_SAMPLER_PARITY_SCRIPT "src/data/sampler_parity_test.py"
#endif

TEST(SamplerParity, SameIndicesAsPyTorchDistributedSampler) {
  // CHORUS_PARITY_PYTHON overrides the interpreter (e.g. "/usr/bin/python3 -S" to see the skip).
  const std::string python = testing::parity_python();
  int status = 0;
  testing::run_capture(python + " -c 'import torch' >/dev/null 2>&1", &status);
  if (status != 0) GTEST_SKIP() << python << " cannot import torch (install python3-torch); no reference to compare";

  const std::string output = testing::run_capture(python + " " + CHORUS_SAMPLER_PARITY_SCRIPT, &status);
  ASSERT_EQ(status, 0) << "the parity script failed: " << CHORUS_SAMPLER_PARITY_SCRIPT;

  std::istringstream lines(output);
  std::string line;
  int64_t cases = 0;
  int64_t expected_cases = -1;
  int64_t shuffled_nonempty = 0;
  while (std::getline(lines, line)) {
    if (line.rfind("END ", 0) == 0) {
      expected_cases = std::stoll(line.substr(4));
      break;
    }
    const size_t colon = line.find(':');
    ASSERT_NE(colon, std::string::npos) << line;
    std::istringstream head(line.substr(0, colon));
    int64_t n = 0, epoch = 0;
    int replicas = 0, rank = 0, shuffle = 0, drop_last = 0;
    uint64_t seed = 0;
    head >> n >> replicas >> rank >> shuffle >> seed >> drop_last >> epoch;
    ASSERT_TRUE(static_cast<bool>(head)) << line;
    std::istringstream tail(line.substr(colon + 1));
    std::vector<int64_t> theirs;
    for (int64_t i; tail >> i;) theirs.push_back(i);

    auto s = make(n, replicas, rank, shuffle != 0, seed, drop_last != 0);
    s.set_epoch(epoch);
    ASSERT_EQ(s.indices(), theirs) << "differs from PyTorch for: " << line.substr(0, colon);
    ASSERT_EQ(s.num_samples(), static_cast<int64_t>(theirs.size()));
    if (shuffle != 0 && theirs.size() > 1) ++shuffled_nonempty;
    ++cases;
  }
  EXPECT_EQ(cases, expected_cases) << "the script's output was cut short";
  EXPECT_GT(shuffled_nonempty, 1000);
  std::printf("compared %lld cases with PyTorch's DistributedSampler\n", static_cast<long long>(cases));
}

}  // namespace
}  // namespace chorus::data
