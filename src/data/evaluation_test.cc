// Exact evaluation: the split (unit), and gather_evaluation / exact_accuracy at W=1..3 with dataset
// sizes that do not divide evenly, including fewer items than ranks (multiproc).
#include "chorus/data/evaluation.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>

#include "chorus/comm/error.h"
#include "chorus/torch/distributed.h"
#include "testing.h"

namespace chorus::data {
namespace {

TEST(EvaluationSplit, ContiguousNearEqualBlocksCoverEveryItemOnce) {
  for (int64_t n : {0, 1, 2, 3, 5, 7, 10, 16, 101, 1000}) {
    for (int world = 1; world <= 8; ++world) {
      int64_t next = 0;
      for (int r = 0; r < world; ++r) {
        const EvaluationRange range = evaluation_range(n, world, r);
        EXPECT_EQ(range.begin, next) << "n=" << n << " world=" << world << " rank=" << r;
        EXPECT_EQ(range.size(), n / world + (r < n % world ? 1 : 0));
        auto idx = evaluation_indices(n, world, r);
        ASSERT_EQ(static_cast<int64_t>(idx.size()), range.size());
        for (size_t i = 0; i < idx.size(); ++i) EXPECT_EQ(idx[i], range.begin + static_cast<int64_t>(i));
        next = range.end;
      }
      EXPECT_EQ(next, n);
    }
  }
}

using testing::usage_error;

TEST(EvaluationSplit, BadArgumentsGetClearErrors) {
  EXPECT_NE(usage_error([] { evaluation_range(-1, 2, 0); }).find("dataset_size is -1"), std::string::npos);
  EXPECT_NE(usage_error([] { evaluation_range(10, 2, 2); }).find("out of range"), std::string::npos);
  EXPECT_NE(usage_error([] { evaluation_range(10, 0, 0); }).find("out of range"), std::string::npos);
  EXPECT_NE(usage_error([] { evaluation_indices(10); }).find("init_process_group"), std::string::npos);
  EXPECT_NE(usage_error([] { gather_evaluation(at::Tensor(), 10); }).find("init_process_group"), std::string::npos);
}

TEST(EvaluationSampler, YieldsThisRanksBlockInOrder) {
  EvaluationSampler s(10, 3, 1);
  EXPECT_EQ(s.indices(), (std::vector<int64_t>{4, 5, 6}));
  auto a = s.next(2);
  auto b = s.next(2);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(*a, (std::vector<size_t>{4, 5}));
  EXPECT_EQ(*b, (std::vector<size_t>{6}));
  EXPECT_FALSE(s.next(2).has_value());
  s.reset(4);  // 4 items over 3 ranks: rank 1 takes item 2
  EXPECT_EQ(*s.next(8), (std::vector<size_t>{2}));
}

// ---- multiproc ----

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

// Item i's result: a row that names i, so order and completeness can be checked with ==.
at::Tensor results_for(const std::vector<int64_t>& items) {
  at::Tensor idx = at::tensor(items, at::kLong).to(at::kFloat).reshape({-1, 1});
  return at::cat({idx, idx * 2 + 1, -idx}, 1);  // rows x 3
}

template <typename F>
void require_usage_error(F&& f, const std::string& needle) {
  std::string what = usage_error(f);
  if (what.find(needle) == std::string::npos) throw std::runtime_error("expected '" + needle + "', got: " + what);
}

void exercise(int rank, int world) {
  dist::init_process_group();
  for (int64_t n : {0, 1, 2, 5, 7, 10, 101}) {
    const std::string at_n = " (n=" + std::to_string(n) + ")";
    const auto mine = evaluation_indices(n);
    std::vector<int64_t> everything(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) everything[static_cast<size_t>(i)] = i;
    const at::Tensor expected = results_for(everything);

    at::Tensor all = gather_evaluation(results_for(mine), n);
    require(all.defined() && all.sizes() == expected.sizes() && at::equal(all, expected), "all ranks" + at_n);

    for (int dst = 0; dst < world; ++dst) {
      at::Tensor got = gather_evaluation(results_for(mine), n, nullptr, dst);
      if (rank == dst) {
        require(got.defined() && got.sizes() == expected.sizes() && at::equal(got, expected), "on dst" + at_n);
      } else {
        require(!got.defined(), "non-dst ranks get an undefined tensor" + at_n);
      }
    }

    // 1-D int64, bool and 3-D results, through a sub-view that is not contiguous.
    at::Tensor ids = at::tensor(mine, at::kLong);
    at::Tensor ids_all = gather_evaluation(ids * 10, n);
    require(at::equal(ids_all, at::arange(n, at::kLong) * 10), "1-D" + at_n);
    at::Tensor flags = gather_evaluation(ids.remainder(3) == 0, n, nullptr, world - 1);
    if (rank == world - 1) require(at::equal(flags, at::arange(n, at::kLong).remainder(3) == 0), "bool" + at_n);
    at::Tensor cube = ids.to(at::kDouble).reshape({-1, 1, 1}).expand({-1, 2, 2}).transpose(1, 2);
    at::Tensor cube_all = gather_evaluation(cube, n);
    require(cube_all.sizes() == at::IntArrayRef({n, 2, 2}) &&
                at::equal(cube_all, at::arange(n, at::kDouble).reshape({-1, 1, 1}).expand({-1, 2, 2})),
            "3-D" + at_n);

    // Accuracy: targets i % 3, predictions wrong exactly when i % 4 == 0.
    at::Tensor targets = ids.remainder(3);
    at::Tensor predicted = at::where(ids.remainder(4) == 0, targets + 1, targets);
    const double want = n == 0 ? 0.0 : static_cast<double>(n - (n + 3) / 4) / static_cast<double>(n);
    require(exact_accuracy(predicted, targets, n) == want, "accuracy from classes" + at_n);
    at::Tensor scores = at::one_hot(predicted, 4).to(at::kFloat);
    require(exact_accuracy(scores, targets, n) == want, "accuracy from scores" + at_n);
  }

  // Mistakes on one rank raise the same UsageError on every rank, and leave the group usable.
  const int64_t n = 10;
  const auto mine = evaluation_indices(n);
  if (world > 1) {
    std::vector<int64_t> padded = mine;
    if (rank == 1) padded.push_back(0);  // what a padding DistributedSampler would do
    require_usage_error([&] { gather_evaluation(results_for(padded), n); }, "rank 1 passed");
    require_usage_error([&] { gather_evaluation(results_for(mine).to(rank == 1 ? at::kDouble : at::kFloat), n); },
                        "disagree on the results' layout");
    require_usage_error([&] { gather_evaluation(results_for(mine).narrow(1, 0, rank == 1 ? 2 : 3), n); },
                        "disagree on the results' layout");
    require_usage_error([&] { gather_evaluation(results_for(mine), n, nullptr, rank == 1 ? 0 : -1); },
                        "ranks disagree");
    require_usage_error([&] { gather_evaluation(rank == 1 ? at::Tensor() : results_for(mine), n); },
                        "rank 1: local_results is undefined");
    require_usage_error([&] { exact_accuracy(at::tensor(padded, at::kLong), at::tensor(padded, at::kLong), n); },
                        "rank 1 passed");
  }
  require_usage_error([&] { gather_evaluation(results_for(mine), n, nullptr, world); }, "dst");
  require_usage_error([&] { gather_evaluation(at::scalar_tensor(1.0), n); }, "0-dimensional");
  require_usage_error([&] { exact_accuracy(at::ones({3}), at::ones({3}), n); }, "integer classes");
  std::vector<int64_t> ten(10);
  for (int64_t i = 0; i < 10; ++i) ten[static_cast<size_t>(i)] = i;
  require(at::equal(gather_evaluation(results_for(mine), n), results_for(ten)), "the group still works after the errors");
  dist::destroy_process_group();
}

class GatherEvaluation : public ::testing::TestWithParam<int> {};

TEST_P(GatherEvaluation, OneRowPerItemInDatasetOrder) {
  EXPECT_EQ(testing::run_ranks(GetParam(), [](int rank, int world, std::shared_ptr<Store>) { exercise(rank, world); },
                               std::chrono::seconds(120)),
            "");
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, GatherEvaluation, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

}  // namespace
}  // namespace chorus::data
