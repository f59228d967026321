// Object collectives on C++ values, torch.distributed style, and at::Tensor in chorus::objects.
//
//   #include <chorus/torch/objects.h>
//   namespace dist = chorus::dist;
//   // PyTorch's three, list in, list out:
//   std::vector<Stats> all;                                   // any encodable type
//   dist::gather_object(mine, rank == 0 ? &(all = std::vector<Stats>(world)) : nullptr, /*dst=*/0);
//   std::vector<Config> out(1);
//   dist::scatter_object_list(out, rank == 0 ? &configs : nullptr, /*src=*/0);   // out[0] = configs[rank]
//   dist::broadcast_object_list(objects, /*src=*/0);          // same length on every rank
//   // Typed helpers, value in, value out:
//   std::vector<double> losses = dist::all_gather_object(loss);
//   auto cfg = dist::broadcast_object(std::map<std::string, int64_t>{...}, /*src=*/0);
//   std::vector<at::Tensor> parts = dist::gather_object(t, /*dst=*/0);    // filled on dst only
//   auto shard = dist::scatter_object(shards, /*src=*/0);    // shards is read on src only
//
// Values travel in chorus's object format (chorus/comm/objects.h, docs/objects.md), not pickle:
// bool, numbers, strings, vectors, maps with string or number keys, pairs, tuples, optionals and
// tensors, nested in any way. A tensor travels with its dtype, shape and data (any strides;
// contiguous on arrival, on the CPU, requires_grad false). Every rank must pass the same type:
// otherwise the rank that decodes raises UsageError naming the type expected, the type found and
// the rank it came from. Lengths a rank gets wrong (a list that is not one per rank, a broadcast
// list shorter than src's) raise UsageError on that rank; dst/src out of range raise UsageError
// on every rank. They block until done; errors and timeouts are those of chorus::ProcessGroup.
//
// std::string goes through the byte-string overloads of chorus/torch/distributed.h
// (all_gather_object(const std::string&), broadcast_object(const std::string&, src)) unchanged:
// their bytes are the string's own, so every rank must call those for strings.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <type_traits>
#include <vector>

#include "chorus/comm/objects.h"
#include "chorus/torch/distributed.h"

namespace chorus::objects {

// at::Tensor: dtype (float32/64, float16, bfloat16, int8/16/32/64, uint8, bool), shape and data;
// an undefined tensor stays undefined. Other dtypes, sparse and quantized tensors: UsageError.
template <>
struct Codec<at::Tensor> {
  static constexpr bool supported = true;
  static constexpr Tag tag = Tag::kTensor;
  static constexpr size_t min_bytes = 2;
  static std::string name() { return "tensor"; }
  static void write(Writer& w, const at::Tensor& t);
  static at::Tensor read(Reader& r);
};

}  // namespace chorus::objects

