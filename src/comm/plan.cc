#include "plan.h"

#include <algorithm>
#include <cmath>
#include <map>

namespace chorus::plan {

Range split(size_t count, int parts, int index) {
  const size_t p = static_cast<size_t>(parts);
  const size_t i = static_cast<size_t>(index);
  const size_t base = count / p;
  const size_t extra = count % p;
  Range r;
  r.count = base + (i < extra ? 1 : 0);
  r.offset = base * i + std::min(i, extra);
  return r;
}

Range RingPlan::segment(int c, int j) const {
  Range ch = chunk(c);
  Range s = split(ch.count, segments, j);
  s.offset += ch.offset;
  return s;
}

int RingPlan::send_chunk(int rank, int step) const {
  return ((rank - step - 1) % ranks + 2 * ranks) % ranks;
}

int RingPlan::recv_chunk(int rank, int step) const {
  return ((rank - step - 2) % ranks + 2 * ranks) % ranks;
}

RingPlan make_ring_plan(size_t count, int ranks, size_t segment_elems) {
  RingPlan p;
  p.ranks = ranks;
  p.count = count;
  const size_t largest = split(count, ranks, 0).count;
  const size_t seg = std::max<size_t>(segment_elems, 1);
  p.segments = static_cast<int>(std::max<size_t>(1, (largest + seg - 1) / seg));
  return p;
}

int pow2_floor(int n) {
  int p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}

int binomial_parent(int rank, int root, int n) {
  int vr = (rank - root + n) % n;
  if (vr == 0) return -1;
  int mask = 1;
  while (!(vr & mask)) mask <<= 1;
  return (vr - mask + root) % n;
}

std::vector<int> binomial_children(int rank, int root, int n) {
  int vr = (rank - root + n) % n;
  int mask = 1;
  while (mask < n && !(vr & mask)) mask <<= 1;
  // mask is now vr's lowest set bit (or >= n for the root); children are vr + m for m < mask.
  std::vector<int> out;
  for (int m = mask >> 1; m > 0; m >>= 1) {
    if (vr + m < n) out.push_back((vr + m + root) % n);
  }
  return out;
}

bool parse_broadcast_shape(const std::string& name, BroadcastShape* shape) {
  if (name == "auto") *shape = BroadcastShape::kAuto;
  else if (name == "binomial") *shape = BroadcastShape::kBinomial;
  else if (name == "chain") *shape = BroadcastShape::kChain;
  else return false;
  return true;
}

size_t chain_segment_bytes(size_t bytes, int n, size_t segment_bytes) {
  const size_t want = bytes / (2 * static_cast<size_t>(std::max(n, 1)));
  return std::max<size_t>(1, std::min(std::max<size_t>(want, 64 << 10), std::max<size_t>(segment_bytes, 1)));
}

double predict_broadcast_us(BroadcastShape shape, size_t bytes, int n, size_t segment_bytes, const LinkModel& m) {
  if (n <= 1) return 0;
  const double b = static_cast<double>(bytes);
  int depth = 0;
  while ((1 << depth) < n) ++depth;
  if (shape == BroadcastShape::kChain) {
    const size_t seg = chain_segment_bytes(bytes, n, segment_bytes);
    const double pieces = std::max(1.0, std::ceil(b / static_cast<double>(seg)));
    return (n - 2 + pieces) * (m.alpha_us + b / pieces * m.beta_us_per_byte);
  }
  // The root sends every segment to each of its ceil(log2 n) children in turn.
  const double pieces = std::max(1.0, std::ceil(b / static_cast<double>(std::max<size_t>(segment_bytes, 1))));
  return depth * (pieces * m.alpha_us + b * m.beta_us_per_byte);
}

BroadcastShape choose_broadcast(BroadcastShape forced, size_t bytes, int n, size_t segment_bytes, const LinkModel& m) {
  if (forced != BroadcastShape::kAuto) return forced;
  return predict_broadcast_us(BroadcastShape::kChain, bytes, n, segment_bytes, m) <
                 predict_broadcast_us(BroadcastShape::kBinomial, bytes, n, segment_bytes, m)
             ? BroadcastShape::kChain
             : BroadcastShape::kBinomial;
}

std::vector<int> collective_peers(int rank, int n) {
  std::vector<int> out;
  for (int64_t d = 1; d < n; d <<= 1) {
    for (int64_t q : {rank + d, rank - d}) {
      const int peer = static_cast<int>(((q % n) + n) % n);
      if (peer != rank) out.push_back(peer);
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

HostPlan plan_hosts(const std::vector<std::string>& host_ids, int rank) {
  HostPlan p;
  std::vector<std::string> order;
  for (int r = 0; r < static_cast<int>(host_ids.size()); ++r) {
    const std::string& id = host_ids[static_cast<size_t>(r)];
    const auto it = std::find(order.begin(), order.end(), id);
    const size_t h = static_cast<size_t>(it - order.begin());
    if (it == order.end()) {
      order.push_back(id);
      p.hosts.emplace_back();
    }
    if (r == rank) {
      p.host = static_cast<int>(h);
      p.local_rank = static_cast<int>(p.hosts[h].size());
    }
    p.hosts[h].push_back(r);
  }
  for (const auto& host : p.hosts) p.even = p.even && host.size() == p.hosts.front().size();
  if (p.even || p.local_rank == 0) {
    for (size_t h = 0; h < p.hosts.size(); ++h) {
      if (static_cast<int>(h) == p.host) p.rail_index = static_cast<int>(p.rail.size());
      p.rail.push_back(p.hosts[h][p.even ? static_cast<size_t>(p.local_rank) : 0]);
    }
  }
  return p;
}

std::vector<int> broadcast_heads(const std::vector<std::vector<int>>& hosts, int root) {
  std::vector<int> heads;
  for (const auto& host : hosts) {
    const bool has_root = std::find(host.begin(), host.end(), root) != host.end();
    heads.push_back(has_root ? root : host.front());
  }
  std::rotate(heads.begin(), std::find(heads.begin(), heads.end(), root), heads.end());
  return heads;
}

AutoTransport choose_auto_transport(const std::vector<std::pair<std::string, uint64_t>>& hosts,
                                    const std::function<uint64_t(int ranks)>& need) {
  std::map<std::string, int> per_host;
  std::map<std::string, uint64_t> free_on;
  for (const auto& [host, free_bytes] : hosts) {
    ++per_host[host];
    free_on[host] = free_bytes;
  }
  AutoTransport out;
  bool shared = false;
  for (const auto& [host, n] : per_host) {
    if (n < 2) continue;
    shared = true;
    const uint64_t want = need(n);
    if (out.short_host.empty() && free_on[host] < want) {
      out.short_host = host;
      out.short_ranks = n;
      out.short_free = free_on[host];
      out.short_need = want;
    }
  }
  out.kind = !out.short_host.empty() ? TransportKind::kTcp
             : per_host.size() == 1  ? TransportKind::kShm
             : shared                ? TransportKind::kHybrid
                                     : TransportKind::kTcp;
  return out;
}

LinkModel default_link_model(TransportKind kind, double latency_us, double gbit_per_s) {
  // Loopback TCP on the 2-core development machine (chorus bench allreduce at W=2, recursive
  // doubling and ring forced, 4 KiB to 16 MiB; docs/algorithms.md): 5-15 us a message, 3.5 GB/s,
  // reductions at 6 GB/s. Shared memory moves bytes faster; its native collectives do not use
  // this model.
  LinkModel m;
  m.alpha_us = kind == TransportKind::kShm ? 5 : 15;
  m.beta_us_per_byte = 1.0 / (kind == TransportKind::kShm ? 8000.0 : 3500.0);  // bytes per us -> us per byte
  m.gamma_us_per_byte = 1.0 / 6000.0;
  m.cache_bytes = kReductionCacheBytes;
  if (latency_us > 0) m.alpha_us = latency_us;
  if (gbit_per_s > 0) m.beta_us_per_byte = 8.0 / (gbit_per_s * 1000.0);
  return m;
}

double ranks_per_core(const std::vector<RankCpus>& ranks) {
  std::map<uint64_t, std::pair<int, decltype(RankCpus::cpus)>> machines;  // ranks, CPUs' union
  for (const RankCpus& r : ranks) {
    auto& [count, cpus] = machines[r.machine];
    ++count;
    for (size_t w = 0; w < cpus.size(); ++w) cpus[w] |= r.cpus[w];
  }
  double most = 1;
  for (const auto& [machine, m] : machines) {
    int cores = 0;
    for (uint64_t word : m.second) cores += __builtin_popcountll(word);
    most = std::max(most, static_cast<double>(m.first) / std::max(cores, 1));
  }
  return most;
}

LinkModel on_shared_cores(LinkModel link, double ranks_per_core) {
  if (ranks_per_core > 1) link.alpha_us += (ranks_per_core - 1) * kSharedCoreStepUs;
  link.core_beta_us_per_byte = std::max(ranks_per_core, 1.0) * default_link_model(TransportKind::kTcp).beta_us_per_byte;
  link.cache_bytes /= std::max(ranks_per_core, 1.0);
  return link;
}

bool exchange_needs_ready(size_t a_bytes, size_t b_bytes, const LinkModel& link) {
  const double block_us = static_cast<double>(std::max(a_bytes, b_bytes)) * link.beta_us_per_byte;
  return block_us >= kReadyBlockAlphas * link.alpha_us;
}

double predict_allreduce_us(AllreduceAlgorithm algorithm, size_t bytes, int ranks, const LinkModel& m) {
  if (ranks <= 1) return 0;
  const double n = static_cast<double>(bytes);
  const double a = m.alpha_us, b = m.beta_us_per_byte, g = m.gamma_us_per_byte;
  const int p2 = pow2_floor(ranks);
  int rounds = 0;
  while ((1 << rounds) < p2) ++rounds;
  // Reducing a received block: free while it and its copy fit in the cache (LinkModel::cache_bytes).
  auto reduce_us = [&](double block) { return 2 * block <= m.cache_bytes ? 0.0 : block * g; };
  // Folding ranks past p2 in and the result back out: two whole-buffer messages and one reduction.
  const double fold = ranks > p2 ? 2 * (a + n * b) + reduce_us(n) : 0;
  switch (algorithm) {
    case AllreduceAlgorithm::kRecursiveDoubling:
      return rounds * (a + n * b + reduce_us(n)) + fold;
    case AllreduceAlgorithm::kRabenseifner: {
      // Recursive halving reduces n/2, n/4, ..., n/p2: (p2 - 1)/p2 of the buffer in all.
      const double share = static_cast<double>(p2 - 1) / p2;
      double reductions = 0;
      for (int k = 1; k <= rounds; ++k) reductions += reduce_us(n / static_cast<double>(1 << k));
      return 2 * rounds * a + 2 * share * n * b + reductions + fold;
    }
    case AllreduceAlgorithm::kRing: {
      const double w = static_cast<double>(ranks - 1) / ranks;
      return 2 * (ranks - 1) * a + w * n * (std::max(b, g) + b);
    }
    case AllreduceAlgorithm::kAuto:
    case AllreduceAlgorithm::kTuned:
      break;
  }
  return 0;
}

AllreduceAlgorithm choose_allreduce(AllreduceAlgorithm forced, size_t bytes, size_t count, int ranks,
                                    const LinkModel& model) {
  const bool splits_for_ring = count >= static_cast<size_t>(ranks);
  const bool splits_for_halving = count >= static_cast<size_t>(pow2_floor(ranks));
  if (forced == AllreduceAlgorithm::kRing && splits_for_ring) return forced;
  if (forced == AllreduceAlgorithm::kRabenseifner && splits_for_halving) return forced;
  if (forced != AllreduceAlgorithm::kAuto && forced != AllreduceAlgorithm::kTuned) {
    return AllreduceAlgorithm::kRecursiveDoubling;
  }
  AllreduceAlgorithm best = AllreduceAlgorithm::kRecursiveDoubling;
  double best_us = predict_allreduce_us(best, bytes, ranks, model);
  for (AllreduceAlgorithm a : {AllreduceAlgorithm::kRabenseifner, AllreduceAlgorithm::kRing}) {
    if (a == AllreduceAlgorithm::kRing ? !splits_for_ring : !splits_for_halving) continue;
    // Two ranks: Rabenseifner is the ring's two steps (halves swapped, then swapped back) with its
    // reduction not overlapped; the model can at most tie them, and then the ring runs.
    if (a == AllreduceAlgorithm::kRabenseifner && ranks == 2) continue;
    const double us = predict_allreduce_us(a, bytes, ranks, model);
    if (us < best_us) {
      best = a;
      best_us = us;
    }
  }
  const bool link_bound = model.beta_us_per_byte >= model.core_beta_us_per_byte;
  // Two ranks talk over their one connection whatever the algorithm: no new flows to ramp, no margin.
  if (best != AllreduceAlgorithm::kRing && splits_for_ring && link_bound && ranks > 2 &&
      predict_allreduce_us(AllreduceAlgorithm::kRing, bytes, ranks, model) <= (1 + kRingPreferredWithin) * best_us) {
    return AllreduceAlgorithm::kRing;
  }
  return best;
}

std::vector<AllreduceAlgorithm> tuning_candidates(size_t bytes, size_t count, int ranks, const LinkModel& model) {
  std::vector<std::pair<double, AllreduceAlgorithm>> by_time;
  for (AllreduceAlgorithm a : {AllreduceAlgorithm::kRecursiveDoubling, AllreduceAlgorithm::kRabenseifner,
                               AllreduceAlgorithm::kRing}) {
    // An algorithm that cannot split this buffer would run recursive doubling in its place.
    if (a != AllreduceAlgorithm::kRecursiveDoubling && choose_allreduce(a, bytes, count, ranks, model) != a) continue;
    by_time.emplace_back(predict_allreduce_us(a, bytes, ranks, model), a);
  }
  std::stable_sort(by_time.begin(), by_time.end(),
                   [](const auto& x, const auto& y) { return x.first < y.first; });
  std::vector<AllreduceAlgorithm> out;
  for (const auto& [us, a] : by_time) {
    if (ranks > 1 && us <= kTuningSpread * by_time.front().first) out.push_back(a);
  }
  if (out.empty()) out.push_back(by_time.front().second);
  const auto pick = std::find(out.begin(), out.end(), choose_allreduce(AllreduceAlgorithm::kAuto, bytes, count, ranks, model));
  if (pick != out.end()) std::rotate(out.begin(), pick, pick + 1);
  return out;
}

int size_class(size_t bytes) {
  int k = 0;
  while (bytes != 0) {
    bytes >>= 1;
    ++k;
  }
  return k;
}

ByteRange size_class_bytes(int size_class) {
  if (size_class <= 0) return {};
  const size_t low = size_t{1} << (size_class - 1);
  return {low, low + (low - 1)};
}

Trial tuning_trial(int index, int candidates) {
  Trial t;
  t.candidate = index % candidates;
  t.timed = index >= candidates;  // the first round is untimed
  return t;
}

double median_us(std::vector<double> us) {
  if (us.empty()) return 0;
  std::sort(us.begin(), us.end());
  const size_t n = us.size();
  return n % 2 == 1 ? us[n / 2] : (us[n / 2 - 1] + us[n / 2]) / 2;
}

int fastest_candidate(const std::vector<double>& agreed_us) {
  int best = 0;
  for (size_t i = 1; i < agreed_us.size(); ++i) {
    if (agreed_us[i] < agreed_us[static_cast<size_t>(best)]) best = static_cast<int>(i);
  }
  return best;
}

bool parse_hierarchy(const std::string& name, Hierarchy* hierarchy) {
  if (name == "auto") *hierarchy = Hierarchy::kAuto;
  else if (name == "hierarchical") *hierarchy = Hierarchy::kHierarchical;
  else if (name == "flat") *hierarchy = Hierarchy::kFlat;
  else return false;
  return true;
}

namespace {

// The fastest algorithm's predicted time (any buffer splits: the prediction is about bandwidth).
double best_allreduce_us(size_t bytes, int ranks, const LinkModel& m) {
  const AllreduceAlgorithm a = choose_allreduce(AllreduceAlgorithm::kAuto, bytes, bytes, ranks, m);
  return predict_allreduce_us(a, bytes, ranks, m);
}

// `link` with its bandwidth shared by `ways` streams at once.
LinkModel shared(LinkModel link, int ways) {
  link.beta_us_per_byte *= std::max(ways, 1);
  return link;
}

}  // namespace

double predict_hierarchical_us(size_t bytes, int hosts, int per_host, const LinkModel& link, const LinkModel& local) {
  const double n = static_cast<double>(bytes);
  int levels = 0;
  while ((1 << levels) < per_host) ++levels;
  // Within the host: a reduce-scatter and an allgather over shared memory (each byte copied in and
  // out once per phase, reduced once), ceil(log2 per_host) synchronisations each.
  const double within = per_host > 1 ? 2 * (levels * local.alpha_us + n * local.beta_us_per_byte) +
                                           n * local.gamma_us_per_byte
                                     : 0;
  // Across: per_host rails at once, each with 1/per_host of the bytes, all through the host's link.
  const size_t rail_bytes = (bytes + static_cast<size_t>(std::max(per_host, 1)) - 1) / static_cast<size_t>(std::max(per_host, 1));
  return within + best_allreduce_us(rail_bytes, hosts, shared(link, per_host));
}

double predict_flat_us(size_t bytes, int hosts, int per_host, const LinkModel& link) {
  // Every rank in one algorithm over hosts x per_host ranks. A step is as slow as its slowest
  // pair: across hosts the host's ranks share its link; within a host, pairs talk over loopback
  // TCP (default_link_model(kTcp)), which a fast network can outrun.
  LinkModel m = shared(link, per_host);
  if (per_host > 1) {
    const LinkModel loopback = default_link_model(TransportKind::kTcp);
    m.alpha_us = std::max(m.alpha_us, loopback.alpha_us);
    m.beta_us_per_byte = std::max(m.beta_us_per_byte, loopback.beta_us_per_byte);
  }
  return best_allreduce_us(bytes, hosts * per_host, m);
}

Hierarchy choose_hierarchy(Hierarchy forced, size_t bytes, int hosts, int per_host, const LinkModel& link,
                           const LinkModel& local) {
  if (forced != Hierarchy::kAuto) return forced;
  if (per_host <= 1) return Hierarchy::kHierarchical;  // one rank per host: the same algorithm either way
  return predict_flat_us(bytes, hosts, per_host, link) < predict_hierarchical_us(bytes, hosts, per_host, link, local)
             ? Hierarchy::kFlat
             : Hierarchy::kHierarchical;
}

int default_spin_us(TransportKind kind, int ranks, unsigned cores) {
  if (ranks < 1 || static_cast<unsigned>(ranks) > cores) return 0;
  return kind == TransportKind::kTcp ? 20 : 50;
}

}  // namespace chorus::plan
