// A worker for the launcher's tests: `launch_probe MODE [ARG]`.
//   env DIR          write DIR/rank_<RANK>.env (the launcher's variables), then allreduce once
//   throw MESSAGE    rank 1 throws an uncaught std::runtime_error(MESSAGE); the others wait
//   exit CODE        rank 1 exits with CODE; the others wait
//   sigkill          rank 1 kills itself with SIGKILL; the others wait
//   caught MESSAGE   ranks >= 2 finish normally; rank 1 throws std::runtime_error(MESSAGE) a moment
//                    later, rank 0 then fails waiting for it (a PeerError); both catch their error
//                    at the top level, record it (chorus::record_fatal_error) and exit 1
//   wait-signal DIR  record the first forwarded signal in DIR/rank_<RANK>.signal, then exit 0
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>

#include "chorus/comm/process_group.h"
#include "chorus/comm/signals.h"

namespace {

int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : -1;
}

void wait_forever() {
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: launch_probe MODE [ARG]\n");
    return 2;
  }
  const std::string mode = argv[1];
  const std::string arg = argc > 2 ? argv[2] : "";
  const int rank = env_int("RANK");
  if (mode == "env") {
    std::ofstream out(arg + "/rank_" + std::to_string(rank) + ".env");
    for (const char* k : {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                          "MASTER_PORT", "CHORUS_STORE_PORT", "CHORUS_RESTART_COUNT", "CHORUS_JOB_TOKEN"}) {
      const char* v = std::getenv(k);
      out << k << "=" << (v ? v : "") << "\n";
    }
    out.close();
    auto pg = chorus::connect_process_group();  // no arguments under chorus run
    int64_t one = 1;
    pg->allreduce(&one, 1, chorus::DataType::kInt64)->wait();
    std::printf("rank %d of %d: allreduce gave %lld\n", pg->rank(), pg->size(), static_cast<long long>(one));
    return one == pg->size() ? 0 : 3;
  }
  if (mode == "throw" || mode == "exit" || mode == "sigkill") {
    auto pg = chorus::connect_process_group();
    pg->barrier()->wait();
    if (rank == 1) {
      if (mode == "throw") throw std::runtime_error(arg);
      if (mode == "exit") std::exit(std::atoi(arg.c_str()));
      ::raise(SIGKILL);
    }
    wait_forever();
  }
  if (mode == "caught") {
    auto pg = chorus::connect_process_group();
    auto pair = pg->new_group({0, 1});
    if (!pair) return 0;
    try {
      pair->barrier()->wait();
      if (rank == 1) {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        throw std::runtime_error(arg);
      }
      pair->barrier()->wait();  // rank 1 never comes
      return 0;
    } catch (const std::exception& e) {
      chorus::record_fatal_error(e);
      std::fprintf(stderr, "launch_probe: rank %d: %s\n", rank, e.what());
      return 1;
    }
  }
  if (mode == "wait-signal") {
    chorus::watch_signals();
    std::ofstream(arg + "/rank_" + std::to_string(rank) + ".ready") << "ready\n";
    while (chorus::pending_signal() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::ofstream(arg + "/rank_" + std::to_string(rank) + ".signal") << chorus::pending_signal() << "\n";
    return 0;
  }
  std::fprintf(stderr, "launch_probe: unknown mode %s\n", mode.c_str());
  return 2;
}
