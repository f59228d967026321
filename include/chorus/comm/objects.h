// chorus::objects: C++ values as self-describing byte strings, for the object collectives
// (chorus::dist::all_gather_object<T>, gather_object, scatter_object_list, broadcast_object_list).
//
//   std::string bytes = chorus::objects::encode(std::map<std::string, std::vector<double>>{...});
//   auto m = chorus::objects::decode<std::map<std::string, std::vector<double>>>(bytes);
//
// Supported: bool, integers of 8 to 64 bits, float, double, std::string, std::vector,
// std::map and std::unordered_map with string or number keys, std::pair, std::tuple,
// std::optional, nested in any way; at::Tensor with chorus/torch/objects.h. The format
// (docs/objects.md) is little endian on every host, and every value carries a type tag, so
// decoding a different type than was encoded raises UsageError naming both types.
//
// Decoding bytes from outside is safe: decode never reads past the end, never allocates more than
// the remaining bytes could hold (a count is checked against them before anything is reserved), and
// any damage (truncation, a bad tag, a bool that is neither 0 nor 1, a duplicate map key, trailing
// bytes) raises UsageError naming the byte offset. Recursion is bounded by the type T, not by the bytes.
//
// Pure functions; thread-safe. Libtorch-free (tensors travel through TensorHeader below).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "chorus/comm/error.h"

namespace chorus::objects {

// The first byte of every encoding: chorus's object format, version 1.
constexpr uint8_t kFormatByte = 0xC1;

// The type tag in front of every value (docs/objects.md has the table).
enum class Tag : uint8_t {
  kBool = 0x01,
  kInt8 = 0x02,
  kUInt8 = 0x03,
  kInt16 = 0x04,
  kUInt16 = 0x05,
  kInt32 = 0x06,
  kUInt32 = 0x07,
  kInt64 = 0x08,
  kUInt64 = 0x09,
  kFloat32 = 0x0a,
  kFloat64 = 0x0b,
  kString = 0x10,    // u64 length, bytes
  kArray = 0x11,     // u8 element tag, u64 count, packed numbers (vector of bool or numbers)
  kList = 0x12,      // u8 element tag, u64 count, tagged values (any other vector)
  kMap = 0x13,       // u8 key tag, u8 value tag, u64 count, tagged key and value pairs
  kTuple = 0x14,     // u8 arity, tagged values (pair, tuple)
  kOptional = 0x15,  // u8 value tag, u8 present (0 or 1), tagged value if present
  kTensor = 0x20,    // see TensorHeader
};

// "int32", "string", "vector (list)", ...; "unknown tag 0x7f" for bytes that are no tag.
std::string tag_name(uint8_t tag);

// Appends little-endian values to a byte string.
class Writer {
 public:
  void tag(Tag t) { u8(static_cast<uint8_t>(t)); }
  void u8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  // The low `bytes` bytes of v, least significant first.
  void uint(uint64_t v, size_t bytes);
  void u64(uint64_t v) { uint(v, 8); }
  void bytes(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }
  // `count` numbers of `size` bytes each, in this host's byte order at p, little endian.
  void elements(const void* p, size_t count, size_t size);
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

// Reads what Writer wrote, checking every length against the bytes that are left. It views `in`,
// which must outlive it.
class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}
  size_t offset() const { return pos_; }
  size_t remaining() const { return in_.size() - pos_; }
  uint8_t u8();
  uint64_t uint(size_t bytes);
  uint64_t u64() { return uint(8); }
  std::string_view bytes(size_t n);
  // `count` numbers of `size` bytes each, little endian, into dst in this host's byte order.
  void elements(void* dst, size_t count, size_t size);
  // Reads a tag; a different one than `want` is a UsageError saying that `type` was expected.
  void expect(Tag want, const std::string& type);
  // Reads the element (or key) tag of a container of `type`; likewise.
  void expect_inner(Tag want, const std::string& type);
  // Reads a u64 count of items of at least `min_bytes` encoded bytes each; a count that the
  // remaining bytes cannot hold is a UsageError, so that no caller reserves memory for it.
  size_t count(size_t min_bytes, const char* what);
  // A UsageError: "chorus::objects::decode: at byte <offset> of <size>: <why>".
  [[noreturn]] void fail(const std::string& why) const;
  // The value must end at the last byte.
  void finish() const;

 private:
  std::string_view in_;
  size_t pos_ = 0;
};

