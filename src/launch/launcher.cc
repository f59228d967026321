// `chorus run`: the per-node agent. It checks the options, meets the other nodes' agents at the
// rendezvous store (node ranks, process counts, the job token), then runs attempts: start this
// node's workers (worker.cc), watch them with chorus::Supervisor (exits, error records, a failure
// on another node, forwarded signals), and on a failure stop them, name the root cause and restart
// the group while restarts are left.
#include "chorus/launch/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <sstream>
#include <thread>

#include "chorus/comm/error.h"
#include "chorus/comm/rendezvous.h"
#include "chorus/comm/spawn.h"
#include "chorus/comm/supervisor.h"
#include "chorus/comm/tcp_store.h"
#include "worker.h"

extern char** environ;

namespace chorus::launch {
namespace {

namespace fs = std::filesystem;
using detail::Clock;
using detail::describe_failure;
using detail::ErrorRecord;
using detail::host_name;
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

// The program as exec will find it, or "" if it cannot be run.
std::string resolve_program(const std::string& prog) {
  if (prog.find('/') != std::string::npos) return ::access(prog.c_str(), X_OK) == 0 ? prog : "";
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    std::string candidate = (dir.empty() ? "." : dir) + "/" + prog;
    struct stat st {};
    if (::stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(candidate.c_str(), X_OK) == 0) {
      return candidate;
    }
  }
  return "";
}

// Milliseconds from now until `t` for poll(): 0 when past, INT_MAX at most.
int ms_until(Clock::time_point t) {
  const auto now = Clock::now();
  if (t <= now) return 0;
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t - now).count() + 1;
  return ms > INT_MAX ? INT_MAX : static_cast<int>(ms);
}

// Scratch directories are /tmp/chorus-run-<launcher pid>-ns<pid namespace>-XXXXXX. A SIGKILLed
// launcher cannot remove its own, so each launcher removes those of launchers (of this user, in
// its pid namespace, where their pids mean what they say) that are no longer running.
constexpr const char* kScratchPrefix = "chorus-run-";

std::string pid_namespace_tag() {
  struct stat st {};
  return "ns" + std::to_string(::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<unsigned long long>(st.st_ino) : 0ull);
}

void sweep_stale_scratch_dirs() {
  const std::string ns = "-" + pid_namespace_tag() + "-";
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator("/tmp", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(kScratchPrefix, 0) != 0) continue;
    const std::string rest = name.substr(std::strlen(kScratchPrefix));
    char* end = nullptr;
    const long pid = std::strtol(rest.c_str(), &end, 10);
    if (pid <= 0 || end == rest.c_str() || std::string(end).rfind(ns, 0) != 0) continue;  // not one of ours
    struct stat st {};
    if (::lstat(entry.path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::getuid()) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // its launcher still runs
    std::error_code rec;
    fs::remove_all(entry.path(), rec);
  }
}

struct Failure {
  bool happened = false;
  std::string report;  // "rank 3 (local rank 1 on host h, pid 42): exit code 7\n  message: ..."
};

// Bounds of the numeric options: beyond them a value is a typo, and would overflow the
// millisecond arithmetic (a grace period of 1e300 s once meant an immediate SIGKILL).
constexpr int kMaxProcsPerNode = 4096;
constexpr int kMaxRestarts = 1000000;
constexpr double kMaxGraceSeconds = 3600;
constexpr double kMaxRdzvSeconds = 7 * 24 * 3600;

// Throws UsageError unless `value` (seconds) is a finite number in [min, max].
void check_seconds(const char* option, double value, double min, double max) {
  if (std::isfinite(value) && value >= min && value <= max) return;
  std::ostringstream out;
  out << "chorus run: " << option << " must be a number of seconds in [" << min << ", " << max << "], got " << value;
  throw UsageError(out.str());
}

class Agent {
 public:
  explicit Agent(const LaunchOptions& o) : o_(o) {}

