// One attempt of `chorus run`'s agent (agent.h): start this node's workers, then watch them with
// chorus::Supervisor (exits, output, error records, forwarded signals, a failure reported by another
// node, the elastic round's end) until they all succeed or the attempt fails; on a failure, stop
// them and name the root cause.
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "agent.h"
#include "chorus/comm/error.h"
#include "chorus/comm/spawn.h"

extern char** environ;

namespace chorus::launch::detail {
namespace {

// Milliseconds from now until `t` for poll(): 0 when past, INT_MAX at most.
int ms_until(Clock::time_point t) {
  const auto now = Clock::now();
  if (t <= now) return 0;
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t - now).count() + 1;
  return ms > INT_MAX ? INT_MAX : static_cast<int>(ms);
}

}  // namespace

std::vector<std::string> Agent::worker_environment(const Worker& w, int attempt) const {
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

void Agent::start(Worker& w, int attempt) {
  WorkerLaunch how;
  how.program_path = program_path_;
  how.argv = o_.program;
  how.env = worker_environment(w, attempt);
  how.bind_cpu = o_.bind_cpu;
  how.local_world = nproc_;
  ::unlink(w.error_file.c_str());
  start_worker(w, how);
}

std::vector<Worker> Agent::make_workers() const {
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

void Agent::wait_for_events(const std::vector<Worker>& ws, const Supervisor& supervisor) {
  std::vector<pollfd> pfds;
  pfds.push_back({g_signal_pipe[0], POLLIN, 0});
  for (const auto& w : ws) {
    if (!w.exited && w.pidfd >= 0) pfds.push_back({w.pidfd, POLLIN, 0});
    if (w.out_fd >= 0) pfds.push_back({w.out_fd, POLLIN, 0});
  }
  ::poll(pfds.data(), pfds.size(), std::min(ms_until(supervisor.next_wakeup()), 100));
}

void Agent::forward_signals(std::vector<Worker>& ws, Supervisor& supervisor) {
  unsigned char sig = 0;
  while (::read(g_signal_pipe[0], &sig, 1) == 1) {
    signal_all(ws, sig);
    if (sig != SIGUSR1 && sig != SIGUSR2 && stop_signal_ == 0) {
      stop_signal_ = sig;
      supervisor.on_stop(Clock::now());
    }
  }
}

size_t Agent::reap_exited(std::vector<Worker>& ws, Supervisor& supervisor) {
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

void Agent::read_running_records(std::vector<Worker>& ws, Supervisor& supervisor) {
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

void Agent::check_other_nodes(const std::string& failed_key, Failure* failure, Supervisor& supervisor) {
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

void Agent::announce_failure(const std::vector<Worker>& ws, const Supervisor& supervisor, const std::string& failed_key,
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

void Agent::check_round(std::vector<Worker>& ws, Failure* failure, Supervisor& supervisor) {
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

Failure Agent::run_attempt(int attempt) {
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
}  // namespace chorus::launch::detail
