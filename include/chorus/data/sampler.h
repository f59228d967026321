// DistributedSampler: torch.utils.data.DistributedSampler for the libtorch C++ frontend.
//
//   chorus::data::DistributedSampler sampler(dataset.size().value());  // world and rank: default group
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);
//     for (int64_t i : sampler.indices()) ...
//   }
//
// or, inside a libtorch data loader (which owns its copy of the sampler, so set_epoch on yours has
// no effect there), with auto_epoch so that every pass over the loader is the next epoch:
//
//   chorus::data::DistributedSamplerOptions o;
//   o.auto_epoch = true;
//   auto loader = torch::data::make_data_loader(dataset, chorus::data::DistributedSampler(n, o), 64);
//
// Contract:
// - For the same dataset_size, num_replicas, rank, shuffle, seed, drop_last and epoch, indices() is
//   exactly what PyTorch's DistributedSampler yields, in the same order (checked against Python's
//   torch by sampler_parity_test). In short: the dataset order is torch.randperm(dataset_size) with a
//   CPU generator seeded with seed + epoch (or 0..dataset_size-1 without shuffle); without drop_last
//   it is padded to total_size by repeating its leading indices (cyclically, when the dataset is
//   smaller than the padding); with drop_last its tail is cut to total_size; rank r takes every
//   num_replicas-th index starting at r.
// - Every rank gets num_samples() indices, so all ranks run the same number of steps. The price is
//   that without drop_last up to num_replicas - 1 items are seen twice per epoch, and with it up to
//   num_replicas - 1 are never seen: use evaluation_indices / gather_evaluation
//   (chorus/data/evaluation.h) for metrics that must count every item exactly once.
// - seed + epoch is taken modulo 2^64 (PyTorch raises beyond 2^64 - 1).
// - Pure: besides resolving num_replicas / rank = -1 from the default process group at
//   construction, it never communicates. Not thread-safe; one sampler per data loader.
#pragma once

#include <torch/data/samplers/base.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace chorus::data {

struct DistributedSamplerOptions {
  int num_replicas = -1;  // -1: chorus::dist::get_world_size() of the default process group
  int rank = -1;          // -1: chorus::dist::get_rank() of the default process group
  bool shuffle = true;
  uint64_t seed = 0;      // must be the same on every rank
  bool drop_last = false;
  // As a torch Sampler: every reset() advances the epoch by one, except the first reset() and the
  // first one after set_epoch() (so set_epoch(e) pins the next pass to epoch e). Without it the
  // epoch changes only through set_epoch(), as in PyTorch.
  bool auto_epoch = false;
};

class DistributedSampler : public torch::data::samplers::Sampler<> {
 public:
  // Throws UsageError for dataset_size < 0, num_replicas < 1, rank outside [0, num_replicas), or
  // -1 values without an initialised default process group.
  explicit DistributedSampler(int64_t dataset_size, DistributedSamplerOptions options = {});

  // The epoch the next pass uses; as in PyTorch it changes the order only when shuffling.
  void set_epoch(int64_t epoch);
  int64_t epoch() const { return epoch_; }

  // This rank's indices for the current epoch (num_samples() of them), in order.
  std::vector<int64_t> indices() const;

  // Indices per rank and per epoch: ceil(dataset_size / num_replicas), or
  // floor(dataset_size / num_replicas) with drop_last.
  int64_t num_samples() const { return num_samples_; }
  // num_samples() * num_replicas.
  int64_t total_size() const { return num_samples_ * options_.num_replicas; }
  int64_t dataset_size() const { return dataset_size_; }
  // The options with num_replicas and rank resolved.
  const DistributedSamplerOptions& options() const { return options_; }

  // torch::data::samplers::Sampler. reset() fixes the order of the next pass at the current epoch
  // (after advancing it, with auto_epoch) and rewinds; new_size replaces dataset_size. next() hands
  // out up to batch_size indices of that order, then nullopt. A next() before any reset() starts a
  // pass at the current epoch.
  void reset(torch::optional<size_t> new_size = torch::nullopt) override;
  torch::optional<std::vector<size_t>> next(size_t batch_size) override;
  // Saves the epoch and the position in the pass; load() restores them and rebuilds the order.
  // Every rank is at the same epoch and position, so one rank's archive serves all. load() throws
  // UsageError if the archive was saved with another num_replicas, seed, shuffle, drop_last or
  // dataset_size (the position would point into a different order).
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  void set_dataset_size(int64_t dataset_size);
  void start_pass();

  int64_t dataset_size_ = 0;
  DistributedSamplerOptions options_;
  int64_t num_samples_ = 0;
  int64_t epoch_ = 0;
  bool advance_on_reset_ = false;  // a reset() has run since construction / set_epoch()
  bool in_pass_ = false;           // order_ holds the current pass
  std::vector<int64_t> order_;
  size_t position_ = 0;
};

}  // namespace chorus::data
