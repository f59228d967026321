#include "testing.h"

#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <thread>

#include <atomic>

#include "chorus/comm/rendezvous.h"
#include "chorus/comm/tcp_store.h"

namespace chorus::testing {
namespace {

// A rank that crashes (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) writes its stack to stderr before
// dying as it would have, so that a crash on a machine the session can no longer reach (the GPU
// runs) is located from the log alone. Test executables link with -rdynamic for the names.
void crash_handler(int sig) {
  char head[96];
  const int n = std::snprintf(head, sizeof(head), "chorus test rank (pid %d): fatal signal %d; stack:\n",
                              static_cast<int>(::getpid()), sig);
  if (n > 0) {
    ssize_t ignored = ::write(2, head, static_cast<size_t>(n));
    (void)ignored;
  }
  void* frames[64];
  const int depth = ::backtrace(frames, 64);
  ::backtrace_symbols_fd(frames, depth, 2);
  ::raise(sig);  // SA_RESETHAND: the default action now
}

void report_crashes() {
  void* warm[1];
  ::backtrace(warm, 1);  // loads the unwinder now, not inside the handler
  struct sigaction sa = {};
  sa.sa_handler = crash_handler;
  sa.sa_flags = SA_RESETHAND;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) ::sigaction(sig, &sa, nullptr);
}

// The test process itself too (its ranks install it again after fork).
const bool g_reports_crashes = (report_crashes(), true);

}  // namespace

std::string run_ranks(int world,
                      const std::function<void(int rank, int world, std::shared_ptr<Store> store)>& fn,
                      std::chrono::milliseconds job_timeout) {
  SpawnOptions options;
  options.timeout = job_timeout;
  options.grace_period = std::chrono::milliseconds(500);
  try {
    spawn(world, [&](int rank, int world_size) {
      report_crashes();
      RendezvousOptions ro;
      ro.timeout = std::chrono::seconds(20);
      Rendezvous rv = rendezvous("env://", rank, world_size, ro);
      fn(rank, world_size, rv.store);
    }, options);
  } catch (const SpawnError& e) {
    return e.what();
  }
  return "";
}

std::vector<ChildReport> run_ranks_independent(int world,
                                               const std::function<std::string(int rank, int world)>& fn,
                                               std::chrono::milliseconds deadline) {
  TcpStoreServerOptions so;
  so.host = "127.0.0.1";
  so.token = random_token();
  so.start_serving = false;  // no server thread while forking (see TcpStoreServerOptions)
  TcpStoreServer server(so);
  std::vector<pid_t> pids;
  std::vector<int> fds;
  std::fflush(nullptr);
  for (int r = 0; r < world; ++r) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(p[0]);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(server.port()).c_str(), 1);
      ::setenv("CHORUS_JOB_TOKEN", so.token.c_str(), 1);
      ::setenv("CHORUS_STORE_EXTERNAL", "1", 1);
      report_crashes();
      std::string text;
      try {
        text = fn(r, world);
      } catch (const std::exception& e) {
        text = std::string("exception: ") + e.what();
      }
      ssize_t ignored = ::write(p[1], text.data(), text.size());
      (void)ignored;
      std::fflush(nullptr);
      ::_exit(0);
    }
    ::close(p[1]);
    pids.push_back(pid);
    fds.push_back(p[0]);
  }
  server.start();
  std::vector<ChildReport> out(static_cast<size_t>(world));
  auto until = std::chrono::steady_clock::now() + deadline;
  for (int r = 0; r < world; ++r) {
    ChildReport& c = out[static_cast<size_t>(r)];
    c.rank = r;
    int status = 0;
    for (;;) {
      pid_t got = ::waitpid(pids[static_cast<size_t>(r)], &status, WNOHANG);
      if (got == pids[static_cast<size_t>(r)]) break;
      if (std::chrono::steady_clock::now() > until) {
        ::kill(pids[static_cast<size_t>(r)], SIGKILL);
        ::waitpid(pids[static_cast<size_t>(r)], &status, 0);
        c.text = "(killed by the test harness at its deadline) ";
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    c.exited = WIFEXITED(status);
    c.exit_code = c.exited ? WEXITSTATUS(status) : -1;
    c.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    char buf[4096];
    ssize_t k;
    while ((k = ::read(fds[static_cast<size_t>(r)], buf, sizeof(buf))) > 0) c.text.append(buf, static_cast<size_t>(k));
    ::close(fds[static_cast<size_t>(r)]);
  }
  return out;
}

std::string hex(const std::string& bytes) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += kDigits[c >> 4];
    out += kDigits[c & 15];
  }
  return out;
}

std::string unique_name(const std::string& stem) {
  static std::atomic<int> counter{0};
  return "chorus-test-" + stem + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
}

std::string run_capture(const std::string& command, int* status) {
  std::string out;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) {
    *status = -1;
    return out;
  }
  char buf[4096];
  for (size_t got; (got = std::fread(buf, 1, sizeof(buf), pipe)) > 0;) out.append(buf, got);
  *status = ::pclose(pipe);
  return out;
}

std::string parity_python() {
  const char* override_python = std::getenv("CHORUS_PARITY_PYTHON");
  return override_python != nullptr ? override_python : "/usr/bin/python3";
}

}  // namespace chorus::testing