// Codec<T>: how T is written and read. A supported T has
//   supported = true, tag (its outer Tag), min_bytes (the fewest bytes an encoding of it takes),
//   name() ("vector<int32>", for errors), write(Writer&, const T&) (tag included), read(Reader&).
template <typename T, typename = void>
struct Codec {
  static constexpr bool supported = false;
};

template <typename T>
constexpr bool is_encodable_v = Codec<T>::supported;

namespace detail {

template <typename T>
constexpr bool is_number_v =
    std::is_arithmetic_v<T> && sizeof(T) <= 8 && (!std::is_floating_point_v<T> || sizeof(T) == 4 || sizeof(T) == 8);

template <typename T>
constexpr Tag number_tag() {
  if constexpr (std::is_same_v<T, bool>) {
    return Tag::kBool;
  } else if constexpr (std::is_floating_point_v<T>) {
    return sizeof(T) == 4 ? Tag::kFloat32 : Tag::kFloat64;
  } else if constexpr (std::is_signed_v<T>) {
    return sizeof(T) == 1 ? Tag::kInt8 : sizeof(T) == 2 ? Tag::kInt16 : sizeof(T) == 4 ? Tag::kInt32 : Tag::kInt64;
  } else {
    return sizeof(T) == 1 ? Tag::kUInt8 : sizeof(T) == 2 ? Tag::kUInt16 : sizeof(T) == 4 ? Tag::kUInt32 : Tag::kUInt64;
  }
}

// A bool's byte must be 0 or 1.
bool read_bool_byte(Reader& r, uint8_t byte);

template <typename T>
void write_number(Writer& w, T v) {
  if constexpr (std::is_same_v<T, bool>) {
    w.u8(v ? 1 : 0);
  } else {
    std::conditional_t<sizeof(T) == 1, uint8_t,
                       std::conditional_t<sizeof(T) == 2, uint16_t, std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>>>
        bits;
    std::memcpy(&bits, &v, sizeof(T));
    w.uint(bits, sizeof(T));
  }
}

template <typename T>
T read_number(Reader& r) {
  if constexpr (std::is_same_v<T, bool>) {
    return read_bool_byte(r, r.u8());
  } else {
    const uint64_t bits = r.uint(sizeof(T));
    T v;
    if constexpr (sizeof(T) == 1) {
      const uint8_t b = static_cast<uint8_t>(bits);
      std::memcpy(&v, &b, 1);
    } else if constexpr (sizeof(T) == 2) {
      const uint16_t b = static_cast<uint16_t>(bits);
      std::memcpy(&v, &b, 2);
    } else if constexpr (sizeof(T) == 4) {
      const uint32_t b = static_cast<uint32_t>(bits);
      std::memcpy(&v, &b, 4);
    } else {
      std::memcpy(&v, &bits, 8);
    }
    return v;
  }
}

// Keys of maps: strings and numbers only (their encodings compare like the keys).
template <typename K>
constexpr bool is_key_v = std::is_same_v<K, std::string> || is_number_v<K>;

}  // namespace detail

// Numbers and bool: tag, then the value's bytes, little endian (floats as their IEEE bits).
template <typename T>
struct Codec<T, std::enable_if_t<detail::is_number_v<T>>> {
  static constexpr bool supported = true;
  static constexpr Tag tag = detail::number_tag<T>();
  static constexpr size_t min_bytes = 1 + sizeof(T);
  static std::string name() { return tag_name(static_cast<uint8_t>(tag)); }
  static void write(Writer& w, T v) {
    w.tag(tag);
    detail::write_number(w, v);
  }
  static T read(Reader& r) {
    r.expect(tag, name());
    return detail::read_number<T>(r);
  }
};

template <>
struct Codec<std::string> {
  static constexpr bool supported = true;
  static constexpr Tag tag = Tag::kString;
  static constexpr size_t min_bytes = 9;
  static std::string name() { return "string"; }
  static void write(Writer& w, const std::string& s) {
    w.tag(tag);
    w.u64(s.size());
    w.bytes(s.data(), s.size());
  }
  static std::string read(Reader& r) {
    r.expect(tag, name());
    const size_t n = r.count(1, "string bytes");
    return std::string(r.bytes(n));
  }
};

