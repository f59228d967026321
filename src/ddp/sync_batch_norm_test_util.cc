#include "sync_batch_norm_test_util.h"

#include <sstream>
#include <stdexcept>

namespace chorus::ddp {

int64_t sum(const std::vector<int64_t>& v, size_t begin, size_t end) {
  int64_t s = 0;
  for (size_t i = begin; i < end; ++i) s += v[i];
  return s;
}

int64_t product(const std::vector<int64_t>& v) {
  int64_t p = 1;
  for (int64_t x : v) p *= x;
  return p;
}

std::vector<float> dyadic_values(int64_t n, uint64_t seed, float scale, float offset) {
  std::vector<float> out(n);
  for (int64_t i = 0; i < n; ++i) {
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i) * 0xBF58476D1CE4E5B9ull;  // splitmix64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = static_cast<float>(static_cast<int64_t>(z % 1024) - 512) / 512.0f;
    out[i] = offset + scale * u;
  }
  return out;
}

void expect_close(const std::string& what, const torch::Tensor& got, const torch::Tensor& want, double tolerance) {
  std::ostringstream out;
  if (got.defined() != want.defined()) {
    out << what << ": " << (got.defined() ? "defined" : "undefined") << ", expected "
        << (want.defined() ? "defined" : "undefined");
    throw std::runtime_error(out.str());
  }
  if (!got.defined()) return;
  if (got.sizes() != want.sizes()) {
    out << what << ": shape " << got.sizes() << ", expected " << want.sizes();
    throw std::runtime_error(out.str());
  }
  if (got.numel() == 0) return;
  auto g = got.detach().to(torch::kDouble);
  auto w = want.detach().to(torch::kDouble);
  auto excess = (g - w).abs() / w.abs().clamp_min(1.0);
  const double worst = excess.max().item<double>();
  if (!(worst <= tolerance)) {
    const int64_t at = excess.reshape({-1}).argmax().item<int64_t>();
    out << what << ": differs by " << worst << " (tolerance " << tolerance << ", relative to max(1, |expected|)) at flat index "
        << at << ": " << g.reshape({-1})[at].item<double>() << " vs " << w.reshape({-1})[at].item<double>();
    throw std::runtime_error(out.str());
  }
}

}  // namespace chorus::ddp
