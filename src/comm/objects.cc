// chorus::objects: the byte-level reader and writer, tag names and the tensor header
// (include/chorus/comm/objects.h; format in docs/objects.md).
#include "chorus/comm/objects.h"

#include <algorithm>
#include <cstdio>
#include <limits>

namespace chorus::objects {
namespace {

constexpr bool kLittleEndianHost = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__;

std::string hex(uint8_t v) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "0x%02x", v);
  return buf;
}

// Copies count elements of `size` bytes, reversing each element's bytes on a big-endian host.
void copy_little_endian(char* dst, const char* src, size_t count, size_t size) {
  if (kLittleEndianHost || size == 1) {
    if (count > 0) std::memcpy(dst, src, count * size);
    return;
  }
  for (size_t i = 0; i < count; ++i) std::reverse_copy(src + i * size, src + (i + 1) * size, dst + i * size);
}

}  // namespace

std::string tag_name(uint8_t tag) {
  switch (static_cast<Tag>(tag)) {
    case Tag::kBool: return "bool";
    case Tag::kInt8: return "int8";
    case Tag::kUInt8: return "uint8";
    case Tag::kInt16: return "int16";
    case Tag::kUInt16: return "uint16";
    case Tag::kInt32: return "int32";
    case Tag::kUInt32: return "uint32";
    case Tag::kInt64: return "int64";
    case Tag::kUInt64: return "uint64";
    case Tag::kFloat32: return "float32";
    case Tag::kFloat64: return "float64";
    case Tag::kString: return "string";
    case Tag::kArray: return "vector of numbers";
    case Tag::kList: return "vector";
    case Tag::kMap: return "map";
    case Tag::kTuple: return "tuple";
    case Tag::kOptional: return "optional";
    case Tag::kTensor: return "tensor";
  }
  return "unknown tag " + hex(tag);
}

