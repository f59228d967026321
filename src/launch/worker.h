// Internal to chorus_launch: one worker process of `chorus run`, from fork to the report of how it
// ended. start_worker forks and execs the program with the environment the launcher built, pinned
// to a CPU when asked, its output piped to the launcher or sent to its log; pump_output copies
// piped output a line at a time; the error record a worker leaves (chorus::record_fatal_error) is
// read back for the root-cause report. The Agent in launcher.cc decides when to start, signal and
// give up on workers (with chorus::Supervisor).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <csignal>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "options.h"

namespace chorus::launch::detail {

using Clock = std::chrono::steady_clock;

// What chorus run forwards to its workers; a worker starts with their default actions.
inline constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2};

// What a worker recorded about the error that ended it (chorus::record_fatal_error).
struct ErrorRecord {
  bool present = false;
  std::string message;
  bool relayed = false;  // a PeerError: it failed because another rank did
  double time = 0;       // wall clock, seconds
};
// "" fields and present == false when the file is missing or cut short.
ErrorRecord read_error_record(const std::string& path);

struct Worker {
  int local_rank = 0;
  int rank = 0;
  pid_t pid = -1;
  int pidfd = -1;
  Output output = Output::kTerminal;  // output_for(): the terminal, prefixed through the launcher, or the log
  int out_fd = -1;  // read end of the output pipe (Output::kPrefixed, or kTerminal with --log-dir)
  std::string partial;
  std::unique_ptr<std::ofstream> log;  // output read through out_fd also goes here (with --log-dir)
  bool exited = false;
  int status = 0;
  Clock::time_point exit_seen;  // when the launcher reaped it
  bool record_seen = false;     // its error record was read while it still ran
  std::string error_file;
  std::string log_path;
};

// How start_worker runs the program.
struct WorkerLaunch {
  std::string program_path;       // as resolved on PATH
  std::vector<std::string> argv;  // argv[0] as the user wrote it
  std::vector<std::string> env;   // NAME=VALUE: the whole environment of the worker
  bool bind_cpu = false;          // pin the worker to the local_rank-th CPU this process may use
  int local_world = 1;            // workers on this node (with bind_cpu: more than CPUs means no pinning)
};

// Forks and execs w's program, its output sent as w.output says; sets w.pid, w.pidfd and, when its
// output is piped, w.out_fd (and w.log with --log-dir). Throws Error when the pipe or the fork fails; a failed exec is the
// worker's exit code 127.
void start_worker(Worker& w, const WorkerLaunch& how);
// Copies a worker's output to ours, a line at a time (prefixed "[rankN]:" for Output::kPrefixed).
void pump_output(Worker& w, bool flush_partial);
// "exit code 7", "killed by SIGKILL", "finished normally (exit code 0)", ...
std::string how_it_ended(const Worker& w);
// The root cause, then one line for every other rank of this node that failed or finished.
std::string describe_failure(const std::vector<Worker>& ws, const Worker& root);
void signal_all(std::vector<Worker>& ws, int sig);

std::string signal_name(int sig);  // "SIGTERM"
std::string host_name();
// The local_rank-th CPU this process may run on, or -1 (with a warning, once) when the node's
// local_world ranks outnumber those CPUs: then no rank is pinned.
int cpu_for_local_rank(int local_rank, int local_world);

}  // namespace chorus::launch::detail
