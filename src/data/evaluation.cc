// Exact distributed evaluation: a split without padding, and gathers that put one result per item
// back in dataset order.
//
// Both collectives start with one all_gather_object of a short text describing this rank's
// arguments (and any local problem with them). Every rank then runs the same checks on the same
// descriptions, so a mistake on one rank becomes the same UsageError on all of them rather than a
// mismatched collective or a hang.
#include "chorus/data/evaluation.h"

#include <ATen/ATen.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <string>

#include "chorus/comm/check.h"
#include "chorus/comm/error.h"
#include "chorus/comm/types.h"
#include "chorus/torch/distributed.h"

namespace chorus::data {
namespace {

ProcessGroup& group_or_default(ProcessGroup* group) { return group != nullptr ? *group : dist::default_group(); }

std::string range_text(const EvaluationRange& r) {
  return "[" + std::to_string(r.begin) + ", " + std::to_string(r.end) + ")";
}

// What one rank passed to gather_evaluation / exact_accuracy.
struct Description {
  int64_t dataset_size = 0;
  int64_t dst = -1;
  int64_t rows = 0;
  int64_t dtype = -1;              // c10::ScalarType, -1 when undefined
  std::vector<int64_t> trailing;   // shape after dim 0
  int64_t correct = 0;             // exact_accuracy only
  std::string problem;             // a local mistake, found before the exchange

  std::string encode() const {
    std::ostringstream out;
    out << dataset_size << ' ' << dst << ' ' << rows << ' ' << dtype << ' ' << correct << ' ' << trailing.size();
    for (int64_t d : trailing) out << ' ' << d;
    out << '|' << problem;
    return out.str();
  }

  static Description decode(const std::string& text) {
    Description d;
    const size_t bar = text.find('|');
    std::istringstream in(text.substr(0, bar));
    size_t ntrail = 0;
    in >> d.dataset_size >> d.dst >> d.rows >> d.dtype >> d.correct >> ntrail;
    d.trailing.resize(ntrail);
    for (auto& t : d.trailing) in >> t;
    if (!in || bar == std::string::npos) {
      throw Error("chorus::data: could not read a peer's evaluation description '" + text + "'");
    }
    d.problem = text.substr(bar + 1);
    return d;
  }
};

std::string shape_text(const std::vector<int64_t>& trailing) {
  std::string s = "[rows";
  for (int64_t d : trailing) s += ", " + std::to_string(d);
  return s + "]";
}

std::string dtype_text(int64_t dtype) {
  if (dtype < 0) return "undefined";
  std::ostringstream out;
  out << static_cast<c10::ScalarType>(dtype);
  return out.str();
}

// Exchanges the descriptions and runs the checks common to both collectives; throws the same
// UsageError on every rank. compare_layout: the trailing shape and dtype must agree too.
std::vector<Description> exchange_and_check(ProcessGroup& pg, const Description& mine, const char* op,
                                            bool compare_layout) {
  auto work = pg.all_gather_object(mine.encode());
  work->wait();
  std::vector<Description> all;
  for (const auto& text : work->objects()) all.push_back(Description::decode(text));

  const int world = pg.size();
  const std::string where = std::string("chorus::data::") + op + ": ";
  for (int r = 0; r < world; ++r) {
    const Description& d = all[static_cast<size_t>(r)];
    if (!d.problem.empty()) throw UsageError(where + "rank " + std::to_string(r) + ": " + d.problem);
  }
  const Description& first = all[0];
  for (int r = 0; r < world; ++r) {
    const Description& d = all[static_cast<size_t>(r)];
    if (d.dataset_size != first.dataset_size || d.dst != first.dst) {
      throw UsageError(where + "ranks disagree: rank 0 passed dataset_size " + std::to_string(first.dataset_size) +
                       " and dst " + std::to_string(first.dst) + ", rank " + std::to_string(r) + " passed " +
                       std::to_string(d.dataset_size) + " and " + std::to_string(d.dst) +
                       "; every rank must pass the same values");
    }
  }
  if (first.dataset_size < 0) {
    throw UsageError(where + "dataset_size is " + std::to_string(first.dataset_size) + "; it must be at least 0");
  }
  if (first.dst < -1 || first.dst >= world) {
    throw UsageError(where + "dst " + std::to_string(first.dst) + " is not a rank of this group of size " +
                     std::to_string(world) + " (or -1 for every rank)");
  }
  for (int r = 0; r < world; ++r) {
    const Description& d = all[static_cast<size_t>(r)];
    const EvaluationRange range = evaluation_range(first.dataset_size, world, r);
    if (d.rows != range.size()) {
      throw UsageError(where + "rank " + std::to_string(r) + " passed " + std::to_string(d.rows) +
                       " rows but its evaluation block " + range_text(range) + " of the " +
                       std::to_string(first.dataset_size) + " items has " + std::to_string(range.size()) +
                       "; evaluate exactly evaluation_indices(dataset_size) on each rank, with no padding");
    }
    if (compare_layout && (d.dtype != first.dtype || d.trailing != first.trailing)) {
      throw UsageError(where + "ranks disagree on the results' layout: rank 0 has dtype " + dtype_text(first.dtype) +
                       " and shape " + shape_text(first.trailing) + ", rank " + std::to_string(r) + " has " +
                       dtype_text(d.dtype) + " and " + shape_text(d.trailing));
    }
  }
  return all;
}

}  // namespace

EvaluationRange evaluation_range(int64_t dataset_size, int num_replicas, int rank) {
  if (dataset_size < 0) {
    throw UsageError("chorus::data::evaluation_range: dataset_size is " + std::to_string(dataset_size) +
                     "; it must be at least 0");
  }
  if (num_replicas < 1 || rank < 0 || rank >= num_replicas) {
    throw UsageError("chorus::data::evaluation_range: rank " + std::to_string(rank) + " of num_replicas " +
                     std::to_string(num_replicas) + " is out of range; need num_replicas >= 1 and 0 <= rank < num_replicas");
  }
  const int64_t base = dataset_size / num_replicas;
  const int64_t extra = dataset_size % num_replicas;  // the first `extra` ranks take one more
  EvaluationRange r;
  r.begin = rank * base + std::min<int64_t>(rank, extra);
  r.end = r.begin + base + (rank < extra ? 1 : 0);
  return r;
}

std::vector<int64_t> evaluation_indices(int64_t dataset_size, int num_replicas, int rank) {
  const EvaluationRange r = evaluation_range(dataset_size, num_replicas, rank);
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(r.size()));
  for (int64_t i = r.begin; i < r.end; ++i) out.push_back(i);
  return out;
}

