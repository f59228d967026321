#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "chorus/comm/check.h"
#include "chorus/comm/error.h"
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

TEST(CollectivePeers, CoverEveryAlgorithmsPartnersSymmetricallyInLogarithmicCount) {
  for (int n = 1; n <= 70; ++n) {
    const int p = plan::pow2_floor(n);
    std::vector<std::set<int>> peers(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) {
      const std::vector<int> v = plan::collective_peers(r, n);
      peers[static_cast<size_t>(r)] = std::set<int>(v.begin(), v.end());
      ASSERT_EQ(peers[static_cast<size_t>(r)].size(), v.size()) << "duplicates, n=" << n;
      ASSERT_TRUE(std::is_sorted(v.begin(), v.end()));
      ASSERT_EQ(peers[static_cast<size_t>(r)].count(r), 0u);
      int log2n = 0;
      while ((1 << log2n) < n) ++log2n;
      EXPECT_LE(static_cast<int>(v.size()), 2 * log2n) << "n=" << n;
    }
    auto has = [&](int r, int q) { return peers[static_cast<size_t>(r)].count(q) == 1; };
    for (int r = 0; r < n; ++r) {
      if (n > 1) {  // the ring
        EXPECT_TRUE(has(r, (r + 1) % n)) << r << "/" << n;
        EXPECT_TRUE(has(r, (r + n - 1) % n)) << r << "/" << n;
      }
      for (int d = 1; d < p; d <<= 1) {  // recursive doubling and halving
        if (r < p) {
          EXPECT_TRUE(has(r, r ^ d)) << r << "/" << n;
        }
      }
      if (r >= p) {
        EXPECT_TRUE(has(r, r - p)) << r << "/" << n;  // the fold
      }
      for (int root = 0; root < n; ++root) {  // binomial trees of every root
        const int parent = plan::binomial_parent(r, root, n);
        if (parent >= 0) {
          EXPECT_TRUE(has(r, parent)) << r << "/" << n << " root " << root;
        }
        for (int c : plan::binomial_children(r, root, n)) EXPECT_TRUE(has(r, c));
      }
      for (int k = 1; k < n; k <<= 1) EXPECT_TRUE(has(r, (r + k) % n));  // dissemination barrier
      for (int q : peers[static_cast<size_t>(r)]) EXPECT_TRUE(has(q, r)) << "not symmetric: " << r << ", " << q;
    }
  }
  EXPECT_EQ(plan::collective_peers(0, 1).size(), 0u);
  EXPECT_EQ(plan::collective_peers(5, 1024).size(), 19u);  // +-1 .. +-256, and 512 once
}

// Flat vs hierarchical across hosts: where the network is slower than the host's memory (1 and 10
// Gbit/s against the 8 GB/s shared memory of the default model), the hierarchy wins at every size
// and scale, since it sends each byte across hosts once per host rather than once per rank, in
// fewer latency steps; flat wins where the host's memory is the slower path. (At 100 Gbit/s the
// two come close with this machine's memory figures; the model decides.) The formulas themselves:
// checked against hand-computed cases.
TEST(Hierarchy, HierarchicalWhereSharedMemoryIsCheaperFlatWhereItIsNotForcedAsAsked) {
  const LinkModel tcp = default_link_model(TransportKind::kTcp);
  const LinkModel shm = default_link_model(TransportKind::kShm);
  for (double gbit : {1.0, 10.0}) {
    const LinkModel link = default_link_model(TransportKind::kTcp, 20, gbit);
    for (int hosts : {2, 3, 8, 64, 128}) {
      for (int per_host : {2, 4, 8}) {
        for (size_t bytes : {size_t{4} << 10, size_t{1} << 20, size_t{64} << 20, size_t{1} << 30}) {
          EXPECT_EQ(choose_hierarchy(Hierarchy::kAuto, bytes, hosts, per_host, link, shm), Hierarchy::kHierarchical)
              << gbit << " Gbit/s, " << hosts << " hosts x " << per_host << ", " << bytes << " bytes";
          EXPECT_LT(predict_hierarchical_us(bytes, hosts, per_host, link, shm), predict_flat_us(bytes, hosts, per_host, link));
        }
      }
    }
  }
  // A host whose shared memory is slower than the network (a 1 ms synchronisation, 10 MB/s): flat.
  LinkModel slow = shm;
  slow.alpha_us = 1000;
  slow.beta_us_per_byte = 0.1;
  EXPECT_EQ(choose_hierarchy(Hierarchy::kAuto, 1 << 20, 4, 4, tcp, slow), Hierarchy::kFlat);
  // Forced either way; one rank per host is the rails alone.
  EXPECT_EQ(choose_hierarchy(Hierarchy::kFlat, 1 << 20, 4, 4, tcp, shm), Hierarchy::kFlat);
  EXPECT_EQ(choose_hierarchy(Hierarchy::kHierarchical, 1 << 20, 4, 4, tcp, slow), Hierarchy::kHierarchical);
  EXPECT_EQ(choose_hierarchy(Hierarchy::kAuto, 1 << 20, 4, 1, tcp, slow), Hierarchy::kHierarchical);
  // By hand: 2 hosts x 2 ranks, 4 KiB. Within: 2 x (1 x 5 + 4096/8000) + 4096/6000 us; across: 2 KiB
  // on 2 hosts, the link shared twice, recursive doubling (one message, one reduction).
  // The across reduction (2 KiB) fits in the cache: no gamma for it (LinkModel::cache_bytes).
  const double within = 2 * (5 + 4096.0 / 8000) + 4096.0 / 6000;
  const double across = 15 + 2048 * 2 / 3500.0;
  EXPECT_NEAR(predict_hierarchical_us(4096, 2, 2, tcp, shm), within + across, 1e-9);
  // Flat: 4 ranks, the link shared twice (slower than loopback here), recursive doubling: 2 rounds
  // of the whole buffer. Over a 100 Gbit/s link the loopback pairs set the pace instead.
  EXPECT_NEAR(predict_flat_us(4096, 2, 2, tcp), 2 * (15 + 4096 * 2 / 3500.0), 1e-9);
  const LinkModel fast = default_link_model(TransportKind::kTcp, 2, 100);
  EXPECT_NEAR(predict_flat_us(4096, 2, 2, fast), 2 * (15 + 4096 / 3500.0), 1e-9);
  Hierarchy h = Hierarchy::kAuto;
  EXPECT_TRUE(parse_hierarchy("flat", &h));
  EXPECT_EQ(h, Hierarchy::kFlat);
  EXPECT_FALSE(parse_hierarchy("sideways", &h));
}

