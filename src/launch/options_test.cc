// `chorus run`'s pure option logic: rank filters and where each worker's output goes.
#include "options.h"

#include <gtest/gtest.h>

#include "chorus/comm/error.h"

namespace chorus::launch::detail {
namespace {

TEST(RankList, NumbersAndRanges) {
  EXPECT_EQ(parse_rank_list("0", "--ranks-filter"), (std::set<int>{0}));
  EXPECT_EQ(parse_rank_list("3,1", "--ranks-filter"), (std::set<int>{1, 3}));
  EXPECT_EQ(parse_rank_list("1-3,7,2", "--ranks-filter"), (std::set<int>{1, 2, 3, 7}));
  EXPECT_EQ(parse_rank_list("4-4", "--ranks-filter"), (std::set<int>{4}));
}

TEST(RankList, BadTextNamesTheOption) {
  for (const char* bad : {"", ",", "1,", ",1", "a", "-1", "3-1", "1-", "-", "1--2", "1 2", "0x1", "99999999"}) {
    try {
      parse_rank_list(bad, "--local-ranks-filter");
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("--local-ranks-filter"), std::string::npos) << e.what();
    }
  }
}

TEST(OutputFor, DefaultsTeeAndFilters) {
  LaunchOptions o;
  EXPECT_EQ(output_for(o, 0, 0), Output::kTerminal);
  EXPECT_EQ(output_for(o, 1, 1), Output::kTerminal);
  o.log_dir = "/tmp/x";  // rank 0 stays on the terminal, the others only in their logs
  EXPECT_EQ(output_for(o, 0, 0), Output::kTerminal);
  EXPECT_EQ(output_for(o, 1, 1), Output::kLogOnly);
  o.tee = true;
  EXPECT_EQ(output_for(o, 0, 0), Output::kPrefixed);
  EXPECT_EQ(output_for(o, 1, 1), Output::kPrefixed);
  o.ranks_filter = "1,3";  // a filter wins over --tee; it picks global ranks
  EXPECT_EQ(output_for(o, 0, 0), Output::kLogOnly);
  EXPECT_EQ(output_for(o, 3, 1), Output::kPrefixed);
  EXPECT_EQ(output_for(o, 2, 1), Output::kLogOnly);
  o.ranks_filter.clear();
  o.local_ranks_filter = "1";  // this one local ranks
  EXPECT_EQ(output_for(o, 3, 1), Output::kPrefixed);
  EXPECT_EQ(output_for(o, 2, 0), Output::kLogOnly);
}

}  // namespace
}  // namespace chorus::launch::detail
