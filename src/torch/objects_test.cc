// at::Tensor in chorus's object format: every dtype, any strides, scalars, empty and undefined
// tensors, tensors nested in containers; the exact bytes; errors. And which overload a call of the
// object collectives picks (checked at compile time; no process group here).
#include "chorus/torch/objects.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "testing.h"

namespace chorus::objects {
namespace {

// Byte strings keep going through the byte-string overloads; other values through the typed ones.
static_assert(std::is_same_v<decltype(dist::all_gather_object("a literal")), std::vector<std::string>>);
static_assert(std::is_same_v<decltype(dist::broadcast_object(std::string(), 0)), std::string>);
static_assert(std::is_same_v<decltype(dist::broadcast_object(1.5, 0)), double>);
static_assert(std::is_same_v<decltype(dist::all_gather_object(at::Tensor())), std::vector<at::Tensor>>);
static_assert(std::is_same_v<decltype(dist::gather_object(int64_t{1}, 0)), std::vector<int64_t>>);
static_assert(std::is_same_v<decltype(dist::gather_object(1, nullptr, 0)), void>);
static_assert(std::is_same_v<decltype(dist::scatter_object(std::vector<std::string>(), 0)), std::string>);
static_assert(!is_encodable_v<const char*> && !is_encodable_v<long double> && !is_encodable_v<std::vector<void*>>);
static_assert(!is_encodable_v<std::map<at::Tensor, int>>, "map keys are strings or numbers");

at::Tensor round_trip(const at::Tensor& t) { return decode<at::Tensor>(encode(t)); }

void expect_same(const at::Tensor& got, const at::Tensor& want) {
  ASSERT_TRUE(got.defined());
  EXPECT_EQ(got.scalar_type(), want.scalar_type());
  EXPECT_EQ(got.sizes(), want.sizes());
  EXPECT_TRUE(got.is_contiguous());
  EXPECT_TRUE(at::equal(got, want)) << got << want;
}

TEST(TensorObjects, EveryDtypeRoundTrips) {
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kChar, at::kByte, at::kShort, at::kInt,
                     at::kLong}) {
    at::Tensor t = (at::arange(24, at::kDouble) - 7).to(dtype).reshape({2, 3, 4});
    SCOPED_TRACE(c10::toString(dtype));
    expect_same(round_trip(t), t);
  }
  at::Tensor b = at::arange(10) % 3 == 0;
  expect_same(round_trip(b), b);
  // Special float values keep their bits.
  at::Tensor f = at::tensor({0.0f, -0.0f, INFINITY, -INFINITY, 1e-45f});
  at::Tensor back = round_trip(f);
  EXPECT_EQ(std::memcmp(back.data_ptr(), f.data_ptr(), 20), 0);
  EXPECT_TRUE(round_trip(at::tensor({NAN})).isnan().item<bool>());
}

TEST(TensorObjects, AnyStridesScalarsEmptyAndUndefined) {
  at::Tensor base = at::arange(60, at::kFloat).reshape({3, 4, 5});
  expect_same(round_trip(base.transpose(0, 2)), base.transpose(0, 2).contiguous());
  expect_same(round_trip(base.slice(1, 1, 4, 2)), base.slice(1, 1, 4, 2).contiguous());  // an offset and a step
  expect_same(round_trip(base[2][3]), base[2][3].contiguous());
  expect_same(round_trip(at::ones({3}).expand({4, 3})), at::ones({4, 3}));  // stride 0
  at::Tensor scalar = at::scalar_tensor(2.5, at::kDouble);
  at::Tensor s = round_trip(scalar);
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.item<double>(), 2.5);
  expect_same(round_trip(at::empty({0, 5}, at::kLong)), at::empty({0, 5}, at::kLong));
  EXPECT_FALSE(round_trip(at::Tensor()).defined());
  // requires_grad does not travel; the data does.
  at::Tensor p = at::ones({2}, at::TensorOptions().requires_grad(true));
  at::Tensor q = round_trip(p);
  EXPECT_FALSE(q.requires_grad());
  EXPECT_TRUE(at::equal(q, p.detach()));
}

TEST(TensorObjects, TensorsNestedInContainers) {
  using StateDict = std::map<std::string, at::Tensor>;
  StateDict sd{{"weight", at::randn({4, 3})}, {"bias", at::zeros({4})}, {"steps", at::scalar_tensor(7, at::kLong)}};
  StateDict back = decode<StateDict>(encode(sd));
  ASSERT_EQ(back.size(), 3u);
  for (const auto& [k, v] : sd) expect_same(back.at(k), v);
  auto tup = decode<std::tuple<int32_t, std::vector<at::Tensor>>>(
      encode(std::make_tuple(5, std::vector<at::Tensor>{at::ones({1}), at::Tensor(), at::arange(3).t()})));
  EXPECT_EQ(std::get<0>(tup), 5);
  ASSERT_EQ(std::get<1>(tup).size(), 3u);
  EXPECT_FALSE(std::get<1>(tup)[1].defined());
  expect_same(std::get<1>(tup)[2], at::arange(3));
}

TEST(TensorObjects, BytesAreDtypeShapeAndLittleEndianData) {
  using testing::hex;
  EXPECT_EQ(hex(encode(at::tensor({1.0f, -2.0f}).reshape({1, 2}))),
            "c1" "20" "01" "02" "0100000000000000" "0200000000000000" "0000803f" "000000c0");
  EXPECT_EQ(hex(encode(at::Tensor())), "c12000");
  EXPECT_EQ(hex(encode(at::scalar_tensor(true, at::kBool))), "c1200a0001");
}

TEST(TensorObjects, ErrorsNameTheProblem) {
  std::string e = testing::usage_error([] { encode(at::ones({2}, at::kComplexFloat)); });
  EXPECT_NE(e.find("a tensor of dtype ComplexFloat has no encoding"), std::string::npos) << e;
  e = testing::usage_error([] { encode(at::ones({2, 2}).to_sparse()); });
  EXPECT_NE(e.find(".to_dense()"), std::string::npos) << e;
  e = testing::usage_error([] { decode<at::Tensor>(encode(int32_t{1})); });
  EXPECT_NE(e.find("expected tensor but found int32"), std::string::npos) << e;
  e = testing::usage_error([] { decode<std::vector<at::Tensor>>(encode(std::vector<std::string>{})); });
  EXPECT_NE(e.find("expected vector<tensor> but its elements"), std::string::npos) << e;
  // Every truncation of a tensor's bytes is refused, never read past.
  const std::string bytes = encode(std::map<std::string, at::Tensor>{{"w", at::arange(6, at::kShort).reshape({2, 3})}});
  for (size_t n = 0; n < bytes.size(); ++n) {
    e = testing::usage_error([&] { decode<std::map<std::string, at::Tensor>>(std::string_view(bytes.data(), n)); });
    EXPECT_NE(e.find("chorus::objects::decode: at byte"), std::string::npos) << "prefix " << n << ": " << e;
  }
}

}  // namespace
}  // namespace chorus::objects
