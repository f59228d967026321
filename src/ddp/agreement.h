// Agreement across ranks on what each rank holds (DDP's and ZeRO's parameters): every rank sends
// a description, one line per item, and every rank compares them all, so a mismatch raises the
// same error on every rank instead of a hang.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "chorus/comm/process_group.h"

namespace chorus::ddp {

// Collective: every rank's lines, in rank order.
std::vector<std::vector<std::string>> gather_lines(ProcessGroup& group, const std::vector<std::string>& lines);

// One entry per line in which a rank differs from rank 0: "#i: rank 0 has A, rank r has B" ("(none)"
// past the end of the shorter list), at most `limit` entries. Empty when every rank agrees. Pure.
std::vector<std::string> differences_from_rank0(const std::vector<std::vector<std::string>>& lines_per_rank,
                                                size_t limit = 20);

}  // namespace chorus::ddp
