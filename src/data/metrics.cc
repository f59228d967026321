// ROC AUC from integer counts: items sorted by score (descending), equal scores taken as one
// group; each group adds the trapezoid between the ROC points before and after it, kept doubled so
// that it stays an integer: negatives_in_group * (2 * positives_above + positives_in_group).
#include "chorus/data/metrics.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <sstream>
#include <string>

#include "chorus/comm/error.h"
#include "chorus/data/evaluation.h"

namespace chorus::data {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::string number(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

// A column of scores and labels as doubles, with the labels checked; `what` names the column in
// errors ("" for a binary task, " class 3" for a multi-label one).
struct Column {
  std::vector<double> scores;
  std::vector<uint8_t> labels;
  int64_t positives = 0;
};

Column read_column(const double* scores, const double* labels, int64_t n, int64_t stride, const std::string& what) {
  Column c;
  c.scores.resize(static_cast<size_t>(n));
  c.labels.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const double s = scores[i * stride];
    const double l = labels[i * stride];
    if (std::isnan(s)) {
      throw UsageError("roc_auc: the score of item " + std::to_string(i) + what +
                       " is NaN (the model diverged, or a sigmoid/softmax overflowed)");
    }
    if (l != 0 && l != 1) {
      throw UsageError("roc_auc: the label of item " + std::to_string(i) + what + " is " + number(l) +
                       "; labels must be 0 or 1");
    }
    c.scores[static_cast<size_t>(i)] = s;
    c.labels[static_cast<size_t>(i)] = l == 1 ? 1 : 0;
    c.positives += l == 1 ? 1 : 0;
  }
  return c;
}

// NaN when the column holds one class only.
double column_auc(const Column& c) {
  const auto n = static_cast<int64_t>(c.scores.size());
  const int64_t negatives = n - c.positives;
  if (c.positives == 0 || negatives == 0) return kNaN;
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return c.scores[static_cast<size_t>(a)] > c.scores[static_cast<size_t>(b)];
  });
  // Doubled area, an integer: at most 2 * positives * negatives, so int64 holds up to ~2^31 items.
  int64_t area2 = 0;
  int64_t positives_above = 0;
  for (int64_t i = 0; i < n;) {
    const double s = c.scores[static_cast<size_t>(order[static_cast<size_t>(i)])];
    int64_t pos = 0;
    int64_t neg = 0;
    for (; i < n && c.scores[static_cast<size_t>(order[static_cast<size_t>(i)])] == s; ++i) {
      (c.labels[static_cast<size_t>(order[static_cast<size_t>(i)])] != 0 ? pos : neg) += 1;
    }
    area2 += neg * (2 * positives_above + pos);
    positives_above += pos;
  }
  return static_cast<double>(area2) / (2.0 * static_cast<double>(c.positives) * static_cast<double>(negatives));
}

// scores and labels as contiguous CPU doubles of one shape, 1-D or 2-D as `dims` asks.
std::pair<at::Tensor, at::Tensor> as_doubles(const at::Tensor& scores, const at::Tensor& labels, int64_t dims,
                                             const char* who) {
  const std::string name = who;
  if (!scores.defined() || !labels.defined()) throw UsageError(name + ": scores or labels is undefined");
  const std::string shape = dims == 1 ? "1-D (one score per item)" : "2-D (items x classes)";
  if (scores.dim() != dims || labels.dim() != dims) {
    throw UsageError(name + ": scores and labels must be " + shape + ", not " + std::to_string(scores.dim()) +
                     "-D and " + std::to_string(labels.dim()) + "-D");
  }
  if (scores.sizes() != labels.sizes()) {
    throw UsageError(name + ": scores and labels have different shapes");
  }
  if (scores.is_complex() || labels.is_complex()) throw UsageError(name + ": complex scores or labels");
  return {scores.to(at::kCPU, at::kDouble).contiguous(), labels.to(at::kCPU, at::kDouble).contiguous()};
}

}  // namespace

double roc_auc(const at::Tensor& scores, const at::Tensor& labels) {
  auto [s, l] = as_doubles(scores, labels, 1, "roc_auc");
  const Column c = read_column(s.data_ptr<double>(), l.data_ptr<double>(), s.size(0), 1, "");
  const double auc = column_auc(c);
  if (std::isnan(auc)) {
    throw UsageError("roc_auc: only one class is present (" + std::to_string(c.positives) + " positive and " +
                     std::to_string(s.size(0) - c.positives) +
                     " negative items): the AUC is undefined; evaluate on a set holding both");
  }
  return auc;
}

MultiLabelAuc multilabel_roc_auc(const at::Tensor& scores, const at::Tensor& labels) {
  auto [s, l] = as_doubles(scores, labels, 2, "multilabel_roc_auc");
  const int64_t n = s.size(0);
  const int64_t classes = s.size(1);
  MultiLabelAuc r;
  double sum = 0;
  for (int64_t k = 0; k < classes; ++k) {
    const Column c = read_column(s.data_ptr<double>() + k, l.data_ptr<double>() + k, n, classes,
                                 " in class " + std::to_string(k));
    const double auc = column_auc(c);
    r.per_class.push_back(auc);
    if (std::isnan(auc)) {
      ++r.undefined;
    } else {
      sum += auc;
    }
  }
  r.mean = r.undefined == classes ? kNaN : sum / static_cast<double>(classes - r.undefined);
  return r;
}

double exact_roc_auc(const at::Tensor& local_scores, const at::Tensor& local_labels, int64_t dataset_size,
                     ProcessGroup* group) {
  const at::Tensor scores = gather_evaluation(local_scores, dataset_size, group);
  const at::Tensor labels = gather_evaluation(local_labels, dataset_size, group);
  return roc_auc(scores, labels);
}

MultiLabelAuc exact_multilabel_roc_auc(const at::Tensor& local_scores, const at::Tensor& local_labels,
                                       int64_t dataset_size, ProcessGroup* group) {
  const at::Tensor scores = gather_evaluation(local_scores, dataset_size, group);
  const at::Tensor labels = gather_evaluation(local_labels, dataset_size, group);
  return multilabel_roc_auc(scores, labels);
}

}  // namespace chorus::data