std::vector<int64_t> evaluation_indices(int64_t dataset_size, ProcessGroup* group) {
  ProcessGroup& pg = group_or_default(group);
  return evaluation_indices(dataset_size, pg.size(), pg.rank());
}

at::Tensor gather_evaluation(const at::Tensor& local_results, int64_t dataset_size, ProcessGroup* group, int dst) {
  ProcessGroup& pg = group_or_default(group);
  const int world = pg.size();
  const int me = pg.rank();

  Description mine;
  mine.dataset_size = dataset_size;
  mine.dst = dst;
  at::Tensor local;
  if (!local_results.defined()) {
    mine.problem = "local_results is undefined";
  } else if (local_results.dim() == 0) {
    mine.problem = "local_results is 0-dimensional; it needs one row per item along dim 0";
  } else if (local_results.layout() != at::kStrided) {
    mine.problem = "local_results must be dense (strided); call .to_dense()";
  } else {
    local = local_results.detach().to(at::kCPU).contiguous();
    mine.rows = local.size(0);
    mine.dtype = static_cast<int64_t>(local.scalar_type());
    mine.trailing.assign(local.sizes().begin() + 1, local.sizes().end());
  }
  exchange_and_check(pg, mine, "gather_evaluation", /*compare_layout=*/true);

  // Every rank now knows that all arguments agree, so each takes the same branch below.
  std::vector<int64_t> out_shape = {dataset_size};
  out_shape.insert(out_shape.end(), mine.trailing.begin(), mine.trailing.end());
  const bool receives = dst == -1 || dst == me;
  at::Tensor out = receives ? at::empty(out_shape, local.options()) : at::Tensor();
  // Bytes per row from the trailing shape (local may have no rows to measure).
  int64_t row_elems = 1;
  for (int64_t d : mine.trailing) row_elems *= d;
  const size_t row_size = static_cast<size_t>(row_elems) * local.element_size();

  if (static_cast<size_t>(dataset_size) * row_size > 0) {
    if (dst == -1) {
      // Blocks are contiguous and in rank order, so rank order is dataset order.
      std::vector<size_t> counts;
      for (int r = 0; r < world; ++r) {
        counts.push_back(static_cast<size_t>(evaluation_range(dataset_size, world, r).size()) * row_size);
      }
      // The checks above made this rank's rows its block; a different count would shift every
      // later rank's items in `out`.
      CHORUS_CHECK(counts[static_cast<size_t>(me)] == static_cast<size_t>(mine.rows) * row_size,
                   "this rank's rows are not its evaluation block");
      pg.allgatherv(local.data_ptr(), out.data_ptr(), counts, DataType::kUInt8)->wait();
    } else {
      // gather takes equal blocks: pad every rank to the largest block (rank 0's), then close the
      // gaps on dst.
      const int64_t max_rows = evaluation_range(dataset_size, world, 0).size();
      const size_t block = static_cast<size_t>(max_rows) * row_size;
      const size_t mine_bytes = static_cast<size_t>(mine.rows) * row_size;
      std::vector<uint8_t> padded;
      const void* in = local.data_ptr();
      if (mine_bytes < block) {
        padded.assign(block, 0);
        if (mine_bytes > 0) std::memcpy(padded.data(), local.data_ptr(), mine_bytes);
        in = padded.data();
      }
      const bool even = dataset_size % world == 0;
      std::vector<uint8_t> staging;
      void* gathered = nullptr;
      if (dst == me) {
        if (even) {
          gathered = out.data_ptr();
        } else {
          staging.resize(block * static_cast<size_t>(world));
          gathered = staging.data();
        }
      }
      pg.gather(in, gathered, block, DataType::kUInt8, dst)->wait();
      if (dst == me && !even) {
        auto* dest = static_cast<uint8_t*>(out.data_ptr());
        for (int r = 0; r < world; ++r) {
          const EvaluationRange range = evaluation_range(dataset_size, world, r);
          std::memcpy(dest + static_cast<size_t>(range.begin) * row_size, staging.data() + static_cast<size_t>(r) * block,
                      static_cast<size_t>(range.size()) * row_size);
        }
      }
    }
  }
  if (!receives) return at::Tensor();
  return out.to(local_results.device());
}

