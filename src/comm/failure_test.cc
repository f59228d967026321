// Errors instead of hangs: dead peers, timeouts, mismatched calls, refused peers.
#include <gtest/gtest.h>
#include <signal.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <set>
#include <thread>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/comm/process_group.h"
#include "chorus/comm/tcp_store.h"
#include "testing.h"

namespace chorus {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// The failure tests run on every transport ("hybrid": the ranks split into two simulated hosts;
// "tcp_lazy": TCP with lazy connections, most pairs connected when first needed).
class Failure : public ::testing::TestWithParam<std::string> {
 protected:
  ProcessGroupOptions opts(milliseconds timeout, int rank = 0, int world = 1) const {
    ProcessGroupOptions o;
    o.timeout = timeout;
    o.transport = GetParam() == "tcp_lazy" ? "tcp" : GetParam();
    if (GetParam() == "tcp_lazy") o.tcp_connections = "lazy";
    if (GetParam() == "hybrid") o.host_id = "test-host-" + std::to_string(rank * 2 / world);
    return o;
  }
  // How errors name rank `peer` on this transport.
  std::string peer_text(int peer) const {
    return "rank " + std::to_string(peer) + (GetParam() == "shm" ? " (pid " : " (127.0.0.1:");
  }
};

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Runs `op` and returns "<ExceptionType> after <s>: <message>", or "ok".
template <typename F>
std::string outcome(F&& op) {
  auto t0 = Clock::now();
  try {
    op();
    return "ok";
  } catch (const TimeoutError& e) {
    return "TimeoutError after " + std::to_string(seconds_since(t0)) + ": " + e.what();
  } catch (const PeerError& e) {
    return "PeerError after " + std::to_string(seconds_since(t0)) + ": " + e.what();
  } catch (const MismatchError& e) {
    return "MismatchError after " + std::to_string(seconds_since(t0)) + ": " + e.what();
  } catch (const HandshakeError& e) {
    return "HandshakeError after " + std::to_string(seconds_since(t0)) + ": " + e.what();
  } catch (const std::exception& e) {
    return std::string("other error: ") + e.what();
  }
}

// How often `text` names `rank` as the rank reporting ("chorus: rank R:"): a setup error names it
// once, whether the message came from the transport (which knows the rank) or from the store.
int times_named(const std::string& text, int rank) {
  const std::string me = "chorus: rank " + std::to_string(rank) + ":";
  int n = 0;
  for (size_t p = text.find(me); p != std::string::npos; p = text.find(me, p + 1)) ++n;
  return n;
}

double elapsed_of(const std::string& text) {
  auto p = text.find(" after ");
  return p == std::string::npos ? 1e9 : std::stod(text.substr(p + 7));
}

TEST_P(Failure, SigkilledRankMidCollectiveFailsTheOthersWithPeerErrorQuickly) {
  const milliseconds timeout(2000);
  for (int world : {2, 3, 4}) {
    auto reports = testing::run_ranks_independent(world, [&](int rank, int w) -> std::string {
      auto pg = connect_process_group("env://", rank, w, opts(timeout, rank, w));
      std::vector<float> big(8 << 20, 1.0f);  // 32 MiB: many segments, long enough to be "mid"
      // Twice: the first barrier makes the connections a lazy group lacks (a handshake per pair,
      // which can take the others well past rank 1's 5 ms), so that the second, which rank 1 leaves
      // 5 ms before it dies, is as quick everywhere as on the full mesh.
      pg->barrier()->wait();
      pg->barrier()->wait();
      if (rank == 1) {
        auto work = pg->allreduce(big.data(), big.size(), DataType::kFloat32);
        std::this_thread::sleep_for(milliseconds(5));
        ::raise(SIGKILL);
      }
      return outcome([&] {
        for (int i = 0; i < 5; ++i) pg->allreduce(big.data(), big.size(), DataType::kFloat32)->wait();
      });
    });
    EXPECT_EQ(reports[1].signal, SIGKILL);
    for (const auto& r : reports) {
      if (r.rank == 1) continue;
      SCOPED_TRACE("world " + std::to_string(world) + " rank " + std::to_string(r.rank) + ": " + r.text);
      EXPECT_EQ(r.text.rfind("PeerError", 0), 0u);
      EXPECT_NE(r.text.find("rank " + std::to_string(r.rank)), std::string::npos);
      EXPECT_NE(r.text.find("rank 1"), std::string::npos);  // names the dead peer (maybe via a relay)
      EXPECT_NE(r.text.find("allreduce"), std::string::npos);
      EXPECT_LT(elapsed_of(r.text), 2 * 2.0);
    }
  }
}

TEST_P(Failure, TimeoutNamesRankPeerAddressOperationAndTime) {
  auto reports = testing::run_ranks_independent(2, [&](int rank, int w) -> std::string {
    auto pg = connect_process_group("env://", rank, w, opts(milliseconds(1000), rank, w));
    if (rank == 1) {
      std::this_thread::sleep_for(milliseconds(2500));  // never joins the allreduce
      return "slept";
    }
    float x = 1;
    std::string first = outcome([&] { pg->allreduce(&x, 1, DataType::kFloat32)->wait(); });
    std::string second = outcome([&] { pg->barrier()->wait(); });
    return first + "\n---\n" + second;
  });
  const std::string& t = reports[0].text;
  SCOPED_TRACE(t);
  EXPECT_EQ(t.rfind("TimeoutError", 0), 0u);
  EXPECT_GE(elapsed_of(t), 0.9);
  EXPECT_LT(elapsed_of(t), 2.0);
  EXPECT_NE(t.find("rank 0"), std::string::npos);
  EXPECT_NE(t.find(peer_text(1)), std::string::npos);
  EXPECT_NE(t.find("allreduce #0"), std::string::npos);
  EXPECT_NE(t.find("timed out after"), std::string::npos);
  // The group is broken: the next call fails at once with the original cause.
  auto second = t.substr(t.find("---") + 4);
  EXPECT_EQ(second.rfind("TimeoutError", 0), 0u);
  EXPECT_LT(elapsed_of(second), 0.1);
  EXPECT_NE(second.find("broken"), std::string::npos);
  EXPECT_NE(second.find("allreduce #0"), std::string::npos);
}

TEST_P(Failure, MismatchedCollectiveRaisesOnEveryRankStatingBothCalls) {
  for (int world : {2, 3}) {
    auto reports = testing::run_ranks_independent(world, [&](int rank, int w) -> std::string {
      auto pg = connect_process_group("env://", rank, w, opts(milliseconds(3000), rank, w));
      std::vector<float> v(1000, 1.0f);
      return outcome([&] {
        if (rank == 1) {
          pg->broadcast(v.data(), 1000, DataType::kFloat32, 0)->wait();
        } else {
          pg->allreduce(v.data(), 1000, DataType::kFloat32)->wait();
        }
        pg->barrier()->wait();  // a root that only sent learns of it here at the latest
      });
    });
    for (const auto& r : reports) {
      SCOPED_TRACE("world " + std::to_string(world) + " rank " + std::to_string(r.rank) + ": " + r.text);
      EXPECT_EQ(r.text.rfind("MismatchError", 0), 0u);
      EXPECT_NE(r.text.find("allreduce #0 (float32 x 1000, sum)"), std::string::npos);
      EXPECT_NE(r.text.find("broadcast #0 (float32 x 1000, root 0)"), std::string::npos);
      EXPECT_LT(elapsed_of(r.text), 2.0);
    }
  }
}

// Over shared memory an allreduce in an allocated buffer reads the peers' copies, so every rank
// must use one (the same buffer and range) or none; elsewhere it is ordinary memory and works.
TEST_P(Failure, AllocatedBufferOnSomeRanksOnly) {
  auto reports = testing::run_ranks_independent(2, [&](int rank, int w) -> std::string {
    auto pg = connect_process_group("env://", rank, w, opts(milliseconds(3000), rank, w));
    auto buf = pg->allocate_buffer(100000 * sizeof(float));
    std::vector<float> plain(100000, 1.0f);
    float* mine = rank == 0 ? static_cast<float*>(buf->data()) : plain.data();
    std::fill(mine, mine + 100000, 1.0f);
    std::string r = outcome([&] { pg->allreduce(mine, 100000, DataType::kFloat32)->wait(); });
    if (r == "ok" && (mine[0] != 2.0f || mine[99999] != 2.0f)) return "wrong result";
    return r;
  });
  for (const auto& r : reports) {
    SCOPED_TRACE(r.text);
    if (GetParam() == "shm") {
      EXPECT_EQ(r.text.rfind("MismatchError", 0), 0u);
      EXPECT_NE(r.text.find("shared buffer #0 at byte 0"), std::string::npos);
      EXPECT_NE(r.text.find("ordinary memory"), std::string::npos);
    } else {
      EXPECT_EQ(r.text, "ok");
    }
  }
}

TEST_P(Failure, MismatchedCountRaisesOnEveryRank) {
  auto reports = testing::run_ranks_independent(2, [&](int rank, int w) -> std::string {
    auto pg = connect_process_group("env://", rank, w, opts(milliseconds(3000), rank, w));
    std::vector<float> v(1000, 1.0f);
    return outcome([&] { pg->allreduce(v.data(), rank == 0 ? 1000 : 999, DataType::kFloat32)->wait(); });
  });
  for (const auto& r : reports) {
    SCOPED_TRACE(r.text);
    EXPECT_EQ(r.text.rfind("MismatchError", 0), 0u);
    EXPECT_NE(r.text.find("float32 x 1000"), std::string::npos);
    EXPECT_NE(r.text.find("float32 x 999"), std::string::npos);
  }
}

// ProcessGroup::run_local: steps run on the worker in issue order (the allreduce waits for the
// slow fill queued before it), and a step that throws breaks the group on every rank: its own next
// operation fails with the step's message, the peer's fails at once instead of timing out.
TEST_P(Failure, LocalStepsRunInIssueOrderAndAFailingOneBreaksTheGroupEverywhere) {
  auto reports = testing::run_ranks_independent(2, [&](int rank, int w) -> std::string {
    auto pg = connect_process_group("env://", rank, w, opts(milliseconds(20000), rank, w));
    std::vector<float> data(1000, 0.0f);
    pg->run_local("slow fill", [&data, rank] {
      std::this_thread::sleep_for(milliseconds(200));
      std::fill(data.begin(), data.end(), static_cast<float>(rank + 1));
    });
    pg->allreduce(data.data(), data.size(), DataType::kFloat32)->wait();
    for (float v : data) {
      if (v != 3.0f) return "allreduce ran before the step queued ahead of it: " + std::to_string(v);
    }
    if (rank == 0) pg->run_local("stage for the test", [] { throw std::runtime_error("planted step failure"); });
    const auto t0 = Clock::now();
    const std::string got = outcome([&] { pg->allreduce(data.data(), data.size(), DataType::kFloat32)->wait(); });
    if (seconds_since(t0) > 10) return "took " + std::to_string(seconds_since(t0)) + " s: " + got;
    return got;
  });
  ASSERT_EQ(reports.size(), 2u);
  for (const auto& r : reports) ASSERT_TRUE(r.exited && r.exit_code == 0) << "rank " << r.rank << ": " << r.text;
  EXPECT_NE(reports[0].text.find("planted step failure"), std::string::npos) << reports[0].text;
  EXPECT_EQ(reports[1].text.rfind("ok", 0), std::string::npos) << "rank 1's allreduce succeeded";
  EXPECT_NE(reports[1].text.find("rank 0"), std::string::npos) << reports[1].text;
  EXPECT_NE(reports[1].text.find("planted step failure"), std::string::npos) << reports[1].text;
}

TEST_P(Failure, PeerThatClosedItsGroupIsReportedAsSuch) {
  auto reports = testing::run_ranks_independent(2, [&](int rank, int w) -> std::string {
    auto pg = connect_process_group("env://", rank, w, opts(milliseconds(3000), rank, w));
    pg->barrier()->wait();
    if (rank == 1) {
      pg->shutdown();
      std::this_thread::sleep_for(milliseconds(1500));
      return "closed";
    }
    std::this_thread::sleep_for(milliseconds(200));
    float x = 1;
    return outcome([&] { pg->allreduce(&x, 1, DataType::kFloat32)->wait(); });
  });
  SCOPED_TRACE(reports[0].text);
  EXPECT_EQ(reports[0].text.rfind("PeerError", 0), 0u);
  EXPECT_NE(reports[0].text.find("closed its process group"), std::string::npos);
  EXPECT_LT(elapsed_of(reports[0].text), 1.0);
}

// recv_any waits for whichever rank sends: a rank that closed its group is passed over, one that
// dies fails it at once, and when no rank is left that could send, or none does before the
// deadline, the error says so and names the ranks.
TEST_P(Failure, RecvFromAnySourcePassesOverClosedRanksAndFailsOnADeadOneOrTimeout) {
  auto reports = testing::run_ranks_independent(3, [&](int rank, int w) -> std::string {
    auto pg = connect_process_group("env://", rank, w, opts(milliseconds(3000), rank, w));
    pg->barrier()->wait();
    if (rank == 2) {
      pg->shutdown();
      std::this_thread::sleep_for(milliseconds(2500));
      return "closed";
    }
    int32_t x = 41;
    if (rank == 1) {
      std::this_thread::sleep_for(milliseconds(300));
      pg->send(&x, 1, DataType::kInt32, 0, 4)->wait();
      std::this_thread::sleep_for(milliseconds(300));
      ::raise(SIGKILL);
    }
    int32_t got = 0;
    auto first = pg->recv_any(&got, 1, DataType::kInt32, 4);
    first->wait();
    return "from " + std::to_string(first->source()) + " got " + std::to_string(got) + "\n" +
           outcome([&] { pg->recv_any(&got, 1, DataType::kInt32, 4)->wait(); });
  });
  const std::string& t = reports[0].text;
  SCOPED_TRACE(t);
  EXPECT_EQ(reports[1].signal, SIGKILL);
  EXPECT_EQ(t.rfind("from 1 got 41\nPeerError", 0), 0u);
  EXPECT_NE(t.find("rank 0"), std::string::npos);
  EXPECT_NE(t.find(peer_text(1)), std::string::npos);
  EXPECT_LT(elapsed_of(t), 1.5);  // not the 3 s deadline

  reports = testing::run_ranks_independent(3, [&](int rank, int w) -> std::string {
    auto pg = connect_process_group("env://", rank, w, opts(milliseconds(1000), rank, w));
    pg->barrier()->wait();
    if (rank != 0) {
      std::this_thread::sleep_for(milliseconds(2000));  // alive, never sends
      return "slept";
    }
    int32_t got = 0;
    return outcome([&] { pg->recv_any(&got, 1, DataType::kInt32, 4)->wait(); });
  });
  SCOPED_TRACE(reports[0].text);
  EXPECT_EQ(reports[0].text.rfind("TimeoutError", 0), 0u);
  EXPECT_GE(elapsed_of(reports[0].text), 0.9);
  EXPECT_NE(reports[0].text.find("from any source"), std::string::npos);
  EXPECT_NE(reports[0].text.find(peer_text(1)), std::string::npos);
  EXPECT_NE(reports[0].text.find(peer_text(2)), std::string::npos);

  reports = testing::run_ranks_independent(3, [&](int rank, int w) -> std::string {
    auto pg = connect_process_group("env://", rank, w, opts(milliseconds(3000), rank, w));
    pg->barrier()->wait();
    if (rank != 0) {
      pg->shutdown();
      std::this_thread::sleep_for(milliseconds(1500));
      return "closed";
    }
    int32_t got = 0;
    return outcome([&] { pg->recv_any(&got, 1, DataType::kInt32, 4)->wait(); });
  });
  SCOPED_TRACE(reports[0].text);
  EXPECT_EQ(reports[0].text.rfind("MismatchError", 0), 0u);
  EXPECT_NE(reports[0].text.find("no rank it could come from can send"), std::string::npos);
  EXPECT_LT(elapsed_of(reports[0].text), 1.5);
}

TEST_P(Failure, PeerWithWrongTokenOrWorldSizeIsRefused) {
  auto reports = testing::run_ranks_independent(2, [&](int rank, int w) -> std::string {
    ProcessGroupOptions o = opts(milliseconds(1500), rank, w);
    if (rank == 1) o.token = "not-the-job-token";
    return outcome([&] { connect_process_group("env://", rank, w, o); });
  });
  SCOPED_TRACE(reports[0].text + " | " + reports[1].text);
  EXPECT_EQ(reports[1].text.rfind("HandshakeError", 0), 0u);
  EXPECT_NE(reports[1].text.find("token"), std::string::npos);
  // Over TCP rank 0 waits for a rank that never joined; over shared memory it sees the stranger too.
  EXPECT_TRUE(reports[0].text.rfind("TimeoutError", 0) == 0 || reports[0].text.rfind("HandshakeError", 0) == 0);
  for (const auto& r : reports) EXPECT_EQ(times_named(r.text, r.rank), 1) << r.text;

  auto sizes = testing::run_ranks_independent(2, [&](int rank, int w) -> std::string {
    // Rank 1 believes the world has 3 ranks; store keys still line up for ranks 0 and 1.
    const int world = rank == 1 ? 3 : 2;
    return outcome([&] { connect_process_group("env://", rank, world, opts(milliseconds(1500), rank, world)); });
  });
  SCOPED_TRACE(sizes[0].text + " | " + sizes[1].text);
  EXPECT_EQ(sizes[0].text.rfind("HandshakeError", 0), 0u);
  EXPECT_NE(sizes[0].text.find("world size"), std::string::npos);
  EXPECT_NE(sizes[1].text.find("world size"), std::string::npos);
  for (const auto& r : sizes) EXPECT_EQ(times_named(r.text, r.rank), 1) << r.text;
}

// Ranks told different links disagree about which exchange steps start with a ready handshake
// (plan::exchange_needs_ready): each gets a message it did not expect, and both fail at once with
// an error that names the options to align, not after the timeout.
// Two ranks over TCP run one Rabenseifner allreduce of 1000 floats after `tell(rank, options)`;
// both must fail at once with a MismatchError that names `setting`.
static void expect_link_mismatch(const std::function<void(int, ProcessGroupOptions&)>& tell, const std::string& setting) {
  auto reports = testing::run_ranks_independent(2, [&](int rank, int w) -> std::string {
    ProcessGroupOptions o;
    o.timeout = milliseconds(20000);
    o.transport = "tcp";
    o.allreduce_algorithm = "rabenseifner";
    tell(rank, o);
    auto pg = connect_process_group("env://", rank, w, o);
    std::vector<float> v(1000, 1.0f);
    return outcome([&] { pg->allreduce(v.data(), v.size(), DataType::kFloat32)->wait(); });
  });
  for (const auto& r : reports) {
    SCOPED_TRACE(r.text);
    EXPECT_EQ(r.text.rfind("MismatchError", 0), 0u);
    EXPECT_LT(elapsed_of(r.text), 10.0);
    EXPECT_NE(r.text.find(setting), std::string::npos);
  }
}

TEST(TcpMismatch, RanksToldDifferentLinksFailWithAMismatchNamingTheOptions) {
  expect_link_mismatch([](int rank, ProcessGroupOptions& o) {
    if (rank == 0) o.link_gbit_per_s = 0.0005;  // every block from 30 bytes takes a handshake
  }, "link_gbit_per_s");
}

// The link can come from the environment (how Python and `chorus run` users tell it): a rank whose
// CHORUS_LINK_GBIT differs from the other's fails as if told through the options, and the error
// names the variables too.
TEST(TcpMismatch, RanksGivenDifferentCHORUS_LINK_GBITFailNamingTheVariable) {
  expect_link_mismatch([](int rank, ProcessGroupOptions&) {
    if (rank == 0) ::setenv("CHORUS_LINK_GBIT", "0.0005", 1);  // this rank's process alone
  }, "CHORUS_LINK_GBIT");
}

// "tuned" on one rank only: its trials run other algorithms than the other rank's plan, and the
// first call where they differ fails on both ranks at once with a MismatchError naming the option
// to align, never after the timeout and never a wrong sum.
TEST(TcpMismatch, TunedOnOneRankOnlyFailsAtOnceNamingTheOption) {
  auto reports = testing::run_ranks_independent(2, [&](int rank, int w) -> std::string {
    ProcessGroupOptions o;
    o.timeout = milliseconds(20000);
    o.transport = "tcp";
    o.allreduce_algorithm = rank == 0 ? "tuned" : "auto";
    auto pg = connect_process_group("env://", rank, w, o);
    std::vector<float> v(1000);
    for (int call = 0; call <= kTunedAllreduceTrials; ++call) {
      std::fill(v.begin(), v.end(), static_cast<float>(rank + 1));
      const std::string r = outcome([&] { pg->allreduce(v.data(), v.size(), DataType::kFloat32)->wait(); });
      if (r != "ok") return r;
      if (v.front() != 3.0f || v.back() != 3.0f) return "call " + std::to_string(call) + ": a wrong sum";
    }
    return "every call ran";
  });
  for (const auto& r : reports) {
    SCOPED_TRACE(r.text);
    EXPECT_EQ(r.text.rfind("MismatchError", 0), 0u);
    EXPECT_LT(elapsed_of(r.text), 10.0);
    EXPECT_NE(r.text.find("allreduce_algorithm"), std::string::npos);
  }
}

// "auto" on some ranks, an algorithm forced on others: the auto ranks gather every rank's machine
// and CPUs at the group's first allreduce, which the others do not, so that allreduce fails on every
// rank within moments with a MismatchError naming the caller's allreduce and the option to align,
// whatever the forced algorithm (even the one auto would have picked), never a wait for the timeout.
TEST(TcpMismatch, AutoBesideAForcedAlgorithmFailsAtTheFirstAllreduceNamingTheOption) {
  for (const char* forced : {"ring", "recursive_doubling", "rabenseifner"}) {
    for (int world : {2, 3}) {
      auto reports = testing::run_ranks_independent(world, [&](int rank, int w) -> std::string {
        ProcessGroupOptions o;
        o.timeout = milliseconds(20000);
        o.transport = "tcp";
        o.allreduce_algorithm = rank == 0 ? "auto" : forced;
        auto pg = connect_process_group("env://", rank, w, o);
        std::vector<float> v(1000, 1.0f);
        return outcome([&] { pg->allreduce(v.data(), v.size(), DataType::kFloat32)->wait(); });
      });
      for (const auto& r : reports) {
        SCOPED_TRACE(std::string(forced) + ", world " + std::to_string(world) + ", rank " + std::to_string(r.rank) +
                     ": " + r.text);
        EXPECT_EQ(r.text.rfind("MismatchError", 0), 0u);
        EXPECT_LT(elapsed_of(r.text), 10.0);
        EXPECT_NE(r.text.find("allreduce #0 (float32 x 1000, sum)"), std::string::npos);
        EXPECT_NE(r.text.find("allreduce_algorithm \"auto\""), std::string::npos);
      }
    }
  }
}

// keep_tuned_allreduce with different decisions on different ranks (e.g. each loaded another saved
// state): the class's first allreduce fails on every rank within moments, naming the call; and so
// do ranks that kept a decision facing ranks that kept none (every rank checks every class's first
// call, so none waits on a partner that took other steps).
TEST(TcpMismatch, KeptTunedDecisionsThatDifferFailAtOnceOnEveryRank) {
  struct Case {
    const char* what;
    int world;
    std::function<const char*(int rank)> keeps;  // nullptr: keeps nothing
  };
  const Case cases[] = {
      {"rank 0 keeps the ring, the others Rabenseifner", 3, [](int r) { return r == 0 ? "ring" : "rabenseifner"; }},
      {"ranks 0 and 1 keep Rabenseifner, 2 and 3 nothing", 4, [](int r) { return r < 2 ? "rabenseifner" : nullptr; }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    auto reports = testing::run_ranks_independent(c.world, [&](int rank, int w) -> std::string {
      ProcessGroupOptions o;
      o.timeout = milliseconds(20000);
      o.transport = "tcp";
      o.allreduce_algorithm = "tuned";
      auto pg = connect_process_group("env://", rank, w, o);
      if (const char* keep = c.keeps(rank)) pg->keep_tuned_allreduce({{w, 1 << 20, (2 << 20) - 1, {}, keep}});
      // 1 MiB: a class whose first trial is the ring (on loopback's model), whose partners are not
      // recursive doubling's.
      std::vector<float> v(1 << 18, static_cast<float>(rank + 1));
      const std::string r = outcome([&] { pg->allreduce(v.data(), v.size(), DataType::kFloat32)->wait(); });
      return r == "ok" ? "the allreduce ran (sum " + std::to_string(v.back()) + ")" : r;
    });
    for (const auto& r : reports) {
      SCOPED_TRACE(r.text);
      EXPECT_EQ(r.text.rfind("MismatchError", 0), 0u);
      EXPECT_LT(elapsed_of(r.text), 10.0);
      EXPECT_NE(r.text.find("keep_tuned_allreduce"), std::string::npos);
    }
  }
}

// The same variable on every rank is a link the ranks agree on: the allreduce runs and is right.
TEST(LinkFromEnvironment, EveryRankGivenTheSameLinkRuns) {
  auto reports = testing::run_ranks_independent(2, [&](int rank, int w) -> std::string {
    ::setenv("CHORUS_LINK_GBIT", "0.0005", 1);
    ::setenv("CHORUS_LINK_LATENCY_US", "40", 1);
    ProcessGroupOptions o;
    o.timeout = milliseconds(20000);
    o.transport = "tcp";
    o.allreduce_algorithm = "rabenseifner";
    auto pg = connect_process_group("env://", rank, w, o);
    std::vector<float> v(1000, static_cast<float>(rank + 1));
    const std::string r = outcome([&] { pg->allreduce(v.data(), v.size(), DataType::kFloat32)->wait(); });
    return r == "ok" && v.front() == 3.0f && v.back() == 3.0f ? "ok" : r + " (sum " + std::to_string(v.back()) + ")";
  });
  for (const auto& r : reports) EXPECT_EQ(r.text, "ok");
}

// A value that is not a positive number fails before any setup, naming the variable, the value and
// what it means; options given explicitly win over the environment.
TEST(LinkFromEnvironment, BadValuesNameTheVariable) {
  for (const char* bad : {"fast", "10GbE", "-1", "0", "nan", "inf", "1e999"}) {
    ::setenv("CHORUS_LINK_GBIT", bad, 1);
    const std::string e = outcome([&] { ProcessGroup pg(std::make_shared<HashStore>(), 0, 1, {}); });
    EXPECT_NE(e.find(std::string("CHORUS_LINK_GBIT='") + bad + "' is not a positive number"), std::string::npos) << e;
    EXPECT_NE(e.find("Gbit/s"), std::string::npos) << e;
    ProcessGroupOptions given;
    given.link_gbit_per_s = 10;
    EXPECT_EQ(outcome([&] { ProcessGroup pg(std::make_shared<HashStore>(), 0, 1, given); }), "ok") << bad;
  }
  ::setenv("CHORUS_LINK_GBIT", " 25 ", 1);
  EXPECT_EQ(outcome([&] { ProcessGroup pg(std::make_shared<HashStore>(), 0, 1, {}); }), "ok");
  ::unsetenv("CHORUS_LINK_GBIT");
  ::setenv("CHORUS_LINK_LATENCY_US", "soon", 1);
  const std::string e = outcome([&] { ProcessGroup pg(std::make_shared<HashStore>(), 0, 1, {}); });
  ::unsetenv("CHORUS_LINK_LATENCY_US");
  EXPECT_NE(e.find("CHORUS_LINK_LATENCY_US='soon' is not a positive number"), std::string::npos) << e;
  EXPECT_EQ(outcome([&] { ProcessGroup pg(std::make_shared<HashStore>(), 0, 1, {}); }), "ok");
}

// A bad tcp_connections, given or from CHORUS_TCP_CONNECTIONS, fails before any setup, naming the
// value, where it came from and the choices.
TEST(Setup, UnknownTcpConnectionsNamesTheChoices) {
  ProcessGroupOptions o;
  o.tcp_connections = "sometimes";
  const std::string given = outcome([&] { ProcessGroup pg(std::make_shared<HashStore>(), 0, 1, o); });
  EXPECT_NE(given.find("unknown tcp_connections 'sometimes'; available: auto, eager, lazy"), std::string::npos) << given;
  ::setenv("CHORUS_TCP_CONNECTIONS", "never", 1);
  const std::string from_env = outcome([&] { ProcessGroup pg(std::make_shared<HashStore>(), 0, 1, {}); });
  ::unsetenv("CHORUS_TCP_CONNECTIONS");
  EXPECT_NE(from_env.find("'never' in CHORUS_TCP_CONNECTIONS"), std::string::npos) << from_env;
  EXPECT_EQ(outcome([&] { ProcessGroup pg(std::make_shared<HashStore>(), 0, 1, {}); }), "ok");
}

// A setup error from code that does not know the rank (here the store, whose server went away)
// gets the rank and group in front, once; the transports' own errors (above) name the rank once too.
TEST(Setup, StoreFailureNamesTheRankAndGroupOnce) {
  TcpStoreServerOptions so;
  so.host = "127.0.0.1";
  so.quiet = true;
  auto server = std::make_unique<TcpStoreServer>(so);
  TcpStoreOptions co;
  co.port = server->port();
  co.timeout = milliseconds(2000);
  auto store = std::make_shared<TcpStore>(co);
  server.reset();
  ProcessGroupOptions o;
  o.group_name = "setup-test";
  o.timeout = milliseconds(2000);
  const std::string text = outcome([&] { ProcessGroup pg(store, 1, 2, o); });
  EXPECT_EQ(text.rfind("PeerError", 0), 0u) << text;
  EXPECT_EQ(times_named(text, 1), 1) << text;
  EXPECT_NE(text.find("chorus: rank 1: group 'setup-test' setup: "), std::string::npos) << text;
}

// A peer that gives up its setup says why in the store before it closes (docs/wire-format.md):
// rank 0 then raises that reason in its class whether the peer closed rank 0's connection
// mid-handshake or refused it, and ignores a reason left by an earlier listener of that rank.
// Rank 1 here is a stand-in that does exactly that, so each case happens every time; the race it
// pins down (lazy setup, one side reading a world-size mismatch from the store) is in
// Failure.PeerWithWrongTokenOrWorldSizeIsRefused.
TEST(TcpSetup, APeerThatGaveUpIsReportedWithItsReason) {
  const std::string reason = "chorus: rank 1: group 'g' setup: world size mismatch: told 3";
  for (const std::string how : {"closes", "refuses", "stale"}) {
    SCOPED_TRACE(how);
    auto store = std::make_shared<HashStore>();
    int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(listener, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    ASSERT_EQ(::listen(listener, 4), 0);
    ASSERT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len), 0);
    const std::string addr = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
    // The reason: '4' is HandshakeError's class; "stale" names another address.
    const std::string said = (how == "stale" ? "127.0.0.1:1" : addr) + "\n4" + reason;
    std::thread rank1([&] {
      if (how == "refuses") {
        store->set("chorus/pg/g/gave_up/1", said);
        ::close(listener);
        store->set("chorus/pg/g/addr/1", addr);
        return;
      }
      store->set("chorus/pg/g/addr/1", addr);
      // Bounded waits: a rank 0 that never connects fails the assertions below, never hangs here.
      pollfd pl{listener, POLLIN, 0};
      const int fd = ::poll(&pl, 1, 5000) == 1 ? ::accept(listener, nullptr, nullptr) : -1;
      pollfd pc{fd, POLLIN, 0};
      char hello[64];
      if (fd >= 0 && ::poll(&pc, 1, 5000) == 1) (void)::recv(fd, hello, sizeof(hello), 0);  // rank 0's hello
      store->set("chorus/pg/g/gave_up/1", said);
      if (fd >= 0) ::close(fd);
      ::close(listener);
    });
    ProcessGroupOptions o;
    o.group_name = "g";
    o.transport = "tcp";
    o.tcp_connections = "eager";
    o.timeout = milliseconds(how == "refuses" ? 1000 : 3000);
    const std::string text = outcome([&] { ProcessGroup pg(store, 0, 2, o); });
    rank1.join();
    EXPECT_EQ(times_named(text, 0), 1) << text;
    if (how == "stale") {
      EXPECT_EQ(text.rfind("PeerError", 0), 0u) << text;
      EXPECT_NE(text.find("closed the connection during the handshake, before its verdict"), std::string::npos) << text;
      EXPECT_EQ(text.find("world size"), std::string::npos) << text;
      continue;
    }
    EXPECT_EQ(text.rfind("HandshakeError", 0), 0u) << text;
    const std::string what = how == "closes" ? "closed the connection during the handshake" : "refused the connection";
    EXPECT_NE(text.find("rank 1 at " + addr + " " + what + " because its setup failed: " + reason), std::string::npos)
        << text;
    EXPECT_LT(elapsed_of(text), 0.9) << text;  // at once, not at the deadline
  }
}

// Over TCP a rank waiting for an absent one must not blame a live rank: every rank serves its
// listener while it connects, so only the absent rank is missing from anyone's view.
TEST(TcpSetup, TimeoutNamesTheMissingRankAndNoLiveOne) {
  const int world = 4, absent = 3;
  // "tcp" is the mesh setup itself; "auto" first has every rank announce itself in the store;
  // "lazy" exchanges every address through the store before connecting the ring.
  for (const std::string transport : {"tcp", "auto", "lazy"}) {
    auto reports = testing::run_ranks_independent(world, [&](int rank, int w) -> std::string {
      if (rank == absent) return "never started";
      ProcessGroupOptions o;
      o.timeout = milliseconds(1500);
      o.transport = transport == "lazy" ? "tcp" : transport;
      o.tcp_connections = transport == "lazy" ? "lazy" : "eager";
      return outcome([&] { connect_process_group("env://", rank, w, o); });
    });
    for (const auto& r : reports) {
      if (r.rank == absent) continue;
      SCOPED_TRACE(transport + " rank " + std::to_string(r.rank) + ": " + r.text);
      EXPECT_EQ(r.text.rfind("TimeoutError", 0), 0u);
      EXPECT_NE(r.text.find("rank(s) [3] never"), std::string::npos);
      EXPECT_LT(elapsed_of(r.text), 3.0);
      EXPECT_EQ(times_named(r.text, r.rank), 1);
      for (int live = 0; live < world; ++live) {
        if (live == absent || live == r.rank) continue;
        const std::string l = std::to_string(live);
        for (const std::string& blame : {"[" + l + "]", "[" + l + ",", " " + l + "]", "rank " + l + " at "}) {
          EXPECT_EQ(r.text.find(blame), std::string::npos) << "blames live rank " << live << " (" << blame << ")";
        }
      }
    }
  }
}

TEST_P(Failure, TimedWaitHonoursItsTimeoutWhileTheOperationGoesOn) {
  auto reports = testing::run_ranks_independent(2, [&](int rank, int w) -> std::string {
    auto pg = connect_process_group("env://", rank, w, opts(milliseconds(5000), rank, w));
    float x = 1;
    if (rank == 1) std::this_thread::sleep_for(milliseconds(1500));
    auto work = pg->allreduce(&x, 1, DataType::kFloat32);
    std::string first = outcome([&] { work->wait(milliseconds(200)); });
    work->wait();  // the operation itself still completes
    return first + (x == 2 ? " | completed" : " | wrong result");
  });
  SCOPED_TRACE(reports[0].text);
  EXPECT_EQ(reports[0].text.rfind("TimeoutError", 0), 0u);
  EXPECT_LT(elapsed_of(reports[0].text), 1.0);
  EXPECT_NE(reports[0].text.find("completed"), std::string::npos);
}

TEST_P(Failure, ShutdownWhileAnotherThreadRunsAnOperationInlineReturns) {
  auto reports = testing::run_ranks_independent(2, [&](int rank, int w) -> std::string {
    auto pg = connect_process_group("env://", rank, w, opts(milliseconds(5000), rank, w));
    std::vector<float> v(4 << 20, 1.0f);
    auto work = pg->allreduce(v.data(), v.size(), DataType::kFloat32);
    std::thread waiter([&] { work->wait(); });
    std::this_thread::sleep_for(milliseconds(1));
    pg->shutdown();  // must return once the running operation ends
    waiter.join();
    return v[0] == 2.0f ? "ok" : "wrong";
  }, std::chrono::seconds(20));
  for (const auto& r : reports) EXPECT_EQ(r.text, "ok") << "rank " << r.rank;
}

// Names in /dev/shm that chorus made.
std::set<std::string> chorus_segments() {
  std::set<std::string> out;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d)) {
      if (std::strncmp(e->d_name, "chorus-", 7) == 0) out.insert(e->d_name);
    }
    ::closedir(d);
  }
  return out;
}

