// chorus::objects: round trips of every supported type and nesting, the exact little-endian
// bytes, and errors: another type decoded, every truncation, hostile counts, damaged bytes.
#include "chorus/comm/objects.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "testing.h"

namespace chorus::objects {
namespace {

template <typename T>
void expect_round_trip(const T& value) {
  const std::string bytes = encode(value);
  EXPECT_EQ(decode<T>(bytes), value) << Codec<T>::name();
  // Every proper prefix is refused as truncated, never read past its end.
  for (size_t n = 0; n < bytes.size(); ++n) {
    const std::string e = testing::usage_error([&] { decode<T>(std::string_view(bytes.data(), n)); });
    EXPECT_NE(e.find("chorus::objects::decode: at byte"), std::string::npos) << Codec<T>::name() << " prefix " << n << ": " << e;
  }
  // And a trailing byte is refused too.
  const std::string e = testing::usage_error([&] { decode<T>(bytes + "x"); });
  EXPECT_NE(e.find("1 trailing bytes after the value"), std::string::npos) << e;
}

TEST(Objects, NumbersRoundTripAtTheirLimits) {
  expect_round_trip(true);
  expect_round_trip(false);
  expect_round_trip(int8_t{-128});
  expect_round_trip(uint8_t{255});
  expect_round_trip(int16_t{-32768});
  expect_round_trip(uint16_t{65535});
  expect_round_trip(std::numeric_limits<int32_t>::min());
  expect_round_trip(std::numeric_limits<uint32_t>::max());
  expect_round_trip(std::numeric_limits<int64_t>::min());
  expect_round_trip(std::numeric_limits<uint64_t>::max());
  expect_round_trip(char{'c'});
  expect_round_trip(-0.0f);
  expect_round_trip(std::numeric_limits<float>::denorm_min());
  expect_round_trip(std::numeric_limits<double>::infinity());
  expect_round_trip(3.141592653589793);
  // NaN keeps its bits (and is not equal to itself).
  const double nan = std::nan("0x5");
  const double back = decode<double>(encode(nan));
  EXPECT_EQ(std::memcmp(&nan, &back, sizeof(nan)), 0);
}

TEST(Objects, BytesAreLittleEndianWithATagPerValue) {
  EXPECT_EQ(testing::hex(encode(int32_t{0x01020304})), "c10604030201");
  EXPECT_EQ(testing::hex(encode(uint16_t{0xbeef})), "c105efbe");
  EXPECT_EQ(testing::hex(encode(1.0f)), "c10a0000803f");
  EXPECT_EQ(testing::hex(encode(true)), "c10101");
  EXPECT_EQ(testing::hex(encode(std::string("hi"))), "c110" "0200000000000000" "6869");
  EXPECT_EQ(testing::hex(encode(std::vector<int16_t>{1, -2})), "c11104" "0200000000000000" "0100feff");
  EXPECT_EQ(testing::hex(encode(std::vector<std::string>{"a"})), "c11210" "0100000000000000" "10" "0100000000000000" "61");
  EXPECT_EQ(testing::hex(encode(std::map<std::string, bool>{{"k", true}})),
            "c1131001" "0100000000000000" "10" "0100000000000000" "6b" "0101");
  EXPECT_EQ(testing::hex(encode(std::make_pair(uint8_t{7}, int8_t{-1}))), "c11402" "0307" "02ff");
  EXPECT_EQ(testing::hex(encode(std::optional<int8_t>())), "c1150200");
}

TEST(Objects, StringsAndContainersRoundTrip) {
  expect_round_trip(std::string());
  expect_round_trip(std::string("with\0nul and \xff bytes", 21));
  expect_round_trip(std::string(100000, 'z'));
  expect_round_trip(std::vector<double>{});
  expect_round_trip(std::vector<double>{1.5, -2.25, 1e300});
  expect_round_trip(std::vector<bool>{true, false, true});
  expect_round_trip(std::vector<uint8_t>(1000, 0xab));
  expect_round_trip(std::vector<int64_t>{std::numeric_limits<int64_t>::min(), 0, 1});
  expect_round_trip(std::vector<std::string>{"", "a", std::string(300, 'b')});
  expect_round_trip(std::map<std::string, int64_t>{});
  expect_round_trip(std::map<std::string, int64_t>{{"", 0}, {"loss", -3}, {"steps", 1 << 30}});
  expect_round_trip(std::map<int32_t, std::string>{{-1, "minus one"}, {7, ""}});
  expect_round_trip(std::unordered_map<std::string, double>{{"a", 0.5}, {"b", 1.5}});
  expect_round_trip(std::unordered_map<uint64_t, bool>{{1, true}, {2, false}});
  expect_round_trip(std::make_pair(std::string("step"), 42));
  expect_round_trip(std::make_tuple(1, 2.5f, std::string("three"), true));
  expect_round_trip(std::tuple<>());
  expect_round_trip(std::optional<std::string>());
  expect_round_trip(std::optional<std::string>("set"));
}

TEST(Objects, NestedValuesRoundTrip) {
  using Metrics = std::map<std::string, std::vector<std::pair<int64_t, double>>>;
  expect_round_trip(Metrics{{"loss", {{1, 2.5}, {2, 2.25}}}, {"empty", {}}});
  expect_round_trip(std::vector<std::vector<int32_t>>{{}, {1}, {2, 3}});
  expect_round_trip(std::vector<std::map<std::string, std::string>>{{{"a", "b"}}, {}});
  expect_round_trip(std::unordered_map<std::string, std::vector<std::optional<std::tuple<int8_t, std::string>>>>{
      {"x", {std::nullopt, std::make_tuple(int8_t{3}, std::string("y"))}}});
  expect_round_trip(std::pair<std::vector<bool>, std::map<int64_t, std::vector<std::string>>>{
      {true}, {{5, {"five", ""}}}});
}

TEST(Objects, DecodingAnotherTypeNamesBoth) {
  auto err = [](auto decode_fn) { return testing::usage_error(decode_fn); };
  std::string e = err([] { decode<int64_t>(encode(int32_t{1})); });
  EXPECT_NE(e.find("expected int64 but found int32"), std::string::npos) << e;
  EXPECT_NE(e.find("every rank must encode and decode the same type"), std::string::npos) << e;
  e = err([] { decode<std::string>(encode(1.0)); });
  EXPECT_NE(e.find("expected string but found float64"), std::string::npos) << e;
  e = err([] { decode<std::vector<float>>(encode(std::vector<double>{1.0})); });
  EXPECT_NE(e.find("expected vector<float32> but its elements"), std::string::npos) << e;
  EXPECT_NE(e.find("are float64, not float32"), std::string::npos) << e;
  // Empty containers still carry their element type.
  e = err([] { decode<std::vector<std::string>>(encode(std::vector<std::vector<int32_t>>{})); });
  EXPECT_NE(e.find("expected vector<string> but its elements"), std::string::npos) << e;
  e = err([] { decode<std::map<std::string, int32_t>>(encode(std::map<int32_t, int32_t>{})); });
  EXPECT_NE(e.find("expected map<string, int32>"), std::string::npos) << e;
  e = err([] { decode<std::optional<int32_t>>(encode(std::optional<std::string>())); });
  EXPECT_NE(e.find("expected optional<int32>"), std::string::npos) << e;
  e = err([] { decode<std::tuple<int32_t, int32_t>>(encode(std::make_tuple(1, 2, 3))); });
  EXPECT_NE(e.find("found a tuple of 3"), std::string::npos) << e;
  e = err([] { decode<std::vector<int32_t>>(encode(std::string("abc"))); });
  EXPECT_NE(e.find("expected vector<int32> but found string"), std::string::npos) << e;
  // A nested mismatch names the offset of the value.
  e = err([] { decode<std::vector<std::string>>(encode(std::vector<std::vector<std::string>>{{"x"}})); });
  EXPECT_NE(e.find("at byte 2 of"), std::string::npos) << e;
  EXPECT_NE(e.find("are vector, not string"), std::string::npos) << e;
}

TEST(Objects, DamagedBytesAreRefused) {
  auto err = [](const std::string& bytes, auto type_tag) {
    using T = decltype(type_tag);
    return testing::usage_error([&] { decode<T>(bytes); });
  };
  EXPECT_NE(err("", int32_t{}).find("no bytes"), std::string::npos);
  EXPECT_NE(err("\x80\x04", std::string{}).find("not chorus object bytes: the first byte is 0x80"), std::string::npos);
  EXPECT_NE(err(std::string("\xc1\x01\x02", 3), bool{}).find("neither 0 nor 1"), std::string::npos);
  EXPECT_NE(err(std::string("\xc1\x7f", 2), bool{}).find("found unknown tag 0x7f"), std::string::npos);
  // Counts far beyond the bytes that follow: refused before anything is reserved.
  const std::string huge_count("\xff\xff\xff\xff\xff\xff\xff\x7f", 8);
  EXPECT_NE(err(std::string("\xc1\x10", 2) + huge_count + "ab", std::string{}).find("string bytes announced, only 2 bytes left"),
            std::string::npos);
  EXPECT_NE(err(std::string("\xc1\x11\x0b", 3) + huge_count, std::vector<double>{}).find("vector elements announced"),
            std::string::npos);
  EXPECT_NE(err(std::string("\xc1\x12\x10", 3) + huge_count + std::string(64, '\0'), std::vector<std::string>{})
                .find("vector elements announced, only 64 bytes left"),
            std::string::npos);
  // 8 strings need at least 72 bytes; 71 are not enough even before the first is read.
  EXPECT_NE(err(std::string("\xc1\x12\x10\x08", 4) + std::string(7, '\0') + std::string(71, '\x10'),
                std::vector<std::string>{})
                .find("8 vector elements announced, only 71 bytes left"),
            std::string::npos);
  EXPECT_NE(err(std::string("\xc1\x13\x10\x01", 4) + huge_count, std::map<std::string, bool>{}).find("map entries announced"),
            std::string::npos);
  // A duplicate key would silently drop an entry.
  std::string dup = encode(std::map<std::string, bool>{{"a", true}, {"b", false}});
  dup[dup.size() - 3] = 'a';  // the second key
  EXPECT_NE(err(dup, std::map<std::string, bool>{}).find("duplicate key in map<string, bool> (entry 1"), std::string::npos)
      << testing::hex(dup);
  std::string bad_bool = encode(std::vector<bool>{true, false});
  bad_bool.back() = 2;
  EXPECT_NE(err(bad_bool, std::vector<bool>{}).find("neither 0 nor 1"), std::string::npos);
}

TEST(Objects, TensorHeadersAreChecked) {
  // A 2 x 3 int16 tensor: written and read back without libtorch.
  const int16_t data[6] = {1, -2, 3, -4, 5, -6};
  Writer w;
  w.u8(kFormatByte);
  write_tensor(w, TensorType::kInt16, {2, 3}, data, sizeof(data));
  const std::string bytes = w.take();
  EXPECT_EQ(testing::hex(bytes.substr(0, 5)), "c120070202");
  Reader r(bytes);
  expect_format(r);
  TensorHeader h = read_tensor_header(r);
  EXPECT_EQ(h.type, TensorType::kInt16);
  EXPECT_EQ(h.sizes, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(h.numel, 6);
  EXPECT_EQ(h.bytes, 12u);
  int16_t back[6] = {};
  read_tensor_data(r, h, back);
  r.finish();
  EXPECT_EQ(std::memcmp(back, data, sizeof(data)), 0);

  auto header_error = [](const std::string& after_tag) {
    return testing::usage_error([&] {
      const std::string bytes = std::string("\x20", 1) + after_tag;
      Reader rr(bytes);
      read_tensor_header(rr);
    });
  };
  auto u64 = [](uint64_t v) {
    Writer ww;
    ww.u64(v);
    return ww.take();
  };
  EXPECT_NE(header_error("\x0b").find("unknown tensor type 11"), std::string::npos);
  EXPECT_NE(header_error(std::string("\x01\x41", 2)).find("a tensor of 65 dims"), std::string::npos);
  EXPECT_NE(header_error(std::string("\x01\x01", 2) + u64(~uint64_t{0})).find("is negative"), std::string::npos);
  // 2^40 x 2^40 elements overflow; so do sizes whose row-major strides would, next to a 0.
  EXPECT_NE(header_error(std::string("\x01\x02", 2) + u64(uint64_t{1} << 40) + u64(uint64_t{1} << 40)).find("overflows"),
            std::string::npos);
  EXPECT_NE(header_error(std::string("\x01\x03", 2) + u64(0) + u64(uint64_t{1} << 40) + u64(uint64_t{1} << 40)).find("overflows"),
            std::string::npos);
  // An empty tensor of huge sizes is fine: no data.
  const std::string empty_bytes = std::string("\x20\x01\x02", 3) + u64(0) + u64(uint64_t{1} << 40);
  Reader empty(empty_bytes);
  EXPECT_EQ(read_tensor_header(empty).bytes, 0u);
  // 1000 float32 elements announced, 12 bytes there.
  EXPECT_NE(header_error(std::string("\x01\x01", 2) + u64(1000) + std::string(12, '\0')).find("truncated: a float32 tensor of 1000 elements"),
            std::string::npos);
  // A bool tensor holds only 0 and 1.
  Writer wb;
  const uint8_t bools[3] = {1, 0, 2};
  write_tensor(wb, TensorType::kBool, {3}, bools, 3);
  const std::string bool_bytes = wb.take();
  Reader rb(bool_bytes);
  TensorHeader hb = read_tensor_header(rb);
  uint8_t out[3];
  EXPECT_NE(testing::usage_error([&] { read_tensor_data(rb, hb, out); }).find("a bool tensor's element is 2"),
            std::string::npos);
}

}  // namespace
}  // namespace chorus::objects
