// `chorus run`: the per-node agent. It checks the options, meets the other nodes' agents at the
// rendezvous store (node ranks, process counts, the job token), then runs attempts: start this
// node's workers (worker.cc), watch them with chorus::Supervisor (exits, error records, a failure
// on another node, forwarded signals), and on a failure stop them, name the root cause and restart
// the group while restarts are left. An elastic job (--nnodes MIN:MAX) meets in rounds instead
// (elastic.cc), and each attempt also ends when the round's membership changes.
#include "chorus/launch/launcher.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include "chorus/comm/error.h"
#include "chorus/comm/files.h"
#include "chorus/comm/rendezvous.h"
#include "chorus/comm/spawn.h"
#include "chorus/comm/supervisor.h"
#include "chorus/comm/tcp_store.h"
#include "elastic.h"
#include "options.h"
#include "worker.h"

extern char** environ;

namespace chorus::launch {
namespace {

// A TCP port that is free on every address of this machine now: the one PyTorch's env:// store
// (rank 0's TCPStore server) listens on in a job that `chorus run` starts, next to chorus's own
// store. The kernel picks it; the window until PyTorch binds it is short.
int free_tcp_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error(std::string("chorus run: socket(): ") + std::strerror(errno));
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok) throw Error(std::string("chorus run: no free TCP port for PyTorch's store: ") + std::strerror(err));
  return ntohs(addr.sin_port);
}

namespace fs = std::filesystem;
using detail::Clock;
using detail::check_options;
using detail::CheckedOptions;
using detail::describe_failure;
using detail::ElasticOptions;
using detail::ElasticRendezvous;
using detail::RoundEnd;
using detail::RoundPlan;
using detail::ErrorRecord;
using detail::host_name;
using detail::make_scratch_dir;
using detail::output_for;
using detail::kForwardedSignals;
using detail::pump_output;
using detail::read_error_record;
using detail::signal_all;
using detail::signal_name;
using detail::start_worker;
using detail::Worker;
using detail::WorkerLaunch;

int g_signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  unsigned char b = static_cast<unsigned char>(sig);
  ssize_t ignored = ::write(g_signal_pipe[1], &b, 1);
  (void)ignored;
}

// Milliseconds from now until `t` for poll(): 0 when past, INT_MAX at most.
int ms_until(Clock::time_point t) {
  const auto now = Clock::now();
  if (t <= now) return 0;
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t - now).count() + 1;
  return ms > INT_MAX ? INT_MAX : static_cast<int>(ms);
}

// How an attempt ended when it did not succeed.
struct Failure {
  bool happened = false;
  bool membership = false;  // elastic: not a failure but the round's end (a node joins or left)
  std::string report;  // "rank 3 (local rank 1 on host h, pid 42): exit code 7\n  message: ..."
};

class Agent {
 public:
  explicit Agent(const LaunchOptions& o) : o_(o), node_rank_(o.node_rank) {}

  int run() {
    validate();
    rendezvous();
    if (elastic()) return run_elastic();
    for (int attempt = 0;; ++attempt) {
      Failure f = run_attempt(attempt);
      if (stop_signal_ != 0) {
        std::fprintf(stderr, "chorus run: stopped by %s after forwarding it to the workers\n",
                     signal_name(stop_signal_).c_str());
        return 128 + stop_signal_;
      }
      if (!f.happened) {
        finish_ok();
        return 0;
      }
      if (attempt < o_.max_restarts) {
        std::fprintf(stderr, "chorus run: attempt %d failed: %s\nchorus run: restarting the group (%d of %d restarts)\n",
                     attempt + 1, f.report.c_str(), attempt + 1, o_.max_restarts);
        continue;
      }
      std::fprintf(stderr,
                   "chorus run: FAILED (%d of %d restarts used)\n  root cause: %s\n", attempt, o_.max_restarts,
                   f.report.c_str());
      return 1;
    }
  }

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
  bool stop_requested() {
    unsigned char sig = 0;
    while (stop_signal_ == 0 && ::read(g_signal_pipe[0], &sig, 1) == 1) {
      if (sig != SIGUSR1 && sig != SIGUSR2) stop_signal_ = sig;
    }
    return stop_signal_ != 0;
  }

