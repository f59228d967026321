// Shared by the C++ sides of the parity tests against PyTorch (ddp_parity_test, zero_parity_test):
// values and data made by the same formulas as parity_util.py makes them, and tensors as JSON.
#pragma once

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <utility>
#include <vector>

namespace chorus::ddp::parity {

// Small dyadic rationals, exact in float on both sides: element e of the k-th parameter is
// ((7e + 5k) mod 13 - 6) / 32.
inline torch::Tensor init_value(int k, at::IntArrayRef shape) {
  auto e = torch::arange(c10::multiply_integers(shape), torch::kInt64);
  return (((e * 7 + k * 5) % 13 - 6).to(torch::kFloat32) / 32.0).reshape(shape);
}

// Rank `rank`'s rows of step `step`'s global batch: per_rank * world rows of 6 features, labels
// in [0, classes).
inline std::pair<torch::Tensor, torch::Tensor> batch(int step, int rank, int world, int per_rank, int classes) {
  auto n = torch::arange(per_rank * world, torch::kInt64);
  auto j = torch::arange(6, torch::kInt64);
  auto x = ((n.unsqueeze(1) * 5 + j.unsqueeze(0) * 3 + step * 7) % 11 - 5).to(torch::kFloat32) / 4.0;
  auto y = (n * 3 + step) % classes;
  return {x.narrow(0, rank * per_rank, per_rank), y.narrow(0, rank * per_rank, per_rank)};
}

// A tensor's values (on any device), flattened, as a JSON array of floats.
inline nlohmann::json flat(const torch::Tensor& t) {
  auto c = t.detach().reshape({-1}).to(torch::kCPU, torch::kFloat32).contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

}  // namespace chorus::ddp::parity
