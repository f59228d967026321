// Ranking metrics over a whole evaluation set: ROC AUC for a binary task and per class for a
// multi-label one, computed exactly as scikit-learn's roc_auc_score, locally or across ranks.
//
//   // each rank: sigmoid scores and 0/1 labels of its evaluation_indices (chorus/data/evaluation.h)
//   chorus::data::MultiLabelAuc auc = chorus::data::exact_multilabel_roc_auc(scores, labels, val_size);
//   std::cout << "mean AUC " << auc.mean << ", class 3: " << auc.per_class[3] << "\n";
//
// Definition: the area under the ROC curve, the trapezoids through every distinct score (ties count
// half: the Mann-Whitney U statistic over positives x negatives). It is computed from integer counts
// and divided once, so it agrees with sklearn.metrics.roc_auc_score(labels, scores) (average=None
// per class) to within rounding (1e-12 in the tests), and it does not depend on the order of the
// items. Distributed: the scores and labels are gathered (gather_evaluation: every item once, no
// padding) and every rank computes the same value from the same data, so ranks agree bit for bit
// and with a single process holding the whole set.
//
// Where the AUC is undefined (a class whose labels are all 0 or all 1) scikit-learn raises an
// error. Here roc_auc raises UsageError; the multi-label functions give NaN for that class, count it
// in `undefined` and leave it out of `mean` (so one class missing from a validation split does not
// end a training run), and `mean` equals sklearn's average="macro" whenever every class is defined.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "chorus/comm/process_group.h"

namespace chorus::data {

// ROC AUC of one binary task. scores: 1-D, any real dtype (probabilities, logits, any monotone
// score). labels: 1-D, the same length, each 0 or 1 (bool, integer or floating). Local, pure.
// Throws UsageError: undefined or not 1-D tensors, different lengths, a label other than 0/1, a NaN
// score (naming the item), or only one class present (saying how many items of each).
double roc_auc(const at::Tensor& scores, const at::Tensor& labels);

struct MultiLabelAuc {
  std::vector<double> per_class;  // by column; NaN where the column has a single label value
  double mean = 0;                // over the defined classes (NaN when none is)
  int64_t undefined = 0;          // classes whose AUC is NaN
};

// Per-class ROC AUC of a multi-label task. scores and labels: [items, classes], labels 0/1. Local,
// pure. Throws UsageError for the same mistakes as roc_auc (a NaN or bad label names item and class).
MultiLabelAuc multilabel_roc_auc(const at::Tensor& scores, const at::Tensor& labels);

// Collective over `group` (nullptr: the default group), on every rank: roc_auc of the whole
// evaluation set. local_scores and local_labels hold this rank's rows of evaluation_indices(
// dataset_size), in that order (as gather_evaluation takes them). Argument mistakes on any rank
// raise the same UsageError on every rank (gather_evaluation's checks, then roc_auc's on the
// gathered set); transport errors are the group's (TimeoutError, PeerError).
double exact_roc_auc(const at::Tensor& local_scores, const at::Tensor& local_labels, int64_t dataset_size,
                     ProcessGroup* group = nullptr);

// The same for a multi-label task: [rows, classes] on each rank.
MultiLabelAuc exact_multilabel_roc_auc(const at::Tensor& local_scores, const at::Tensor& local_labels,
                                       int64_t dataset_size, ProcessGroup* group = nullptr);

}  // namespace chorus::data
