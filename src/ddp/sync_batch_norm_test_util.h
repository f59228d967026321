// Helpers shared by sync_batch_norm_test.cc and sync_batch_norm_convert_test.cc.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace chorus::ddp {

int64_t sum(const std::vector<int64_t>& v, size_t begin, size_t end);
int64_t product(const std::vector<int64_t>& v);

// n values offset + scale * u, u in [-1, 1) in steps of 1/512, from a fixed hash of (seed, index):
// exact in float32 and in JSON, the same in every process and in Python.
std::vector<float> dyadic_values(int64_t n, uint64_t seed, float scale, float offset);

// Throws std::runtime_error naming `what` and the largest difference when some element of got
// differs from want by more than tolerance * max(1, |want|), or the shapes differ.
void expect_close(const std::string& what, const torch::Tensor& got, const torch::Tensor& want,
                  double tolerance = 1e-5);

}  // namespace chorus::ddp
