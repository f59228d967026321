// Seeing preemption and shutdown signals from the training loop.
//
// Slurm sends SIGUSR1 or SIGTERM before it preempts a job, and `chorus run` forwards SIGINT,
// SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 to every worker. watch_signals() installs handlers that only
// record the signal (async-signal-safe); the loop polls pending_signal() between steps and, for
// example, writes a final checkpoint and exits:
//
//   chorus::watch_signals();
//   for (...) {
//     train_step();
//     if (int sig = chorus::pending_signal()) { save_checkpoint(...); return 0; }
//   }
#pragma once

#include <exception>
#include <initializer_list>
#include <string>

namespace chorus {

// Installs recording handlers for the given signals (default: SIGINT, SIGTERM, SIGHUP, SIGUSR1,
// SIGUSR2). Idempotent.
void watch_signals();
void watch_signals(std::initializer_list<int> signals);
// The most recent watched signal received, or 0. Does not clear it.
int pending_signal();
// Clears the recorded signal (e.g. after handling a SIGUSR1 that asked only for a checkpoint).
void clear_pending_signal();

// From here on an uncaught exception is recorded in `path` as by record_fatal_error before the
// process aborts, so the launcher's report can show it; `rank` is the record's rank (-1: null).
// chorus run names the file in CHORUS_ERROR_FILE: connect_process_group (and so
// init_process_group) installs it from there (Rendezvous::error_file), and so does run_job before
// the training function runs. A program that fails before either records nothing and is
// reported by its exit status.
void install_error_file_handler(const char* path, int rank = -1);

// Records `error` as the one that ends this process, in the error file installed above (nothing
// when none is): JSON {"message", "type", "relayed", "rank", "pid", "time"}, written atomically.
// relayed is true for a PeerError: this rank failed because another one did (it died, left or
// broke the group), so the launcher looks past it for the root cause. time is the wall clock in
// seconds (microseconds resolution), to order the ranks' failures. `message` replaces
// error.what() when not empty (e.g. without a backtrace). Only the first call in a process writes.
// A program that catches its errors at the top level and exits non-zero calls this first:
//
//   try { train(); } catch (const std::exception& e) { chorus::record_fatal_error(e); return 1; }
void record_fatal_error(const std::exception& error, const std::string& message = {});

}  // namespace chorus
