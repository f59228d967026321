// Internal: pure planning functions for the collective algorithms. No I/O; unit-tested alone, and
// every rank's plan can be built in one process and compared.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace chorus::plan {

struct Range {
  size_t offset = 0;  // in elements
  size_t count = 0;
  bool operator==(const Range& o) const { return offset == o.offset && count == o.count; }
};

// Splits `count` elements into `parts` contiguous near-equal parts; the first count % parts parts
// get one element more. Parts cover [0, count) in order, without gaps.
Range split(size_t count, int parts, int index);

// The pipelined ring: the buffer is cut into `ranks` chunks, each chunk into `segments` segments
// (the same number for every chunk, so segment j of every chunk travels at the same pipeline
// slot). At ring step s (0 <= s < 2(ranks-1)) rank r sends chunk send_chunk(r, s) to r+1 and
// receives chunk recv_chunk(r, s) from r-1; steps < ranks-1 reduce (reduce-scatter), the rest
// copy (allgather). After the reduce-scatter, rank r holds the reduced chunk r.
struct RingPlan {
  int ranks = 1;
  size_t count = 0;
  int segments = 1;

  Range chunk(int c) const { return split(count, ranks, c); }
  Range segment(int c, int j) const;
  int send_chunk(int rank, int step) const;
  int recv_chunk(int rank, int step) const;
  int steps() const { return 2 * (ranks - 1); }
};
RingPlan make_ring_plan(size_t count, int ranks, size_t segment_elems);

// Largest power of two <= n (n >= 1).
int pow2_floor(int n);

// Binomial tree rooted at `root` over n ranks: the parent of `rank` (-1 for the root) and its
// children in the order they are served.
int binomial_parent(int rank, int root, int n);
std::vector<int> binomial_children(int rank, int root, int n);

// The hybrid transport's view of the hosts, from every rank's host id (index = rank).
struct HostPlan {
  std::vector<std::vector<int>> hosts;  // each host's ranks in order; hosts in order of lowest rank
  int host = 0;                         // this rank's host
  int local_rank = 0;                   // this rank's index on its host
  bool even = true;                     // every host holds the same number of ranks
  // The ranks this rank allreduces its slice with across hosts: even hosts, local rank l of every
  // host (a "rail"); uneven, the leaders (local rank 0) only. Empty when this rank is on no rail.
  std::vector<int> rail;
  int rail_index = -1;                  // this rank's position in `rail`
};
HostPlan plan_hosts(const std::vector<std::string>& host_ids, int rank);

// A hierarchical broadcast's first stage: one rank per host, the root first (the root on its own
// host, the lowest rank elsewhere).
std::vector<int> broadcast_heads(const std::vector<std::vector<int>>& hosts, int root);

}  // namespace chorus::plan