  // Elastic: meet the other nodes in a round, run it, and re-form after a failure (while restarts
  // are left) or a membership change (always), until the job succeeds.
  int run_elastic() {
    ElasticOptions eo;
    eo.min_nodes = o_.nnodes;
    eo.max_nodes = o_.max_nodes;
    eo.last_call = millis(o_.rdzv_last_call_s);
    eo.timeout = millis(o_.rdzv_timeout_s);
    rdzv_ = std::make_unique<ElasticRendezvous>(store_, eo);
    const std::string me = host_name() + " pid " + std::to_string(::getpid());
    int failures = 0;
    int previous_rank = -1;
    for (;;) {
      std::optional<RoundPlan> plan = rdzv_->join({me, nproc_, store_host_, previous_rank}, [&] { return stop_requested(); });
      if (!plan) {
        if (stop_signal_ != 0) {
          std::fprintf(stderr, "chorus run: stopped by %s while waiting to join\n", signal_name(stop_signal_).c_str());
          return 128 + stop_signal_;
        }
        const RoundEnd& outcome = rdzv_->finished_reason();
        if (outcome.reason == RoundEnd::Reason::kDone) {
          std::fprintf(stderr, "chorus run: the job finished while this node (%s) waited to join it\n", me.c_str());
          return 0;
        }
        std::fprintf(stderr, "chorus run: the job failed while this node (%s) waited to join it: %s\n", me.c_str(),
                     outcome.detail.c_str());
        return 1;
      }
      plan_ = *plan;
      node_rank_ = previous_rank = plan_.node_rank;
      world_ = plan_.world_size;
      offset_ = plan_.rank_offset;
      std::fprintf(stderr, "chorus run: round %d: %zu node(s), %d worker(s); this is node %d (ranks %d-%d)\n", plan_.round,
                   plan_.nodes.size(), world_, node_rank_, offset_, offset_ + nproc_ - 1);
      const Failure f = run_attempt(plan_.round);
      if (stop_signal_ != 0) {
        try {
          rdzv_->end_round(plan_.round, {RoundEnd::Reason::kMembership, "node " + std::to_string(node_rank_) + " (" + me +
                                                                          ") was stopped by " + signal_name(stop_signal_)});
        } catch (const Error&) {
        }
        std::fprintf(stderr, "chorus run: stopped by %s after forwarding it to the workers\n",
                     signal_name(stop_signal_).c_str());
        return 128 + stop_signal_;
      }
      if (!f.happened) {
        rdzv_->finish(plan_, {RoundEnd::Reason::kDone, ""}, store_host_);
        return 0;
      }
      if (f.membership) {
        std::fprintf(stderr, "chorus run: round %d ended (membership: %s); re-forming the job\n", plan_.round,
                     f.report.c_str());
        continue;
      }
      if (++failures > o_.max_restarts) {
        std::fprintf(stderr, "chorus run: FAILED (%d of %d restarts used)\n  root cause: %s\n", failures - 1,
                     o_.max_restarts, f.report.c_str());
        try {
          rdzv_->finish(plan_, {RoundEnd::Reason::kFailure, "failed after " + std::to_string(failures - 1) + " restarts: " + f.report},
                        store_host_);
        } catch (const Error&) {
        }
        return 1;
      }
      std::fprintf(stderr, "chorus run: round %d failed: %s\nchorus run: re-forming the job (%d of %d restarts)\n",
                   plan_.round, f.report.c_str(), failures, o_.max_restarts);
    }
  }

  void validate() {
    const CheckedOptions checked = check_options(o_);
    program_path_ = checked.program_path;
    nproc_ = checked.nproc;
    master_addr_ = checked.master_addr;
    master_port_ = checked.master_port;
    if (!o_.log_dir.empty()) {
      std::error_code ec;
      fs::create_directories(o_.log_dir, ec);
      if (ec) throw UsageError("chorus run: cannot create --log-dir " + o_.log_dir + ": " + ec.message());
    }
    if ((!o_.ranks_filter.empty() || !o_.local_ranks_filter.empty()) && o_.log_dir.empty()) {
      std::fprintf(stderr, "chorus run: the output of ranks the filter leaves out is discarded; "
                           "add --log-dir DIR to keep every rank's\n");
    }
    scratch_ = make_scratch_dir();
  }

