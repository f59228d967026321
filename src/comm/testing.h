// Internal test helpers: run a function on W ranks as forked processes with a shared store.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/comm/spawn.h"
#include "chorus/comm/store.h"

namespace chorus::testing {

// Runs fn(rank, world, store) in `world` forked processes (via chorus::spawn) and returns "" when
// all succeeded, else the SpawnError text. Each child connects its own TcpStore client.
std::string run_ranks(int world,
                      const std::function<void(int rank, int world, std::shared_ptr<Store> store)>& fn,
                      std::chrono::milliseconds job_timeout = std::chrono::seconds(60));

// Like run_ranks, but a failing rank does not end the others: every child runs to its end and
// reports a line of text (fn's return value, or "exception: <what>"). Children that are still
// running at the deadline are killed. Used by failure tests, where one rank dies on purpose.
struct ChildReport {
  int rank = -1;
  bool exited = false;
  int exit_code = -1;
  int signal = 0;
  std::string text;
};
std::vector<ChildReport> run_ranks_independent(int world, const std::function<std::string(int rank, int world)>& fn,
                                               std::chrono::milliseconds deadline = std::chrono::seconds(30));

// Bytes as lowercase hex, two digits each: for comparing encodings with the bytes a format names.
std::string hex(const std::string& bytes);

// A per-test unique name ("chorus-test-<pid>-<counter>").
std::string unique_name(const std::string& stem);

// Runs `command` through /bin/sh and returns its standard output; *status is pclose's result
// (-1 when it could not start). For parity tests that run a Python reference.
std::string run_capture(const std::string& command, int* status);

// The Python that parity tests run: CHORUS_PARITY_PYTHON (e.g. "/usr/bin/python3 -S" to see a
// test skip), else /usr/bin/python3 (Debian's, with python3-torch).
std::string parity_python();

// What the UsageError that fn() throws says, or "(no UsageError)" when it throws none.
template <typename F>
std::string usage_error(F&& fn) {
  try {
    fn();
  } catch (const UsageError& e) {
    return e.what();
  }
  return "(no UsageError)";
}

}  // namespace chorus::testing
