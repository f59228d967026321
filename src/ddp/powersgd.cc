// PowerSGD (Vogels, Karimireddy, Jaggi, 2019) as PyTorch 1.13's powerSGD_hook
// (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py), step for step, so that the same
// model, data and seed give the same parameters (src/ddp/powersgd_parity_test.py checks it):
// - Before start_powerSGD_iter: plain allreduce; the iteration count grows at the last bucket.
// - Then per bucket: add last step's error (error feedback) and keep a copy of the input; split
//   the parameters into matrices worth compressing ((n + m) r * min_compression_rate < n m, each
//   viewed as n x m with n its first dimension) and the rest (1-D ones never are); allreduce the
//   rest as one flat tensor; for each matrix M: P = M Q, allreduce P, orthogonalise P, Q = M^T P,
//   allreduce Q, divide Q by the world, M = P Q^T; error = input - result.
// - Q starts from torch.randn under torch.manual_seed(s) with s = RandomState(random_seed).randint(1e9)
//   drawn once per bucket and initialisation: the same Qs as PyTorch's, bit for bit. With
//   warm_start, later steps start from the last Q (re-orthogonalised).
// The whole per-bucket chain runs on the reducer's hook thread (GradBucket::run_async), so the
// backward thread goes on while P and Q travel.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <sstream>

#include "chorus/comm/error.h"
#include "chorus/ddp/comm_hook.h"
#include "chorus/torch/distributed.h"

namespace chorus::ddp {
namespace {

// PyTorch's _orthogonalize on a batch of n x r matrices, in place: Gram-Schmidt for r <= 2, else QR.
void orthogonalize(at::Tensor matrices, double epsilon) {
  const int64_t cols = matrices.size(2);
  if (cols > 2 && matrices.scalar_type() != at::kHalf && matrices.scalar_type() != at::kBFloat16) {
    matrices.copy_(std::get<0>(at::linalg_qr(matrices)));
    return;
  }
  for (int64_t i = 0; i < cols; ++i) {
    at::Tensor col = matrices.narrow(2, i, 1);
    if (epsilon == 0) {
      col.div_(at::norm(col, 2, {1}, /*keepdim=*/true));
    } else {
      col.div_(at::norm(col, 2, {1}, /*keepdim=*/true) + epsilon);
    }
    if (i + 1 < cols) {
      at::Tensor rest = matrices.narrow(2, i + 1, cols - i - 1);
      rest.sub_(at::sum(col * rest, {1}, /*keepdim=*/true) * col);
    }
  }
}

}  // namespace

int64_t numpy_randint(std::mt19937& rng, int64_t high) {
  if (high <= 0 || high > (int64_t{1} << 32)) throw UsageError("numpy_randint: high must be in (0, 2^32]");
  const uint64_t range = static_cast<uint64_t>(high - 1);
  if (range == 0) return 0;
  uint64_t mask = range;
  for (int shift = 1; shift < 64; shift <<= 1) mask |= mask >> shift;
  uint64_t v = 0;
  do {
    v = static_cast<uint64_t>(rng()) & mask;
  } while (v > range);
  return static_cast<int64_t>(v);
}

PowerSGDHook::PowerSGDHook(PowerSGDOptions options) : opts_(options), rng_(options.random_seed) {
  if ((opts_.use_error_feedback || opts_.warm_start) && opts_.start_powerSGD_iter <= 1) {
    throw UsageError("chorus::ddp::PowerSGDHook: start_powerSGD_iter must be > 1 with use_error_feedback or "
                     "warm_start (as in PyTorch); got " + std::to_string(opts_.start_powerSGD_iter));
  }
  if (opts_.matrix_approximation_rank < 1) {
    throw UsageError("chorus::ddp::PowerSGDHook: matrix_approximation_rank must be >= 1, got " +
                     std::to_string(opts_.matrix_approximation_rank));
  }
}

std::string PowerSGDHook::describe() const {
  std::ostringstream out;
  out << "powersgd_hook rank=" << opts_.matrix_approximation_rank << " start=" << opts_.start_powerSGD_iter
      << " min_compression_rate=" << opts_.min_compression_rate << " error_feedback=" << opts_.use_error_feedback
      << " warm_start=" << opts_.warm_start << " epsilon=" << opts_.orthogonalization_epsilon
      << " seed=" << opts_.random_seed << " batch_same_shape=" << opts_.batch_tensors_with_same_shape;
  return out.str();
}

PowerSGDHook::CompressionStats PowerSGDHook::compression_stats() const {
  CompressionStats s;
  s.numel_before = numel_before_.load();
  s.numel_after = numel_after_.load();
  s.rate = s.numel_after > 0 ? static_cast<double>(s.numel_before) / static_cast<double>(s.numel_after) : 0;
  return s;
}

void PowerSGDHook::maybe_increase_iter(const GradBucket& bucket) {
  if (bucket.is_last()) iter_++;
}

std::shared_ptr<Work> PowerSGDHook::run(GradBucket& bucket) {
  if (iter_.load() < opts_.start_powerSGD_iter) {
    maybe_increase_iter(bucket);
    return allreduce_->run(bucket);
  }
  return bucket.run_async([this, &bucket] { compress(bucket); });
}

void PowerSGDHook::compress(GradBucket& bucket) {
  ProcessGroup* group = bucket.group;
  const size_t index = bucket.index;
  at::Tensor input = bucket.buffer;
  at::Tensor input_copy;
  if (opts_.use_error_feedback) {
    auto it = error_.find(index);
    if (it != error_.end()) {
      input.add_(it->second);
    } else {
      error_[index] = at::zeros_like(input);
    }
    input_copy = input.clone();
  }

  // Step I: matrices worth compressing, and the rest.
  std::vector<at::Tensor> to_compress, uncompressed;
  int64_t total_p = 0, total_q = 0;
  for (const at::Tensor& tensor : bucket.gradients()) {
    if (tensor.dim() == 0) {  // PyTorch's view(shape[0], -1) has no first dimension to take
      uncompressed.push_back(tensor);
      numel_before_ += 1;
      numel_after_ += 1;
      continue;
    }
    at::Tensor matrix = tensor.view({tensor.size(0), -1});
    const int64_t n = matrix.size(0), m = matrix.size(1);
    const int64_t r = std::min({n, m, opts_.matrix_approximation_rank});
    const int64_t before = n * m, after = (n + m) * r;
    numel_before_ += before;
    if (static_cast<double>(after) * opts_.min_compression_rate < static_cast<double>(before)) {
      to_compress.push_back(matrix);
      total_p += n * r;
      total_q += m * r;
      numel_after_ += after;
    } else {
      uncompressed.push_back(tensor);
      numel_after_ += before;
    }
  }

  // Step II: the rest, as one flat tensor.
  std::vector<at::Tensor> flat_pieces;
  for (const auto& t : uncompressed) flat_pieces.push_back(t.reshape({-1}));
  at::Tensor uncompressed_memory = flat_pieces.empty() ? at::empty({0}, input.options()) : at::cat(flat_pieces);

  // Step III: P and Q memory (kept across steps with warm_start), matrices batched by shape in
  // the order their shapes first appear, as PyTorch's defaultdict does.
  bool randomize_q = false;
  if (!opts_.warm_start || p_memory_.count(index) == 0) {
    randomize_q = true;
    p_memory_[index] = at::empty({total_p}, input.options());
    q_memory_[index] = at::empty({total_q}, input.options());
  }
  std::vector<std::pair<std::vector<int64_t>, std::vector<at::Tensor>>> by_shape;
  for (const auto& matrix : to_compress) {
    const std::vector<int64_t> shape = matrix.sizes().vec();
    auto it = std::find_if(by_shape.begin(), by_shape.end(), [&](const auto& e) { return e.first == shape; });
    if (it == by_shape.end()) {
      by_shape.push_back({shape, {matrix}});
    } else {
      it->second.push_back(matrix);
    }
  }
  std::vector<at::Tensor> batched, ps, qs;
  for (const auto& [shape, matrices] : by_shape) {
    if (opts_.batch_tensors_with_same_shape) {
      batched.push_back(matrices.size() == 1 ? matrices[0].unsqueeze(0) : at::stack(matrices));
    } else {
      for (const auto& m : matrices) batched.push_back(m.unsqueeze(0));
    }
  }
  int64_t p_at = 0, q_at = 0;
  for (const auto& t : batched) {
    const int64_t b = t.size(0), n = t.size(1), m = t.size(2);
    const int64_t r = std::min({n, m, opts_.matrix_approximation_rank});
    ps.push_back(p_memory_[index].narrow(0, p_at, b * n * r).view({b, n, r}));
    qs.push_back(q_memory_[index].narrow(0, q_at, b * m * r).view({b, m, r}));
    p_at += b * n * r;
    q_at += b * m * r;
  }
  if (!randomize_q) {
    for (auto& q : qs) orthogonalize(q, opts_.orthogonalization_epsilon);
  } else {
    // torch.manual_seed(rng.randint(1_000_000_000)) on a forked RNG, then torch.randn per Q.
    at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(numpy_randint(rng_, 1000000000)));
    for (auto& q : qs) {
      q.copy_(at::randn(q.sizes(), gen, q.options()));
      orthogonalize(q, opts_.orthogonalization_epsilon);
    }
  }
  for (size_t k = 0; k < batched.size(); ++k) at::bmm_out(ps[k], batched[k], qs[k]);

