// The policy that chorus::spawn and `chorus run` share for watching a job's processes: when a
// failure is decided, which rank is its root cause, and when the others are terminated and then
// killed. Pure: it is fed exit reports, stop requests and the time, and answers what to send; the
// drivers fork, poll, signal and reap. Tested without processes (supervisor_test). docs/supervisor.md.
//
// - A failure (a process that exited non-zero or was killed) is decided `failure_window` after the
//   first one is seen, or at once when no process is left running: peers report a death within a
//   millisecond, often before the dead process is reaped, so the window lets the real cause arrive.
// - Then the root cause is named from structured reports, never from message wording (root_cause),
//   the others get SIGTERM, and SIGKILL `grace_period` later.
// - A job deadline (timeout) ends the job the same way with no root cause.
// - A stop from outside (a signal forwarded to the job) decides no failure; SIGKILL follows after
//   the grace period. A failure decided elsewhere (another node) terminates now, root cause none.
#pragma once

#include <chrono>
#include <vector>

namespace chorus {

// How one process ended, as its supervisor learnt it.
struct ExitReport {
  int rank = -1;
  int exit_code = 0;  // when signal == 0
  int signal = 0;     // the signal that killed it; 0 when it exited
  // What the process recorded about its failure (spawn's error pipe, chorus run's error file).
  bool recorded = false;
  bool relayed = false;      // the record is a PeerError's: it failed because another rank did
  double recorded_at = 0.0;  // the record's wall-clock time in seconds (the ranks share the clock)

  bool failed() const { return signal != 0 || exit_code != 0; }
};

// The index in `exits` (in the order they were seen) of the failed process most likely to be the
// root cause, or -1 when none failed: one that recorded an error of its own (the earliest record),
// then one killed by a signal without a record (nobody in the job sent it: the OOM killer, a
// crash), then one that exited non-zero without a record (the first seen), then one whose record
// is relayed (the earliest). A process that exited 0 is never the cause.
int root_cause(const std::vector<ExitReport>& exits);

class Supervisor {
 public:
  using Clock = std::chrono::steady_clock;
  struct Options {
    std::chrono::milliseconds failure_window{100};
    std::chrono::milliseconds grace_period{3000};  // SIGTERM to SIGKILL
    std::chrono::milliseconds timeout{0};          // the whole job's; 0: none
  };
  enum class Send { kNothing, kTerminate, kKill };

  Supervisor(Options options, Clock::time_point start);

  void on_exit(const ExitReport& report, Clock::time_point now);
  // A process still running recorded its error (it writes the record before it exits, and its
  // teardown may outlast the failure window): it counts for the root cause as if it had exited
  // non-zero with that record, and opens the window as a failed exit does. `report.rank` names it;
  // its exit, when reaped, is reported by on_exit as usual.
  void on_record(const ExitReport& report, Clock::time_point now);
  void on_stop(Clock::time_point now);            // a stop signal, already forwarded to the job
  void on_remote_failure(Clock::time_point now);  // decided elsewhere: terminate, no local cause

  // What to send to the processes still running (`running` of them) at `now`: each of SIGTERM and
  // SIGKILL at most once. Call after every batch of events and whenever next_wakeup() passes.
  Send step(Clock::time_point now, size_t running);
  // When step() next has something to do; Clock::time_point::max() when only an event can change it.
  Clock::time_point next_wakeup() const;

  bool failure_decided() const { return decided_; }
  // A failed exit or a record has opened the window and the failure is not decided yet.
  bool deciding() const { return !decided_ && !timed_out_ && !stopping_ && decide_at_ != Clock::time_point::max(); }
  bool timed_out() const { return timed_out_; }
  bool stopping() const { return stopping_; }
  // The root cause's rank once a failure is decided here (-1: none, or decided elsewhere).
  int root_cause_rank() const { return root_; }
  const std::vector<ExitReport>& exits() const { return exits_; }

 private:
  Options options_;
  Clock::time_point deadline_;  // the job's timeout; max() when none
  Clock::time_point decide_at_ = Clock::time_point::max();
  Clock::time_point kill_at_ = Clock::time_point::max();
  std::vector<ExitReport> exits_;
  std::vector<ExitReport> records_;  // on_record's, of processes not reaped yet
  bool decided_ = false;
  bool timed_out_ = false;
  bool stopping_ = false;
  bool terminate_due_ = false;  // a SIGTERM to send at the next step()
  bool killed_ = false;
  int root_ = -1;
};

}  // namespace chorus
