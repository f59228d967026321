// The supervision policy without processes: exit reports and a clock in, signals and the root
// cause out.
#include "chorus/comm/supervisor.h"

#include <gtest/gtest.h>

#include <chrono>
#include <csignal>

namespace chorus {
namespace {

using namespace std::chrono_literals;
using Clock = Supervisor::Clock;
using Send = Supervisor::Send;

ExitReport exited(int rank, int code) {
  ExitReport e;
  e.rank = rank;
  e.exit_code = code;
  return e;
}
ExitReport killed(int rank, int sig) {
  ExitReport e;
  e.rank = rank;
  e.signal = sig;
  return e;
}
ExitReport recorded(int rank, bool relayed, double at) {
  ExitReport e = exited(rank, 1);
  e.recorded = true;
  e.relayed = relayed;
  e.recorded_at = at;
  return e;
}

Supervisor::Options options(std::chrono::milliseconds timeout = 0ms) {
  Supervisor::Options o;
  o.failure_window = 100ms;
  o.grace_period = 3000ms;
  o.timeout = timeout;
  return o;
}

TEST(RootCause, NobodyFailedIsMinusOne) {
  EXPECT_EQ(root_cause({}), -1);
  EXPECT_EQ(root_cause({exited(0, 0), exited(1, 0)}), -1);
}

TEST(RootCause, AnOwnRecordBeatsASignalAnExitCodeAndRelayedRecords) {
  // Seen in this order; the own record is the cause whatever its position.
  EXPECT_EQ(root_cause({recorded(0, true, 1.0), killed(1, SIGKILL), exited(2, 3), recorded(3, false, 9.0)}), 3);
}

TEST(RootCause, TheEarliestOwnRecordWinsNotTheFirstSeen) {
  EXPECT_EQ(root_cause({recorded(0, false, 5.0), recorded(1, false, 2.0), recorded(2, false, 3.0)}), 1);
}

TEST(RootCause, ASignalBeatsAnExitCodeAndARelayedRecord) {
  // A rank killed by the OOM killer: the peers' PeerErrors only relay it.
  EXPECT_EQ(root_cause({recorded(0, true, 1.0), recorded(2, true, 1.1), exited(3, 1), killed(1, SIGKILL)}), 3);
}

TEST(RootCause, WithoutRecordsTheFirstExitSeenWins) {
  EXPECT_EQ(root_cause({exited(0, 0), exited(2, 7), exited(1, 1)}), 1);
}

TEST(RootCause, RelayedRecordsAloneNameTheEarliest) {
  EXPECT_EQ(root_cause({recorded(0, true, 4.0), recorded(1, true, 3.5)}), 1);
}

TEST(Supervisor, AFailureIsDecidedAfterTheWindowThenTermThenKillAfterTheGrace) {
  const auto t0 = Clock::now();
  Supervisor s(options(), t0);
  EXPECT_EQ(s.step(t0, 3), Send::kNothing);
  EXPECT_EQ(s.next_wakeup(), Clock::time_point::max());
  s.on_exit(recorded(1, true, 2.0), t0 + 10ms);  // a peer reports first
  EXPECT_EQ(s.step(t0 + 10ms, 2), Send::kNothing);
  EXPECT_EQ(s.next_wakeup(), t0 + 110ms);
  EXPECT_FALSE(s.failure_decided());
  EXPECT_TRUE(s.deciding());
  s.on_exit(killed(0, SIGKILL), t0 + 50ms);  // the real cause, reaped later
  EXPECT_EQ(s.step(t0 + 109ms, 1), Send::kNothing);
  EXPECT_EQ(s.step(t0 + 110ms, 1), Send::kTerminate);
  EXPECT_TRUE(s.failure_decided());
  EXPECT_FALSE(s.deciding());
  EXPECT_EQ(s.root_cause_rank(), 0);
  EXPECT_EQ(s.next_wakeup(), t0 + 3110ms);
  EXPECT_EQ(s.step(t0 + 3109ms, 1), Send::kNothing);
  EXPECT_EQ(s.step(t0 + 3110ms, 1), Send::kKill);
  EXPECT_EQ(s.step(t0 + 9000ms, 1), Send::kNothing);  // once
  EXPECT_EQ(s.next_wakeup(), Clock::time_point::max());
}

TEST(Supervisor, WhenNobodyIsLeftTheFailureIsDecidedAtOnce) {
  const auto t0 = Clock::now();
  Supervisor s(options(), t0);
  s.on_exit(exited(0, 0), t0);
  s.on_exit(exited(1, 2), t0 + 1ms);
  EXPECT_EQ(s.step(t0 + 1ms, 0), Send::kNothing);  // nobody to signal
  EXPECT_TRUE(s.failure_decided());
  EXPECT_EQ(s.root_cause_rank(), 1);
}

// The failing rank wrote its record but is still tearing down when the window closes; a peer
// that relayed the failure has exited: the record names the cause.
TEST(Supervisor, ARecordOfAProcessStillRunningCounts) {
  const auto t0 = Clock::now();
  Supervisor s(options(), t0);
  ExitReport own = recorded(1, false, 1.0);
  s.on_record(own, t0);  // opens the window
  EXPECT_EQ(s.next_wakeup(), t0 + 100ms);
  s.on_exit(recorded(0, true, 1.5), t0 + 20ms);
  EXPECT_EQ(s.step(t0 + 100ms, 1), Send::kTerminate);
  EXPECT_EQ(s.root_cause_rank(), 1);
  s.on_exit(recorded(1, false, 1.0), t0 + 300ms);  // reaped at last: nothing changes
  EXPECT_EQ(s.root_cause_rank(), 1);
}

TEST(Supervisor, ASuccessfulJobDecidesNothing) {
  const auto t0 = Clock::now();
  Supervisor s(options(10s), t0);
  s.on_exit(exited(0, 0), t0 + 1s);
  s.on_exit(exited(1, 0), t0 + 2s);
  EXPECT_EQ(s.step(t0 + 2s, 0), Send::kNothing);
  EXPECT_FALSE(s.failure_decided());
  EXPECT_FALSE(s.timed_out());
  EXPECT_EQ(s.step(t0 + 20s, 0), Send::kNothing);  // the deadline means nothing once all ended
  EXPECT_FALSE(s.timed_out());
}

TEST(Supervisor, TheJobDeadlineTerminatesWithNoRootCause) {
  const auto t0 = Clock::now();
  Supervisor s(options(5s), t0);
  EXPECT_EQ(s.next_wakeup(), t0 + 5s);
  EXPECT_EQ(s.step(t0 + 4999ms, 2), Send::kNothing);
  EXPECT_EQ(s.step(t0 + 5s, 2), Send::kTerminate);
  EXPECT_TRUE(s.timed_out());
  EXPECT_FALSE(s.failure_decided());
  s.on_exit(killed(0, SIGTERM), t0 + 5100ms);  // ended by us: no failure decided after a timeout
  EXPECT_EQ(s.step(t0 + 5200ms, 1), Send::kNothing);
  EXPECT_FALSE(s.failure_decided());
  EXPECT_EQ(s.step(t0 + 8s, 1), Send::kKill);
}

TEST(Supervisor, AStopDecidesNoFailureAndKillsAfterTheGrace) {
  const auto t0 = Clock::now();
  Supervisor s(options(), t0);
  s.on_stop(t0 + 1s);  // forwarded by the driver; nothing to send now
  EXPECT_EQ(s.step(t0 + 1s, 2), Send::kNothing);
  s.on_exit(exited(0, 1), t0 + 1100ms);  // a rank that fails while stopping is not a failure
  EXPECT_EQ(s.step(t0 + 2s, 1), Send::kNothing);
  EXPECT_FALSE(s.failure_decided());
  EXPECT_TRUE(s.stopping());
  s.on_stop(t0 + 3s);  // a second signal does not push the kill back
  EXPECT_EQ(s.next_wakeup(), t0 + 4s);
  EXPECT_EQ(s.step(t0 + 4s, 1), Send::kKill);
}

TEST(Supervisor, AFailureDecidedElsewhereTerminatesNow) {
  const auto t0 = Clock::now();
  Supervisor s(options(), t0);
  s.on_remote_failure(t0 + 1s);
  EXPECT_EQ(s.next_wakeup(), Clock::time_point::min());
  EXPECT_EQ(s.step(t0 + 1s, 2), Send::kTerminate);
  EXPECT_TRUE(s.failure_decided());
  EXPECT_EQ(s.root_cause_rank(), -1);
  s.on_exit(exited(0, 1), t0 + 1100ms);
  EXPECT_EQ(s.root_cause_rank(), -1);  // still decided elsewhere
  EXPECT_EQ(s.step(t0 + 4s, 1), Send::kKill);
}

}  // namespace
}  // namespace chorus
