#include <gtest/gtest.h>

#include <set>

#include "plan.h"

namespace chorus::plan {
namespace {

TEST(Split, CoversRangeInOrderWithoutGaps) {
  for (size_t count : {0, 1, 2, 7, 100, 1001}) {
    for (int parts = 1; parts <= 9; ++parts) {
      size_t next = 0;
      for (int i = 0; i < parts; ++i) {
        Range r = split(count, parts, i);
        EXPECT_EQ(r.offset, next) << count << "/" << parts << "#" << i;
        next += r.count;
        EXPECT_LE(r.count, count / parts + 1);
        EXPECT_GE(r.count, count / parts);
      }
      EXPECT_EQ(next, count);
    }
  }
}

TEST(RingPlan, EveryRankEndsOwningItsChunkAndEveryChunkIsSentOncePerStep) {
  for (int n = 1; n <= 8; ++n) {
    RingPlan p = make_ring_plan(1000, n, 7);
    for (int s = 0; s < p.steps(); ++s) {
      std::set<int> sent, received;
      for (int r = 0; r < n; ++r) {
        sent.insert(p.send_chunk(r, s));
        received.insert(p.recv_chunk(r, s));
        // What rank r receives at step s is what its predecessor sends at step s.
        EXPECT_EQ(p.recv_chunk(r, s), p.send_chunk((r - 1 + n) % n, s));
        // ... and is what r forwards at step s + 1 (the pipeline).
        EXPECT_EQ(p.recv_chunk(r, s), p.send_chunk(r, s + 1));
      }
      EXPECT_EQ(sent.size(), static_cast<size_t>(n));
      EXPECT_EQ(received.size(), static_cast<size_t>(n));
    }
    // The last reduce-scatter step leaves rank r with chunk r.
    for (int r = 0; r < n && n > 1; ++r) EXPECT_EQ(p.recv_chunk(r, n - 2), r);
  }
}

TEST(RingPlan, SegmentsTileEachChunk) {
  for (size_t count : {0, 1, 5, 97, 4099}) {
    for (int n : {1, 2, 3, 5, 8}) {
      for (size_t seg : {1, 3, 64, 100000}) {
        RingPlan p = make_ring_plan(count, n, seg);
        EXPECT_GE(p.segments, 1);
        for (int c = 0; c < n; ++c) {
          Range ch = p.chunk(c);
          size_t next = ch.offset;
          for (int j = 0; j < p.segments; ++j) {
            Range g = p.segment(c, j);
            EXPECT_EQ(g.offset, next);
            EXPECT_LE(g.count, seg);
            next += g.count;
          }
          EXPECT_EQ(next, ch.offset + ch.count);
        }
      }
    }
  }
}

TEST(Binomial, TreeReachesEveryRankOnce) {
  for (int n = 1; n <= 13; ++n) {
    for (int root = 0; root < n; ++root) {
      std::vector<int> parent_count(static_cast<size_t>(n), 0);
      for (int r = 0; r < n; ++r) {
        for (int c : binomial_children(r, root, n)) {
          EXPECT_EQ(binomial_parent(c, root, n), r);
          parent_count[static_cast<size_t>(c)]++;
        }
      }
      for (int r = 0; r < n; ++r) {
        EXPECT_EQ(parent_count[static_cast<size_t>(r)], r == root ? 0 : 1) << "n=" << n << " root=" << root;
        EXPECT_EQ(binomial_parent(r, root, n) == -1, r == root);
      }
    }
  }
}

TEST(Pow2, Floor) {
  EXPECT_EQ(pow2_floor(1), 1);
  EXPECT_EQ(pow2_floor(2), 2);
  EXPECT_EQ(pow2_floor(3), 2);
  EXPECT_EQ(pow2_floor(5), 4);
  EXPECT_EQ(pow2_floor(8), 8);
  EXPECT_EQ(pow2_floor(9), 8);
}

}  // namespace
}  // namespace chorus::plan