TEST(SharedMemory, NothingIsLeftInDevShmAfterNormalExitErrorOrSigkill) {
  const auto before = chorus_segments();
  auto shm = [](milliseconds timeout) {
    ProcessGroupOptions o;
    o.timeout = timeout;
    o.transport = "shm";
    return o;
  };
  // A normal job, a job whose rank 2 is SIGKILLed mid-allreduce, and a job whose rank 1 dies
  // before it joins (rank 0 has created its segment and times out waiting).
  auto normal = testing::run_ranks(3, [&](int rank, int w, std::shared_ptr<Store>) {
    auto pg = connect_process_group("env://", rank, w, shm(milliseconds(3000)));
    std::vector<float> v(1 << 20, 1.0f);
    pg->allreduce(v.data(), v.size(), DataType::kFloat32)->wait();
    if (v[0] != 3.0f) throw std::runtime_error("wrong allreduce result");
  });
  EXPECT_EQ(normal, "");
  auto killed = testing::run_ranks_independent(3, [&](int rank, int w) -> std::string {
    auto pg = connect_process_group("env://", rank, w, shm(milliseconds(2000)));
    std::vector<float> v(4 << 20, 1.0f);
    if (rank == 2) {
      auto work = pg->allreduce(v.data(), v.size(), DataType::kFloat32);
      std::this_thread::sleep_for(milliseconds(2));
      ::raise(SIGKILL);
    }
    return outcome([&] {
      for (int i = 0; i < 5; ++i) pg->allreduce(v.data(), v.size(), DataType::kFloat32)->wait();
    });
  });
  EXPECT_EQ(killed[2].signal, SIGKILL);
  for (int r : {0, 1}) EXPECT_EQ(killed[static_cast<size_t>(r)].text.rfind("PeerError", 0), 0u) << killed[static_cast<size_t>(r)].text;
  auto early = testing::run_ranks_independent(2, [&](int rank, int w) -> std::string {
    if (rank == 1) ::raise(SIGKILL);
    return outcome([&] { connect_process_group("env://", rank, w, shm(milliseconds(1000))); });
  });
  EXPECT_EQ(early[0].text.rfind("TimeoutError", 0), 0u) << early[0].text;
  EXPECT_EQ(chorus_segments(), before);
}

