// Errors instead of hangs: dead peers, timeouts, mismatched calls, refused peers.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <thread>

#include "chorus/comm/error.h"
#include "chorus/comm/process_group.h"
#include "testing.h"

namespace chorus {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

ProcessGroupOptions opts(milliseconds timeout) {
  ProcessGroupOptions o;
  o.timeout = timeout;
  return o;
}

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

double elapsed_of(const std::string& text) {
  auto p = text.find(" after ");
  return p == std::string::npos ? 1e9 : std::stod(text.substr(p + 7));
}

TEST(Failure, SigkilledRankMidCollectiveFailsTheOthersWithPeerErrorQuickly) {
  const milliseconds timeout(2000);
  for (int world : {2, 3, 4}) {
    auto reports = testing::run_ranks_independent(world, [&](int rank, int w) -> std::string {
      auto pg = connect_process_group("env://", rank, w, opts(timeout));
      std::vector<float> big(8 << 20, 1.0f);  // 32 MiB: many segments, long enough to be "mid"
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

TEST(Failure, TimeoutNamesRankPeerAddressOperationAndTime) {
  auto reports = testing::run_ranks_independent(2, [](int rank, int w) -> std::string {
    auto pg = connect_process_group("env://", rank, w, opts(milliseconds(1000)));
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
  EXPECT_NE(t.find("rank 1 (127.0.0.1:"), std::string::npos);
  EXPECT_NE(t.find("allreduce #0"), std::string::npos);
  EXPECT_NE(t.find("timed out after"), std::string::npos);
  // The group is broken: the next call fails at once with the original cause.
  auto second = t.substr(t.find("---") + 4);
  EXPECT_EQ(second.rfind("TimeoutError", 0), 0u);
  EXPECT_LT(elapsed_of(second), 0.1);
  EXPECT_NE(second.find("broken"), std::string::npos);
  EXPECT_NE(second.find("allreduce #0"), std::string::npos);
}

TEST(Failure, MismatchedCollectiveRaisesOnEveryRankStatingBothCalls) {
  for (int world : {2, 3}) {
    auto reports = testing::run_ranks_independent(world, [](int rank, int w) -> std::string {
      auto pg = connect_process_group("env://", rank, w, opts(milliseconds(3000)));
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

TEST(Failure, MismatchedCountRaisesOnEveryRank) {
  auto reports = testing::run_ranks_independent(2, [](int rank, int w) -> std::string {
    auto pg = connect_process_group("env://", rank, w, opts(milliseconds(3000)));
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

TEST(Failure, PeerThatClosedItsGroupIsReportedAsSuch) {
  auto reports = testing::run_ranks_independent(2, [](int rank, int w) -> std::string {
    auto pg = connect_process_group("env://", rank, w, opts(milliseconds(3000)));
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

TEST(Failure, PeerWithWrongTokenOrWorldSizeIsRefused) {
  auto reports = testing::run_ranks_independent(2, [](int rank, int w) -> std::string {
    ProcessGroupOptions o = opts(milliseconds(1500));
    if (rank == 1) o.token = "not-the-job-token";
    return outcome([&] { connect_process_group("env://", rank, w, o); });
  });
  SCOPED_TRACE(reports[0].text + " | " + reports[1].text);
  EXPECT_EQ(reports[1].text.rfind("HandshakeError", 0), 0u);
  EXPECT_NE(reports[1].text.find("token"), std::string::npos);
  EXPECT_EQ(reports[0].text.rfind("TimeoutError", 0), 0u);  // rank 0 waited for a rank that never joined

  auto sizes = testing::run_ranks_independent(2, [](int rank, int w) -> std::string {
    // Rank 1 believes the world has 3 ranks; store keys still line up for ranks 0 and 1.
    return outcome([&] { connect_process_group("env://", rank, rank == 1 ? 3 : 2, opts(milliseconds(1500))); });
  });
  SCOPED_TRACE(sizes[0].text + " | " + sizes[1].text);
  EXPECT_EQ(sizes[0].text.rfind("HandshakeError", 0), 0u);
  EXPECT_NE(sizes[0].text.find("world size"), std::string::npos);
  EXPECT_NE(sizes[1].text.find("world size"), std::string::npos);
}

TEST(Failure, TimedWaitHonoursItsTimeoutWhileTheOperationGoesOn) {
  auto reports = testing::run_ranks_independent(2, [](int rank, int w) -> std::string {
    auto pg = connect_process_group("env://", rank, w, opts(milliseconds(5000)));
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

TEST(Failure, ShutdownWhileAnotherThreadRunsAnOperationInlineReturns) {
  auto reports = testing::run_ranks_independent(2, [](int rank, int w) -> std::string {
    auto pg = connect_process_group("env://", rank, w, opts(milliseconds(5000)));
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

}  // namespace
}  // namespace chorus