  int run() {
    validate();
    rendezvous();
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
  void validate() {
    if (o_.program.empty()) throw UsageError("chorus run: no program given; usage: chorus run [options] PROGRAM [ARGS...]");
    if (o_.program[0].size() > 1 && o_.program[0][0] == '-') {
      throw UsageError("chorus run: unknown option '" + o_.program[0] + "' (options go before PROGRAM; see chorus run --help)");
    }
    program_path_ = resolve_program(o_.program[0]);
    if (program_path_.empty()) {
      throw UsageError("chorus run: cannot run '" + o_.program[0] + "': not found or not executable" +
                       (o_.program[0].find('/') == std::string::npos ? " (searched PATH)" : ""));
    }
    if (o_.nproc_per_node == "auto") {
      nproc_ = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    } else {
      try {
        size_t pos = 0;
        nproc_ = std::stoi(o_.nproc_per_node, &pos);
        if (pos != o_.nproc_per_node.size()) throw std::invalid_argument("");
      } catch (...) {
        throw UsageError("chorus run: --nproc-per-node must be a number or 'auto', got '" + o_.nproc_per_node + "'");
      }
    }
    if (nproc_ < 1) throw UsageError("chorus run: --nproc-per-node must be at least 1, got " + std::to_string(nproc_));
    if (o_.nnodes < 1) throw UsageError("chorus run: --nnodes must be at least 1");
    if (o_.node_rank < 0 || o_.node_rank >= o_.nnodes) {
      throw UsageError("chorus run: --node-rank " + std::to_string(o_.node_rank) + " is outside [0, " +
                       std::to_string(o_.nnodes) + ")");
    }
    if (nproc_ > kMaxProcsPerNode) {
      throw UsageError("chorus run: --nproc-per-node " + std::to_string(nproc_) + " is more than " +
                       std::to_string(kMaxProcsPerNode) + " workers on one node");
    }
    if (o_.max_restarts < 0 || o_.max_restarts > kMaxRestarts) {
      throw UsageError("chorus run: --max-restarts must be in [0, " + std::to_string(kMaxRestarts) + "], got " +
                       std::to_string(o_.max_restarts));
    }
    check_seconds("--grace-period", o_.grace_period_s, 0, kMaxGraceSeconds);
    check_seconds("--rdzv-timeout", o_.rdzv_timeout_s, 0.001, kMaxRdzvSeconds);
    if (o_.master_port != -1 && (o_.master_port < 1 || o_.master_port > 65535)) {
      throw UsageError("chorus run: --master-port " + std::to_string(o_.master_port) +
                       " is not a TCP port; give one in [1, 65535]");
    }
    if (!o_.rdzv_endpoint.empty()) {
      parse_endpoint(o_.rdzv_endpoint, &master_addr_, &master_port_);
    } else if (!o_.master_addr.empty() || o_.master_port >= 0) {
      if (o_.master_addr.empty() || o_.master_port < 0) {
        throw UsageError("chorus run: give both --master-addr and --master-port (or --rdzv-endpoint HOST:PORT)");
      }
      master_addr_ = o_.master_addr;
      master_port_ = o_.master_port;
    } else if (o_.nnodes > 1) {
      throw UsageError("chorus run: --nnodes " + std::to_string(o_.nnodes) +
                       " needs --rdzv-endpoint HOST:PORT (node 0's address and a free port)");
    }
    if (!o_.log_dir.empty()) {
      std::error_code ec;
      fs::create_directories(o_.log_dir, ec);
      if (ec) throw UsageError("chorus run: cannot create --log-dir " + o_.log_dir + ": " + ec.message());
    }
    sweep_stale_scratch_dirs();
    std::string tmpl =
        std::string("/tmp/") + kScratchPrefix + std::to_string(::getpid()) + "-" + pid_namespace_tag() + "-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) {
      throw Error("chorus run: cannot create a scratch directory " + tmpl + ": " + std::strerror(errno));
    }
    scratch_ = tmpl;
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
    if (token_.empty() && o_.nnodes > 1) {
      // Anything every node could derive without talking first, a stranger could derive too.
      throw UsageError("chorus run: --nnodes " + std::to_string(o_.nnodes) +
                       " needs a job secret shared by every node, or any process that reaches " + master_addr_ + ":" +
                       std::to_string(master_port_) + " could join the job: give every node the same --token-file "
                       "(a file only you can read: openssl rand -hex 16 > ~/.chorus-token && chmod 600 "
                       "~/.chorus-token), --token or CHORUS_JOB_TOKEN");
    }
    if (token_.empty()) token_ = random_token();  // one node: a fresh secret, handed to the workers only
    const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(o_.rdzv_timeout_s * 1000));
    if (o_.node_rank == 0) {
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
    co.who = "chorus run (node " + std::to_string(o_.node_rank) + ")";
    try {
      store_ = std::make_shared<TcpStore>(co);
    } catch (const TimeoutError& e) {
      throw TimeoutError("chorus run: node " + std::to_string(o_.node_rank) +
                         " could not reach the rendezvous endpoint " + master_addr_ + ":" +
                         std::to_string(master_port_) + " within " + std::to_string(o_.rdzv_timeout_s) +
                         " s; is node 0's launcher running and the address reachable? (" + e.what() + ")");
    }
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
    if (o_.nnodes == 1 || attempt == 0) return;
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
    put("GROUP_RANK", std::to_string(o_.node_rank));
    put("MASTER_ADDR", master_addr_);
    put("MASTER_PORT", std::to_string(master_port_));
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
    how.tee = o_.tee;
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
    if (o_.nnodes > 1) {
      try {
        store_->set(failed_key, "node " + std::to_string(o_.node_rank) + ": " + failure->report);
      } catch (const Error&) {
      }
    }
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
      if (o_.nnodes > 1 && !supervisor.failure_decided() && Clock::now() >= next_store_check) {
        next_store_check = Clock::now() + std::chrono::milliseconds(100);
        check_other_nodes(failed_key, &failure, supervisor);
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
      fs::remove_all(scratch_, ec);
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
  std::string token_;
  std::string scratch_;
  std::unique_ptr<TcpStoreServer> server_;
  std::shared_ptr<TcpStore> store_;
  int stop_signal_ = 0;
};

}  // namespace

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
