// Internal: pure planning functions for the collective algorithms. No I/O; unit-tested alone, and
// every rank's plan can be built in one process and compared.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "chorus/comm/types.h"

namespace chorus::plan {

// What transport "auto" picks. `hosts` holds each rank's host id and the bytes free in that host's
// /dev/shm; `need(n)` is the /dev/shm a host of n ranks needs. shm when every rank shares one host,
// hybrid when some host holds several ranks, tcp when each rank is alone on its host, and tcp when a
// host of several ranks lacks the /dev/shm they need (short_host names the first, with its figures).
struct AutoTransport {
  TransportKind kind = TransportKind::kTcp;
  std::string short_host;  // "" unless /dev/shm decided
  int short_ranks = 0;
  uint64_t short_free = 0;
  uint64_t short_need = 0;
};
AutoTransport choose_auto_transport(const std::vector<std::pair<std::string, uint64_t>>& hosts,
                                    const std::function<uint64_t(int ranks)>& need);

// How long a transport busy-polls before it sleeps, by default: 20 us over TCP, 50 us over shared
// memory and MPI, when the `ranks` sharing this host fit its `cores`; 0 otherwise (spinning on an
// oversubscribed host takes the core a peer needs). `ranks` counts this host's ranks of the group.
int default_spin_us(TransportKind kind, int ranks, unsigned cores);

// The alpha-beta-gamma cost of a link: a message of n bytes takes alpha_us + n * beta_us_per_byte
// to arrive, and reducing n bytes into a buffer takes n * gamma_us_per_byte (docs/algorithms.md).
struct LinkModel {
  double alpha_us = 0;
  double beta_us_per_byte = 0;
  double gamma_us_per_byte = 0;
  // Set by on_shared_cores: a byte's cost to ranks that take turns on their cores (loopback's beta,
  // once per rank a core holds). Not in the predicted times; where it exceeds beta the cores, not
  // the link, bound the bytes, and choose_allreduce keeps no margin for the ring. 0: not known.
  double core_beta_us_per_byte = 0;
  // A block reduced after it arrives (recursive doubling's whole buffer, Rabenseifner's halves,
  // the fold) costs gamma per byte only when the block and the copy it is reduced from do not fit
  // in this much of a core's cache (2 x block > cache_bytes): gamma prices a reduction streamed
  // through memory; one in cache runs at 40-65 GB/s here, free next to its transfer. 0: every
  // reduction is priced. The ring's reductions overlap its transfers and are priced as before.
  double cache_bytes = 0;
};
// The cache default_link_model assumes a rank has: a core's L2 on the development machine (1 MiB).
// Recursive doubling at W=2 over loopback TCP beat the ring by 15-20% from 128 KiB to 512 KiB and
// lost by 10% at 1 MiB, where the buffer and its received copy no longer fit (docs/algorithms.md).
constexpr double kReductionCacheBytes = 1 << 20;
// The model a transport starts from, measured on loopback TCP (docs/algorithms.md, "The model's
// figures"); `latency_us` and `gbit_per_s` replace its alpha and beta where above 0 (the link a
// user knows: 10 GbE, 100 Gbit/s InfiniBand ...).
LinkModel default_link_model(TransportKind kind, double latency_us = 0, double gbit_per_s = 0);

// Ranks that share a machine's cores. The link's alpha is measured with a core per rank; where
// several ranks take turns on each core, every step of an algorithm also waits until the kernel
// runs the rank it woke, behind the others on its core, so algorithms of fewer steps gain
// (docs/algorithms.md, "Shared cores"). One rank's machine and the CPUs it may run on:
struct RankCpus {
  uint64_t machine = 0;                 // a hash of the machine's identity (its kernel's boot_id)
  std::array<uint64_t, 16> cpus{};      // the CPUs it may run on, one bit each (CPU_SETSIZE = 1024)
};
// The most ranks per core on any machine of the group: its ranks over the CPUs any of them may run
// on (ranks pinned to disjoint cores share none). 1 when every rank has a core of its own; at
// least 1. Every rank computes the same figure from the same list.
double ranks_per_core(const std::vector<RankCpus>& ranks);
// A step's wait for a shared core, per rank beyond the first on it, in microseconds: fitted on
// loopback TCP with 4 and 8 ranks on 2 cores (chorus bench, the three algorithms forced in one
// job, 16 KiB-4 MiB; docs/algorithms.md), and checked on namespace hosts it was not fitted on.
constexpr double kSharedCoreStepUs = 25;
// `link` with each message's latency raised by kSharedCoreStepUs for every rank a core holds beyond
// one (unchanged at ranks_per_core <= 1), core_beta_us_per_byte set, and cache_bytes shared among
// the ranks a core holds. Its bandwidth stays the link's.
LinkModel on_shared_cores(LinkModel link, double ranks_per_core);

// The predicted time of one allreduce of `bytes` over `ranks` ranks by `algorithm`, in microseconds
// (Thakur, Rabenseifner and Gropp 2005, with the ring's reduction overlapped with its transfers, as
// its segments pipeline them). Ranks beyond the largest power of two fold into it first and get
// the result back after (recursive doubling and Rabenseifner).
double predict_allreduce_us(AllreduceAlgorithm algorithm, size_t bytes, int ranks, const LinkModel& model);

// The algorithm one allreduce call runs: `forced` unless it is kAuto (or kTuned, whose trials and
// choice algo::MeasuredAllreduce makes), else the one with the least predicted time. Recursive
// doubling wherever the others cannot split the buffer: fewer elements (`count`) than the ranks the
// buffer is cut among. Pure: every rank computes the same choice.
// Within kRingPreferredWithin of the least predicted time the ring is kept where the link bounds
// the bytes (beta at least core_beta_us_per_byte): its one steady flow per neighbour reaches the
// link's rate, while each of the others' steps starts a new flow that TCP ramps up again, which the
// model does not price (measured: Rabenseifner 1-17% behind the ring at 4-16 MiB over 8 shaped
// hosts where the model has them level; docs/algorithms.md). Where shared cores bound them, a flow
// never reaches the link's rate to ramp to, and every extra step waits for a core: no margin. Nor
// between two ranks, whose every algorithm uses their one connection.
constexpr double kRingPreferredWithin = 0.05;
AllreduceAlgorithm choose_allreduce(AllreduceAlgorithm forced, size_t bytes, size_t count, int ranks,
                                    const LinkModel& model);

// allreduce_algorithm "tuned": the algorithm measured rather than predicted (docs/algorithms.md,
// "Measured choice"). Calls fall into size classes, bytes in [2^(k-1), 2^k) for class k (bit
// width); the first tuning_calls(C) calls of a class over a group run its C candidates in turn,
// kTuningRounds rounds, the first untimed (it pays for first-use connections and TCP's slow
// start). Then the group agrees on each candidate's time, the slowest rank's median of its timed
// rounds, and the class runs the fastest from then on.
constexpr int kTuningRounds = 6;
static_assert(kTuningRounds * 3 == kTunedAllreduceTrials, "types.h promises the trials' bound");
// Candidates: the algorithms that can split the buffer and are predicted within this factor of the
// model's best, so that trials never run one the model is sure is far slower (recursive doubling
// of a gigabyte over 1024 ranks); the model's pick (choose_allreduce, which may keep the ring within
// its margin) first, the others in predicted order, so a tie goes to the model's pick.
constexpr double kTuningSpread = 4;
std::vector<AllreduceAlgorithm> tuning_candidates(size_t bytes, size_t count, int ranks, const LinkModel& model);
constexpr int tuning_calls(int candidates) { return candidates > 1 ? kTuningRounds * candidates : 0; }
int size_class(size_t bytes);  // bytes' bit width: 0 for 0 bytes, k for [2^(k-1), 2^k)
struct ByteRange {
  size_t min_bytes = 0;
  size_t max_bytes = 0;  // inclusive
};
ByteRange size_class_bytes(int size_class);
// The trial that a class's call `index` (0-based, below tuning_calls(candidates)) runs: its
// candidate, and whether its time counts.
struct Trial {
  int candidate = 0;
  bool timed = false;
};
Trial tuning_trial(int index, int candidates);
// The median of one candidate's timed rounds on one rank (0 for none).
double median_us(std::vector<double> us);
// The candidate to keep from the agreed times (each the slowest rank's median): the fastest, the
// earlier on a tie.
int fastest_candidate(const std::vector<double>& agreed_us);

// An allreduce across several hosts (the hybrid transport): hierarchical (shared memory within each
// host, then the hosts over TCP, one rail per local rank, each moving its share of the buffer, then
// shared memory again) or flat (every rank in one TCP algorithm, as if each were alone on a host).
enum class Hierarchy { kAuto, kHierarchical, kFlat };
bool parse_hierarchy(const std::string& name, Hierarchy* hierarchy);
// Predicted times in microseconds of one allreduce of `bytes` over `hosts` hosts of `per_host` ranks
// each: `link` is the network between hosts (shared by a host's ranks or rails), `local` the shared
// memory within one (its beta a copy, its gamma a reduction); flat's pairs within a host talk over
// loopback TCP (default_link_model(kTcp)). Each network part takes the fastest algorithm of
// predict_allreduce_us.
double predict_hierarchical_us(size_t bytes, int hosts, int per_host, const LinkModel& link, const LinkModel& local);
double predict_flat_us(size_t bytes, int hosts, int per_host, const LinkModel& link);
// `forced` unless kAuto; else the faster (one rank per host: hierarchical, which is then the rails
// alone). Every rank must pass the same figures: per_host is the most ranks any host has.
Hierarchy choose_hierarchy(Hierarchy forced, size_t bytes, int hosts, int per_host, const LinkModel& link,
                           const LinkModel& local);

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

// Whether an exchange step of recursive doubling or Rabenseifner, this rank sending a_bytes to its
// partner and receiving b_bytes back, starts with a ready handshake (exchange_steps in
// algorithms.cc): when the larger block takes at least kReadyBlockAlphas message latencies on `link`,
// so that the handshake costs at most about 1/kReadyBlockAlphas of the step. Smaller blocks would
// pay more for it than they save: they fit in a switch's queue when they meet another rank's. On
// loopback's figures (default_link_model) that is blocks from 1.7 MB; told a 1 Gbit/s link, from
// 60 kB. Symmetric in a_bytes and b_bytes, so both partners agree.
constexpr double kReadyBlockAlphas = 32;
bool exchange_needs_ready(size_t a_bytes, size_t b_bytes, const LinkModel& link);

// Binomial tree rooted at `root` over n ranks: the parent of `rank` (-1 for the root) and its
// children in the order they are served.
int binomial_parent(int rank, int root, int n);
std::vector<int> binomial_children(int rank, int root, int n);

// Broadcast: a binomial tree (the root's link carries the buffer ceil(log2 n) times; few steps) or a
// chain through the ranks in order from the root (every link carries it once, in `segments`
// pipelined pieces; n - 1 steps to fill the pipe). Predicted time of each in microseconds, and the
// choice: `forced` "binomial" or "chain" as given, else the faster (CHORUS_BROADCAST_ALGORITHM).
enum class BroadcastShape { kAuto, kBinomial, kChain };
bool parse_broadcast_shape(const std::string& name, BroadcastShape* shape);
// The chain's piece for `bytes` over n ranks: bytes / (2n), within [64 KiB, segment_bytes] (at least 1).
size_t chain_segment_bytes(size_t bytes, int n, size_t segment_bytes);
double predict_broadcast_us(BroadcastShape shape, size_t bytes, int n, size_t segment_bytes, const LinkModel& m);
BroadcastShape choose_broadcast(BroadcastShape forced, size_t bytes, int n, size_t segment_bytes, const LinkModel& m);

// The peers the collective algorithms of `rank` ever exchange with over n ranks: (rank +- 2^k) mod n
// for 2^k < n. That covers the ring's neighbours, recursive doubling's and halving's partners
// (rank xor 2^k), the fold of the ranks past the largest power of two, binomial trees of any root
// and the dissemination barrier. Sorted, without `rank`; symmetric (q is rank's peer iff rank is
// q's); at most 2 ceil(log2 n). Gather, scatter, alltoall and point-to-point name their own peers.
// For connections that follow the algorithms (docs/algorithms.md, "Connections at scale").
std::vector<int> collective_peers(int rank, int n);

// Whether a TCP group of n ranks connects lazily when nothing is asked for (tcp_connections
// "auto"): the full mesh costs each rank 2(n-1) sockets and a setup that grows with n, lazy
// connections a first-use handshake per peer (about 0.1-0.3 ms on loopback). Lazy above
// kLazyConnectionsFrom - 1 ranks.
constexpr int kLazyConnectionsFrom = 17;
constexpr bool lazy_connections_by_default(int n) { return n >= kLazyConnectionsFrom; }

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
