// chorus::spawn: run a function in N local processes, like torch.multiprocessing.spawn.
//
// The parent hosts a TcpStore server on a port the kernel picks and forks N children. Child i runs
// fn(i, nprocs) with the environment that init_process_group("env://") reads already set
// (MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE, CHORUS_JOB_TOKEN, CHORUS_STORE_EXTERNAL).
// A child that returns exits 0; one that throws writes the exception's message back to the parent
// and exits 1. When any child fails, the others get SIGTERM, then SIGKILL after the grace period,
// and spawn() throws SpawnError naming the rank that failed first on an error of its own (a
// PeerError only relays another rank's failure; a rank killed by a signal comes first), how (exit
// code or signal) and its message, then the other ranks that failed. Call spawn() from a process with no other threads running user work: fork() copies
// only the calling thread.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/comm/random.h"  // random_token, declared here before it had a header of its own

namespace chorus {

struct SpawnOptions {
  // Whole-job deadline; 0 = none. On expiry every child is ended and SpawnError is thrown.
  std::chrono::milliseconds timeout{0};
  // Time between SIGTERM and SIGKILL when ending the others after a failure.
  std::chrono::milliseconds grace_period{3000};
  // Job token for the store handshake; "" = a fresh random one.
  std::string token;
};

struct SpawnFailure {
  int rank = -1;
  int exit_code = -1;  // -1 when killed by a signal
  int signal = 0;      // 0 when it exited
  std::string message; // the child's exception text, if it sent one
};

class SpawnError : public Error {
 public:
  SpawnError(const std::string& what, SpawnFailure first) : Error(what), first_(std::move(first)) {}
  const SpawnFailure& first_failure() const { return first_; }

 private:
  SpawnFailure first_;
};

void spawn(int nprocs, const std::function<void(int rank, int world_size)>& fn,
           const SpawnOptions& options = {});


}  // namespace chorus
