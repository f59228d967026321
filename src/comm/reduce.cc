#include "reduce.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "chorus/comm/error.h"

#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define CHORUS_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CHORUS_CLONES
#endif

namespace chorus::reduce {
namespace {

// IEEE half precision. Clang before 15 has no _Float16 on x86 (the fuzz build uses Debian's clang
// 14); its __fp16 is the same storage format with the same conversions, arithmetic done in float
// as here anyway.
#if defined(__clang__) && __clang_major__ < 15
using Half = __fp16;
#else
using Half = _Float16;
#endif

inline float bf16_bits_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

template <typename T>
struct OpSum { static T apply(T a, T b) { return a + b; } };
template <typename T>
struct OpProd { static T apply(T a, T b) { return a * b; } };
template <typename T>
struct OpMin { static T apply(T a, T b) { return b < a ? b : a; } };
template <typename T>
struct OpMax { static T apply(T a, T b) { return a < b ? b : a; } };

// Integer sums and products wrap (two's complement) like PyTorch's, without UB.
template <typename T, template <typename> class Op>
inline T apply_int(T a, T b) {
  using U = std::make_unsigned_t<T>;
  if constexpr (std::is_same_v<Op<T>, OpSum<T>>) {
    return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else if constexpr (std::is_same_v<Op<T>, OpProd<T>>) {
    return static_cast<T>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
  } else {
    return Op<T>::apply(a, b);
  }
}

#define CHORUS_DEFINE_LOOP(NAME, T, EXPR)                                          \
  CHORUS_CLONES void NAME(T* __restrict dst, const T* __restrict src, size_t n) { \
    for (size_t i = 0; i < n; ++i) {                                               \
      T a = dst[i];                                                                \
      T b = src[i];                                                                \
      dst[i] = (EXPR);                                                             \
    }                                                                              \
  }

#define CHORUS_DEFINE_FLOAT(T, SUFFIX)                         \
  CHORUS_DEFINE_LOOP(sum_##SUFFIX, T, a + b)                    \
  CHORUS_DEFINE_LOOP(prod_##SUFFIX, T, a * b)                   \
  CHORUS_DEFINE_LOOP(min_##SUFFIX, T, (b < a ? b : a))          \
  CHORUS_DEFINE_LOOP(max_##SUFFIX, T, (a < b ? b : a))

#define CHORUS_DEFINE_INT(T, SUFFIX)                                       \
  CHORUS_DEFINE_LOOP(sum_##SUFFIX, T, (apply_int<T, OpSum>(a, b)))          \
  CHORUS_DEFINE_LOOP(prod_##SUFFIX, T, (apply_int<T, OpProd>(a, b)))        \
  CHORUS_DEFINE_LOOP(min_##SUFFIX, T, (b < a ? b : a))                      \
  CHORUS_DEFINE_LOOP(max_##SUFFIX, T, (a < b ? b : a))

CHORUS_DEFINE_FLOAT(float, f32)
CHORUS_DEFINE_FLOAT(double, f64)
CHORUS_DEFINE_INT(int8_t, i8)
CHORUS_DEFINE_INT(uint8_t, u8)
CHORUS_DEFINE_INT(int32_t, i32)
CHORUS_DEFINE_INT(int64_t, i64)

#define CHORUS_DEFINE_BF16(NAME, EXPR)                                                      \
  CHORUS_CLONES void NAME(uint16_t* __restrict dst, const uint16_t* __restrict src, size_t n) { \
    for (size_t i = 0; i < n; ++i) {                                                        \
      float a = bf16_bits_to_float(dst[i]);                                                 \
      float b = bf16_bits_to_float(src[i]);                                                 \
      dst[i] = float_to_bf16_bits(EXPR);                                                    \
    }                                                                                       \
  }
CHORUS_DEFINE_BF16(sum_bf16, a + b)
CHORUS_DEFINE_BF16(prod_bf16, a * b)
CHORUS_DEFINE_BF16(min_bf16, (b < a ? b : a))
CHORUS_DEFINE_BF16(max_bf16, (a < b ? b : a))

#define CHORUS_DEFINE_F16(NAME, EXPR)                                                   \
  CHORUS_CLONES void NAME(Half* __restrict dst, const Half* __restrict src, size_t n) { \
    for (size_t i = 0; i < n; ++i) {                                                    \
      float a = static_cast<float>(dst[i]);                                             \
      float b = static_cast<float>(src[i]);                                             \
      dst[i] = static_cast<Half>(EXPR);                                                 \
    }                                                                                   \
  }
CHORUS_DEFINE_F16(sum_f16, a + b)
CHORUS_DEFINE_F16(prod_f16, a * b)
CHORUS_DEFINE_F16(min_f16, (b < a ? b : a))
CHORUS_DEFINE_F16(max_f16, (a < b ? b : a))

template <typename T>
void divide(T* p, size_t n, int d) {
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<T>(p[i] / static_cast<T>(d));
}

}  // namespace

float half_to_float(uint16_t h) {
  Half v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}
uint16_t float_to_half(float f) {
  Half v = static_cast<Half>(f);
  uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
}
float bf16_to_float(uint16_t b) { return bf16_bits_to_float(b); }
uint16_t float_to_bf16(float f) { return float_to_bf16_bits(f); }

void reduce_into(DataType dtype, ReduceOp op, void* dst, const void* src, size_t n) {
  if (n == 0) return;
  const int o = op == ReduceOp::kAvg ? 0 : static_cast<int>(op);  // avg reduces as a sum
#define CHORUS_DISPATCH(SUFFIX, T)                                                   \
  switch (o) {                                                                       \
    case 0: return sum_##SUFFIX(static_cast<T*>(dst), static_cast<const T*>(src), n);  \
    case 2: return prod_##SUFFIX(static_cast<T*>(dst), static_cast<const T*>(src), n); \
    case 3: return min_##SUFFIX(static_cast<T*>(dst), static_cast<const T*>(src), n);  \
    case 4: return max_##SUFFIX(static_cast<T*>(dst), static_cast<const T*>(src), n);  \
  }                                                                                  \
  break;
  switch (dtype) {
    case DataType::kFloat32: CHORUS_DISPATCH(f32, float)
    case DataType::kFloat64: CHORUS_DISPATCH(f64, double)
    case DataType::kFloat16: CHORUS_DISPATCH(f16, Half)
    case DataType::kBFloat16: CHORUS_DISPATCH(bf16, uint16_t)
    case DataType::kInt8: CHORUS_DISPATCH(i8, int8_t)
    case DataType::kUInt8: CHORUS_DISPATCH(u8, uint8_t)
    case DataType::kInt32: CHORUS_DISPATCH(i32, int32_t)
    case DataType::kInt64: CHORUS_DISPATCH(i64, int64_t)
  }
#undef CHORUS_DISPATCH
  throw UsageError(std::string("unsupported reduction ") + to_string(op) + " on " + to_string(dtype));
}

namespace {
CHORUS_CLONES void sum_pair_loop(float* __restrict a, float* __restrict b, size_t n, float scale) {
  for (size_t i = 0; i < n; ++i) {
    const float v = (a[i] + b[i]) * scale;
    a[i] = v;
    b[i] = v;
  }
}
}  // namespace

void sum_pair_f32(float* a, float* b, size_t n, bool average) { sum_pair_loop(a, b, n, average ? 0.5f : 1.0f); }

void finish_avg(DataType dtype, void* data, size_t n, int divisor) {
  if (n == 0 || divisor == 1) return;
  switch (dtype) {
    case DataType::kFloat32: return divide(static_cast<float*>(data), n, divisor);
    case DataType::kFloat64: return divide(static_cast<double*>(data), n, divisor);
    case DataType::kInt8: return divide(static_cast<int8_t*>(data), n, divisor);
    case DataType::kUInt8: return divide(static_cast<uint8_t*>(data), n, divisor);
    case DataType::kInt32: return divide(static_cast<int32_t*>(data), n, divisor);
    case DataType::kInt64: return divide(static_cast<int64_t*>(data), n, divisor);
    case DataType::kFloat16: {
      auto* p = static_cast<Half*>(data);
      for (size_t i = 0; i < n; ++i) p[i] = static_cast<Half>(static_cast<float>(p[i]) / divisor);
      return;
    }
    case DataType::kBFloat16: {
      auto* p = static_cast<uint16_t*>(data);
      for (size_t i = 0; i < n; ++i) p[i] = float_to_bf16_bits(bf16_bits_to_float(p[i]) / divisor);
      return;
    }
  }
}

}  // namespace chorus::reduce
