// ROC AUC: hand-computed values and errors (unit), scikit-learn's roc_auc_score on random cases
// with and without ties (parity), and the distributed form at W=1..3 equal to one process holding
// the whole set, bit for bit (multiproc).
#include "chorus/data/metrics.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "chorus/comm/error.h"
#include "chorus/data/evaluation.h"
#include "chorus/torch/distributed.h"
#include "testing.h"

namespace chorus::data {
namespace {

using testing::usage_error;

at::Tensor vec(std::vector<double> v) { return at::tensor(v, at::kDouble); }

TEST(RocAuc, HandComputedValues) {
  // sklearn's documentation example: 0.75.
  EXPECT_DOUBLE_EQ(roc_auc(vec({0.1, 0.4, 0.35, 0.8}), vec({0, 0, 1, 1})), 0.75);
  EXPECT_EQ(roc_auc(vec({0.1, 0.2, 0.9, 1.0}), vec({0, 0, 1, 1})), 1.0);
  EXPECT_EQ(roc_auc(vec({0.9, 1.0, 0.1, 0.2}), vec({0, 0, 1, 1})), 0.0);
  EXPECT_EQ(roc_auc(vec({0.5, 0.5, 0.5}), vec({0, 1, 1})), 0.5);  // all tied
  // A tie between a positive and a negative counts half. Positives {0.9, 0.5}, negatives {0.5, 0.1}: pairs (0.9>0.5) (0.9>0.1) (0.5=0.5) (0.5>0.1) = 3.5/4.
  EXPECT_EQ(roc_auc(vec({0.9, 0.5, 0.5, 0.1}), vec({1, 1, 0, 0})), 0.875);
  // Order of the items, dtypes of scores and labels do not matter.
  EXPECT_EQ(roc_auc(at::tensor({3, 1, 2, 0}, at::kInt), at::tensor({1, 0, 1, 0}).to(at::kBool)), 1.0);
  EXPECT_EQ(roc_auc(at::tensor({0.4f, 0.1f, 0.8f, 0.35f}), at::tensor({0, 0, 1, 1}, at::kLong)), 0.75);
  // Infinite scores are ordinary scores.
  EXPECT_EQ(roc_auc(vec({-INFINITY, INFINITY, 0}), vec({0, 1, 0})), 1.0);
}

TEST(RocAuc, MultiLabelPerClassAndMean) {
  at::Tensor scores = at::tensor({0.9, 0.1, 0.2, 0.8, 0.6, 0.3, 0.4, 0.7}, at::kDouble).reshape({4, 2});
  at::Tensor labels = at::tensor({1, 0, 0, 1, 1, 0, 0, 0}, at::kFloat).reshape({4, 2});
  MultiLabelAuc r = multilabel_roc_auc(scores, labels);
  ASSERT_EQ(r.per_class.size(), 2u);
  // Class 0: scores {0.9, 0.2, 0.6, 0.4}, positives {0.9, 0.6}: 1. Class 1: {0.1, 0.8, 0.3, 0.7},
  // positive {0.8}: 1.
  EXPECT_EQ(r.per_class[0], 1.0);
  EXPECT_EQ(r.per_class[1], 1.0);
  EXPECT_EQ(r.mean, 1.0);
  EXPECT_EQ(r.undefined, 0);
  // A class with no positive is NaN, counted, and left out of the mean.
  labels.select(1, 1).zero_();
  r = multilabel_roc_auc(scores, labels);
  EXPECT_EQ(r.per_class[0], 1.0);
  EXPECT_TRUE(std::isnan(r.per_class[1]));
  EXPECT_EQ(r.undefined, 1);
  EXPECT_EQ(r.mean, 1.0);
  labels.zero_();
  EXPECT_TRUE(std::isnan(multilabel_roc_auc(scores, labels).mean));
}

TEST(RocAuc, MistakesAreOneLineUsageErrors) {
  EXPECT_NE(usage_error([] { roc_auc(vec({0.1, 0.2}), vec({1, 1})); }).find("only one class is present (2 positive and 0"),
            std::string::npos);
  EXPECT_NE(usage_error([] { roc_auc(vec({0.1, NAN, 0.3}), vec({1, 0, 1})); }).find("score of item 1 is NaN"),
            std::string::npos);
  EXPECT_NE(usage_error([] { roc_auc(vec({0.1, 0.2}), vec({1, 2})); }).find("label of item 1 is 2"), std::string::npos);
  EXPECT_NE(usage_error([] { roc_auc(vec({0.1, 0.2}), vec({1, 0, 1})); }).find("different shapes"), std::string::npos);
  EXPECT_NE(usage_error([] { roc_auc(vec({0.1, 0.2}).reshape({2, 1}), vec({1, 0})); }).find("must be 1-D"),
            std::string::npos);
  EXPECT_NE(usage_error([] { roc_auc(at::Tensor(), vec({1, 0})); }).find("undefined"), std::string::npos);
  EXPECT_NE(usage_error([] { multilabel_roc_auc(vec({0.1, 0.2}), vec({1, 0})); }).find("2-D (items x classes)"),
            std::string::npos);
  EXPECT_NE(usage_error([] {
              multilabel_roc_auc(at::zeros({3, 2}), at::tensor({0., 1., 0., 1., 0.5, 1.}).reshape({3, 2}));
            }).find("label of item 2 in class 0 is 0.5"),
            std::string::npos);
}

// Random cases: float32 and float64 scores, continuous or with many ties, balanced or rare
// positives, sizes 2..5000; multi-label [500, 10].
struct Case {
  at::Tensor scores;  // [n] or [n, classes]
  at::Tensor labels;
};

std::vector<Case> random_cases() {
  at::Generator gen = at::detail::createCPUGenerator(2026);
  std::vector<Case> cases;
  for (int64_t n : {2, 3, 10, 101, 1000, 5000}) {
    for (double rate : {0.5, 0.05}) {
      for (int kind = 0; kind < 3; ++kind) {
        at::Tensor s = at::rand({n}, gen, at::kDouble);
        if (kind == 1) s = (s * 8).floor() / 8;       // many ties
        if (kind == 2) s = s.to(at::kFloat);          // float32 scores
        at::Tensor l = (at::rand({n}, gen, at::kDouble) < rate).to(at::kFloat);
        l[0] = 1;  // both classes present
        l[1] = 0;
        cases.push_back({s, l});
      }
    }
  }
  at::Tensor s = at::rand({500, 10}, gen, at::kFloat);
  at::Tensor l = (at::rand({500, 10}, gen, at::kFloat) < s * 0.8 + 0.1).to(at::kFloat);  // informative scores
  cases.push_back({s, l});
  cases.push_back({(s * 4).round() / 4, l});  // ties
  return cases;
}

// Writes the cases as text for metrics_parity.py: "n classes" then n lines of scores, n of labels.
std::string write_cases(const std::vector<Case>& cases) {
  const std::string path = "/tmp/" + testing::unique_name("metrics-parity") + ".txt";
  std::ofstream out(path);
  out.precision(17);
  for (const Case& c : cases) {
    const at::Tensor s = c.scores.to(at::kDouble).reshape({c.scores.size(0), -1});
    const at::Tensor l = c.labels.to(at::kDouble).reshape({c.labels.size(0), -1});
    out << s.size(0) << ' ' << s.size(1) << '\n';
    for (const at::Tensor& t : {s, l}) {
      for (int64_t i = 0; i < t.size(0); ++i) {
        for (int64_t k = 0; k < t.size(1); ++k) out << (k > 0 ? " " : "") << t[i][k].item<double>();
        out << '\n';
      }
    }
  }
  return path;
}

TEST(RocAucParity, EqualsScikitLearn) {
  int status = 0;
  testing::run_capture(testing::parity_python() + " -c 'import sklearn.metrics' 2>/dev/null", &status);
  if (status != 0) GTEST_SKIP() << "/usr/bin/python3 cannot import sklearn (Debian python3-sklearn)";
  const std::vector<Case> cases = random_cases();
  const std::string path = write_cases(cases);
  const std::string out =
      testing::run_capture(testing::parity_python() + " " CHORUS_METRICS_PARITY_SCRIPT " " + path, &status);
  std::remove(path.c_str());
  ASSERT_EQ(status, 0) << out;
  std::istringstream in(out);
  double max_diff = 0;
  int compared = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    std::vector<double> ours;
    if (c.scores.dim() == 1) {
      ours.push_back(roc_auc(c.scores, c.labels));
    } else {
      ours = multilabel_roc_auc(c.scores, c.labels).per_class;
    }
    for (size_t k = 0; k < ours.size(); ++k) {
      if (std::isnan(ours[k])) continue;  // a class with one label value: sklearn raises, the script skips it
      double theirs = 0;
      ASSERT_TRUE(in >> theirs) << "case " << i << ": no value from the script; it printed:\n" << out;
      EXPECT_NEAR(ours[k], theirs, 1e-12) << "case " << i << " class " << k;
      max_diff = std::max(max_diff, std::abs(ours[k] - theirs));
      ++compared;
    }
    if (c.scores.dim() == 2) {
      double macro = 0;
      ASSERT_TRUE(in >> macro);
      EXPECT_NEAR(multilabel_roc_auc(c.scores, c.labels).mean, macro, 1e-12) << "case " << i << " macro";
    }
  }
  std::printf("%d AUC values compared with sklearn.metrics.roc_auc_score: max abs diff %.3g\n", compared, max_diff);
}

// ---- multiproc ----

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

void exercise(int rank, int world) {
  dist::init_process_group();
  at::Generator gen = at::detail::createCPUGenerator(7);
  for (int64_t n : {2, 7, 100, 1001}) {
    // The same whole set on every rank (same seed); each passes its block of it.
    at::Tensor scores = (at::rand({n, 4}, gen, at::kFloat) * 16).floor();  // ties across ranks' blocks
    at::Tensor labels = (at::rand({n, 4}, gen, at::kFloat) < 0.4).to(at::kFloat);
    labels.select(0, 0).fill_(1);
    labels.select(0, 1).fill_(0);
    labels.select(1, 3).zero_();  // class 3 undefined
    const EvaluationRange mine = evaluation_range(n, world, rank);
    const at::Tensor my_scores = scores.narrow(0, mine.begin, mine.size());
    const at::Tensor my_labels = labels.narrow(0, mine.begin, mine.size());

    const MultiLabelAuc whole = multilabel_roc_auc(scores, labels);
    const MultiLabelAuc got = exact_multilabel_roc_auc(my_scores, my_labels, n);
    const std::string at_n = " (n=" + std::to_string(n) + ")";
    require(got.per_class.size() == 4 && got.undefined == 1 && got.mean == whole.mean, "mean" + at_n);
    for (size_t k = 0; k < 3; ++k) require(got.per_class[k] == whole.per_class[k], "class " + std::to_string(k) + at_n);
    require(std::isnan(got.per_class[3]), "class 3 undefined" + at_n);
    require(exact_roc_auc(my_scores.select(1, 0), my_labels.select(1, 0), n) == roc_auc(scores.select(1, 0), labels.select(1, 0)),
            "binary" + at_n);
  }
  // A bad label on one rank: every rank raises the same UsageError, and the group still works.
  at::Tensor s = at::arange(10, at::kFloat);
  at::Tensor l = (at::arange(10) % 2).to(at::kFloat);
  if (rank == world - 1) l[9] = 3;
  const EvaluationRange mine = evaluation_range(10, world, rank);
  const std::string what = usage_error([&] {
    exact_roc_auc(s.narrow(0, mine.begin, mine.size()), l.narrow(0, mine.begin, mine.size()), 10);
  });
  require(what.find("label of item 9 is 3") != std::string::npos, "bad label on the last rank: " + what);
  const std::string one_class = usage_error([&] {
    exact_roc_auc(s.narrow(0, mine.begin, mine.size()), at::zeros({mine.size()}), 10);
  });
  require(one_class.find("only one class") != std::string::npos, "one class: " + one_class);
  l[9] = 1;
  require(exact_roc_auc(s.narrow(0, mine.begin, mine.size()), l.narrow(0, mine.begin, mine.size()), 10) ==
              roc_auc(s, l),
          "the group still works after the errors");
  dist::destroy_process_group();
}

class ExactRocAuc : public ::testing::TestWithParam<int> {};

TEST_P(ExactRocAuc, EqualsOneProcessOnTheWholeSet) {
  EXPECT_EQ(testing::run_ranks(GetParam(), [](int rank, int world, std::shared_ptr<Store>) { exercise(rank, world); },
                               std::chrono::seconds(60)),
            "");
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ExactRocAuc, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

}  // namespace
}  // namespace chorus::data