TEST(Broadcast, TreeForFewBytesChainForManyForcedAsAsked) {
  const LinkModel m = default_link_model(TransportKind::kTcp);
  const size_t seg = 1 << 20;
  EXPECT_EQ(choose_broadcast(BroadcastShape::kAuto, 64 << 10, 8, seg, m), BroadcastShape::kBinomial);
  EXPECT_EQ(choose_broadcast(BroadcastShape::kAuto, 16 << 20, 8, seg, m), BroadcastShape::kChain);
  EXPECT_EQ(choose_broadcast(BroadcastShape::kAuto, 256 << 20, 2, seg, m), BroadcastShape::kBinomial);
  EXPECT_EQ(choose_broadcast(BroadcastShape::kChain, 4, 8, seg, m), BroadcastShape::kChain);
  EXPECT_EQ(choose_broadcast(BroadcastShape::kBinomial, 1 << 30, 64, seg, m), BroadcastShape::kBinomial);
  // The tree's root sends the buffer ceil(log2 n) times; the chain about once.
  const double tree = predict_broadcast_us(BroadcastShape::kBinomial, 64 << 20, 8, seg, m);
  const double chain = predict_broadcast_us(BroadcastShape::kChain, 64 << 20, 8, seg, m);
  EXPECT_NEAR(tree / chain, 3.0, 0.4);
  EXPECT_EQ(predict_broadcast_us(BroadcastShape::kChain, 1 << 20, 1, seg, m), 0);
  // Pieces: bytes / 2n within [64 KiB, the segment size].
  EXPECT_EQ(chain_segment_bytes(64 << 20, 8, seg), size_t{1} << 20);
  EXPECT_EQ(chain_segment_bytes(8 << 20, 8, seg), size_t{512} << 10);
  EXPECT_EQ(chain_segment_bytes(1000, 8, seg), size_t{64} << 10);
  EXPECT_EQ(chain_segment_bytes(1 << 20, 8, 96), size_t{96});
  BroadcastShape shape;
  EXPECT_TRUE(parse_broadcast_shape("chain", &shape));
  EXPECT_EQ(shape, BroadcastShape::kChain);
  EXPECT_FALSE(parse_broadcast_shape("tree", &shape));
}

TEST(Pow2, Floor) {
  EXPECT_EQ(pow2_floor(1), 1);
  EXPECT_EQ(pow2_floor(2), 2);
  EXPECT_EQ(pow2_floor(3), 2);
  EXPECT_EQ(pow2_floor(5), 4);
  EXPECT_EQ(pow2_floor(8), 8);
  EXPECT_EQ(pow2_floor(9), 8);
}

