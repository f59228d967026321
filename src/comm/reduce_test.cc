#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "reduce.h"

namespace chorus::reduce {
namespace {

TEST(Reduce, Float32AllOpsOverVectorAndTailLengths) {
  for (size_t n : {0, 1, 3, 15, 16, 17, 64, 1000, 1027}) {
    std::vector<float> a(n), b(n);
    for (size_t i = 0; i < n; ++i) {
      a[i] = static_cast<float>(i % 13) - 6;
      b[i] = static_cast<float>(i % 7) - 3;
    }
    auto x = a;
    reduce_into(DataType::kFloat32, ReduceOp::kSum, x.data(), b.data(), n);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(x[i], a[i] + b[i]);
    x = a;
    reduce_into(DataType::kFloat32, ReduceOp::kProd, x.data(), b.data(), n);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(x[i], a[i] * b[i]);
    x = a;
    reduce_into(DataType::kFloat32, ReduceOp::kMin, x.data(), b.data(), n);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(x[i], std::min(a[i], b[i]));
    x = a;
    reduce_into(DataType::kFloat32, ReduceOp::kMax, x.data(), b.data(), n);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(x[i], std::max(a[i], b[i]));
  }
}

// The fused two-copy kernel gives the same bits as the two-step sum (and average), in both copies.
TEST(Reduce, SumPairMatchesReduceThenAverage) {
  for (size_t n : {0, 1, 3, 15, 16, 17, 64, 1000, 1027}) {
    for (bool average : {false, true}) {
      std::vector<float> a(n), b(n);
      for (size_t i = 0; i < n; ++i) {
        a[i] = std::ldexp(static_cast<float>(i % 97) - 48.3f, static_cast<int>(i % 11) - 140);  // subnormals too
        b[i] = static_cast<float>(i % 7) * 0.37f - 1.1f;
      }
      auto want = a;
      reduce_into(DataType::kFloat32, average ? ReduceOp::kAvg : ReduceOp::kSum, want.data(), b.data(), n);
      if (average) finish_avg(DataType::kFloat32, want.data(), n, 2);
      sum_pair_f32(a.data(), b.data(), n, average);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(std::memcmp(&a[i], &want[i], 4), 0) << "element " << i << " of " << n;
        ASSERT_EQ(std::memcmp(&b[i], &want[i], 4), 0) << "element " << i << " of " << n;
      }
    }
  }
}

TEST(Reduce, IntegersWrapLikeTwosComplement) {
  std::vector<int8_t> a = {127, -128, 5}, b = {1, -1, 5};
  reduce_into(DataType::kInt8, ReduceOp::kSum, a.data(), b.data(), 3);
  EXPECT_EQ(a[0], -128);
  EXPECT_EQ(a[1], 127);
  EXPECT_EQ(a[2], 10);
  std::vector<uint8_t> u = {200}, v = {100};
  reduce_into(DataType::kUInt8, ReduceOp::kSum, u.data(), v.data(), 1);
  EXPECT_EQ(u[0], 44);
}

TEST(Reduce, HalfAndBfloatReduceInFloat) {
  const float vals[] = {0.0f, 1.0f, -2.5f, 1024.0f, 0.333f, 65504.0f};
  for (float f : vals) {
    EXPECT_EQ(half_to_float(float_to_half(f)), static_cast<float>(static_cast<_Float16>(f)));
  }
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f)), 1.0f);
  EXPECT_EQ(bf16_to_float(float_to_bf16(-3.0f)), -3.0f);
  // Round to nearest even: 1 + 2^-8 is halfway between two bf16 values and rounds down to 1.
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  std::vector<uint16_t> a(100), b(100);
  for (size_t i = 0; i < 100; ++i) {
    a[i] = float_to_bf16(static_cast<float>(i));
    b[i] = float_to_bf16(2.0f);
  }
  reduce_into(DataType::kBFloat16, ReduceOp::kSum, a.data(), b.data(), 100);
  for (size_t i = 0; i < 100; ++i) EXPECT_EQ(bf16_to_float(a[i]), static_cast<float>(i) + 2.0f);
  std::vector<uint16_t> h(33), k(33);
  for (size_t i = 0; i < 33; ++i) {
    h[i] = float_to_half(static_cast<float>(i));
    k[i] = float_to_half(3.0f);
  }
  reduce_into(DataType::kFloat16, ReduceOp::kProd, h.data(), k.data(), 33);
  for (size_t i = 0; i < 33; ++i) EXPECT_EQ(half_to_float(h[i]), static_cast<float>(i) * 3.0f);
}

TEST(Reduce, AverageDividesOnceAndTruncatesIntegers) {
  std::vector<float> f = {3.0f, 6.0f};
  finish_avg(DataType::kFloat32, f.data(), 2, 3);
  EXPECT_EQ(f[0], 1.0f);
  EXPECT_EQ(f[1], 2.0f);
  std::vector<int32_t> i = {7, -7};
  finish_avg(DataType::kInt32, i.data(), 2, 2);
  EXPECT_EQ(i[0], 3);
  EXPECT_EQ(i[1], -3);
}

}  // namespace
}  // namespace chorus::reduce
