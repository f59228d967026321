// Conformance suite: every collective, world sizes 1..8, every dtype and op, edge sizes, on every
// store-connected transport (the checks: collectives_checks.h; over MPI: mpi_collectives_test).
#include <gtest/gtest.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/comm/log.h"
#include "chorus/comm/process_group.h"
#include "chorus/comm/rendezvous.h"
#include "collectives_checks.h"
#include "testing.h"

namespace chorus {
namespace {

// One instance of the suite: a transport, a world size, and for "hybrid" how many simulated hosts
// the ranks are split into (ranks [h*W/H, (h+1)*W/H) share host h and its shared memory); and the
// TCP connections ("" = the default for W, or "eager" / "lazy").
struct SuiteSetup {
  std::string transport;
  int world;
  int hosts;
  std::string connections = "";
};

std::string setup_name(const SuiteSetup& s) {
  return s.transport + "_W" + std::to_string(s.world) + "_hosts" + std::to_string(s.hosts) +
         (s.connections.empty() ? "" : "_" + s.connections);
}

ProcessGroupOptions test_options(const SuiteSetup& setup, int rank, size_t segment_bytes, const std::string& algorithm,
                                 bool tiny_shm_chunks) {
  ProcessGroupOptions o;
  o.timeout = std::chrono::seconds(20);
  o.transport = setup.transport;
  o.host_id = "test-host-" + std::to_string(rank * setup.hosts / setup.world);
  o.segment_bytes = segment_bytes;  // tiny segments reach the multi-segment ring paths
  o.allreduce_algorithm = algorithm;
  if (!setup.connections.empty()) o.tcp_connections = setup.connections;
  if (tiny_shm_chunks) {  // and tiny shared-memory chunks the multi-chunk paths
    o.shm_chunk_bytes = 4096;
    o.shm_small_bytes = 64;
  }
  return o;
}

void conformance(const SuiteSetup& setup, int rank, int world) {
  auto pg = connect_process_group("env://", rank, world, test_options(setup, rank, 96, "ring", true));
  // auto: shm on one host, hybrid when the simulated hosts share some ranks.
  const std::string asked = setup.transport == "auto" ? (setup.hosts > 1 ? "hybrid" : "shm") : setup.transport;
  const std::string want = world == 1 ? "tcp" : asked;
  if (pg->transport() != want) throw std::runtime_error("transport is " + pg->transport() + ", not " + want);
  conformance::every_collective(*pg);
}

class Conformance : public ::testing::TestWithParam<SuiteSetup> {};

TEST_P(Conformance, EveryCollectiveDtypeOpAndSize) {
  const SuiteSetup setup = GetParam();
  EXPECT_EQ(testing::run_ranks(setup.world, [&](int rank, int w, std::shared_ptr<Store>) { conformance(setup, rank, w); },
                               std::chrono::seconds(240)),
            "");
}

TEST_P(Conformance, DefaultTuningLargeBuffers) {
  const SuiteSetup setup = GetParam();
  EXPECT_EQ(testing::run_ranks(setup.world, [&](int rank, int w, std::shared_ptr<Store>) {
    auto pg = connect_process_group("env://", rank, w, test_options(setup, rank, 1 << 20, "auto", false));
    conformance::large_buffers(*pg);
  }, std::chrono::seconds(120)), "");
}

TEST_P(Conformance, PointToPointObjectsAndSubgroups) {
  const SuiteSetup setup = GetParam();
  EXPECT_EQ(testing::run_ranks(setup.world, [&](int rank, int w, std::shared_ptr<Store>) {
    auto pg = connect_process_group("env://", rank, w, test_options(setup, rank, 96, "ring", true));
    conformance::point_to_point_objects_subgroups(*pg);
  }, std::chrono::seconds(60)), "");
}

// ProcessGroup::allocate_buffer: shared across ranks over shm (allreduce in place, in the peers'
// copies), ordinary memory elsewhere; the same results either way, used again and again, whole
// or by range, and the memory outlives the group.
TEST_P(Conformance, AllocatedBuffersAllreduceInPlace) {
  const SuiteSetup setup = GetParam();
  EXPECT_EQ(testing::run_ranks(setup.world, [&](int rank, int w, std::shared_ptr<Store>) {
    // 1 KiB segments: still several per range (the whole buffer is 560 KB, the ranges 4-8 KB), at a
    // tenth of the suite's 96-byte segments' cost on 70001 elements of every dtype and op.
    conformance::allocated_buffers(connect_process_group("env://", rank, w, test_options(setup, rank, 1024, "ring", true)));
  }, std::chrono::seconds(120)), "");
}

// Every allreduce algorithm forced, at every world size 1..8 over TCP and across hosts under hybrid
// (the rails: 3 hosts, 4 hosts), with 96-byte ring segments; and "tuned", whose trials switch
// algorithm from call to call within a size class (of every dtype: some too short for the ring).
class Algorithms : public ::testing::TestWithParam<std::tuple<std::string, SuiteSetup>> {};

TEST_P(Algorithms, EveryAllreduceDtypeOpAndSize) {
  // Copies, not structured bindings: lambdas capture those only from C++20 (clang holds to it).
  const std::string algorithm = std::get<0>(GetParam());
  const SuiteSetup setup = std::get<1>(GetParam());
  EXPECT_EQ(testing::run_ranks(setup.world, [&](int rank, int w, std::shared_ptr<Store>) {
    auto pg = connect_process_group("env://", rank, w, test_options(setup, rank, 96, algorithm, false));
    conformance::every_allreduce(*pg);
  }, std::chrono::seconds(120)), "");
}

std::vector<SuiteSetup> algorithm_setups() {
  std::vector<SuiteSetup> out;
  for (int w = 1; w <= 8; ++w) out.push_back({"tcp", w, 1});
  out.push_back({"hybrid", 6, 3});
  out.push_back({"hybrid", 8, 4});
  out.push_back({"tcp", 7, 1, "lazy"});  // Rabenseifner's fold and halving partners connect on first use
  return out;
}

INSTANTIATE_TEST_SUITE_P(Forced, Algorithms,
                         ::testing::Combine(::testing::Values("ring", "recursive_doubling", "rabenseifner", "tuned"),
                                            ::testing::ValuesIn(algorithm_setups())),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + setup_name(std::get<1>(info.param));
                         });

// "tuned": its trials give the right sums, every rank ends with the same measurements and choices
// (ProcessGroup::tuned_allreduce), and on 64-byte buffers, where the ring's 6 latency-bound steps
// at 4 ranks face recursive doubling's 2, the ring is tried and not kept.
TEST(TunedAllreduce, RanksAgreeOnTheirChoicesAndALatencyBoundSizeAvoidsTheRing) {
  EXPECT_EQ(testing::run_ranks(4, [&](int rank, int w, std::shared_ptr<Store>) {
    auto pg = connect_process_group("env://", rank, w, test_options({"tcp", w, 1}, rank, 1 << 20, "tuned", false));
    for (size_t count : {size_t{16}, size_t{16384}}) {  // 64 B and 64 KiB of float32
      std::vector<float> v(count);
      for (int call = 0; call <= kTunedAllreduceTrials; ++call) {
        for (size_t i = 0; i < count; ++i) v[i] = static_cast<float>(rank + static_cast<int>(i % 7));
        pg->allreduce(v.data(), count, DataType::kFloat32)->wait();
        for (size_t i = 0; i < count; ++i) {
          const float want = static_cast<float>(w * (w - 1) / 2 + w * static_cast<int>(i % 7));
          if (v[i] != want) {
            throw std::runtime_error("call " + std::to_string(call) + " of " + std::to_string(count) + ": element " +
                                     std::to_string(i) + " is " + std::to_string(v[i]));
          }
        }
      }
    }
    const std::vector<TunedAllreduce> tuned = pg->tuned_allreduce();
    std::string text;
    for (const TunedAllreduce& t : tuned) {
      text += std::to_string(t.ranks) + " " + std::to_string(t.min_bytes) + "-" + std::to_string(t.max_bytes) + " " +
              t.chosen + ":";
      for (const auto& [name, us] : t.measured_us) text += " " + name + "=" + std::to_string(us);
      text += "\n";
    }
    if (tuned.size() != 2 || tuned[0].min_bytes != 64 || tuned[1].min_bytes != 65536 || tuned[0].ranks != w) {
      throw std::runtime_error("expected the 64 B and 64 KiB classes over 4 ranks, got\n" + text);
    }
    if (tuned[0].measured_us.size() != 3 || tuned[0].chosen == "ring") {
      throw std::runtime_error("64 B: expected all three tried and the ring not kept, got\n" + text);
    }
    // The same on every rank: the text's hash, its largest and smallest over the group.
    int64_t h[2] = {static_cast<int64_t>(std::hash<std::string>{}(text) >> 1), 0};
    h[1] = -h[0];
    pg->allreduce(h, 2, DataType::kInt64, ReduceOp::kMax)->wait();
    if (h[0] != -h[1]) throw std::runtime_error("ranks disagree on what was tuned; this rank has\n" + text);
  }, std::chrono::seconds(60)), "");
}

// A rank that comes late to a trial is not charged to the candidate tried: the trials start from a
// barrier. Rank 0 sleeps 100 ms before each of the 64 KiB class's calls; timed from each rank's own
// start, the other ranks would measure every candidate at 100 ms and more.
TEST(TunedAllreduce, ARankLateToATrialIsNotChargedToTheCandidate) {
  EXPECT_EQ(testing::run_ranks(4, [&](int rank, int w, std::shared_ptr<Store>) {
    auto pg = connect_process_group("env://", rank, w, test_options({"tcp", w, 1}, rank, 1 << 20, "tuned", false));
    std::vector<float> v(16384);
    for (int call = 0; call < kTunedAllreduceTrials; ++call) {
      if (rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      std::fill(v.begin(), v.end(), 1.0f);
      pg->allreduce(v.data(), v.size(), DataType::kFloat32)->wait();
      if (v.front() != w || v.back() != w) throw std::runtime_error("call " + std::to_string(call) + ": a wrong sum");
    }
    const std::vector<TunedAllreduce> tuned = pg->tuned_allreduce();
    if (tuned.size() != 1 || tuned[0].measured_us.size() < 2) {
      throw std::runtime_error("expected the 64 KiB class decided over two candidates or more, got " +
                               std::to_string(tuned.size()) + " classes");
    }
    for (const auto& [name, us] : tuned[0].measured_us) {
      if (us >= 50000) throw std::runtime_error(name + " was measured at " + std::to_string(us) + " us");
    }
  }, std::chrono::seconds(60)), "");
}

// new_group(ranks, options): the sub-group runs by its own options (here "tuned" under a parent
// forcing the ring) and keeps the parent's transport whatever `options` asks for.
TEST(NewGroup, WithOptionsRunsByThemOnTheParentsTransport) {
  EXPECT_EQ(testing::run_ranks(3, [&](int rank, int w, std::shared_ptr<Store>) {
    auto pg = connect_process_group("env://", rank, w, test_options({"tcp", w, 1}, rank, 1 << 20, "ring", false));
    ProcessGroupOptions o = test_options({"shm", w, 1}, rank, 1 << 20, "tuned", false);
    auto sub = pg->new_group({0, 1, 2}, o);
    auto pair = pg->new_group({0, 2}, o);
    if (sub->transport() != "tcp") throw std::runtime_error("the sub-group's transport is " + sub->transport());
    if ((rank != 1) != (pair != nullptr)) throw std::runtime_error("new_group({0, 2}) membership wrong");
    std::vector<float> v(16);
    for (int call = 0; call < kTunedAllreduceTrials; ++call) {
      for (auto* g : {pg.get(), sub.get(), pair.get()}) {
        if (g == nullptr) continue;
        std::fill(v.begin(), v.end(), 1.0f);
        g->allreduce(v.data(), v.size(), DataType::kFloat32)->wait();
        if (v.front() != g->size()) throw std::runtime_error("a wrong sum over " + std::to_string(g->size()) + " ranks");
      }
    }
    if (!pg->tuned_allreduce().empty()) throw std::runtime_error("the parent (ring) tuned");
    if (sub->tuned_allreduce().size() != 1 || sub->tuned_allreduce()[0].ranks != 3) {
      throw std::runtime_error("the sub-group did not tune its 64-byte class over 3 ranks");
    }
    if (pair != nullptr && (pair->tuned_allreduce().size() != 1 || pair->tuned_allreduce()[0].ranks != 2)) {
      throw std::runtime_error("the pair did not tune its 64-byte class over 2 ranks");
    }
  }, std::chrono::seconds(60)), "");
}

// allreduce "auto" learns at the group's first allreduce how many ranks share a core: 4 ranks on
// this machine's CPUs, then 4 ranks all pinned to CPU 0 (4 a core), each rank's debug line naming
// the figure, the plan's raised latency, and a right sum either way.
TEST(AutoAllreduce, LearnsHowManyRanksShareACoreAtTheFirstCall) {
  cpu_set_t allowed;
  ASSERT_EQ(::sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  const double cpus = CPU_COUNT(&allowed);
  for (bool pinned : {false, true}) {
    const int world = 4;
    const double want = pinned ? world : std::max(1.0, world / cpus);
    EXPECT_EQ(testing::run_ranks(world, [&](int rank, int w, std::shared_ptr<Store>) {
      if (pinned) {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(0, &one);
        if (::sched_setaffinity(0, sizeof(one), &one) != 0) throw std::runtime_error("cannot pin to CPU 0");
      }
      std::vector<std::string> lines;
      set_log_level(LogLevel::kDebug);
      set_log_sink([&](LogLevel, const std::string& line) { lines.push_back(line); });
      auto pg = connect_process_group("env://", rank, w, test_options({"tcp", w, 1}, rank, 1 << 20, "auto", false));
      std::vector<float> v(1000, static_cast<float>(rank));
      pg->allreduce(v.data(), v.size(), DataType::kFloat32)->wait();
      pg->allreduce(v.data(), v.size(), DataType::kFloat32)->wait();  // learned once
      set_log_sink(nullptr);
      if (v.front() != 4 * 6.0f || v.back() != 4 * 6.0f) throw std::runtime_error("a wrong sum");
      std::vector<std::string> learned;
      for (const auto& l : lines) {
        if (l.find("allreduce \"auto\" over 4 ranks on 1 machine(s): at most ") != std::string::npos) learned.push_back(l);
      }
      if (learned.size() != 1) throw std::runtime_error("expected one line on what auto learned, got " + std::to_string(learned.size()));
      const std::string& l = learned.front();
      const double k = std::strtod(l.c_str() + l.find("at most ") + 8, nullptr);
      const double alpha = std::strtod(l.c_str() + l.find("latency as ") + 11, nullptr);
      if (k != want || alpha != 15 + (want - 1) * 25) {
        throw std::runtime_error("expected " + std::to_string(want) + " ranks a core, got: " + l);
      }
    }, std::chrono::seconds(60)), "") << (pinned ? "pinned to CPU 0" : "on this machine's CPUs");
  }
}

// keep_tuned_allreduce: decisions from an earlier run are used from a class's first call, with no
// trials, and sum bit for bit as that algorithm forced (what a resumed run relies on); decisions
// for another group size are not used; malformed ones are a UsageError.
TEST(TunedAllreduce, KeptDecisionsRunFromTheFirstCallAndSumAsThatAlgorithmForced) {
  EXPECT_EQ(testing::run_ranks(5, [&](int rank, int w, std::shared_ptr<Store>) {
    auto tuned = connect_process_group("env://", rank, w, test_options({"tcp", w, 1}, rank, 1 << 20, "tuned", false));
    // Malformed decisions first: a byte range that is not a size class, a name that is no algorithm.
    auto usage = [&](TunedAllreduce d, const std::string& says) {
      try {
        tuned->keep_tuned_allreduce({d});
      } catch (const UsageError& e) {
        if (std::string(e.what()).find(says) == std::string::npos) throw std::runtime_error(e.what());
        return;
      }
      throw std::runtime_error("no UsageError for a decision that should say: " + says);
    };
    usage({w, 65536, 100000, {}, "ring"}, "not one of tuned_allreduce()'s size classes");
    usage({w, 65536, 131071, {}, "auto"}, "must name an algorithm");
    usage({w, 65536, 131071, {{"fastest", 1.0}}, "ring"}, "'fastest', which is not an algorithm");
    // 64 KiB-128 KiB keeps the ring, 64-127 B Rabenseifner; 4 KiB is kept for 4 ranks only.
    tuned->keep_tuned_allreduce({{w, 65536, 131071, {{"ring", 10.0}, {"rabenseifner", 20.0}}, "ring"},
                                 {w, 64, 127, {}, "rabenseifner"},
                                 {w - 1, 4096, 8191, {}, "ring"}});
    ProcessGroupOptions o = test_options({"tcp", w, 1}, rank, 1 << 20, "ring", false);
    o.group_name = "forced-ring";
    auto ring = connect_process_group("env://", rank, w, o);
    o.allreduce_algorithm = "rabenseifner";
    o.group_name = "forced-rabenseifner";
    auto rabenseifner = connect_process_group("env://", rank, w, o);
    auto values = [&](size_t count) {  // sums whose rounding depends on the order of addition
      std::vector<float> v(count);
      for (size_t i = 0; i < count; ++i) v[i] = 0.1f * static_cast<float>(rank + 1) + 1e-3f * static_cast<float>(i % 977);
      return v;
    };
    auto same_sums = [&](size_t count, ProcessGroup& forced) {
      std::vector<float> a = values(count), b = values(count);
      tuned->allreduce(a.data(), count, DataType::kFloat32)->wait();
      forced.allreduce(b.data(), count, DataType::kFloat32)->wait();
      if (std::memcmp(a.data(), b.data(), count * sizeof(float)) != 0) {
        throw std::runtime_error(std::to_string(count) + " floats: the kept algorithm's sums differ from " +
                                 forced.options().allreduce_algorithm + " forced");
      }
    };
    same_sums(20000, *ring);       // 80 000 B
    {  // which matters: on these values the ring and Rabenseifner differ in the last bits
      std::vector<float> a = values(20000), b = values(20000);
      ring->allreduce(a.data(), a.size(), DataType::kFloat32)->wait();
      rabenseifner->allreduce(b.data(), b.size(), DataType::kFloat32)->wait();
      if (std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0) {
        throw std::runtime_error("the ring and Rabenseifner summed 20000 floats alike: these values test nothing");
      }
    }
    same_sums(20, *rabenseifner);  // 80 B
    std::vector<float> other(1500, 1.0f);  // 6000 B: kept for another group size only, so its trials begin
    tuned->allreduce(other.data(), other.size(), DataType::kFloat32)->wait();
    if (other.front() != static_cast<float>(w)) throw std::runtime_error("6000 B: a wrong sum");
    const std::vector<TunedAllreduce> now = tuned->tuned_allreduce();
    std::string text;
    for (const TunedAllreduce& t : now) text += std::to_string(t.ranks) + " " + std::to_string(t.min_bytes) + " " + t.chosen + "\n";
    // Decided after one call each: the two kept classes, not the 4 KiB one (its trials go on).
    if (now.size() != 2 || now[0].min_bytes != 64 || now[0].chosen != "rabenseifner" || now[1].min_bytes != 65536 ||
        now[1].chosen != "ring" || now[1].measured_us.size() != 2 || now[1].measured_us[1].second != 20.0) {
      throw std::runtime_error("expected the kept 64 B and 64 KiB classes only, got\n" + text);
    }
    // What tuned_allreduce() returns is what keep_tuned_allreduce takes, the empty class included.
    tuned->allreduce(nullptr, 0, DataType::kFloat32)->wait();
    tuned->keep_tuned_allreduce(tuned->tuned_allreduce());
  }, std::chrono::seconds(60)), "");
}

// Recursive doubling and Rabenseifner with a ready handshake ahead of every exchange step's block
// (plan::exchange_needs_ready): told a link so slow (0.5 Mbit/s) that blocks from 30 bytes take one,
// the suite's awkward sizes put blocks on both sides of that, with partners whose blocks differ.
class ReadyHandshakes : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(ReadyHandshakes, EveryAllreduceDtypeOpAndSize) {
  const std::string algorithm = std::get<0>(GetParam());
  const int world = std::get<1>(GetParam());
  const SuiteSetup setup{"tcp", world, 1};
  EXPECT_EQ(testing::run_ranks(world, [&](int rank, int w, std::shared_ptr<Store>) {
    ProcessGroupOptions o = test_options(setup, rank, 96, algorithm, false);
    o.link_gbit_per_s = 0.0005;
    auto pg = connect_process_group("env://", rank, w, o);
    conformance::every_allreduce(*pg);
  }, std::chrono::seconds(120)), "");
}

INSTANTIATE_TEST_SUITE_P(SlowLink, ReadyHandshakes,
                         ::testing::Combine(::testing::Values("recursive_doubling", "rabenseifner"),
                                            ::testing::Values(2, 3, 4, 5, 7, 8)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_w" + std::to_string(std::get<1>(info.param));
                         });

// The hybrid's allreduce forced flat (CHORUS_HYBRID_ALLREDUCE): one TCP algorithm over every rank of
// 2 and 3 simulated hosts, even and uneven, every dtype and op; the same results as hierarchical.
class FlatHybrid : public ::testing::TestWithParam<SuiteSetup> {};

TEST_P(FlatHybrid, EveryAllreduceDtypeOpAndSize) {
  const SuiteSetup setup = GetParam();
  EXPECT_EQ(testing::run_ranks(setup.world, [&](int rank, int w, std::shared_ptr<Store>) {
    ::setenv("CHORUS_HYBRID_ALLREDUCE", "flat", 1);  // this rank's process alone
    auto pg = connect_process_group("env://", rank, w, test_options(setup, rank, 96, "auto", false));
    if (pg->transport() != "hybrid") throw std::runtime_error("transport is " + pg->transport() + ", not hybrid");
    conformance::every_allreduce(*pg);
  }, std::chrono::seconds(120)), "");
}

INSTANTIATE_TEST_SUITE_P(Forced, FlatHybrid,
                         ::testing::Values(SuiteSetup{"hybrid", 4, 2}, SuiteSetup{"hybrid", 5, 2},
                                           SuiteSetup{"hybrid", 6, 3}),
                         [](const auto& info) { return setup_name(info.param); });

// Both broadcast shapes forced (CHORUS_BROADCAST_ALGORITHM) at every world size 1..8 over TCP, from
// every root, with 96-byte segments (the chain's pieces: many per call).
class BroadcastShapes : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(BroadcastShapes, EveryRootDtypeAndSize) {
  const std::string shape = std::get<0>(GetParam());
  const int world = std::get<1>(GetParam());
  EXPECT_EQ(testing::run_ranks(world, [&](int rank, int w, std::shared_ptr<Store>) {
    ::setenv("CHORUS_BROADCAST_ALGORITHM", shape.c_str(), 1);  // this rank's process alone
    auto pg = connect_process_group("env://", rank, w, test_options({"tcp", w, 1}, rank, 96, "auto", false));
    conformance::every_broadcast(*pg);
  }, std::chrono::seconds(120)), "");
}

INSTANTIATE_TEST_SUITE_P(Forced, BroadcastShapes,
                         ::testing::Combine(::testing::Values("binomial", "chain"), ::testing::Range(1, 9)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_tcp_W" + std::to_string(std::get<1>(info.param));
                         });

std::vector<SuiteSetup> setups() {
  std::vector<SuiteSetup> out;
  for (int w : {1, 2, 3, 4, 5, 8}) {
    out.push_back({"tcp", w, 1});
    out.push_back({"shm", w, 1});
    // Two simulated hosts: 1+1 (TCP only), 1+2 and 2+3 (uneven: through the leaders), 2+2 and
    // 4+4 (even: one rail per local rank).
    if (w > 1) out.push_back({"hybrid", w, 2});
  }
  out.push_back({"hybrid", 6, 3});  // three hosts of two
  out.push_back({"auto", 4, 1});    // picks shm
  out.push_back({"auto", 3, 2});    // picks hybrid (hosts of 1 and 2 ranks)
  // Lazy connections: every collective, point-to-point, alltoall and sub-group on connections
  // made when first needed (W=2: the ring is everything; 3, 5, 8: most pairs connect on first use).
  for (int w : {2, 3, 5, 8}) out.push_back({"tcp", w, 1, "lazy"});
  out.push_back({"hybrid", 6, 3, "lazy"});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Transports, Conformance, ::testing::ValuesIn(setups()),
                         [](const auto& info) { return setup_name(info.param); });

}  // namespace
}  // namespace chorus