TEST(SharedMemory, RankThatRanAheadIntoTheNextCollectiveIsAMismatchNotAResult) {
  // Rank 0's gather to root 1 fits in the ring and completes without rank 1, so rank 0 meets
  // rank 1 at the same shared-memory barrier while it is in allreduce #1 and rank 1 in #0.
  auto reports = testing::run_ranks_independent(2, [](int rank, int w) -> std::string {
    ProcessGroupOptions o;
    o.timeout = milliseconds(3000);
    o.transport = "shm";
    auto pg = connect_process_group("env://", rank, w, o);
    std::vector<float> v(16, 1.0f), all(32);
    if (rank == 0) pg->gather(v.data(), all.data(), v.size(), DataType::kFloat32, 1)->wait();
    // The allreduce itself must fail: nothing after it may be needed to notice.
    return outcome([&] { pg->allreduce(v.data(), v.size(), DataType::kFloat32)->wait(); });
  });
  for (const auto& r : reports) {
    SCOPED_TRACE("rank " + std::to_string(r.rank) + ": " + r.text);
    EXPECT_EQ(r.text.rfind("MismatchError", 0), 0u);
    EXPECT_NE(r.text.find("allreduce"), std::string::npos);
  }
}

TEST(SharedMemory, ReceiveAgainstACollectiveIsAMismatchNotATimeout) {
  auto reports = testing::run_ranks_independent(2, [](int rank, int w) -> std::string {
    ProcessGroupOptions o;
    o.timeout = milliseconds(3000);
    o.transport = "shm";
    auto pg = connect_process_group("env://", rank, w, o);
    std::vector<float> v(16, 1.0f);
    return outcome([&] {
      if (rank == 0) {
        pg->recv(v.data(), v.size(), DataType::kFloat32, 1, 5)->wait();
      } else {
        pg->allreduce(v.data(), v.size(), DataType::kFloat32)->wait();
      }
    });
  });
  for (const auto& r : reports) {
    SCOPED_TRACE("rank " + std::to_string(r.rank) + ": " + r.text);
    EXPECT_EQ(r.text.rfind("MismatchError", 0), 0u);
    EXPECT_NE(r.text.find("recv #0"), std::string::npos);
    EXPECT_NE(r.text.find("allreduce #0"), std::string::npos);
    EXPECT_LT(elapsed_of(r.text), 1.5);  // well before the 3 s timeout
  }
}

