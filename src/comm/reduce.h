// Internal: element-wise reduction kernels used by every collective algorithm.
//
// Kernels are compiled for several instruction sets (AVX-512, AVX2, baseline) and the best one is
// picked at load time, so one binary is fast on every x86-64. float16 and bfloat16 are converted
// to float32, reduced, and rounded back (to nearest even) at each step.
#pragma once

#include <cstddef>

#include "chorus/comm/types.h"

namespace chorus::reduce {

// dst[i] = dst[i] (op) src[i] for i < n. kAvg reduces as a sum: call finish_avg() once after.
void reduce_into(DataType dtype, ReduceOp op, void* dst, const void* src, size_t n);

// Divides each of n elements by `divisor` (integers: truncation toward zero).
void finish_avg(DataType dtype, void* data, size_t n, int divisor);

// Two ranks' float32 copies reduced into both in one pass: a[i] = b[i] = a[i] + b[i], halved when
// `average` (exact, so the bits equal reduce_into then finish_avg(.., 2)).
void sum_pair_f32(float* a, float* b, size_t n, bool average);

// Conversions, exposed for tests.
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bf16_to_float(uint16_t b);
uint16_t float_to_bf16(float f);

}  // namespace chorus::reduce
