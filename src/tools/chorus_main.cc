// The `chorus` command: `chorus run ...` (the launcher) and `chorus bench ...`.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

#include "bench.h"
#include "chorus/comm/error.h"
#include "chorus/config.h"
#include "chorus/launch/launcher.h"

int main(int argc, char** argv) {
  CLI::App app{"chorus: distributed data-parallel training for libtorch"};
  app.set_version_flag("--version", std::string(CHORUS_VERSION));
  app.require_subcommand(1);

  chorus::launch::LaunchOptions launch;
  CLI::App* run = app.add_subcommand("run", "start a job's workers on this node (like torchrun)");
  run->prefix_command();  // everything from PROGRAM on belongs to the program
  run->add_option("-n,--nproc-per-node", launch.nproc_per_node, "workers on this node: a number or 'auto' (one per core)");
  run->add_option("--nnodes", launch.nnodes, "number of nodes");
  run->add_option("--node-rank", launch.node_rank, "this node's rank in [0, nnodes)");
  run->add_option("--rdzv-endpoint", launch.rdzv_endpoint, "HOST:PORT of node 0's rendezvous store");
  run->add_option("--master-addr", launch.master_addr, "node 0's address (with --master-port)");
  run->add_option("--master-port", launch.master_port, "node 0's store port");
  run->add_option("--max-restarts", launch.max_restarts, "restart the whole group this many times after a failure");
  run->add_option("--log-dir", launch.log_dir, "write one log per rank here (rank_N.log)");
  run->add_flag("--tee", launch.tee, "prefix every output line with [rank N] (and log it with --log-dir)");
  run->add_option("--grace-period", launch.grace_period_s, "seconds between SIGTERM and SIGKILL when stopping workers");
  run->add_option("--rdzv-timeout", launch.rdzv_timeout_s, "seconds to wait for the store and the other nodes");
  run->add_option("--token", launch.token, "job token (default: CHORUS_JOB_TOKEN, else --token-file, else a fresh one on one node)");
  run->add_option("--token-file", launch.token_file, "file holding the job token, readable only by you (or CHORUS_JOB_TOKEN_FILE); needed with --nnodes > 1");

  chorus::tools::BenchArgs bench;
  CLI::App* b = app.add_subcommand("bench", "measure a collective on W local ranks");
  chorus::tools::add_bench_options(*b, bench);
  CLI11_PARSE(app, argc, argv);
  try {
    if (run->parsed()) {
      launch.program = run->remaining();
      return chorus::launch::run(launch);
    }
    if (b->parsed()) return chorus::tools::run_bench(bench);
  } catch (const chorus::UsageError& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "chorus: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