// "auto": one host -> shm, some hosts shared -> hybrid, every rank alone -> tcp, and a host of
// several ranks without the /dev/shm they need -> tcp, naming that host.
TEST(AutoTransport, PicksFromWhereTheRanksAreAndWhatDevShmHolds) {
  const auto need = [](int n) { return static_cast<uint64_t>(n) * 100; };
  using H = std::vector<std::pair<std::string, uint64_t>>;
  EXPECT_EQ(choose_auto_transport(H{{"a", 1000}, {"a", 1000}, {"a", 1000}}, need).kind, TransportKind::kShm);
  EXPECT_EQ(choose_auto_transport(H{{"a", 1000}, {"a", 1000}, {"b", 1000}}, need).kind, TransportKind::kHybrid);
  EXPECT_EQ(choose_auto_transport(H{{"a", 0}, {"b", 0}, {"c", 0}}, need).kind, TransportKind::kTcp);  // no shm needed
  const AutoTransport short_b = choose_auto_transport(H{{"a", 1000}, {"a", 1000}, {"b", 150}, {"b", 150}}, need);
  EXPECT_EQ(short_b.kind, TransportKind::kTcp);
  EXPECT_EQ(short_b.short_host, "b");
  EXPECT_EQ(short_b.short_ranks, 2);
  EXPECT_EQ(short_b.short_free, 150u);
  EXPECT_EQ(short_b.short_need, 200u);
  const AutoTransport exact = choose_auto_transport(H{{"a", 200}, {"a", 200}}, need);  // just enough
  EXPECT_EQ(exact.kind, TransportKind::kShm);
  EXPECT_EQ(exact.short_host, "");
}

TEST(SpinDefault, TwentyOverTcpFiftyOverSharedMemoryNoneWhenOversubscribed) {
  EXPECT_EQ(default_spin_us(TransportKind::kTcp, 2, 2), 20);
  EXPECT_EQ(default_spin_us(TransportKind::kShm, 2, 2), 50);
  EXPECT_EQ(default_spin_us(TransportKind::kMpi, 1, 2), 50);
  EXPECT_EQ(default_spin_us(TransportKind::kShm, 3, 2), 0);
  EXPECT_EQ(default_spin_us(TransportKind::kTcp, 3, 2), 0);
}

TEST(TransportNames, OneParserReadsEveryNameItWrites) {
  for (TransportKind k : {TransportKind::kAuto, TransportKind::kTcp, TransportKind::kShm, TransportKind::kHybrid,
                          TransportKind::kMpi}) {
    TransportKind back = TransportKind::kAuto;
    ASSERT_TRUE(parse_transport(to_string(k), &back)) << to_string(k);
    EXPECT_EQ(back, k);
  }
  TransportKind unchanged = TransportKind::kShm;
  for (const char* bad : {"", "TCP", "gloo", "nccl", "shm "}) {
    EXPECT_FALSE(parse_transport(bad, &unchanged)) << bad;
  }
  EXPECT_EQ(unchanged, TransportKind::kShm);
}

TEST(AllreduceNames, OneParserReadsEveryNameItWrites) {
  for (AllreduceAlgorithm a : {AllreduceAlgorithm::kAuto, AllreduceAlgorithm::kRing, AllreduceAlgorithm::kRecursiveDoubling,
                               AllreduceAlgorithm::kRabenseifner, AllreduceAlgorithm::kTuned}) {
    AllreduceAlgorithm back = AllreduceAlgorithm::kAuto;
    EXPECT_TRUE(parse_allreduce_algorithm(to_string(a), &back)) << to_string(a);
    EXPECT_EQ(back, a);
  }
  AllreduceAlgorithm back;
  EXPECT_FALSE(parse_allreduce_algorithm("Ring", &back));
  EXPECT_FALSE(parse_allreduce_algorithm("", &back));
}

// The model's terms, each checked against the formula written out by hand for one case.
TEST(AllreduceModel, PredictsTheTextbookCostOfEachAlgorithm) {
  LinkModel m;
  m.alpha_us = 10;
  m.beta_us_per_byte = 0.001;
  m.gamma_us_per_byte = 0.0005;
  const double n = 1 << 20;
  using A = AllreduceAlgorithm;
  // 8 ranks: three rounds.
  EXPECT_DOUBLE_EQ(predict_allreduce_us(A::kRecursiveDoubling, 1 << 20, 8, m), 3 * (10 + n * 0.0015));
  EXPECT_DOUBLE_EQ(predict_allreduce_us(A::kRabenseifner, 1 << 20, 8, m), 60 + 2 * 0.875 * n * 0.001 + 0.875 * n * 0.0005);
  EXPECT_DOUBLE_EQ(predict_allreduce_us(A::kRing, 1 << 20, 8, m), 140 + 0.875 * n * 0.002);
  // 6 ranks: 4 do the work, 2 fold in and get the result back (two messages and a reduction).
  const double fold = 2 * (10 + n * 0.001) + n * 0.0005;
  EXPECT_DOUBLE_EQ(predict_allreduce_us(A::kRecursiveDoubling, 1 << 20, 6, m), 2 * (10 + n * 0.0015) + fold);
  EXPECT_DOUBLE_EQ(predict_allreduce_us(A::kRabenseifner, 1 << 20, 6, m), 40 + 1.5 * n * 0.001 + 0.75 * n * 0.0005 + fold);
  EXPECT_DOUBLE_EQ(predict_allreduce_us(A::kRing, 1 << 20, 6, m), 100 + (5.0 / 6) * n * 0.002);
  EXPECT_EQ(predict_allreduce_us(A::kRing, 1 << 20, 1, m), 0);
}