void Writer::uint(uint64_t v, size_t bytes) {
  for (size_t i = 0; i < bytes; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void Writer::elements(const void* p, size_t count, size_t size) {
  const size_t at = out_.size();
  out_.resize(at + count * size);
  copy_little_endian(out_.data() + at, static_cast<const char*>(p), count, size);
}

void Reader::fail(const std::string& why) const {
  throw UsageError("chorus::objects::decode: at byte " + std::to_string(pos_) + " of " + std::to_string(in_.size()) +
                   ": " + why);
}

uint8_t Reader::u8() {
  if (remaining() < 1) fail("truncated: the value needs 1 more byte");
  return static_cast<uint8_t>(in_[pos_++]);
}

uint64_t Reader::uint(size_t bytes) {
  if (remaining() < bytes) {
    fail("truncated: the value needs " + std::to_string(bytes) + " bytes, " + std::to_string(remaining()) + " left");
  }
  uint64_t v = 0;
  for (size_t i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(in_[pos_ + i])) << (8 * i);
  pos_ += bytes;
  return v;
}

std::string_view Reader::bytes(size_t n) {
  if (remaining() < n) {
    fail("truncated: " + std::to_string(n) + " bytes announced, " + std::to_string(remaining()) + " left");
  }
  std::string_view out = in_.substr(pos_, n);
  pos_ += n;
  return out;
}

void Reader::elements(void* dst, size_t count, size_t size) {
  if (size == 0 || count > remaining() / size) {
    fail("truncated: " + std::to_string(count) + " elements of " + std::to_string(size) + " bytes announced, " +
         std::to_string(remaining()) + " bytes left");
  }
  copy_little_endian(static_cast<char*>(dst), in_.data() + pos_, count, size);
  pos_ += count * size;
}

void Reader::expect(Tag want, const std::string& type) {
  const uint8_t found = u8();
  if (found != static_cast<uint8_t>(want)) {
    --pos_;  // the offset names the tag
    fail("expected " + type + " but found " + (found == kFormatByte ? "a format byte" : tag_name(found)) +
         "; every rank must encode and decode the same type");
  }
}

void Reader::expect_inner(Tag want, const std::string& type) {
  const uint8_t found = u8();
  if (found != static_cast<uint8_t>(want)) {
    --pos_;
    fail("expected " + type + " but its elements (or keys or values) are " + tag_name(found) + ", not " +
         tag_name(static_cast<uint8_t>(want)) + "; every rank must encode and decode the same type");
  }
}

size_t Reader::count(size_t min_bytes, const char* what) {
  const uint64_t n = u64();
  if (min_bytes == 0 || n > remaining() / min_bytes) {
    pos_ -= 8;
    fail(std::string("truncated or damaged: ") + std::to_string(n) + " " + what + " announced, only " +
         std::to_string(remaining() - 8) + " bytes left");
  }
  return static_cast<size_t>(n);
}

void Reader::finish() const {
  if (remaining() != 0) fail(std::to_string(remaining()) + " trailing bytes after the value");
}

void expect_format(Reader& r) {
  if (r.remaining() == 0) r.fail("no bytes: an encoded object starts with its format byte " + hex(kFormatByte));
  const uint8_t b = r.u8();
  if (b != kFormatByte) {
    r.fail("not chorus object bytes: the first byte is " + hex(b) + ", not the format byte " + hex(kFormatByte) +
           " (bytes from chorus::objects::encode, or an encoder of another version?)");
  }
}

namespace detail {

bool read_bool_byte(Reader& r, uint8_t byte) {
  if (byte > 1) r.fail("a bool's byte is " + std::to_string(byte) + ", neither 0 nor 1");
  return byte == 1;
}

}  // namespace detail

size_t element_size(TensorType type) {
  switch (type) {
    case TensorType::kUndefined: return 0;
    case TensorType::kFloat32: return 4;
    case TensorType::kFloat64: return 8;
    case TensorType::kFloat16: return 2;
    case TensorType::kBFloat16: return 2;
    case TensorType::kInt8: return 1;
    case TensorType::kUInt8: return 1;
    case TensorType::kInt16: return 2;
    case TensorType::kInt32: return 4;
    case TensorType::kInt64: return 8;
    case TensorType::kBool: return 1;
  }
  return 0;
}

const char* to_string(TensorType type) {
  switch (type) {
    case TensorType::kUndefined: return "undefined";
    case TensorType::kFloat32: return "float32";
    case TensorType::kFloat64: return "float64";
    case TensorType::kFloat16: return "float16";
    case TensorType::kBFloat16: return "bfloat16";
    case TensorType::kInt8: return "int8";
    case TensorType::kUInt8: return "uint8";
    case TensorType::kInt16: return "int16";
    case TensorType::kInt32: return "int32";
    case TensorType::kInt64: return "int64";
    case TensorType::kBool: return "bool";
  }
  return "unknown";
}

void write_tensor(Writer& w, TensorType type, const std::vector<int64_t>& sizes, const void* data, size_t bytes) {
  w.tag(Tag::kTensor);
  w.u8(static_cast<uint8_t>(type));
  if (type == TensorType::kUndefined) return;
  if (sizes.size() > kMaxTensorDims) {
    throw UsageError("chorus::objects::encode: a tensor of " + std::to_string(sizes.size()) + " dims; at most " +
                     std::to_string(kMaxTensorDims) + " are supported");
  }
  w.u8(static_cast<uint8_t>(sizes.size()));
  for (int64_t s : sizes) w.u64(static_cast<uint64_t>(s));
  w.elements(data, bytes / element_size(type), element_size(type));
}

TensorHeader read_tensor_header(Reader& r) {
  r.expect(Tag::kTensor, "tensor");
  TensorHeader h;
  const uint8_t type = r.u8();
  if (type > static_cast<uint8_t>(TensorType::kBool)) {
    r.fail("unknown tensor type " + std::to_string(type));
  }
  h.type = static_cast<TensorType>(type);
  if (h.type == TensorType::kUndefined) return h;
  const uint8_t dims = r.u8();
  if (dims > kMaxTensorDims) {
    r.fail("a tensor of " + std::to_string(dims) + " dims; at most " + std::to_string(kMaxTensorDims));
  }
  // numel, and the product of the sizes with 0 counted as 1 (the largest row-major stride that
  // libtorch computes for the shape): both must fit in int64.
  constexpr uint64_t kMax = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  uint64_t numel = 1;
  uint64_t reach = 1;
  for (uint8_t d = 0; d < dims; ++d) {
    const uint64_t s = r.u64();
    if (s > kMax) r.fail("tensor size " + std::to_string(static_cast<int64_t>(s)) + " of dim " + std::to_string(d) + " is negative");
    const uint64_t nonzero = std::max<uint64_t>(s, 1);
    if (reach > kMax / nonzero) r.fail("a tensor shape whose element count overflows int64");
    reach *= nonzero;
    numel = s == 0 ? 0 : numel * s;  // numel <= reach
    h.sizes.push_back(static_cast<int64_t>(s));
  }
  const size_t esize = element_size(h.type);
  if (numel > r.remaining() / esize) {
    r.fail("truncated: a " + std::string(to_string(h.type)) + " tensor of " + std::to_string(numel) + " elements, " +
           std::to_string(r.remaining()) + " bytes left");
  }
  h.numel = static_cast<int64_t>(numel);
  h.bytes = static_cast<size_t>(numel) * esize;
  return h;
}

void read_tensor_data(Reader& r, const TensorHeader& h, void* dst) {
  if (h.type == TensorType::kUndefined) return;
  const size_t at = r.offset();
  r.elements(dst, static_cast<size_t>(h.numel), element_size(h.type));
  if (h.type == TensorType::kBool) {
    const uint8_t* p = static_cast<const uint8_t*>(dst);
    for (size_t i = 0; i < h.bytes; ++i) {
      if (p[i] > 1) {
        throw UsageError("chorus::objects::decode: at byte " + std::to_string(at + i) +
                         ": a bool tensor's element is " + std::to_string(p[i]) + ", neither 0 nor 1");
      }
    }
  }
}

}  // namespace chorus::objects
