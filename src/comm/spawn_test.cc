#include "chorus/comm/spawn.h"

#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <string>
#include <cstdlib>
#include <thread>
#include <vector>

#include "chorus/comm/process_group.h"

namespace chorus {
namespace {

using Clock = std::chrono::steady_clock;

TEST(Spawn, RunsEveryRankWithTheEnvironmentForEnvInit) {
  spawn(3, [](int rank, int world) {
    if (std::atoi(std::getenv("RANK")) != rank || std::atoi(std::getenv("WORLD_SIZE")) != world) {
      throw std::runtime_error("wrong RANK/WORLD_SIZE");
    }
    auto pg = connect_process_group();  // env:// from what spawn set
    int64_t v = rank;
    pg->allreduce(&v, 1, DataType::kInt64)->wait();
    if (v != 3) throw std::runtime_error("allreduce under spawn gave " + std::to_string(v));
  });
}

// fork() copies only the calling thread: a lock another thread holds at that moment stays locked
// in the child for ever. spawn's own store server must not run while it forks (it once did, and
// a child hung in OpenSSL's random generator, locked by the server mid-handshake with an earlier
// child). Counted at each fork by a pthread_atfork handler: no more than this test process had before.
std::atomic<int> g_most_threads_at_fork{0};

int thread_count() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

void count_threads_at_fork() { g_most_threads_at_fork = std::max(g_most_threads_at_fork.load(), thread_count()); }

TEST(Spawn, ForksWhileNoOtherThreadRuns) {
  static const int registered = ::pthread_atfork(count_threads_at_fork, nullptr, nullptr);
  ASSERT_EQ(registered, 0);
  g_most_threads_at_fork = 0;
  const int before = thread_count();  // 1, or 2 under ThreadSanitizer (its own thread)
  spawn(4, [](int rank, int) {
    auto pg = connect_process_group();
    int64_t v = rank;
    pg->allreduce(&v, 1, DataType::kInt64)->wait();
    if (v != 6) throw std::runtime_error("allreduce gave " + std::to_string(v));
  });
  EXPECT_EQ(g_most_threads_at_fork.load(), before);
}

// A rank is a fork without exec: it must not keep the descriptors spawn holds for the ranks
// forked before it (their message pipes and pidfds), or a rank's descriptors grow with its
// number. Every rank counts its own before it connects: all the same.
TEST(Spawn, EveryRankHoldsTheSameDescriptorsWhateverItsNumber) {
  spawn(5, [](int, int world) {
    int fds = 0;
    for (int fd = 0; fd < 4096; ++fd) fds += ::fcntl(fd, F_GETFD) != -1 ? 1 : 0;
    auto pg = connect_process_group();
    std::vector<int64_t> all(static_cast<size_t>(world), 0);
    all[static_cast<size_t>(pg->rank())] = fds;
    pg->allreduce(all.data(), all.size(), DataType::kInt64)->wait();
    if (*std::min_element(all.begin(), all.end()) != *std::max_element(all.begin(), all.end())) {
      std::string seen;
      for (int64_t n : all) seen += " " + std::to_string(n);
      throw std::runtime_error("descriptors per rank before connecting:" + seen);
    }
  });
}

TEST(Spawn, FailingRankIsReportedAndTheOthersAreEnded) {
  auto t0 = Clock::now();
  try {
    SpawnOptions o;
    o.grace_period = std::chrono::milliseconds(300);
    spawn(3, [](int rank, int) {
      if (rank == 2) throw std::runtime_error("bad batch at step 7");
      std::this_thread::sleep_for(std::chrono::seconds(60));  // must be ended, not awaited
    }, o);
    FAIL() << "spawn should have thrown";
  } catch (const SpawnError& e) {
    EXPECT_EQ(e.first_failure().rank, 2);
    EXPECT_EQ(e.first_failure().exit_code, 1);
    EXPECT_NE(std::string(e.what()).find("rank 2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("bad batch at step 7"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 0: killed by SIGTERM (ended by spawn)"), std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 10.0);
}

TEST(Spawn, KilledRankIsReportedWithItsSignal) {
  try {
    spawn(2, [](int rank, int) {
      if (rank == 0) ::raise(SIGKILL);
      std::this_thread::sleep_for(std::chrono::seconds(60));
    });
    FAIL() << "spawn should have thrown";
  } catch (const SpawnError& e) {
    EXPECT_EQ(e.first_failure().rank, 0);
    EXPECT_EQ(e.first_failure().signal, SIGKILL);
    EXPECT_NE(std::string(e.what()).find("SIGKILL"), std::string::npos) << e.what();
  }
}

TEST(Spawn, TheRankThatDiedIsBlamedNotThePeersThatReportedIt) {
  for (int trial = 0; trial < 5; ++trial) {
    try {
      spawn(4, [](int rank, int world) {
        ProcessGroupOptions o;
        o.timeout = std::chrono::seconds(5);
        auto pg = connect_process_group("env://", rank, world, o);
        pg->barrier()->wait();
        if (rank == 3) ::raise(SIGKILL);
        float x = 1;
        pg->allreduce(&x, 1, DataType::kFloat32)->wait();  // the others fail fast with PeerError
      });
      FAIL() << "spawn should have thrown";
    } catch (const SpawnError& e) {
      EXPECT_EQ(e.first_failure().rank, 3) << e.what();
      EXPECT_EQ(e.first_failure().signal, SIGKILL) << e.what();
    }
  }
}

TEST(Spawn, AnOwnErrorIsBlamedNotTheRelayedErrorsOfLowerRanks) {
  for (int trial = 0; trial < 3; ++trial) {
    try {
      spawn(3, [](int rank, int world) {
        ProcessGroupOptions o;
        o.timeout = std::chrono::seconds(5);
        auto pg = connect_process_group("env://", rank, world, o);
        pg->barrier()->wait();
        if (rank == 2) throw std::runtime_error("bad batch at step 7");
        pg->barrier()->wait();  // ranks 0 and 1 fail with a PeerError: rank 2 is gone
      });
      FAIL() << "spawn should have thrown";
    } catch (const SpawnError& e) {
      EXPECT_EQ(e.first_failure().rank, 2) << e.what();
      EXPECT_EQ(e.first_failure().message, "bad batch at step 7") << e.what();
      EXPECT_NE(std::string(e.what()).find("rank 0: exit code 1, failed because another rank did"),
                std::string::npos) << e.what();
    }
  }
}

TEST(Spawn, ARankThatFinishedIsSaidToHaveFinished) {
  try {
    spawn(2, [](int rank, int) {
      if (rank == 0) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      throw std::runtime_error("late failure");
    });
    FAIL() << "spawn should have thrown";
  } catch (const SpawnError& e) {
    EXPECT_EQ(e.first_failure().rank, 1) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 0: finished normally (exit code 0)"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("ended"), std::string::npos) << e.what();
  }
}

TEST(Spawn, JobTimeoutEndsEveryone) {
  SpawnOptions o;
  o.timeout = std::chrono::milliseconds(300);
  o.grace_period = std::chrono::milliseconds(200);
  try {
    spawn(2, [](int, int) { std::this_thread::sleep_for(std::chrono::seconds(60)); }, o);
    FAIL() << "spawn should have thrown";
  } catch (const SpawnError& e) {
    EXPECT_NE(std::string(e.what()).find("did not finish"), std::string::npos) << e.what();
  }
}

TEST(Spawn, RejectsZeroProcesses) {
  EXPECT_THROW(spawn(0, [](int, int) {}), UsageError);
}

}  // namespace
}  // namespace chorus