// A received block reduced in cache (it and its copy within cache_bytes) costs no gamma; a larger
// one does. The ring's reductions overlap its transfers and are priced as before.
TEST(AllreduceModel, ReductionsThatFitTheCacheAreFree) {
  using A = AllreduceAlgorithm;
  LinkModel m;
  m.alpha_us = 10;
  m.beta_us_per_byte = 0.001;
  m.gamma_us_per_byte = 0.0005;
  m.cache_bytes = 1 << 20;
  const double n = 1 << 20;
  // 8 ranks, 1 MiB: recursive doubling's whole buffer does not fit with its copy; Rabenseifner's
  // halves (512, 256, 128 KiB) do.
  EXPECT_DOUBLE_EQ(predict_allreduce_us(A::kRecursiveDoubling, 1 << 20, 8, m), 3 * (10 + n * 0.0015));
  EXPECT_DOUBLE_EQ(predict_allreduce_us(A::kRabenseifner, 1 << 20, 8, m), 60 + 2 * 0.875 * n * 0.001);
  EXPECT_DOUBLE_EQ(predict_allreduce_us(A::kRing, 1 << 20, 8, m), 140 + 0.875 * n * 0.002);
  // 2 MiB: Rabenseifner's first half (1 MiB) is priced, the rest not.
  EXPECT_DOUBLE_EQ(predict_allreduce_us(A::kRabenseifner, 2 << 20, 8, m), 60 + 2 * 0.875 * 2 * n * 0.001 + n * 0.0005);
  // 512 KiB over 6 ranks: the fold's and recursive doubling's reductions fit.
  const double h = n / 2;
  EXPECT_DOUBLE_EQ(predict_allreduce_us(A::kRecursiveDoubling, 1 << 19, 6, m), 2 * (10 + h * 0.001) + 2 * (10 + h * 0.001));
  // Ranks that share a core share its cache.
  const LinkModel two = on_shared_cores(m, 2);
  EXPECT_DOUBLE_EQ(two.cache_bytes, m.cache_bytes / 2);
  EXPECT_DOUBLE_EQ(predict_allreduce_us(A::kRecursiveDoubling, 1 << 19, 2, two), two.alpha_us + h * 0.001 + h * 0.0005);
  // The default model: recursive doubling at W=2 while the buffer and its copy fit in 1 MiB (it
  // beat the ring by 15-20% from 128 KiB to 512 KiB over loopback TCP), the ring from 1 MiB.
  const LinkModel tcp = default_link_model(TransportKind::kTcp);
  EXPECT_EQ(tcp.cache_bytes, kReductionCacheBytes);
  for (size_t bytes : {size_t{128} << 10, size_t{256} << 10, size_t{512} << 10}) {
    EXPECT_EQ(choose_allreduce(A::kAuto, bytes, bytes / 4, 2, tcp), A::kRecursiveDoubling) << bytes;
  }
  EXPECT_EQ(choose_allreduce(A::kAuto, 1 << 20, 1 << 18, 2, tcp), A::kRing);
  // Told a link, the same: two ranks keep no margin for the ring (one connection either way), and
  // Rabenseifner, the ring's two steps at W=2, never runs in its place.
  for (double gbit : {0.1, 1.0, 10.0, 100.0}) {
    const LinkModel link = default_link_model(TransportKind::kTcp, 0, gbit);
    EXPECT_EQ(choose_allreduce(A::kAuto, 512 << 10, 128 << 10, 2, link), A::kRecursiveDoubling) << gbit;
    EXPECT_EQ(choose_allreduce(A::kAuto, 1 << 20, 1 << 18, 2, link), A::kRing) << gbit;
    EXPECT_EQ(choose_allreduce(A::kAuto, 64 << 20, 16 << 20, 2, link), A::kRing) << gbit;
  }
}

TEST(AllreduceModel, LinkFiguresReplaceTheMeasuredDefault) {
  const LinkModel tcp = default_link_model(TransportKind::kTcp);
  EXPECT_GT(tcp.alpha_us, 0);
  EXPECT_GT(tcp.beta_us_per_byte, 0);
  const LinkModel ten = default_link_model(TransportKind::kTcp, 50, 10);
  EXPECT_EQ(ten.alpha_us, 50);
  EXPECT_DOUBLE_EQ(ten.beta_us_per_byte, 1.0 / 1250);  // 10 Gbit/s = 1250 bytes per microsecond
  EXPECT_EQ(ten.gamma_us_per_byte, tcp.gamma_us_per_byte);
}