TEST(Hybrid, HostsThatDisagreeOnTheOpRaiseOnEveryRank) {
  // Two simulated hosts of two ranks; within each host the calls agree, across hosts they do not.
  auto reports = testing::run_ranks_independent(4, [](int rank, int w) -> std::string {
    ProcessGroupOptions o;
    o.timeout = milliseconds(3000);
    o.transport = "hybrid";
    o.host_id = "test-host-" + std::to_string(rank / 2);
    auto pg = connect_process_group("env://", rank, w, o);
    std::vector<float> v(100000, 1.0f);
    return outcome([&] {
      pg->allreduce(v.data(), v.size(), DataType::kFloat32, rank < 2 ? ReduceOp::kAvg : ReduceOp::kSum)->wait();
      pg->barrier()->wait();
    });
  });
  for (const auto& r : reports) {
    SCOPED_TRACE("rank " + std::to_string(r.rank) + ": " + r.text);
    EXPECT_EQ(r.text.rfind("MismatchError", 0), 0u);
    EXPECT_NE(r.text.find("avg"), std::string::npos);
    EXPECT_NE(r.text.find("sum"), std::string::npos);
  }
}

TEST(SharedMemory, OversubscribedGroupSleepsInsteadOfSpinningAndFinishes) {
  // 8 ranks on this machine's cores (2 in CI): waiting ranks must give their core away.
  const auto t0 = Clock::now();
  auto result = testing::run_ranks(8, [](int rank, int w, std::shared_ptr<Store>) {
    ProcessGroupOptions o;
    o.timeout = std::chrono::seconds(20);
    o.transport = "shm";
    auto pg = connect_process_group("env://", rank, w, o);
    std::vector<float> small(1024, 1.0f), large(1 << 20, 1.0f);
    for (int i = 0; i < 200; ++i) pg->allreduce(small.data(), small.size(), DataType::kFloat32)->wait();
    for (int i = 0; i < 10; ++i) pg->allreduce(large.data(), large.size(), DataType::kFloat32)->wait();
    if (large[0] != std::pow(8.0f, 10.0f)) throw std::runtime_error("wrong result");
    pg->barrier()->wait();
  }, std::chrono::seconds(60));
  EXPECT_EQ(result, "");
  // Generous: it takes about a second here. Spinning ranks that starve the others take minutes.
  EXPECT_LT(seconds_since(t0), 30.0);
}

INSTANTIATE_TEST_SUITE_P(Transports, Failure, ::testing::Values("tcp", "shm", "hybrid", "tcp_lazy"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace chorus
