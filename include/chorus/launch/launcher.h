// `chorus run`: start a job's worker processes on this node and watch them.
//
// One launcher runs per node. On one node it hosts the rendezvous store itself on a port the
// kernel picks; across nodes, node 0's launcher hosts it at --rdzv-endpoint and the others join.
// Workers get the environment torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
// GROUP_RANK, MASTER_ADDR, MASTER_PORT) plus CHORUS_RESTART_COUNT, CHORUS_JOB_TOKEN,
// CHORUS_STORE_EXTERNAL, CHORUS_STORE_PREFIX (one key space per attempt) and CHORUS_ERROR_FILE.
//
// Failure: when a worker exits non-zero or by a signal, the others get SIGTERM, then SIGKILL after
// the grace period, on every node; the launcher restarts the whole group up to max_restarts times,
// else exits non-zero with a root-cause report: the rank that failed first on an error of its own,
// chosen by the workers' error records (chorus::record_fatal_error: time, and whether the error
// was relayed from another rank), with its host, exit code or signal and message, then how this
// node's other workers ended. SIGINT, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 sent to the launcher
// are forwarded to every worker. A launcher killed by SIGKILL leaves its scratch directory in
// /tmp; the next launcher removes it.
//
// Elastic (max_nodes > 0, `--nnodes MIN:MAX`): node ranks are not given but assigned in
// rendezvous rounds; the launcher that can listen on --rdzv-endpoint's address hosts the store and
// is node 0. A failure (a node that died among them), a node that asks to join while there is
// room, or a node whose launcher was stopped ends the round: every node stops its workers (SIGTERM,
// so a program can save its state) and the job re-forms with the nodes that are there (MIN at
// least), with new ranks and world size. Failures count against max_restarts; membership changes
// do not. docs/elastic.md.
#pragma once

#include <string>
#include <vector>

namespace chorus::launch {

struct LaunchOptions {
  std::string nproc_per_node = "1";  // a number or "auto" (one per core)
  int nnodes = 1;                    // the node count; elastic: the fewest nodes the job runs on
  int max_nodes = 0;                 // elastic: the most nodes (>= nnodes); 0: not elastic
  double rdzv_last_call_s = 5.0;     // elastic: a round with MIN nodes waits this long for more, in [0, 3600]
  int node_rank = 0;                 // fixed node counts only (elastic jobs assign node ranks)
  std::string rdzv_endpoint;         // HOST:PORT of node 0's store (required with nnodes > 1)
  std::string master_addr;           // alternative to rdzv_endpoint: address ...
  int master_port = -1;              // ... and port, in [1, 65535] (-1: none)
  int max_restarts = 0;
  std::string log_dir;               // one log per rank: <log_dir>/rank_<N>.log; rank 0 stays on the terminal too
  bool tee = false;                  // every rank's output, each line prefixed "[rankN]:" (and logged)
  std::string ranks_filter;          // "0,2-3": only these ranks' output on the terminal, prefixed "[rankN]:"
  std::string local_ranks_filter;    // the same by local rank (torchrun's --local-ranks-filter)
  bool bind_cpu = false;             // pin local rank r to the r-th CPU the launcher may run on (when they fit)
  double grace_period_s = 5.0;       // SIGTERM to SIGKILL, finite, in [0, 3600]
  double rdzv_timeout_s = 60.0;      // waiting for the store and for the other nodes, finite, > 0
  std::string token;                 // job token; default CHORUS_JOB_TOKEN, else token_file, else fresh (one node only)
  std::string token_file;            // file holding the job token (only the user may read it); or CHORUS_JOB_TOKEN_FILE
  std::vector<std::string> program;  // the program and its arguments
};

// Runs the job; returns the launcher's exit code (0 on success). Throws UsageError for bad
// options, TimeoutError when the rendezvous endpoint cannot be reached in time.
int run(const LaunchOptions& options);

// Sets options->nnodes from --nnodes' text "N", or nnodes and max_nodes from "MIN:MAX" (elastic);
// throws UsageError naming the text otherwise.
void parse_nnodes(const std::string& text, LaunchOptions* options);

// Parses "HOST:PORT" ("[v6]:PORT" too); throws UsageError naming the text otherwise.
void parse_endpoint(const std::string& text, std::string* host, int* port);

}  // namespace chorus::launch
