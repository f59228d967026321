// at::Tensor in chorus's object format, and the error helpers of the typed object collectives
// (include/chorus/torch/objects.h).
#include "chorus/torch/objects.h"

#include <ATen/ATen.h>

#include <sstream>

namespace chorus::objects {
namespace {

struct TypePair {
  c10::ScalarType scalar;
  TensorType type;
};

constexpr TypePair kTypes[] = {
    {at::kFloat, TensorType::kFloat32}, {at::kDouble, TensorType::kFloat64}, {at::kHalf, TensorType::kFloat16},
    {at::kBFloat16, TensorType::kBFloat16}, {at::kChar, TensorType::kInt8}, {at::kByte, TensorType::kUInt8},
    {at::kShort, TensorType::kInt16}, {at::kInt, TensorType::kInt32}, {at::kLong, TensorType::kInt64},
    {at::kBool, TensorType::kBool},
};

TensorType tensor_type(c10::ScalarType scalar) {
  for (const TypePair& p : kTypes) {
    if (p.scalar == scalar) return p.type;
  }
  std::ostringstream out;
  out << "chorus::objects::encode: a tensor of dtype " << scalar
      << " has no encoding; use float32, float64, float16, bfloat16, int8, int16, int32, int64, uint8 or bool";
  throw UsageError(out.str());
}

c10::ScalarType scalar_type(TensorType type) {
  for (const TypePair& p : kTypes) {
    if (p.type == type) return p.scalar;
  }
  throw UsageError(std::string("chorus::objects::decode: no dtype for tensor type ") + to_string(type));
}

}  // namespace

void Codec<at::Tensor>::write(Writer& w, const at::Tensor& t) {
  if (!t.defined()) {
    write_tensor(w, TensorType::kUndefined, {}, nullptr, 0);
    return;
  }
  if (t.layout() != at::kStrided) {
    std::ostringstream out;
    out << "chorus::objects::encode: a tensor of layout " << t.layout() << "; only dense tensors are encoded: call .to_dense()";
    throw UsageError(out.str());
  }
  const TensorType type = tensor_type(t.scalar_type());
  // Any strides and offset: the data travels contiguous, row-major.
  const at::Tensor c = t.cpu().contiguous();
  write_tensor(w, type, c.sizes().vec(), c.data_ptr(), static_cast<size_t>(c.numel()) * c.element_size());
}

at::Tensor Codec<at::Tensor>::read(Reader& r) {
  const TensorHeader h = read_tensor_header(r);
  if (h.type == TensorType::kUndefined) return at::Tensor();
  // The header has checked that the remaining bytes hold the data before anything is allocated.
  at::Tensor t = at::empty(h.sizes, at::TensorOptions().dtype(scalar_type(h.type)));
  read_tensor_data(r, h, t.data_ptr());
  return t;
}

}  // namespace chorus::objects

namespace chorus::dist::detail {

void check_root(ProcessGroup& pg, int root, const char* op, const char* what) {
  if (root < 0 || root >= pg.size()) {
    throw UsageError(std::string("chorus::dist::") + op + ": " + what + " " + std::to_string(root) +
                     " is not a rank of this group of size " + std::to_string(pg.size()));
  }
}

void check_one_per_rank(ProcessGroup& pg, size_t size, const char* op, const char* list) {
  if (size != static_cast<size_t>(pg.size())) {
    throw UsageError(std::string("chorus::dist::") + op + ": " + list + " has " + std::to_string(size) +
                     " entries on rank " + std::to_string(pg.rank()) + "; it needs one per rank (" +
                     std::to_string(pg.size()) + ")");
  }
}

void throw_decode_error(const char* op, int from, const std::string& type, const std::exception& e) {
  throw UsageError(std::string("chorus::dist::") + op + ": the object from rank " + std::to_string(from) +
                   " does not decode as " + type + " (" + e.what() + ")");
}

void broadcast_length_mismatch(ProcessGroup& pg, size_t mine, size_t src_length, int src) {
  throw UsageError("chorus::dist::broadcast_object_list: object_list has " + std::to_string(mine) + " entries on rank " +
                   std::to_string(pg.rank()) + " but " + std::to_string(src_length) + " on src " + std::to_string(src) +
                   "; it must have the same length on every rank");
}

}  // namespace chorus::dist::detail
