#include "chorus/comm/spawn.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <sstream>
#include <thread>

#include "chorus/comm/supervisor.h"
#include "chorus/comm/tcp_store.h"
#include "handshake.h"
#include "socket.h"

namespace chorus {
namespace {

using net::Clock;

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

// A child's message starts with one of these: its own error, or a PeerError (it failed because
// another rank did).
constexpr char kOwnError = 'E';
constexpr char kRelayedError = 'R';

struct Child {
  int rank = 0;
  pid_t pid = -1;
  int pidfd = -1;
  int msg_fd = -1;  // read end of the child's error pipe
  std::string message;  // as sent: a kind byte (kOwnError or kRelayedError), then the text
  bool exited = false;
  int status = 0;
  bool ended = false;  // spawn signalled it to end

  bool relayed() const { return !message.empty() && message[0] == kRelayedError; }
  std::string text() const { return message.empty() ? "" : message.substr(1); }
};

void drain(Child& c) {
  if (c.msg_fd < 0) return;
  char buf[4096];
  for (;;) {
    ssize_t k = ::read(c.msg_fd, buf, sizeof(buf));
    if (k > 0) {
      if (c.message.size() < 64 * 1024) c.message.append(buf, static_cast<size_t>(k));
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k == 0) {
      ::close(c.msg_fd);
      c.msg_fd = -1;
    }
    return;
  }
}

[[noreturn]] void run_child(int rank, int nprocs, int port, const std::string& token, int msg_fd,
                            const std::function<void(int, int)>& fn) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() == 1) ::_exit(1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  ::setenv("RANK", std::to_string(rank).c_str(), 1);
  ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(nprocs).c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", std::to_string(nprocs).c_str(), 1);
  ::setenv("CHORUS_JOB_TOKEN", token.c_str(), 1);
  ::setenv("CHORUS_STORE_EXTERNAL", "1", 1);
  int code = 0;
  std::string message;
  try {
    fn(rank, nprocs);
  } catch (const PeerError& e) {
    message = kRelayedError + std::string(e.what());
    code = 1;
  } catch (const std::exception& e) {
    message = kOwnError + std::string(e.what());
    code = 1;
  } catch (...) {
    message = kOwnError + std::string("unknown exception (not derived from std::exception)");
    code = 1;
  }
  if (!message.empty()) {
    size_t off = 0;
    while (off < message.size()) {
      ssize_t k = ::write(msg_fd, message.data() + off, message.size() - off);
      if (k <= 0 && errno != EINTR) break;
      if (k > 0) off += static_cast<size_t>(k);
    }
  }
  std::fflush(nullptr);
  ::_exit(code);
}


void kill_all(std::vector<Child>& children, int sig) {
  for (auto& c : children) {
    if (c.pid > 0 && !c.exited) {
      ::kill(c.pid, sig);
      c.ended = true;
    }
  }
}

// Forks the nprocs children, each running fn as one rank against the store at `port`. When a
// pipe or a fork fails, the children started so far are killed and an Error is thrown.
std::vector<Child> fork_children(int nprocs, int port, const std::string& token,
                                 const std::function<void(int rank, int world_size)>& fn) {
  std::vector<Child> children(static_cast<size_t>(nprocs));
  for (int r = 0; r < nprocs; ++r) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) {
      kill_all(children, SIGKILL);
      throw Error(std::string("spawn: pipe failed: ") + std::strerror(errno));
    }
    pid_t pid = ::fork();
    if (pid < 0) {
      ::close(fds[0]);
      ::close(fds[1]);
      kill_all(children, SIGKILL);
      for (auto& c : children) {
        if (c.pid > 0) ::waitpid(c.pid, nullptr, 0);
      }
      throw Error(std::string("spawn: fork failed: ") + std::strerror(errno));
    }
    if (pid == 0) {
      ::close(fds[0]);
      // The child runs without exec: close the earlier children's descriptors it inherited (their
      // message pipes and pidfds), so that a rank holds only its own, whatever its number.
      for (int e = 0; e < r; ++e) {
        const Child& sibling = children[static_cast<size_t>(e)];
        if (sibling.msg_fd >= 0) ::close(sibling.msg_fd);
        if (sibling.pidfd >= 0) ::close(sibling.pidfd);
      }
      run_child(r, nprocs, port, token, fds[1], fn);
    }
    ::close(fds[1]);
    ::fcntl(fds[0], F_SETFL, ::fcntl(fds[0], F_GETFL) | O_NONBLOCK);  // drain() must never block
    Child& c = children[static_cast<size_t>(r)];
    c.rank = r;
    c.pid = pid;
    c.msg_fd = fds[0];
    c.pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  }
  return children;
}