TEST(ExchangeReady, FromThirtyTwoLatenciesOfTheLargerBlockAndTheSameForBothPartners) {
  LinkModel m;
  m.alpha_us = 8;
  m.beta_us_per_byte = 0.0625;  // 16 bytes a microsecond: 32 latencies are 4096 bytes
  EXPECT_TRUE(exchange_needs_ready(4096, 4096, m));
  EXPECT_FALSE(exchange_needs_ready(4095, 4095, m));
  EXPECT_FALSE(exchange_needs_ready(0, 0, m));
  // Rabenseifner's blocks differ by an element where the count does not divide: the partner that
  // sends the smaller one decides as the one that sends the larger.
  for (size_t a : {size_t{0}, size_t{1}, size_t{4092}, size_t{4095}, size_t{4096}, size_t{1} << 20}) {
    for (size_t b : {size_t{0}, size_t{4095}, size_t{4096}, size_t{4100}}) {
      EXPECT_EQ(exchange_needs_ready(a, b, m), exchange_needs_ready(b, a, m)) << a << " " << b;
      EXPECT_EQ(exchange_needs_ready(a, b, m), std::max(a, b) >= 4096) << a << " " << b;
    }
  }
  // Loopback's figures hold the handshake back to blocks of megabytes; told a slow link, it starts
  // at tens of kilobytes.
  const LinkModel loopback = default_link_model(TransportKind::kTcp);
  EXPECT_FALSE(exchange_needs_ready(size_t{1} << 20, size_t{1} << 20, loopback));
  EXPECT_TRUE(exchange_needs_ready(size_t{2} << 20, 0, loopback));
  const LinkModel gbit = default_link_model(TransportKind::kTcp, 0, 1);
  EXPECT_FALSE(exchange_needs_ready(size_t{32} << 10, size_t{32} << 10, gbit));
  EXPECT_TRUE(exchange_needs_ready(size_t{64} << 10, size_t{64} << 10, gbit));
}

TEST(ChooseAllreduce, LatencyBoundSizesDoubleMediumHalveLargeRing) {
  using A = AllreduceAlgorithm;
  const LinkModel m = default_link_model(TransportKind::kTcp);
  auto pick = [&](size_t bytes, int ranks) { return choose_allreduce(A::kAuto, bytes, bytes / 4, ranks, m); };
  for (int w : {2, 3, 4, 5, 8, 16, 64, 1024}) {
    EXPECT_EQ(pick(4 << 10, w), A::kRecursiveDoubling) << w;  // a few messages beat many
    EXPECT_EQ(pick(256 << 20, w), A::kRing) << w;           // the ring overlaps its reductions
    // Whatever it picks, nothing else is predicted faster, but for the ring's margin: the ring
    // within kRingPreferredWithin of the fastest prediction is kept, and only then.
    for (size_t bytes : {size_t{1} << 12, size_t{1} << 16, size_t{1} << 20, size_t{1} << 24, size_t{1} << 28}) {
      const A chosen = pick(bytes, w);
      const double chosen_us = predict_allreduce_us(chosen, bytes, w, m);
      double fastest_us = chosen_us;
      for (A other : {A::kRing, A::kRecursiveDoubling, A::kRabenseifner}) {
        fastest_us = std::min(fastest_us, predict_allreduce_us(other, bytes, w, m));
      }
      const double ring_us = predict_allreduce_us(A::kRing, bytes, w, m);
      if (chosen == A::kRing) {
        EXPECT_LE(chosen_us, (1 + kRingPreferredWithin) * fastest_us) << bytes << " bytes, " << w << " ranks";
      } else {
        EXPECT_EQ(chosen_us, fastest_us) << bytes << " bytes, " << w << " ranks";
        EXPECT_GT(ring_us, (1 + kRingPreferredWithin) * fastest_us) << bytes << " bytes, " << w << " ranks";
      }
    }
  }
  // Between them, at 8 ranks and more, halving and doubling: 2 log2(W) messages instead of the
  // ring's 2(W-1), and a fraction of the bytes recursive doubling moves.
  EXPECT_EQ(pick(512 << 10, 8), A::kRabenseifner);
  EXPECT_EQ(pick(4 << 20, 1024), A::kRabenseifner);
  // A power of two of ranks suits halving; two ranks past one fold in at the price of two whole
  // messages, and the ring takes over sooner.
  EXPECT_EQ(pick(256 << 10, 8), A::kRabenseifner);
  EXPECT_EQ(pick(256 << 10, 10), A::kRing);
}

