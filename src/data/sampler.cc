// DistributedSampler: PyTorch's index math (torch/utils/data/distributed.py), step for step.
#include "chorus/data/sampler.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "chorus/comm/error.h"
#include "chorus/torch/distributed.h"

namespace chorus::data {
namespace {

const char* kWhere = "chorus::data::DistributedSampler: ";

}  // namespace

DistributedSampler::DistributedSampler(int64_t dataset_size, DistributedSamplerOptions options)
    : options_(options) {
  if (options_.num_replicas == -1 || options_.rank == -1) {
    if (!dist::is_initialized()) {
      throw UsageError(std::string(kWhere) +
                       "num_replicas and rank are -1 (take them from the default process group) but it is not "
                       "initialised; call chorus::dist::init_process_group() first or pass both explicitly");
    }
    if (options_.num_replicas == -1) options_.num_replicas = dist::get_world_size();
    if (options_.rank == -1) options_.rank = dist::get_rank();
  }
  if (options_.num_replicas < 1) {
    throw UsageError(std::string(kWhere) + "num_replicas is " + std::to_string(options_.num_replicas) +
                     "; it must be at least 1 (or -1 for the default group's world size)");
  }
  if (options_.rank < 0 || options_.rank >= options_.num_replicas) {
    throw UsageError(std::string(kWhere) + "rank " + std::to_string(options_.rank) +
                     " is outside [0, " + std::to_string(options_.num_replicas - 1) + "] (num_replicas " +
                     std::to_string(options_.num_replicas) + ")");
  }
  set_dataset_size(dataset_size);
}

void DistributedSampler::set_dataset_size(int64_t dataset_size) {
  if (dataset_size < 0) {
    throw UsageError(std::string(kWhere) + "dataset_size is " + std::to_string(dataset_size) +
                     "; it must be at least 0");
  }
  dataset_size_ = dataset_size;
  const int64_t n = options_.num_replicas;
  // PyTorch: drop_last and an uneven split give ceil((len - n) / n), which is floor(len / n) for
  // len > 0; otherwise ceil(len / n).
  num_samples_ = options_.drop_last ? dataset_size / n : (dataset_size + n - 1) / n;
}

void DistributedSampler::set_epoch(int64_t epoch) {
  epoch_ = epoch;
  advance_on_reset_ = false;
}

std::vector<int64_t> DistributedSampler::indices() const {
  const int64_t len = dataset_size_;
  std::vector<int64_t> order(static_cast<size_t>(len));
  if (options_.shuffle && len > 0) {
    // Python: g = torch.Generator(); g.manual_seed(seed + epoch); torch.randperm(len, generator=g).
    // manual_seed maps negative seeds to their value modulo 2^64, as the unsigned sum does here.
    const uint64_t seed = options_.seed + static_cast<uint64_t>(epoch_);
    at::Tensor perm = at::randperm(len, at::detail::createCPUGenerator(seed), at::TensorOptions().dtype(at::kLong));
    std::memcpy(order.data(), perm.data_ptr<int64_t>(), order.size() * sizeof(int64_t));
  } else {
    for (int64_t i = 0; i < len; ++i) order[static_cast<size_t>(i)] = i;
  }

  // Padding repeats the leading indices, cyclically when the dataset is shorter than the padding;
  // drop_last cuts the tail. Either way the list ends up total_size() long.
  const int64_t total = total_size();
  const int64_t n = options_.num_replicas;
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(num_samples_));
  for (int64_t i = options_.rank; i < total; i += n) mine.push_back(order[static_cast<size_t>(i % len)]);
  return mine;
}

void DistributedSampler::start_pass() {
  order_ = indices();
  position_ = 0;
  in_pass_ = true;
}

void DistributedSampler::reset(torch::optional<size_t> new_size) {
  if (new_size.has_value()) set_dataset_size(static_cast<int64_t>(*new_size));
  if (options_.auto_epoch && advance_on_reset_) ++epoch_;
  advance_on_reset_ = true;
  start_pass();
}

torch::optional<std::vector<size_t>> DistributedSampler::next(size_t batch_size) {
  if (!in_pass_) start_pass();
  if (position_ >= order_.size() || batch_size == 0) return torch::nullopt;
  const size_t end = std::min(order_.size(), position_ + batch_size);
  std::vector<size_t> batch(order_.begin() + static_cast<std::ptrdiff_t>(position_),
                            order_.begin() + static_cast<std::ptrdiff_t>(end));
  position_ = end;
  return batch;
}

void DistributedSampler::save(torch::serialize::OutputArchive& archive) const {
  auto put = [&](const char* key, int64_t v) { archive.write(std::string("chorus_sampler/") + key, c10::IValue(v)); };
  put("version", 1);
  put("epoch", epoch_);
  put("position", in_pass_ ? static_cast<int64_t>(position_) : -1);
  put("advance_on_reset", advance_on_reset_ ? 1 : 0);
  put("dataset_size", dataset_size_);
  put("num_replicas", options_.num_replicas);
  int64_t seed_bits = 0;
  std::memcpy(&seed_bits, &options_.seed, sizeof(seed_bits));
  put("seed", seed_bits);
  put("shuffle", options_.shuffle ? 1 : 0);
  put("drop_last", options_.drop_last ? 1 : 0);
}

void DistributedSampler::load(torch::serialize::InputArchive& archive) {
  auto get = [&](const char* key) {
    c10::IValue v;
    archive.read(std::string("chorus_sampler/") + key, v);
    return v.toInt();
  };
  if (get("version") != 1) throw UsageError(std::string(kWhere) + "load: unknown archive version");
  int64_t seed_bits = 0;
  std::memcpy(&seed_bits, &options_.seed, sizeof(seed_bits));
  auto same = [&](const char* key, int64_t mine) {
    const int64_t saved = get(key);
    if (saved != mine) {
      throw UsageError(std::string(kWhere) + "load: the archive was saved by a sampler with " + key + " " +
                       std::to_string(saved) + " but this one has " + std::to_string(mine) +
                       "; the saved position would point into a different order. Construct the sampler with the "
                       "same dataset_size, num_replicas, seed, shuffle and drop_last, or call set_epoch() instead");
    }
  };
  same("dataset_size", dataset_size_);
  same("num_replicas", options_.num_replicas);
  same("seed", seed_bits);
  same("shuffle", options_.shuffle ? 1 : 0);
  same("drop_last", options_.drop_last ? 1 : 0);
  epoch_ = get("epoch");
  advance_on_reset_ = get("advance_on_reset") != 0;
  const int64_t position = get("position");
  if (position < 0) {
    in_pass_ = false;
    order_.clear();
    position_ = 0;
  } else {
    start_pass();
    position_ = std::min(static_cast<size_t>(position), order_.size());
  }
}

}  // namespace chorus::data
