// One worker of `chorus run` (worker.h): started with fork and exec, its output pumped a line at a
// time, its error record read back, and the report of how the node's workers ended.
#include "worker.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <sstream>

#include "chorus/comm/error.h"

namespace chorus::launch::detail {
namespace {

void emit(Worker& w, const std::string& line) {
  // torchrun's prefix, so what filters its logs filters ours.
  std::string out =
      (w.output == Output::kPrefixed ? "[rank" + std::to_string(w.rank) + "]:" : std::string()) + line + "\n";
  std::fwrite(out.data(), 1, out.size(), stdout);
  std::fflush(stdout);
  if (w.log) *w.log << line << "\n" << std::flush;
}

}  // namespace

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

int cpu_for_local_rank(int local_rank, int local_world) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (::sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return -1;
  if (local_world > CPU_COUNT(&allowed)) {
    if (local_rank == 0) {
      std::fprintf(stderr, "chorus run: --bind-cpu: %d ranks on this node but %d CPUs to run on; not pinning\n",
                   local_world, CPU_COUNT(&allowed));
    }
    return -1;
  }
  int seen = 0;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &allowed) && seen++ == local_rank) return cpu;
  }
  return -1;
}

std::string host_name() {
  char buf[256] = {0};
  ::gethostname(buf, sizeof(buf) - 1);
  return buf;
}

ErrorRecord read_error_record(const std::string& path) {
  ErrorRecord r;
  std::ifstream in(path);
  if (!in) return r;
  try {
    nlohmann::json j;
    in >> j;
    r.message = j.value("message", "");
    r.relayed = j.value("relayed", false);
    r.time = j.value("time", 0.0);
    r.present = true;
  } catch (...) {
    // A record cut short (the worker was killed while writing it) says nothing reliable.
  }
  return r;
}

void start_worker(Worker& w, const WorkerLaunch& how) {
  // Output the launcher reads: prefixed ranks' (--tee, --ranks-filter), and with --log-dir rank 0's,
  // so the terminal still shows the job (and its log gets a copy).
  const bool piped = w.output == Output::kPrefixed || (w.output == Output::kTerminal && !w.log_path.empty());
  int pipefd[2] = {-1, -1};
  if (piped && ::pipe2(pipefd, O_CLOEXEC) != 0) throw Error(std::string("chorus run: pipe: ") + std::strerror(errno));
  const int cpu = how.bind_cpu ? cpu_for_local_rank(w.local_rank, how.local_world) : -1;
  std::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid < 0) throw Error(std::string("chorus run: fork: ") + std::strerror(errno));
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (cpu >= 0) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpu, &one);
      ::sched_setaffinity(0, sizeof(one), &one);
    }
    for (int sig : kForwardedSignals) ::signal(sig, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    if (piped) {
      ::dup2(pipefd[1], 1);
      ::dup2(pipefd[1], 2);
    } else if (w.output == Output::kLogOnly) {
      // Without --log-dir, a rank a filter leaves out writes nowhere (chorus run said so at start).
      const char* path = w.log_path.empty() ? "/dev/null" : w.log_path.c_str();
      int fd = ::open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
      }
    }
    std::vector<char*> argv, envp;
    for (const auto& a : how.argv) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    for (const auto& e : how.env) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);
    ::execve(how.program_path.c_str(), argv.data(), envp.data());
    std::fprintf(stderr, "chorus run: cannot exec %s: %s\n", how.program_path.c_str(), std::strerror(errno));
    ::_exit(127);
  }
  w.pid = pid;
  w.exited = false;
  w.status = 0;
  w.pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (piped) {
    ::close(pipefd[1]);
    w.out_fd = pipefd[0];
    ::fcntl(w.out_fd, F_SETFL, ::fcntl(w.out_fd, F_GETFL) | O_NONBLOCK);
    if (!w.log_path.empty()) w.log = std::make_unique<std::ofstream>(w.log_path, std::ios::app);
  }
}

void pump_output(Worker& w, bool flush_partial) {
  if (w.out_fd < 0) return;
  char buf[8192];
  for (;;) {
    ssize_t k = ::read(w.out_fd, buf, sizeof(buf));
    if (k > 0) {
      w.partial.append(buf, static_cast<size_t>(k));
      continue;
    }
    if (k == 0) {
      ::close(w.out_fd);
      w.out_fd = -1;
      flush_partial = true;
    }
    break;
  }
  size_t start = 0;
  for (size_t nl; (nl = w.partial.find('\n', start)) != std::string::npos; start = nl + 1) {
    emit(w, w.partial.substr(start, nl - start));
  }
  w.partial.erase(0, start);
  if (flush_partial && !w.partial.empty()) {
    emit(w, w.partial);
    w.partial.clear();
  }
}

std::string how_it_ended(const Worker& w) {
  if (!w.exited) return "still running (stopped by the launcher)";
  if (WIFSIGNALED(w.status)) return "killed by " + signal_name(WTERMSIG(w.status));
  if (WEXITSTATUS(w.status) == 0) return "finished normally (exit code 0)";
  return "exit code " + std::to_string(WEXITSTATUS(w.status));
}

std::string describe_failure(const std::vector<Worker>& ws, const Worker& root) {
  std::ostringstream out;
  out << "rank " << root.rank << " (local rank " << root.local_rank << " on host " << host_name() << ", pid "
      << root.pid << "): " << how_it_ended(root);
  const ErrorRecord rec = read_error_record(root.error_file);
  if (rec.present) {
    out << "\n  message: " << rec.message;
    if (rec.relayed) out << "\n  (a relayed error: no rank recorded an error of its own)";
  }
  if (!root.log_path.empty()) out << "\n  log: " << root.log_path;
  for (const auto& w : ws) {
    if (&w == &root || !w.exited) continue;
    out << "\n  rank " << w.rank << ": " << how_it_ended(w);
    const ErrorRecord r = read_error_record(w.error_file);
    if (!r.present || (WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0)) continue;
    out << (r.relayed ? ", failed because another rank did: " : ": ") << r.message;
  }
  return out.str();
}

void signal_all(std::vector<Worker>& ws, int sig) {
  for (auto& w : ws) {
    if (!w.exited && w.pid > 0) ::kill(w.pid, sig);
  }
}

}  // namespace chorus::launch::detail