TEST(ChooseAllreduce, ForcedUnlessTheBufferCannotBeSplit) {
  using A = AllreduceAlgorithm;
  const LinkModel m = default_link_model(TransportKind::kTcp);
  EXPECT_EQ(choose_allreduce(A::kRing, 4, 1, 8, m), A::kRecursiveDoubling);  // 1 element, 8 chunks
  EXPECT_EQ(choose_allreduce(A::kRing, 32, 8, 8, m), A::kRing);
  EXPECT_EQ(choose_allreduce(A::kRing, 28, 7, 8, m), A::kRecursiveDoubling);
  EXPECT_EQ(choose_allreduce(A::kRabenseifner, 28, 7, 8, m), A::kRecursiveDoubling);
  EXPECT_EQ(choose_allreduce(A::kRabenseifner, 32, 8, 10, m), A::kRabenseifner);  // blocks among 8
  EXPECT_EQ(choose_allreduce(A::kRecursiveDoubling, 1 << 28, 1 << 26, 8, m), A::kRecursiveDoubling);
  EXPECT_EQ(choose_allreduce(A::kAuto, 1 << 28, 7, 8, m), A::kRecursiveDoubling);  // wide elements, few
}

// Ranks per core: per machine, its ranks over the union of the CPUs they may run on; the busiest
// machine's figure; never below 1.
TEST(SharedCores, RanksOverTheUnionOfTheirCpusOnTheBusiestMachine) {
  auto rank = [](uint64_t machine, std::vector<int> cpus) {
    RankCpus r;
    r.machine = machine;
    for (int c : cpus) r.cpus[static_cast<size_t>(c / 64)] |= uint64_t{1} << (c % 64);
    return r;
  };
  EXPECT_EQ(ranks_per_core({}), 1);
  EXPECT_EQ(ranks_per_core({rank(7, {0, 1})}), 1);  // one rank, two cores: not below 1
  // 8 ranks on one 2-core machine (8 namespace hosts on this machine): 4 a core.
  std::vector<RankCpus> eight(8, rank(7, {0, 1}));
  EXPECT_EQ(ranks_per_core(eight), 4);
  // Pinned each to a core of its own: the union has 8 cores, none shared.
  std::vector<RankCpus> pinned;
  for (int c = 0; c < 8; ++c) pinned.push_back(rank(7, {c}));
  EXPECT_EQ(ranks_per_core(pinned), 1);
  // One rank per machine, each machine its own: 1, however many machines (CPU 1000 counts too).
  std::vector<RankCpus> spread;
  for (uint64_t m = 0; m < 64; ++m) spread.push_back(rank(m, {1000}));
  EXPECT_EQ(ranks_per_core(spread), 1);
  // The busiest machine decides: 3 ranks on 2 cores beside machines of a core per rank.
  spread.push_back(rank(5, {1000}));
  spread.push_back(rank(5, {1001}));
  EXPECT_EQ(ranks_per_core(spread), 1.5);
}

// On shared cores every step costs more, so the plan takes fewer steps: recursive doubling over
// Rabenseifner at 64 KiB and Rabenseifner at 1 MiB, 8 ranks told 10 Gbit/s, 4 a core (8
// namespace hosts on 2 cores measured them so, docs/benchmarks.md "Judged in one job"), and at
// 2 MiB, where a core per rank keeps the ring; with a core per rank the link's model is unchanged
// and so are its picks.
TEST(SharedCores, ChargeEveryStepSoThePlanTakesFewer) {
  using A = AllreduceAlgorithm;
  const LinkModel link = default_link_model(TransportKind::kTcp, 0, 10);
  auto pick = [](size_t bytes, int ranks, const LinkModel& m) {
    return choose_allreduce(A::kAuto, bytes, bytes / 4, ranks, m);
  };
  EXPECT_EQ(pick(64 << 10, 8, link), A::kRabenseifner);
  EXPECT_EQ(pick(2 << 20, 8, link), A::kRing);
  const LinkModel shared = on_shared_cores(link, 4);
  EXPECT_DOUBLE_EQ(shared.alpha_us, link.alpha_us + 3 * kSharedCoreStepUs);
  EXPECT_EQ(shared.beta_us_per_byte, link.beta_us_per_byte);
  EXPECT_EQ(shared.gamma_us_per_byte, link.gamma_us_per_byte);
  EXPECT_EQ(pick(64 << 10, 8, shared), A::kRecursiveDoubling);
  EXPECT_EQ(pick(1 << 20, 8, shared), A::kRabenseifner);
  EXPECT_EQ(pick(2 << 20, 8, shared), A::kRabenseifner);
  // Where the link's bytes dominate the pick stays: at 1 Gbit/s, 64 KiB, recursive doubling's
  // whole-buffer steps cost more than Rabenseifner's three extra waits.
  const LinkModel gbit = default_link_model(TransportKind::kTcp, 0, 1);
  EXPECT_EQ(pick(64 << 10, 8, gbit), A::kRabenseifner);
  EXPECT_EQ(pick(64 << 10, 8, on_shared_cores(gbit, 4)), A::kRabenseifner);
  // At 4 MiB the ring and Rabenseifner are level in the model, 4 a core or not (the ring's 8 extra
  // waits against Rabenseifner's unhidden reduction). Over 100 Mbit/s the link bounds the bytes and
  // the ring's margin keeps it; over 10 Gbit/s 4 ranks a core copy slower than the link (4 x
  // loopback's beta) and Rabenseifner's fewer steps are kept.
  const LinkModel slow = default_link_model(TransportKind::kTcp, 0, 0.1);
  EXPECT_EQ(pick(4 << 20, 8, slow), A::kRing);
  EXPECT_EQ(pick(4 << 20, 8, on_shared_cores(slow, 4)), A::kRing);
  EXPECT_GT(shared.core_beta_us_per_byte, shared.beta_us_per_byte);
  EXPECT_EQ(pick(4 << 20, 8, shared), A::kRabenseifner);
  EXPECT_EQ(pick(4 << 20, 8, link), A::kRing);  // a core per rank: the link bounds, the margin holds
  // A core per rank, or fewer ranks than cores: the link's model as it is.
  EXPECT_EQ(on_shared_cores(link, 1).alpha_us, link.alpha_us);
  EXPECT_EQ(on_shared_cores(link, 0.25).alpha_us, link.alpha_us);
}

