// Internal: how DDP groups gradients into buckets. A pure function, unit-tested alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace chorus::ddp {

struct ParamInfo {
  size_t bytes = 0;   // numel * element size
  int dtype = 0;      // buckets never mix dtypes
};

// Buckets in the order their gradients become ready in backward: parameters in reverse
// registration order, each bucket of one dtype. A bucket closes once it holds at least its limit:
// first_bucket_bytes for the first bucket of each dtype (small, so communication starts early),
// bucket_cap_bytes after it. Returns parameter indices per bucket, each bucket in the order its
// parameters were visited; every parameter appears exactly once.
std::vector<std::vector<size_t>> assign_buckets(const std::vector<ParamInfo>& params, size_t first_bucket_bytes,
                                                size_t bucket_cap_bytes);

}  // namespace chorus::ddp