// Reaps the children that have exited (reading their messages first) and reports each to the
// supervisor; returns how many it reaped.
size_t reap_exited(std::vector<Child>& children, Supervisor& supervisor) {
  size_t reaped = 0;
  for (auto& c : children) {
    drain(c);  // a child writes its message before it exits: read it before reaping
    if (c.exited) continue;
    int status = 0;
    if (::waitpid(c.pid, &status, WNOHANG) != c.pid) continue;
    c.exited = true;
    c.status = status;
    ++reaped;
    if (c.pidfd >= 0) {
      ::close(c.pidfd);
      c.pidfd = -1;
    }
    ExitReport r;
    r.rank = c.rank;
    r.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.recorded = !c.message.empty();
    r.relayed = c.relayed();
    r.recorded_at = std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
    supervisor.on_exit(r, Clock::now());
  }
  return reaped;
}

// Every child has exited, so its pipe is at end of file once its last bytes are read.
void drain_to_end(std::vector<Child>& children) {
  for (auto& c : children) {
    while (c.msg_fd >= 0) {
      pollfd p{c.msg_fd, POLLIN, 0};
      ::poll(&p, 1, 100);
      drain(c);
      if (!(p.revents & (POLLIN | POLLHUP))) break;
    }
    if (c.msg_fd >= 0) {
      ::close(c.msg_fd);
      c.msg_fd = -1;
    }
  }
}

// The SpawnError for a job that timed out, or whose rank `cause` failed first.
[[noreturn]] void throw_failure(const std::vector<Child>& children, std::chrono::milliseconds timeout,
                                bool timed_out, int cause) {
  std::ostringstream out;
  SpawnFailure first;
  if (timed_out) {
    out << "spawn: job of " << children.size() << " processes did not finish within "
        << net::format_duration(timeout) << "; all were ended";
    first.rank = -1;
  } else {
    const Child& c = children[static_cast<size_t>(cause)];
    first.rank = c.rank;
    if (WIFSIGNALED(c.status)) {
      first.signal = WTERMSIG(c.status);
      first.exit_code = -1;
    } else {
      first.exit_code = WEXITSTATUS(c.status);
    }
    first.message = c.text();
    out << "spawn: rank " << c.rank << " (pid " << c.pid << ") failed first: ";
    if (first.signal != 0) {
      out << "killed by " << signal_name(first.signal);
    } else {
      out << "exit code " << first.exit_code;
    }
    if (!c.message.empty()) out << ": " << c.text();
  }
  // How every other rank ended, with its message: they often explain the cascade. A rank that
  // finished is said to have, never to have been ended or to have failed.
  for (const auto& c : children) {
    if (c.rank == first.rank) continue;
    out << "\n  rank " << c.rank << ": ";
    if (WIFSIGNALED(c.status)) {
      out << "killed by " << signal_name(WTERMSIG(c.status)) << (c.ended ? " (ended by spawn)" : "");
    } else if (WEXITSTATUS(c.status) == 0) {
      out << "finished normally (exit code 0)";
    } else {
      out << "exit code " << WEXITSTATUS(c.status);
    }
    if (c.relayed()) out << ", failed because another rank did";
    if (!c.message.empty()) out << ": " << c.text();
  }
  throw SpawnError(out.str(), first);
}

}  // namespace

void spawn(int nprocs, const std::function<void(int rank, int world_size)>& fn,
           const SpawnOptions& options) {
  if (nprocs < 1) throw UsageError("spawn: nprocs must be >= 1, got " + std::to_string(nprocs));
  TcpStoreServerOptions so;
  so.host = "127.0.0.1";
  so.port = 0;
  so.token = options.token.empty() ? random_token() : options.token;
  // Listening, but no server thread until every child is forked: a child forked while that thread
  // held a lock (OpenSSL's random generator mid-handshake with an earlier child) would hang on it.
  so.start_serving = false;
  TcpStoreServer server(so);

  std::fflush(nullptr);  // children must not re-emit the parent's buffered output
  std::vector<Child> children = fork_children(nprocs, server.port(), so.token, fn);
  server.start();  // children that connected already wait in the listen backlog

  Supervisor::Options policy;
  policy.grace_period = options.grace_period;
  policy.timeout = options.timeout;
  Supervisor supervisor(policy, Clock::now());
  size_t alive = children.size();
  while (alive > 0) {
    std::vector<pollfd> pfds;
    for (auto& c : children) {
      if (c.msg_fd >= 0) pfds.push_back({c.msg_fd, POLLIN, 0});
      if (!c.exited && c.pidfd >= 0) pfds.push_back({c.pidfd, POLLIN, 0});
    }
    const int wait_ms = std::min(std::max(net::ms_until(supervisor.next_wakeup()), 0), 100);  // 100 ms: kernels without pidfd
    ::poll(pfds.data(), pfds.size(), wait_ms);
    alive -= reap_exited(children, supervisor);
    switch (supervisor.step(Clock::now(), alive)) {
      case Supervisor::Send::kTerminate: kill_all(children, SIGTERM); break;
      case Supervisor::Send::kKill: kill_all(children, SIGKILL); break;
      case Supervisor::Send::kNothing: break;
    }
  }
  drain_to_end(children);
  if (supervisor.timed_out() || supervisor.root_cause_rank() >= 0) {
    throw_failure(children, options.timeout, supervisor.timed_out(), supervisor.root_cause_rank());
  }
}

}  // namespace chorus