namespace chorus::dist {

using objects::decode;
using objects::encode;

namespace detail {

template <typename T>
using if_encodable = std::enable_if_t<objects::is_encodable_v<T>, int>;
// Keeps T from being deduced from a list argument (so that nullptr can be passed for it).
template <typename T>
struct identity {
  using type = T;
};
template <typename T>
using identity_t = typename identity<T>::type;

// UsageError unless 0 <= root < group size: "chorus::dist::<op>: <what> <root> is not a rank ...".
void check_root(ProcessGroup& pg, int root, const char* op, const char* what);
// UsageError unless `list` has one entry per rank of pg.
void check_one_per_rank(ProcessGroup& pg, size_t size, const char* op, const char* list);
[[noreturn]] void throw_decode_error(const char* op, int from, const std::string& type, const std::exception& e);

// decode<T>, with the operation and the rank the bytes came from in the error.
template <typename T>
T decode_from(const std::string& bytes, const char* op, int from) {
  try {
    return objects::decode<T>(bytes);
  } catch (const UsageError& e) {
    throw_decode_error(op, from, objects::Codec<T>::name(), e);
  }
}

[[noreturn]] void broadcast_length_mismatch(ProcessGroup& pg, size_t mine, size_t src_length, int src);

}  // namespace detail

// --- torch.distributed's object collectives -------------------------------------------------

// gather_object(obj, object_gather_list, dst): on dst, object_gather_list (one entry per rank)
// gets every rank's obj in rank order; on other ranks it must be nullptr or empty (PyTorch's rule).
template <typename T>
void gather_object(const T& obj, std::vector<detail::identity_t<T>>* object_gather_list, int dst = 0,
                   ProcessGroup* group = nullptr) {
  ProcessGroup& pg = detail::group_or_default(group);
  detail::check_root(pg, dst, "gather_object", "dst");
  if (pg.rank() == dst) {
    if (object_gather_list == nullptr) {
      throw UsageError("chorus::dist::gather_object: object_gather_list is nullptr on the destination rank " +
                       std::to_string(dst) + "; pass a vector of one entry per rank (" + std::to_string(pg.size()) + ")");
    }
    detail::check_one_per_rank(pg, object_gather_list->size(), "gather_object", "object_gather_list");
  } else if (object_gather_list != nullptr && !object_gather_list->empty()) {
    throw UsageError("chorus::dist::gather_object: object_gather_list must be nullptr or empty on rank " +
                     std::to_string(pg.rank()) + ", which is not the destination (dst " + std::to_string(dst) + ")");
  }
  auto w = pg.gather_object(objects::encode(obj), dst);
  w->wait();
  if (pg.rank() != dst) return;
  for (size_t i = 0; i < w->objects().size(); ++i) {
    (*object_gather_list)[i] = detail::decode_from<T>(w->objects()[i], "gather_object", static_cast<int>(i));
  }
}

// scatter_object_list(out, in, src): on src, in holds one object per rank; rank i gets (*in)[i]
// in out[0]. out must have at least one entry on every rank (PyTorch's rule); in is read on src only.
template <typename T>
void scatter_object_list(std::vector<T>& scatter_object_output_list,
                         const std::vector<detail::identity_t<T>>* scatter_object_input_list, int src = 0,
                         ProcessGroup* group = nullptr) {
  ProcessGroup& pg = detail::group_or_default(group);
  detail::check_root(pg, src, "scatter_object_list", "src");
  if (scatter_object_output_list.empty()) {
    throw UsageError("chorus::dist::scatter_object_list: scatter_object_output_list is empty on rank " +
                     std::to_string(pg.rank()) + "; it needs at least one entry (the object lands in the first)");
  }
  std::vector<std::string> encoded;
  if (pg.rank() == src) {
    if (scatter_object_input_list == nullptr) {
      throw UsageError("chorus::dist::scatter_object_list: scatter_object_input_list is nullptr on the source rank " +
                       std::to_string(src) + "; pass one object per rank (" + std::to_string(pg.size()) + ")");
    }
    detail::check_one_per_rank(pg, scatter_object_input_list->size(), "scatter_object_list", "scatter_object_input_list");
    encoded.reserve(scatter_object_input_list->size());
    for (const T& o : *scatter_object_input_list) encoded.push_back(objects::encode(o));
  }
  auto w = pg.scatter_object(std::move(encoded), src);
  w->wait();
  scatter_object_output_list[0] = detail::decode_from<T>(w->objects().at(0), "scatter_object_list", src);
}

// broadcast_object_list(object_list, src): every rank's object_list becomes src's. Its length must
// be the same on every rank (PyTorch's rule): a rank whose length differs raises UsageError.
template <typename T>
void broadcast_object_list(std::vector<T>& object_list, int src = 0, ProcessGroup* group = nullptr) {
  ProcessGroup& pg = detail::group_or_default(group);
  detail::check_root(pg, src, "broadcast_object_list", "src");
  auto w = pg.broadcast_object(pg.rank() == src ? objects::encode(object_list) : std::string(), src);
  w->wait();
  if (pg.rank() == src) return;
  auto got = detail::decode_from<std::vector<T>>(w->objects().at(0), "broadcast_object_list", src);
  if (got.size() != object_list.size()) detail::broadcast_length_mismatch(pg, object_list.size(), got.size(), src);
  object_list = std::move(got);
}

// --- Typed helpers: one value in, the result out ---------------------------------------------

// One value per rank, in rank order, on every rank.
template <typename T, detail::if_encodable<T> = 0>
std::vector<T> all_gather_object(const T& obj, ProcessGroup* group = nullptr) {
  ProcessGroup& pg = detail::group_or_default(group);
  auto w = pg.all_gather_object(objects::encode(obj));
  w->wait();
  std::vector<T> out;
  out.reserve(w->objects().size());
  for (size_t i = 0; i < w->objects().size(); ++i) {
    out.push_back(detail::decode_from<T>(w->objects()[i], "all_gather_object", static_cast<int>(i)));
  }
  return out;
}

// src's obj, on every rank (the others' obj is not sent).
template <typename T, detail::if_encodable<T> = 0>
T broadcast_object(const T& obj, int src, ProcessGroup* group = nullptr) {
  ProcessGroup& pg = detail::group_or_default(group);
  detail::check_root(pg, src, "broadcast_object", "src");
  auto w = pg.broadcast_object(pg.rank() == src ? objects::encode(obj) : std::string(), src);
  w->wait();
  if (pg.rank() == src) return obj;
  return detail::decode_from<T>(w->objects().at(0), "broadcast_object", src);
}

// Every rank's obj in rank order on dst; empty on the other ranks.
template <typename T, detail::if_encodable<T> = 0>
[[nodiscard]] std::vector<T> gather_object(const T& obj, int dst, ProcessGroup* group = nullptr) {
  ProcessGroup& pg = detail::group_or_default(group);
  std::vector<T> out;
  if (pg.rank() == dst) out.resize(static_cast<size_t>(pg.size()));
  gather_object(obj, pg.rank() == dst ? &out : nullptr, dst, &pg);
  return out;
}

// objects[rank] of src's objects (one per rank; the other ranks' objects is not read).
template <typename T, detail::if_encodable<T> = 0>
T scatter_object(const std::vector<T>& objects, int src, ProcessGroup* group = nullptr) {
  ProcessGroup& pg = detail::group_or_default(group);
  std::vector<T> out(1);
  scatter_object_list(out, pg.rank() == src ? &objects : nullptr, src, &pg);
  return std::move(out[0]);
}

}  // namespace chorus::dist
