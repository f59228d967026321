#include "program.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "chorus/comm/error.h"

extern char** environ;

namespace chorus::report::detail {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxErr = 64 * 1024;

// Closes the descriptors it holds when the scope ends, whatever way it ends.
struct Pipe {
  int fd[2] = {-1, -1};
  ~Pipe() {
    for (int f : fd) {
      if (f >= 0) ::close(f);
    }
  }
  void close_end(int i) {
    if (fd[i] >= 0) ::close(fd[i]);
    fd[i] = -1;
  }
};

std::string join(const std::vector<std::string>& argv) {
  std::string out;
  for (const auto& a : argv) out += (out.empty() ? "" : " ") + a;
  return out;
}

// Reads what is there; returns false at end of file.
bool drain(int fd, std::string* into, size_t limit) {
  char buf[16384];
  for (;;) {
    ssize_t k = ::read(fd, buf, sizeof(buf));
    if (k > 0) {
      if (into->size() < limit) into->append(buf, static_cast<size_t>(k));
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    return k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);  // more later; else end of file (or broken)
  }
}

}  // namespace

std::string describe_exit(const ProgramResult& result) {
  if (result.signal != 0) {
    const char* abbrev = sigabbrev_np(result.signal);
    return std::string("killed by ") + (abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(result.signal));
  }
  return "exit code " + std::to_string(result.exit_code);
}

ProgramResult run_program(const std::vector<std::string>& argv, std::chrono::milliseconds timeout) {
  if (argv.empty()) throw UsageError("run_program: empty argv");
  Pipe out, err;
  if (::pipe2(out.fd, O_CLOEXEC) != 0 || ::pipe2(err.fd, O_CLOEXEC) != 0) {
    throw Error("cannot start " + argv[0] + ": pipe failed: " + std::strerror(errno));
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, out.fd[1], 1);
  posix_spawn_file_actions_adddup2(&actions, err.fd[1], 2);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int rc = ::posix_spawnp(&pid, argv[0].c_str(), &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) throw Error("cannot start `" + join(argv) + "`: " + std::strerror(rc));
  out.close_end(1);
  err.close_end(1);
  ::fcntl(out.fd[0], F_SETFL, ::fcntl(out.fd[0], F_GETFL) | O_NONBLOCK);
  ::fcntl(err.fd[0], F_SETFL, ::fcntl(err.fd[0], F_GETFL) | O_NONBLOCK);

  ProgramResult result;
  const auto deadline = Clock::now() + timeout;
  bool out_open = true, err_open = true, exited = false, timed_out = false;
  int status = 0;
  while (!exited) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      timed_out = true;
      ::kill(pid, SIGKILL);
      while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      break;
    }
    // Until both pipes close, their data wake us; after that, poll the child's exit every 10 ms.
    pollfd pfds[2];
    nfds_t n = 0;
    if (out_open) pfds[n++] = {out.fd[0], POLLIN, 0};
    if (err_open) pfds[n++] = {err.fd[0], POLLIN, 0};
    const int wait_ms = static_cast<int>(std::min<long long>(left, n > 0 ? 1000 : 10));
    if (::poll(n > 0 ? pfds : nullptr, n, wait_ms) < 0 && errno != EINTR) {
      const int err_no = errno;
      ::kill(pid, SIGKILL);
      while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      throw Error("waiting for `" + join(argv) + "`: poll failed: " + std::strerror(err_no));
    }
    if (out_open) out_open = drain(out.fd[0], &result.out, SIZE_MAX);
    if (err_open) err_open = drain(err.fd[0], &result.err, kMaxErr);
    if (!out_open && !err_open) exited = ::waitpid(pid, &status, WNOHANG) == pid;
  }
  if (timed_out) {
    throw TimeoutError("`" + join(argv) + "` did not finish within " + std::to_string(timeout.count()) +
                       " ms and was killed" + (result.err.empty() ? "" : "; its stderr:\n" + result.err));
  }
  if (WIFSIGNALED(status)) {
    result.signal = WTERMSIG(status);
  } else {
    result.exit_code = WEXITSTATUS(status);
  }
  return result;
}

}  // namespace chorus::report::detail
