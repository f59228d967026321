// Fuzz target: chorus::objects' decoder (include/chorus/comm/objects.h), the bytes every rank of an
// object collective decodes from its peers. Byte 0 picks the type decoded; the rest is the encoding.
// A refusal must be a UsageError, nothing else; what decodes must encode again to the input (maps:
// to bytes that encode to themselves). Tensors: the header and data as chorus/torch/objects.h reads
// them, without libtorch.
#include <cstdint>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/comm/objects.h"

namespace objects = chorus::objects;

namespace {

// What encoding a decoded value again must give: the input itself (kExact), bytes that encode to
// themselves (kStable: a std::map, which sorts entries that arrived in another order), or a value of
// the same size (kSize: an unordered map, whose order of entries is its own).
enum class Again { kExact, kStable, kSize };

template <typename T>
void check(std::string_view bytes, Again want = Again::kExact) {
  const T value = objects::decode<T>(bytes);
  const std::string again = objects::encode(value);
  if (want == Again::kExact && again != bytes) std::abort();
  if (want == Again::kStable && objects::encode(objects::decode<T>(again)) != again) std::abort();
  if (objects::decode<T>(again).size() != value.size()) std::abort();
}

template <typename T>
void check_scalar(std::string_view bytes) {
  const T value = objects::decode<T>(bytes);
  if (objects::encode(value) != bytes) std::abort();
}

void check_tensor(std::string_view bytes) {
  objects::Reader r(bytes);
  objects::expect_format(r);
  const objects::TensorHeader h = objects::read_tensor_header(r);
  if (h.bytes > r.remaining()) std::abort();  // the header promised the data is there
  if (h.type != objects::TensorType::kUndefined && h.bytes != static_cast<size_t>(h.numel) * objects::element_size(h.type)) {
    std::abort();
  }
  std::vector<char> data(h.bytes);
  objects::read_tensor_data(r, h, data.data());
  r.finish();
  objects::Writer w;
  w.u8(objects::kFormatByte);
  objects::write_tensor(w, h.type, h.sizes, data.data(), data.size());
  if (w.take() != bytes) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string_view bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    switch (data[0] % 13) {
      case 0: check_scalar<int32_t>(bytes); break;
      case 1: check_scalar<bool>(bytes); break;
      case 2: check_scalar<double>(bytes); break;
      case 3: check<std::string>(bytes); break;
      case 4: check<std::vector<int64_t>>(bytes); break;
      case 5: check<std::vector<bool>>(bytes); break;
      case 6: check<std::vector<std::string>>(bytes); break;
      case 7: check<std::map<std::string, std::vector<double>>>(bytes, Again::kStable); break;
      case 8: check<std::map<int32_t, std::string>>(bytes, Again::kStable); break;
      case 9: check_scalar<std::tuple<uint8_t, std::string, std::optional<int16_t>>>(bytes); break;
      case 10: check<std::vector<std::vector<std::pair<std::string, float>>>>(bytes); break;
      case 11: check<std::unordered_map<std::string, int64_t>>(bytes, Again::kSize); break;
      case 12: check_tensor(bytes); break;
    }
  } catch (const chorus::UsageError&) {
  }
  return 0;
}