// "tuned": the candidates are what can run and what the model does not rule out, model's pick first.
TEST(TunedAllreduce, CandidatesRunnableWithinTheSpreadInPredictedOrder) {
  using A = AllreduceAlgorithm;
  const LinkModel m = default_link_model(TransportKind::kTcp);
  for (int w : {2, 3, 5, 8, 64, 1024}) {
    for (size_t bytes : {size_t{4}, size_t{1} << 12, size_t{1} << 16, size_t{1} << 20, size_t{1} << 24, size_t{1} << 30}) {
      const size_t count = bytes / 4;
      const std::vector<A> c = tuning_candidates(bytes, count, w, m);
      ASSERT_FALSE(c.empty());
      EXPECT_EQ(c.front(), choose_allreduce(A::kAuto, bytes, count, w, m)) << bytes << " bytes, " << w << " ranks";
      for (size_t i = 0; i < c.size(); ++i) {
        EXPECT_EQ(choose_allreduce(c[i], bytes, count, w, m), c[i]) << "a candidate that cannot split the buffer";
        const double us = predict_allreduce_us(c[i], bytes, w, m);
        EXPECT_LE(us, kTuningSpread * predict_allreduce_us(c.front(), bytes, w, m));
        if (i > 0) {
          EXPECT_GE(us, predict_allreduce_us(c[i - 1], bytes, w, m));
        }
      }
    }
  }
  // One element over 8 ranks: only recursive doubling can run, so there is nothing to try.
  EXPECT_EQ(tuning_candidates(4, 1, 8, m), std::vector<A>{A::kRecursiveDoubling});
  EXPECT_EQ(tuning_calls(1), 0);
  EXPECT_EQ(tuning_candidates(1 << 20, 1 << 18, 1, m).size(), 1u);
  // 1 GB over 1024 ranks: recursive doubling moves the whole buffer 10 times; never tried.
  const std::vector<A> big = tuning_candidates(size_t{1} << 30, size_t{1} << 28, 1024, m);
  EXPECT_EQ(std::count(big.begin(), big.end(), A::kRecursiveDoubling), 0);
  EXPECT_GE(big.size(), 2u);
  // 64 KiB over 8 ranks: all three are close enough to try.
  EXPECT_EQ(tuning_candidates(64 << 10, 16 << 10, 8, m).size(), 3u);
}

TEST(TunedAllreduce, RoundRobinTrialsFirstRoundUntimedThenTheFastestAgreedTime) {
  EXPECT_EQ(tuning_calls(3), kTunedAllreduceTrials);
  EXPECT_EQ(tuning_calls(2), 2 * kTuningRounds);
  std::vector<int> runs(3, 0), timed(3, 0);
  for (int i = 0; i < tuning_calls(3); ++i) {
    const Trial t = tuning_trial(i, 3);
    ++runs[static_cast<size_t>(t.candidate)];
    timed[static_cast<size_t>(t.candidate)] += t.timed ? 1 : 0;
    EXPECT_EQ(t.timed, i >= 3) << i;
    // Interleaved: no candidate runs twice in a row, so a slow spell of the machine hits them all.
    if (i > 0) {
      EXPECT_NE(t.candidate, tuning_trial(i - 1, 3).candidate);
    }
  }
  EXPECT_EQ(runs, std::vector<int>(3, kTuningRounds));
  EXPECT_EQ(timed, std::vector<int>(3, kTuningRounds - 1));
  EXPECT_EQ(median_us({5, 1, 3}), 3);
  EXPECT_EQ(median_us({4, 1, 3, 100}), 3.5);  // one outlier moves the median little
  EXPECT_EQ(median_us({}), 0);
  EXPECT_EQ(fastest_candidate({30, 10, 20}), 1);
  EXPECT_EQ(fastest_candidate({10, 20, 10}), 0);  // a tie: the model's order
  EXPECT_EQ(fastest_candidate({7}), 0);
}