double exact_accuracy(const at::Tensor& local_predictions, const at::Tensor& local_targets, int64_t dataset_size,
                      ProcessGroup* group) {
  ProcessGroup& pg = group_or_default(group);
  Description mine;
  mine.dataset_size = dataset_size;
  const at::Tensor& p = local_predictions;
  const at::Tensor& t = local_targets;
  if (!p.defined() || !t.defined()) {
    mine.problem = "local_predictions or local_targets is undefined";
  } else if (t.dim() != 1) {
    mine.problem = "local_targets must be 1-D (one class per item), not " + std::to_string(t.dim()) + "-D";
  } else if (p.dim() != 1 && p.dim() != 2) {
    mine.problem = "local_predictions must be classes (1-D) or scores (items x classes), not " +
                   std::to_string(p.dim()) + "-D";
  } else if (p.size(0) != t.size(0)) {
    mine.problem = "local_predictions has " + std::to_string(p.size(0)) + " rows but local_targets has " +
                   std::to_string(t.size(0));
  } else if (p.dim() == 1 && at::isFloatingType(p.scalar_type())) {
    mine.problem = "1-D local_predictions must hold integer classes; pass scores as items x classes for an argmax";
  } else if (p.dim() == 2 && p.size(1) == 0 && p.size(0) > 0) {
    mine.problem = "local_predictions has 0 classes";
  } else {
    mine.rows = t.size(0);
    if (mine.rows > 0) {
      at::Tensor classes = p.dim() == 2 ? p.detach().argmax(1) : p.detach();
      mine.correct = (classes.to(at::kCPU, at::kLong) == t.detach().to(at::kCPU, at::kLong)).sum().item<int64_t>();
    }
  }
  auto all = exchange_and_check(pg, mine, "exact_accuracy", /*compare_layout=*/false);
  int64_t correct = 0;
  for (const auto& d : all) correct += d.correct;
  return dataset_size == 0 ? 0.0 : static_cast<double>(correct) / static_cast<double>(dataset_size);
}

EvaluationSampler::EvaluationSampler(int64_t dataset_size, int num_replicas, int rank)
    : num_replicas_(num_replicas), rank_(rank) {
  if (num_replicas_ == -1 || rank_ == -1) {
    if (!dist::is_initialized()) {
      throw UsageError("chorus::data::EvaluationSampler: num_replicas and rank are -1 (take them from the default "
                       "process group) but it is not initialised; call chorus::dist::init_process_group() first "
                       "or pass both explicitly");
    }
    if (num_replicas_ == -1) num_replicas_ = dist::get_world_size();
    if (rank_ == -1) rank_ = dist::get_rank();
  }
  dataset_size_ = dataset_size;
  indices_ = evaluation_indices(dataset_size_, num_replicas_, rank_);
}

void EvaluationSampler::reset(torch::optional<size_t> new_size) {
  if (new_size.has_value()) {
    indices_ = evaluation_indices(static_cast<int64_t>(*new_size), num_replicas_, rank_);
    dataset_size_ = static_cast<int64_t>(*new_size);
  }
  position_ = 0;
}

torch::optional<std::vector<size_t>> EvaluationSampler::next(size_t batch_size) {
  if (position_ >= indices_.size() || batch_size == 0) return torch::nullopt;
  const size_t end = std::min(indices_.size(), position_ + batch_size);
  std::vector<size_t> batch(indices_.begin() + static_cast<std::ptrdiff_t>(position_),
                            indices_.begin() + static_cast<std::ptrdiff_t>(end));
  position_ = end;
  return batch;
}

void EvaluationSampler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("chorus_evaluation_sampler/dataset_size", c10::IValue(dataset_size_));
  archive.write("chorus_evaluation_sampler/position", c10::IValue(static_cast<int64_t>(position_)));
}

void EvaluationSampler::load(torch::serialize::InputArchive& archive) {
  c10::IValue size;
  c10::IValue position;
  archive.read("chorus_evaluation_sampler/dataset_size", size);
  archive.read("chorus_evaluation_sampler/position", position);
  if (size.toInt() != dataset_size_) reset(static_cast<size_t>(size.toInt()));
  position_ = std::min(static_cast<size_t>(std::max<int64_t>(position.toInt(), 0)), indices_.size());
}

}  // namespace chorus::data
