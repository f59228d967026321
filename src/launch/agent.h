// The per-node agent of `chorus run` (launcher.cc: the options check, the meeting of the nodes and
// the loop over attempts or elastic rounds; attempt.cc: one attempt, which starts this node's
// workers and watches them until they succeed, one fails, or the round ends). Internal to
// chorus_launch.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "chorus/comm/supervisor.h"
#include "chorus/comm/tcp_store.h"
#include "chorus/launch/launcher.h"
#include "elastic.h"
#include "options.h"
#include "worker.h"

namespace chorus::launch::detail {

// The launcher's self-pipe: the signal handler writes each forwarded signal's number to [1].
extern int g_signal_pipe[2];

// How an attempt ended when it did not succeed.
struct Failure {
  bool happened = false;
  bool membership = false;  // elastic: not a failure but the round's end (a node joins or left)
  std::string report;  // "rank 3 (local rank 1 on host h, pid 42): exit code 7\n  message: ..."
};

// One node's agent: run() checks the options, meets the other nodes, then runs attempts (or
// elastic rounds) until the job succeeds, the restarts are spent, or a signal stops it; it returns
// the launcher's exit status. Not thread-safe; one per launcher process.
class Agent {
 public:
  explicit Agent(const LaunchOptions& o) : o_(o), node_rank_(o.node_rank) {}
  ~Agent();  // removes the scratch directory
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  int run();

 private:
  bool elastic() const { return o_.max_nodes > 0; }
  bool multi_node() const { return elastic() || o_.nnodes > 1; }
  std::string nnodes_text() const {
    return elastic() ? std::to_string(o_.nnodes) + ":" + std::to_string(o_.max_nodes) : std::to_string(o_.nnodes);
  }
  static std::chrono::milliseconds millis(double seconds) {
    return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  }

  // A stop signal that arrived while no worker runs (between rounds); SIGUSR1/2 are dropped then.
  bool stop_requested();

  // Elastic: meet the other nodes in a round, run it, and re-form after a failure (while restarts
  // are left) or a membership change (always), until the job succeeds.
  int run_elastic();

  void validate();

  void rendezvous();

  // MASTER_PORT for the workers: a port of its own for PyTorch's env:// TCPStore, which rank 0
  // opens on MASTER_ADDR (the store host's machine, where rank 0 runs), so that a Python script's
  // init_process_group("gloo" or "chorus") does not collide with chorus's store. The store host
  // picks it; the other nodes read it from the store. chorus's own env:// rendezvous goes to
  // CHORUS_STORE_ADDR/PORT instead.
  void share_torch_port(std::chrono::milliseconds timeout);

  void finish_ok();

  void wait_for_nodes(int attempt);

  // The worker's environment: this launcher's, plus the rank layout, the rendezvous and this attempt.
  std::vector<std::string> worker_environment(const Worker& w, int attempt) const;

  void start(Worker& w, int attempt);
  std::vector<Worker> make_workers() const;

  // Waits for a signal, a worker's exit or output, or the supervisor's next deadline (100 ms at most).
  static void wait_for_events(const std::vector<Worker>& ws, const Supervisor& supervisor);

  // Passes the signals the launcher received on to the workers; any but SIGUSR1/2 stops the job.
  void forward_signals(std::vector<Worker>& ws, Supervisor& supervisor);

  // Copies the workers' output, reaps those that exited and reports each to the supervisor;
  // returns how many it reaped.
  static size_t reap_exited(std::vector<Worker>& ws, Supervisor& supervisor);

  // A worker writes its error record before it exits, and its teardown may take longer than the
  // failure window: a record of a worker still running counts too. (Read only while a failure is
  // being decided: no file reads per worker per poll in a healthy job.)
  static void read_running_records(std::vector<Worker>& ws, Supervisor& supervisor);

  // Whether another node has reported this attempt's failure under `failed_key`.
  void check_other_nodes(const std::string& failed_key, Failure* failure, Supervisor& supervisor);

  // Decided here: name the root cause, and tell the other nodes.
  void announce_failure(const std::vector<Worker>& ws, const Supervisor& supervisor, const std::string& failed_key,
                        Failure* failure);

  // Elastic: whether the round goes on. A failure elsewhere terminates the workers as a remote
  // failure; a membership change stops them as a signal does (SIGTERM, then SIGKILL after the
  // grace period), so that they can save their state.
  void check_round(std::vector<Worker>& ws, Failure* failure, Supervisor& supervisor);

  Failure run_attempt(int attempt);
  std::chrono::milliseconds grace() const {
    return std::chrono::milliseconds(static_cast<int64_t>(o_.grace_period_s * 1000));
  }

  LaunchOptions o_;
  std::string program_path_;
  int nproc_ = 1;
  int world_ = 0;
  int offset_ = 0;
  std::string master_addr_;
  int master_port_ = -1;
  int torch_port_ = -1;  // MASTER_PORT for the workers (share_torch_port)
  std::string token_;
  std::string scratch_;
  std::unique_ptr<TcpStoreServer> server_;
  std::shared_ptr<TcpStore> store_;
  int node_rank_ = 0;       // o_.node_rank, or the elastic round's
  bool store_host_ = false; // elastic: this launcher hosts the store
  std::string host_error_;  // elastic: why it does not
  std::unique_ptr<ElasticRendezvous> rdzv_;
  RoundPlan plan_;
  int stop_signal_ = 0;
};

}  // namespace chorus::launch::detail