TEST(TunedAllreduce, SizeClassesArePowersOfTwo) {
  const std::pair<size_t, int> bit_widths[] = {{0, 0}, {1, 1}, {65535, 16}, {65536, 17}, {131071, 17}};
  for (const auto& [bytes, k] : bit_widths) EXPECT_EQ(size_class(bytes), k) << bytes;
  const ByteRange r = size_class_bytes(17);
  EXPECT_EQ(r.min_bytes, 65536u);
  EXPECT_EQ(r.max_bytes, 131071u);
  for (size_t b : {size_t{1}, size_t{3}, size_t{4096}, size_t{100000}, size_t{1} << 40}) {
    const ByteRange c = size_class_bytes(size_class(b));
    EXPECT_LE(c.min_bytes, b);
    EXPECT_GE(c.max_bytes, b);
  }
}

TEST(HostPlan, EvenHostsGiveOneRailPerLocalRank) {
  // Ranks 0, 2 on host a; 1, 3 on host b (interleaved on purpose).
  const std::vector<std::string> ids = {"a", "b", "a", "b"};
  const std::vector<std::vector<int>> hosts = {{0, 2}, {1, 3}};
  for (int r = 0; r < 4; ++r) {
    HostPlan p = plan_hosts(ids, r);
    EXPECT_EQ(p.hosts, hosts);
    EXPECT_TRUE(p.even);
    EXPECT_EQ(p.host, r % 2);
    EXPECT_EQ(p.local_rank, r / 2);
    EXPECT_EQ(p.rail, (r / 2 == 0 ? std::vector<int>{0, 1} : std::vector<int>{2, 3})) << "rank " << r;
    EXPECT_EQ(p.rail[static_cast<size_t>(p.rail_index)], r);
  }
}

TEST(HostPlan, UnevenHostsPutOnlyTheLeadersOnARail) {
  const std::vector<std::string> ids = {"a", "a", "a", "b", "b"};  // 3 + 2
  for (int r = 0; r < 5; ++r) {
    HostPlan p = plan_hosts(ids, r);
    EXPECT_FALSE(p.even);
    const bool leader = r == 0 || r == 3;
    EXPECT_EQ(p.rail, (leader ? std::vector<int>{0, 3} : std::vector<int>{})) << "rank " << r;
    EXPECT_EQ(p.rail_index, leader ? (r == 0 ? 0 : 1) : -1);
  }
  HostPlan alone = plan_hosts({"x"}, 0);
  EXPECT_TRUE(alone.even);
  EXPECT_EQ(alone.rail, std::vector<int>{0});
}

TEST(BroadcastHeads, RootFirstThenTheLowestRankOfEveryOtherHost) {
  const std::vector<std::vector<int>> hosts = {{0, 1, 2}, {3, 4}, {5}};
  EXPECT_EQ(broadcast_heads(hosts, 0), (std::vector<int>{0, 3, 5}));
  EXPECT_EQ(broadcast_heads(hosts, 4), (std::vector<int>{4, 5, 0}));
  EXPECT_EQ(broadcast_heads(hosts, 2), (std::vector<int>{2, 3, 5}));
  EXPECT_EQ(broadcast_heads(hosts, 5), (std::vector<int>{5, 0, 3}));
}

}  // namespace
}  // namespace chorus::plan

namespace chorus {
namespace {

TEST(Check, PassesSilentlyAndFailsWithAnInternalErrorNamingTheSpot) {
  int evaluated = 0;
  CHORUS_CHECK(++evaluated == 1, "evaluated once");
  EXPECT_EQ(evaluated, 1);
  try {
    const size_t offset = 10, count = 4, total = 12;
    CHORUS_CHECK(offset + count <= total, "segment out of its buffer");
    FAIL() << "no throw";
  } catch (const UsageError&) {
    FAIL() << "a broken invariant is chorus's bug, not a UsageError";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("chorus internal error at plan_test.cc:"), std::string::npos) << what;
    EXPECT_NE(what.find("offset + count <= total (segment out of its buffer)"), std::string::npos) << what;
    EXPECT_NE(what.find("bug in chorus"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace chorus
