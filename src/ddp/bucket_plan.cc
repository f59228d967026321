#include "bucket_plan.h"

#include <map>

namespace chorus::ddp {

std::vector<std::vector<size_t>> assign_buckets(const std::vector<ParamInfo>& params, size_t first_bucket_bytes,
                                                size_t bucket_cap_bytes) {
  struct Open {
    std::vector<size_t> members;
    size_t bytes = 0;
    bool first = true;  // the next bucket of this dtype is its first
  };
  std::map<int, Open> open;  // per dtype
  std::vector<std::vector<size_t>> out;
  for (size_t k = params.size(); k-- > 0;) {
    Open& b = open[params[k].dtype];
    b.members.push_back(k);
    b.bytes += params[k].bytes;
    const size_t limit = b.first ? first_bucket_bytes : bucket_cap_bytes;
    if (b.bytes >= limit) {
      out.push_back(std::move(b.members));
      b.members.clear();
      b.bytes = 0;
      b.first = false;
    }
  }
  for (auto& [dtype, b] : open) {
    if (!b.members.empty()) out.push_back(std::move(b.members));
  }
  return out;
}

}  // namespace chorus::ddp
