#include "bucket_plan.h"

#include <gtest/gtest.h>

#include <set>

namespace chorus::ddp {
namespace {

std::vector<ParamInfo> sizes(std::initializer_list<size_t> bytes, int dtype = 0) {
  std::vector<ParamInfo> out;
  for (size_t b : bytes) out.push_back({b, dtype});
  return out;
}

TEST(BucketPlan, ReverseOrderSmallFirstBucketThenCap) {
  // Parameters 0..5 of 400 bytes; first bucket closes at >= 500 bytes, then at >= 1000.
  auto plan = assign_buckets(sizes({400, 400, 400, 400, 400, 400}), 500, 1000);
  ASSERT_EQ(plan.size(), 3u);
  EXPECT_EQ(plan[0], (std::vector<size_t>{5, 4}));
  EXPECT_EQ(plan[1], (std::vector<size_t>{3, 2, 1}));
  EXPECT_EQ(plan[2], (std::vector<size_t>{0}));
}

TEST(BucketPlan, LargeParameterGetsItsOwnBucket) {
  auto plan = assign_buckets(sizes({10, 5000, 10}), 100, 1000);
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0], (std::vector<size_t>{2, 1}));
  EXPECT_EQ(plan[1], (std::vector<size_t>{0}));
}

TEST(BucketPlan, DtypesNeverMixAndEveryParameterAppearsOnce) {
  std::vector<ParamInfo> p = {{100, 0}, {100, 1}, {100, 0}, {100, 1}, {100, 0}};
  auto plan = assign_buckets(p, 150, 150);
  std::multiset<size_t> seen;
  for (const auto& b : plan) {
    ASSERT_FALSE(b.empty());
    for (size_t i : b) {
      seen.insert(i);
      EXPECT_EQ(p[i].dtype, p[b[0]].dtype);
    }
  }
  EXPECT_EQ(seen, (std::multiset<size_t>{0, 1, 2, 3, 4}));
}

TEST(BucketPlan, EmptyAndSingle) {
  EXPECT_TRUE(assign_buckets({}, 1, 1).empty());
  auto plan = assign_buckets(sizes({7}), 1 << 20, 25 << 20);
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_EQ(plan[0], (std::vector<size_t>{0}));
}

}  // namespace
}  // namespace chorus::ddp