// Vectors: element tag, count, then the elements. Numbers (and bool) are packed, without a tag
// each; anything else is one tagged value per element.
template <typename T, typename A>
struct Codec<std::vector<T, A>, std::enable_if_t<is_encodable_v<T>>> {
  static constexpr bool packed = detail::is_number_v<T>;
  static constexpr bool supported = true;
  static constexpr Tag tag = packed ? Tag::kArray : Tag::kList;
  static constexpr size_t min_bytes = 10;
  static std::string name() { return "vector<" + Codec<T>::name() + ">"; }
  static void write(Writer& w, const std::vector<T, A>& v) {
    w.tag(tag);
    w.tag(Codec<T>::tag);
    w.u64(v.size());
    if constexpr (std::is_same_v<T, bool>) {
      for (bool b : v) w.u8(b ? 1 : 0);
    } else if constexpr (packed) {
      w.elements(v.data(), v.size(), sizeof(T));
    } else {
      for (const T& e : v) Codec<T>::write(w, e);
    }
  }
  static std::vector<T, A> read(Reader& r) {
    r.expect(tag, name());
    r.expect_inner(Codec<T>::tag, name());
    const size_t n = r.count(packed ? sizeof(T) : Codec<T>::min_bytes, "vector elements");
    std::vector<T, A> v;
    if constexpr (std::is_same_v<T, bool>) {
      v.resize(n);
      for (size_t i = 0; i < n; ++i) v[i] = detail::read_bool_byte(r, r.u8());
    } else if constexpr (packed) {
      v.resize(n);
      r.elements(v.data(), n, sizeof(T));
    } else {
      v.reserve(n);
      for (size_t i = 0; i < n; ++i) v.push_back(Codec<T>::read(r));
    }
    return v;
  }
};

namespace detail {

// std::map and std::unordered_map: key tag, value tag, count, then key and value pairs.
template <typename M>
struct MapCodec {
  using K = typename M::key_type;
  using V = typename M::mapped_type;
  static constexpr bool supported = true;
  static constexpr Tag tag = Tag::kMap;
  static constexpr size_t min_bytes = 11;
  static std::string name() { return "map<" + Codec<K>::name() + ", " + Codec<V>::name() + ">"; }
  static void write(Writer& w, const M& m) {
    w.tag(tag);
    w.tag(Codec<K>::tag);
    w.tag(Codec<V>::tag);
    w.u64(m.size());
    for (const auto& [k, v] : m) {
      Codec<K>::write(w, k);
      Codec<V>::write(w, v);
    }
  }
  static M read(Reader& r) {
    r.expect(tag, name());
    r.expect_inner(Codec<K>::tag, name());
    r.expect_inner(Codec<V>::tag, name());
    const size_t n = r.count(Codec<K>::min_bytes + Codec<V>::min_bytes, "map entries");
    M m;
    for (size_t i = 0; i < n; ++i) {
      const size_t at = r.offset();
      K k = Codec<K>::read(r);
      V v = Codec<V>::read(r);
      if (!m.emplace(std::move(k), std::move(v)).second) {
        r.fail("duplicate key in " + name() + " (entry " + std::to_string(i) + ", from byte " + std::to_string(at) + ")");
      }
    }
    return m;
  }
};

}  // namespace detail

template <typename K, typename V, typename C, typename A>
struct Codec<std::map<K, V, C, A>, std::enable_if_t<detail::is_key_v<K> && is_encodable_v<V>>>
    : detail::MapCodec<std::map<K, V, C, A>> {};

template <typename K, typename V, typename H, typename E, typename A>
struct Codec<std::unordered_map<K, V, H, E, A>, std::enable_if_t<detail::is_key_v<K> && is_encodable_v<V>>>
    : detail::MapCodec<std::unordered_map<K, V, H, E, A>> {};

// std::tuple and std::pair: arity, then each member's tagged value.
namespace detail {

template <typename Tuple, typename... Ts>
struct TupleCodec {
  static constexpr bool supported = true;
  static constexpr Tag tag = Tag::kTuple;
  static constexpr size_t min_bytes = 2 + (Codec<Ts>::min_bytes + ... + 0);
  static std::string name() {
    std::string out = "tuple<";
    ((out += Codec<Ts>::name() + ", "), ...);
    if (sizeof...(Ts) > 0) out.resize(out.size() - 2);
    return out + ">";
  }
  static void write(Writer& w, const Tuple& t) {
    w.tag(tag);
    w.u8(static_cast<uint8_t>(sizeof...(Ts)));
    std::apply([&](const auto&... e) { (Codec<Ts>::write(w, e), ...); }, t);
  }
  static Tuple read(Reader& r) {
    r.expect(tag, name());
    const size_t at = r.offset();
    const uint8_t arity = r.u8();
    if (arity != sizeof...(Ts)) {
      r.fail("expected " + name() + " of " + std::to_string(sizeof...(Ts)) + " members, found a tuple of " +
             std::to_string(arity) + " (arity at byte " + std::to_string(at) + ")");
    }
    // Braced initialisation evaluates the members in order.
    return Tuple{Codec<Ts>::read(r)...};
  }
};

}  // namespace detail

