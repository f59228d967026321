// Exact distributed evaluation: every dataset item is evaluated once, by one rank, and the results
// come back one per item, in dataset order.
//
// DistributedSampler pads the dataset so that all ranks take the same number of steps; for
// training that is harmless, for a metric it counts up to num_replicas - 1 items twice
// (pytorch/pytorch#25162). Here instead:
//
//   auto mine = chorus::data::evaluation_indices(test_set_size);        // this rank's items
//   at::Tensor logits = model->forward(batch_of(mine));                 // one row per item, in order
//   at::Tensor all = chorus::data::gather_evaluation(logits, test_set_size);  // test_set_size rows
//
// The split: rank r of W takes the contiguous block [begin, end) of the dataset, the first
// dataset_size % W ranks one item more than the others (floor or ceil of dataset_size / W), with
// no padding and no duplicates. Ranks may therefore run different numbers of evaluation steps:
// nothing in the evaluation loop may be a collective (run the model in eval mode without DDP's
// gradient hooks), only gather_evaluation / exact_accuracy at the end.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/data/samplers/base.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "chorus/comm/process_group.h"

namespace chorus::data {

// Rank `rank`'s block [begin, end) of the evaluation split.
struct EvaluationRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};

// Pure; throws UsageError for dataset_size < 0, num_replicas < 1 or rank outside [0, num_replicas).
EvaluationRange evaluation_range(int64_t dataset_size, int num_replicas, int rank);
// begin, begin + 1, ..., end - 1 of evaluation_range.
std::vector<int64_t> evaluation_indices(int64_t dataset_size, int num_replicas, int rank);
// The same for this rank of `group` (nullptr: the default process group).
std::vector<int64_t> evaluation_indices(int64_t dataset_size, ProcessGroup* group = nullptr);

// Gathers per-item results. local_results (any dtype, any device, dim >= 1) holds one row along
// dim 0 per index of this rank's evaluation_indices, in that order; every rank's rows must have
// the same trailing shape and dtype. Returns a tensor of dataset_size rows in dataset order, row i
// being the result for item i, on local_results' device: on every rank (dst = -1) or on rank dst
// only (the others get an undefined tensor).
//
// Collective over `group` (nullptr: the default group): every rank calls it with the same
// dataset_size and dst. The ranks first exchange a description of their arguments, so a
// disagreement (row count, trailing shape, dtype, dataset_size, dst), an undefined or 0-dim tensor
// raises the same UsageError on every rank instead of a hang. Errors of the transport are those of
// ProcessGroup (TimeoutError, PeerError).
at::Tensor gather_evaluation(const at::Tensor& local_results, int64_t dataset_size, ProcessGroup* group = nullptr,
                             int dst = -1);

// Exact accuracy over the whole dataset, on every rank. local_predictions holds this rank's
// predicted classes (one per item, integer) or scores (items x classes; the argmax of each row is
// the prediction); local_targets the classes, one per item; both in the order of this rank's
// evaluation_indices. Returns correct / dataset_size (0 for an empty dataset), with every item
// counted exactly once. Collective, with the same argument checks as gather_evaluation.
double exact_accuracy(const at::Tensor& local_predictions, const at::Tensor& local_targets, int64_t dataset_size,
                      ProcessGroup* group = nullptr);

// A torch Sampler over this rank's evaluation_indices, in order, for torch::data::make_data_loader.
// reset(new_size) recomputes the split for a new dataset size. save/load keep the position.
class EvaluationSampler : public torch::data::samplers::Sampler<> {
 public:
  // num_replicas / rank = -1: from the default process group.
  explicit EvaluationSampler(int64_t dataset_size, int num_replicas = -1, int rank = -1);

  const std::vector<int64_t>& indices() const { return indices_; }
  int64_t dataset_size() const { return dataset_size_; }

  void reset(torch::optional<size_t> new_size = torch::nullopt) override;
  torch::optional<std::vector<size_t>> next(size_t batch_size) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  int64_t dataset_size_ = 0;
  int num_replicas_ = 1;
  int rank_ = 0;
  std::vector<int64_t> indices_;
  size_t position_ = 0;
};

}  // namespace chorus::data