  void rendezvous() {
    token_ = o_.token;
    if (token_.empty()) {
      if (const char* t = std::getenv("CHORUS_JOB_TOKEN")) token_ = t;
    }
    if (token_.empty() && !o_.token_file.empty()) token_ = read_token_file(o_.token_file);
    if (token_.empty()) {
      if (const char* f = std::getenv("CHORUS_JOB_TOKEN_FILE"); f != nullptr && *f != '\0') token_ = read_token_file(f);
    }
    if (token_.empty() && multi_node()) {
      // Anything every node could derive without talking first, a stranger could derive too.
      throw UsageError("chorus run: --nnodes " + nnodes_text() +
                       " needs a job secret shared by every node, or any process that reaches " + master_addr_ + ":" +
                       std::to_string(master_port_) + " could join the job: give every node the same --token-file "
                       "(a file only you can read: openssl rand -hex 16 > ~/.chorus-token && chmod 600 "
                       "~/.chorus-token), --token or CHORUS_JOB_TOKEN");
    }
    if (token_.empty()) token_ = random_token();  // one node: a fresh secret, handed to the workers only
    const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(o_.rdzv_timeout_s * 1000));
    if (elastic()) {
      // The launcher that can listen on the endpoint's address hosts the store (as torchrun's c10d
      // rendezvous does); the others, and a second launcher on that machine, connect to it.
      TcpStoreServerOptions so;
      so.host = master_addr_;
      so.port = master_port_;
      so.token = token_;
      try {
        server_ = std::make_unique<TcpStoreServer>(so);
        store_host_ = true;
      } catch (const Error& e) {
        host_error_ = e.what();
      }
    } else if (o_.node_rank == 0) {
      TcpStoreServerOptions so;
      so.host = o_.nnodes == 1 && master_addr_.empty() ? "127.0.0.1" : "";
      so.port = master_port_ >= 0 ? master_port_ : 0;
      so.token = token_;
      server_ = std::make_unique<TcpStoreServer>(so);
      if (master_addr_.empty()) master_addr_ = "127.0.0.1";
      master_port_ = server_->port();
    }
    TcpStoreOptions co;
    co.host = master_addr_;
    co.port = master_port_;
    co.token = token_;
    co.timeout = timeout;
    co.who = elastic() ? "chorus run (" + host_name() + ")" : "chorus run (node " + std::to_string(o_.node_rank) + ")";
    try {
      store_ = std::make_shared<TcpStore>(co);
    } catch (const TimeoutError& e) {
      throw TimeoutError("chorus run: " + (elastic() ? std::string("this node") : "node " + std::to_string(o_.node_rank)) +
                         " could not reach the rendezvous endpoint " + master_addr_ + ":" +
                         std::to_string(master_port_) + " within " + std::to_string(o_.rdzv_timeout_s) +
                         " s; is node 0's launcher running and the address reachable? (" + e.what() + ")" +
                         (elastic() ? " This launcher does not host the store itself: " + host_error_ : ""));
    }
    share_torch_port(timeout);
    if (elastic()) return;  // node ranks come from the rounds (run_elastic)
    // Claim the node rank, publish this node's process count, learn everyone's.
    const std::string me = host_name() + " pid " + std::to_string(::getpid());
    std::string claimed = store_->compare_set("launch/node/" + std::to_string(o_.node_rank), "", me);
    if (claimed != me) {
      throw UsageError("chorus run: --node-rank " + std::to_string(o_.node_rank) + " is already taken by " + claimed +
                       "; give every node its own --node-rank");
    }
    store_->set("launch/nproc/" + std::to_string(o_.node_rank), std::to_string(nproc_));
    std::vector<std::string> keys;
    for (int n = 0; n < o_.nnodes; ++n) keys.push_back("launch/nproc/" + std::to_string(n));
    try {
      store_->wait(keys, timeout);
    } catch (const TimeoutError& e) {
      throw TimeoutError("chorus run: not every node joined within " + std::to_string(o_.rdzv_timeout_s) +
                         " s (" + e.what() + "); start one `chorus run` per node with its own --node-rank");
    }
    world_ = 0;
    for (int n = 0; n < o_.nnodes; ++n) {
      int count = std::stoi(store_->get(keys[static_cast<size_t>(n)]));
      if (n < o_.node_rank) offset_ += count;
      world_ += count;
    }
  }

  // MASTER_PORT for the workers: a port of its own for PyTorch's env:// TCPStore, which rank 0
  // opens on MASTER_ADDR (the store host's machine, where rank 0 runs), so that a Python script's
  // init_process_group("gloo" or "chorus") does not collide with chorus's store. The store host
  // picks it; the other nodes read it from the store. chorus's own env:// rendezvous goes to
  // CHORUS_STORE_ADDR/PORT instead.
  void share_torch_port(std::chrono::milliseconds timeout) {
    const std::string key = "launch/torch_port";
    if (elastic() ? store_host_ : o_.node_rank == 0) {
      store_->compare_set(key, "", std::to_string(free_tcp_port()));
    }
    store_->wait({key}, timeout);
    torch_port_ = std::stoi(store_->get(key));
  }

  void finish_ok() {
    if (o_.nnodes == 1) return;
    try {
      store_->add("launch/done", 1);
      if (o_.node_rank == 0) {
        // Keep the store up until every node's workers are done (they report failures through it).
        while (store_->add("launch/done", 0) < o_.nnodes) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    } catch (const Error&) {
      // Node 0 has finished and taken the store down; nothing is left to coordinate.
    }
  }

  void wait_for_nodes(int attempt) {
    if (o_.nnodes == 1 || attempt == 0 || elastic()) return;  // an elastic round has met already
    const std::string key = "launch/attempt" + std::to_string(attempt) + "/ready";
    store_->add(key, 1);
    const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o_.rdzv_timeout_s * 1000));
    while (store_->add(key, 0) < o_.nnodes) {
      if (Clock::now() > deadline) throw TimeoutError("chorus run: nodes did not all come back for the restart");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  // The worker's environment: this launcher's, plus the rank layout, the rendezvous and this attempt.
  std::vector<std::string> worker_environment(const Worker& w, int attempt) const {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
    auto put = [&](const std::string& k, const std::string& v) {
      env.erase(std::remove_if(env.begin(), env.end(), [&](const std::string& s) { return s.rfind(k + "=", 0) == 0; }),
                env.end());
      env.push_back(k + "=" + v);
    };
    put("RANK", std::to_string(w.rank));
    put("LOCAL_RANK", std::to_string(w.local_rank));
    put("WORLD_SIZE", std::to_string(world_));
    put("LOCAL_WORLD_SIZE", std::to_string(nproc_));
    put("GROUP_RANK", std::to_string(node_rank_));
    put("MASTER_ADDR", master_addr_);
    put("MASTER_PORT", std::to_string(torch_port_));         // PyTorch's env:// store (share_torch_port)
    put("CHORUS_STORE_ADDR", master_addr_);                  // chorus's own, authenticated store
    put("CHORUS_STORE_PORT", std::to_string(master_port_));
    put("CHORUS_RESTART_COUNT", std::to_string(attempt));
    put("TORCHELASTIC_RESTART_COUNT", std::to_string(attempt));
    put("CHORUS_JOB_TOKEN", token_);
    put("CHORUS_STORE_EXTERNAL", "1");
    put("CHORUS_STORE_PREFIX", "attempt" + std::to_string(attempt));
    put("CHORUS_ERROR_FILE", w.error_file);
    return env;
  }

  void start(Worker& w, int attempt) {
    WorkerLaunch how;
    how.program_path = program_path_;
    how.argv = o_.program;
    how.env = worker_environment(w, attempt);
    how.bind_cpu = o_.bind_cpu;
    how.local_world = nproc_;
    ::unlink(w.error_file.c_str());
    start_worker(w, how);
  }
  std::vector<Worker> make_workers() const {
    std::vector<Worker> ws(static_cast<size_t>(nproc_));
    for (int i = 0; i < nproc_; ++i) {
      Worker& w = ws[static_cast<size_t>(i)];
      w.local_rank = i;
      w.rank = offset_ + i;
      w.error_file = scratch_ + "/error_rank" + std::to_string(w.rank) + ".json";
      if (!o_.log_dir.empty()) w.log_path = o_.log_dir + "/rank_" + std::to_string(w.rank) + ".log";
      w.output = output_for(o_, w.rank, w.local_rank);
    }
    return ws;
  }

  // Waits for a signal, a worker's exit or output, or the supervisor's next deadline (100 ms at most).
  static void wait_for_events(const std::vector<Worker>& ws, const Supervisor& supervisor) {
    std::vector<pollfd> pfds;
    pfds.push_back({g_signal_pipe[0], POLLIN, 0});
    for (const auto& w : ws) {
      if (!w.exited && w.pidfd >= 0) pfds.push_back({w.pidfd, POLLIN, 0});
      if (w.out_fd >= 0) pfds.push_back({w.out_fd, POLLIN, 0});
    }
    ::poll(pfds.data(), pfds.size(), std::min(ms_until(supervisor.next_wakeup()), 100));
  }

  // Passes the signals the launcher received on to the workers; any but SIGUSR1/2 stops the job.
  void forward_signals(std::vector<Worker>& ws, Supervisor& supervisor) {
    unsigned char sig = 0;
    while (::read(g_signal_pipe[0], &sig, 1) == 1) {
      signal_all(ws, sig);
      if (sig != SIGUSR1 && sig != SIGUSR2 && stop_signal_ == 0) {
        stop_signal_ = sig;
        supervisor.on_stop(Clock::now());
      }
    }
  }

  // Copies the workers' output, reaps those that exited and reports each to the supervisor;
  // returns how many it reaped.
  static size_t reap_exited(std::vector<Worker>& ws, Supervisor& supervisor) {
    size_t reaped = 0;
    for (auto& w : ws) {
      pump_output(w, false);
      if (w.exited) continue;
      int status = 0;
      if (::waitpid(w.pid, &status, WNOHANG) != w.pid) continue;
      w.exited = true;
      w.status = status;
      w.exit_seen = Clock::now();
      ++reaped;
      if (w.pidfd >= 0) {
        ::close(w.pidfd);
        w.pidfd = -1;
      }
      // The record is renamed into place before the worker exits: complete when it is reaped.
      const ErrorRecord rec = read_error_record(w.error_file);
      ExitReport r;
      r.rank = w.rank;
      r.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
      r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      r.recorded = rec.present;
      r.relayed = rec.relayed;
      r.recorded_at = rec.time;
      supervisor.on_exit(r, w.exit_seen);
    }
    return reaped;
  }

  // A worker writes its error record before it exits, and its teardown may take longer than the
  // failure window: a record of a worker still running counts too. (Read only while a failure is
  // being decided: no file reads per worker per poll in a healthy job.)
  static void read_running_records(std::vector<Worker>& ws, Supervisor& supervisor) {
    for (auto& w : ws) {
      if (w.exited || w.record_seen) continue;
      const ErrorRecord rec = read_error_record(w.error_file);
      if (!rec.present) continue;
      w.record_seen = true;
      ExitReport r;
      r.rank = w.rank;
      r.recorded = true;
      r.relayed = rec.relayed;
      r.recorded_at = rec.time;
      supervisor.on_record(r, Clock::now());
    }
  }

  // Whether another node has reported this attempt's failure under `failed_key`.
  void check_other_nodes(const std::string& failed_key, Failure* failure, Supervisor& supervisor) {
    try {
      if (store_->check({failed_key})) {
        failure->happened = true;
        failure->report = store_->get(failed_key);
        supervisor.on_remote_failure(Clock::now());
      }
    } catch (const Error&) {
      // The store is gone (node 0 finished): local workers go on by themselves.
    }
  }

  // Decided here: name the root cause, and tell the other nodes.
  void announce_failure(const std::vector<Worker>& ws, const Supervisor& supervisor, const std::string& failed_key,
                        Failure* failure) {
    failure->happened = true;
    failure->report = describe_failure(ws, ws[static_cast<size_t>(supervisor.root_cause_rank() - offset_)]);
    if (multi_node()) {
      try {
        const std::string report = "node " + std::to_string(node_rank_) + ": " + failure->report;
        store_->set(failed_key, report);
        if (elastic()) rdzv_->end_round(plan_.round, {RoundEnd::Reason::kFailure, report});
      } catch (const Error&) {
      }
    }
  }

  // Elastic: whether the round goes on. A failure elsewhere terminates the workers as a remote
  // failure; a membership change stops them as a signal does (SIGTERM, then SIGKILL after the
  // grace period), so that they can save their state.
  void check_round(std::vector<Worker>& ws, Failure* failure, Supervisor& supervisor) {
    std::optional<RoundEnd> end;
    try {
      end = rdzv_->poll(plan_);
    } catch (const Error&) {
      return;  // the store is gone (its host finished): local workers go on by themselves
    }
    if (!end) return;
    failure->happened = true;
    failure->report = end->detail;
    if (end->reason == RoundEnd::Reason::kFailure) {
      supervisor.on_remote_failure(Clock::now());
      return;
    }
    failure->membership = true;
    signal_all(ws, SIGTERM);
    supervisor.on_stop(Clock::now());
  }

  Failure run_attempt(int attempt) {
    wait_for_nodes(attempt);
    std::vector<Worker> ws = make_workers();
    for (auto& w : ws) start(w, attempt);

    const std::string failed_key = "launch/attempt" + std::to_string(attempt) + "/failed";
    Failure failure;
    Supervisor::Options policy;
    policy.grace_period = grace();
    Supervisor supervisor(policy, Clock::now());
    auto next_store_check = Clock::now();
    size_t alive = ws.size();
    while (alive > 0) {
      wait_for_events(ws, supervisor);
      forward_signals(ws, supervisor);
      alive -= reap_exited(ws, supervisor);
      if (supervisor.deciding()) read_running_records(ws, supervisor);
      if (multi_node() && !supervisor.failure_decided() && !failure.happened && Clock::now() >= next_store_check) {
        next_store_check = Clock::now() + std::chrono::milliseconds(100);
        if (elastic()) {
          check_round(ws, &failure, supervisor);
        } else {
          check_other_nodes(failed_key, &failure, supervisor);
        }
      }
      const Supervisor::Send send = supervisor.step(Clock::now(), alive);
      if (supervisor.failure_decided() && !failure.happened) announce_failure(ws, supervisor, failed_key, &failure);
      if (send == Supervisor::Send::kTerminate) signal_all(ws, SIGTERM);
      if (send == Supervisor::Send::kKill) signal_all(ws, SIGKILL);
    }
    for (auto& w : ws) {
      while (w.out_fd >= 0) pump_output(w, true);
    }
    if (supervisor.root_cause_rank() >= 0) {
      // Again now that every worker has ended: ranks that ended after the decision are in it too.
      failure.report = describe_failure(ws, ws[static_cast<size_t>(supervisor.root_cause_rank() - offset_)]);
    }
    return failure;
  }

  std::chrono::milliseconds grace() const {
    return std::chrono::milliseconds(static_cast<int64_t>(o_.grace_period_s * 1000));
  }

 public:
  ~Agent() {
    if (!scratch_.empty()) {
      std::error_code ec;
      remove_tree(scratch_, ec);
    }
  }

 private:
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

}  // namespace

void parse_nnodes(const std::string& text, LaunchOptions* options) {
  const detail::NodeCount count = detail::parse_node_count(text);
  options->nnodes = count.min;
  options->max_nodes = count.elastic ? count.max : 0;
}

void parse_endpoint(const std::string& text, std::string* host, int* port) {
  if (const std::string bad = split_host_port(text, host, port); !bad.empty()) {
    throw UsageError("chorus run: bad endpoint '" + text + "': " + bad + "; expected HOST:PORT");
  }
}

int run(const LaunchOptions& options) {
  if (g_signal_pipe[0] < 0 && ::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    throw Error(std::string("chorus run: pipe: ") + std::strerror(errno));
  }
  for (int sig : kForwardedSignals) {
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    ::sigaction(sig, &sa, nullptr);
  }
  Agent agent(options);
  return agent.run();
}

}  // namespace chorus::launch