template <typename... Ts>
struct Codec<std::tuple<Ts...>, std::enable_if_t<(sizeof...(Ts) < 256) && (is_encodable_v<Ts> && ...)>>
    : detail::TupleCodec<std::tuple<Ts...>, Ts...> {};

template <typename A, typename B>
struct Codec<std::pair<A, B>, std::enable_if_t<is_encodable_v<A> && is_encodable_v<B>>>
    : detail::TupleCodec<std::pair<A, B>, A, B> {};

template <typename T>
struct Codec<std::optional<T>, std::enable_if_t<is_encodable_v<T>>> {
  static constexpr bool supported = true;
  static constexpr Tag tag = Tag::kOptional;
  static constexpr size_t min_bytes = 3;
  static std::string name() { return "optional<" + Codec<T>::name() + ">"; }
  static void write(Writer& w, const std::optional<T>& v) {
    w.tag(tag);
    w.tag(Codec<T>::tag);
    w.u8(v.has_value() ? 1 : 0);
    if (v) Codec<T>::write(w, *v);
  }
  static std::optional<T> read(Reader& r) {
    r.expect(tag, name());
    r.expect_inner(Codec<T>::tag, name());
    if (!detail::read_bool_byte(r, r.u8())) return std::nullopt;
    return Codec<T>::read(r);
  }
};

// Tensors, without libtorch: what chorus/torch/objects.h writes and reads for an at::Tensor.
// Layout after Tag::kTensor: u8 type, u8 dims, dims x u64 sizes, then numel x element bytes,
// little endian, contiguous (row-major). kUndefined (an undefined tensor) has no dims and no data.
enum class TensorType : uint8_t {
  kUndefined = 0,
  kFloat32 = 1,
  kFloat64 = 2,
  kFloat16 = 3,
  kBFloat16 = 4,
  kInt8 = 5,
  kUInt8 = 6,
  kInt16 = 7,
  kInt32 = 8,
  kInt64 = 9,
  kBool = 10,
};
constexpr size_t kMaxTensorDims = 64;
size_t element_size(TensorType type);  // 0 for kUndefined
const char* to_string(TensorType type);

struct TensorHeader {
  TensorType type = TensorType::kUndefined;
  std::vector<int64_t> sizes;
  int64_t numel = 0;
  size_t bytes = 0;  // numel x element size: what read_tensor_data copies
};

// Writes the tag, the header and `bytes` of data (numel x element size, host byte order at data).
void write_tensor(Writer& w, TensorType type, const std::vector<int64_t>& sizes, const void* data, size_t bytes);
// Reads the tag and the header. Refuses an unknown type, more than kMaxTensorDims dims, a negative
// size, a shape whose elements (or row-major strides) overflow int64, and data that the remaining
// bytes do not hold, before the caller allocates anything.
TensorHeader read_tensor_header(Reader& r);
// Copies the data read_tensor_header announced into dst (header.bytes), checking that a bool
// tensor holds only 0 and 1.
void read_tensor_data(Reader& r, const TensorHeader& header, void* dst);

// encode(value): kFormatByte, then the value.
template <typename T>
std::string encode(const T& value) {
  static_assert(is_encodable_v<T>,
                "chorus::objects::encode: this type has no encoding; use bool, numbers, std::string, std::vector, "
                "std::map or std::unordered_map with string or number keys, std::pair, std::tuple, std::optional, "
                "or at::Tensor (include chorus/torch/objects.h)");
  Writer w;
  w.u8(kFormatByte);
  Codec<T>::write(w, value);
  return w.take();
}

// Checks the format byte; throws UsageError when `bytes` are not chorus object bytes.
void expect_format(Reader& r);

// decode<T>(bytes): the value encode(T) wrote. Throws UsageError for bytes of another type, for
// damaged or truncated bytes and for trailing bytes.
template <typename T>
T decode(std::string_view bytes) {
  static_assert(is_encodable_v<T>, "chorus::objects::decode: this type has no encoding (see encode)");
  Reader r(bytes);
  expect_format(r);
  T value = Codec<T>::read(r);
  r.finish();
  return value;
}

}  // namespace chorus::objects
