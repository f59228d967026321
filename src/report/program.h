// Internal to chorus_report: runs a program as a child process with a deadline.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace chorus::report::detail {

struct ProgramResult {
  int exit_code = -1;  // -1 when killed by a signal
  int signal = 0;      // 0 when it exited
  std::string out;     // its standard output
  std::string err;     // its standard error (the first 64 KiB)
};

// Runs argv[0] (searched in PATH when it has no '/') with argv, standard input /dev/null, and
// collects its output. Throws chorus::Error when it cannot start (the system's reason, e.g. "No
// such file or directory"), chorus::TimeoutError when it runs past `timeout`: it is then
// SIGKILLed and reaped, and the message carries what it wrote to stderr so far. Safe to call from
// any thread; the child gets no other descriptors of ours (posix_spawn, pipes O_CLOEXEC).
ProgramResult run_program(const std::vector<std::string>& argv, std::chrono::milliseconds timeout);

// "exit code 3" or "killed by SIGSEGV".
std::string describe_exit(const ProgramResult& result);

}  // namespace chorus::report::detail