  // The rest and the Ps travel back to back (PyTorch sends the Ps once the rest is back).
  const double world = bucket.divisor;
  auto rest_work = dist::all_reduce(uncompressed_memory, ReduceOp::kSum, group, /*async_op=*/true);
  auto p_work = dist::all_reduce(p_memory_[index], ReduceOp::kSum, group, /*async_op=*/true);
  rest_work->wait();
  uncompressed_memory.div_(world);
  int64_t at_rest = 0;
  for (auto& t : uncompressed) {
    t.copy_(uncompressed_memory.narrow(0, at_rest, t.numel()).view_as(t));
    at_rest += t.numel();
  }
  p_work->wait();  // no division: the Ps are orthogonalised next

  for (auto& p : ps) orthogonalize(p, opts_.orthogonalization_epsilon);
  for (size_t k = 0; k < batched.size(); ++k) at::bmm_out(qs[k], batched[k].transpose(1, 2), ps[k]);
  dist::all_reduce(q_memory_[index], ReduceOp::kSum, group);
  q_memory_[index].div_(world);

  for (size_t k = 0; k < batched.size(); ++k) at::bmm_out(batched[k], ps[k], qs[k].transpose(1, 2));
  if (opts_.batch_tensors_with_same_shape) {  // stacked copies go back to the bucket
    size_t k = 0;
    for (const auto& [shape, matrices] : by_shape) {
      if (matrices.size() == 1) {
        ++k;
        continue;
      }
      for (size_t i = 0; i < matrices.size(); ++i) matrices[i].copy_(batched[k][static_cast<int64_t>(i)]);
      ++k;
    }
  }
  if (opts_.use_error_feedback) error_[index] = input_copy - input;
  if (!opts_.warm_start) {
    p_memory_.clear();
    q_memory_.clear();
  }
  maybe_increase_iter(bucket);
}

}  // namespace chorus::ddp
