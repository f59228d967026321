// Agreement across ranks: see agreement.h.
#include "agreement.h"

#include <algorithm>
#include <sstream>

namespace chorus::ddp {

std::vector<std::vector<std::string>> gather_lines(ProcessGroup& group, const std::vector<std::string>& lines) {
  std::ostringstream mine;
  for (const auto& line : lines) mine << line << "\n";
  auto work = group.all_gather_object(mine.str());
  work->wait();
  std::vector<std::vector<std::string>> out;
  for (const auto& text : work->objects()) {
    std::vector<std::string> rank_lines;
    std::istringstream in(text);
    for (std::string l; std::getline(in, l);) rank_lines.push_back(l);
    out.push_back(std::move(rank_lines));
  }
  return out;
}

std::vector<std::string> differences_from_rank0(const std::vector<std::vector<std::string>>& lines_per_rank,
                                                size_t limit) {
  std::vector<std::string> out;
  if (lines_per_rank.empty()) return out;
  const auto& ref = lines_per_rank[0];
  for (size_t r = 1; r < lines_per_rank.size(); ++r) {
    const auto& other = lines_per_rank[r];
    for (size_t i = 0; i < std::max(ref.size(), other.size()) && out.size() < limit; ++i) {
      const std::string a = i < ref.size() ? ref[i] : "(none)";
      const std::string b = i < other.size() ? other[i] : "(none)";
      if (a != b) out.push_back("#" + std::to_string(i) + ": rank 0 has " + a + ", rank " + std::to_string(r) + " has " + b);
    }
  }
  return out;
}

}  // namespace chorus::ddp
