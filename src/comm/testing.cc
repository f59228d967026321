#include "testing.h"

#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <atomic>

#include "chorus/comm/rendezvous.h"
#include "chorus/comm/tcp_store.h"

namespace chorus::testing {
namespace {

// A rank or test process that crashes (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) writes its stack,
// the faulting address and the mapping it lies in to stderr before dying as it would have, so
// that a crash on a machine the session can no longer reach (the GPU runs) is located from the log
// alone. Test executables link with -rdynamic for the names.
const pid_t g_test_pid = ::getpid();  // ranks are forked: they see the test process's pid here

void write_err(const char* text, int n) {
  if (n > 0) {
    ssize_t ignored = ::write(2, text, static_cast<size_t>(std::min(n, 511)));
    (void)ignored;
  }
}

// Writes the /proc/self/maps line whose range holds `addr` (which file, at which offset), or says
// there is none. Only async-signal-safe calls, no allocation.
void describe_address(const char* label, uintptr_t addr) {
  char line[512];
  int fd = ::open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  char buf[4096];
  size_t used = 0;
  bool found = false;
  for (ssize_t got; fd >= 0 && !found && (got = ::read(fd, buf + used, sizeof(buf) - used - 1)) > 0;) {
    used += static_cast<size_t>(got);
    buf[used] = '\0';
    char* start = buf;
    for (char* nl; (nl = std::strchr(start, '\n')) != nullptr; start = nl + 1) {
      *nl = '\0';
      char* dash = nullptr;
      const uintptr_t lo = std::strtoull(start, &dash, 16);
      const uintptr_t hi = dash != nullptr && *dash == '-' ? std::strtoull(dash + 1, nullptr, 16) : 0;
      if (addr >= lo && addr < hi) {
        // "lo-hi perms offset dev inode path": the file offset of `addr` is offset + (addr - lo).
        const char* field = std::strchr(dash, ' ');
        field = field != nullptr ? std::strchr(field + 1, ' ') : nullptr;
        const uintptr_t offset = field != nullptr ? std::strtoull(field + 1, nullptr, 16) : 0;
        write_err(line, std::snprintf(line, sizeof(line), "  %s 0x%lx (file offset 0x%lx in: %s)\n", label,
                                      static_cast<unsigned long>(addr), static_cast<unsigned long>(offset + addr - lo),
                                      start));
        found = true;
        break;
      }
    }
    used = static_cast<size_t>(buf + used - start);
    std::memmove(buf, start, used);
    if (used >= sizeof(buf) - 1) used = 0;  // an over-long line: drop it
  }
  if (fd >= 0) ::close(fd);
  if (!found) {
    write_err(line, std::snprintf(line, sizeof(line), "  %s 0x%lx (in no mapping)\n", label,
                                  static_cast<unsigned long>(addr)));
  }
}

void crash_handler(int sig, siginfo_t* info, void* context) {
  char head[256];
  const pid_t pid = ::getpid();
  write_err(head, std::snprintf(head, sizeof(head), "chorus %s (pid %d, thread %ld): fatal signal %d at address %p; stack:\n",
                                pid == g_test_pid ? "test process" : "test rank", static_cast<int>(pid),
                                static_cast<long>(::syscall(SYS_gettid)), sig, info != nullptr ? info->si_addr : nullptr));
  void* frames[64];
  const int depth = ::backtrace(frames, 64);
  ::backtrace_symbols_fd(frames, depth, 2);
#if defined(__x86_64__)
  // Where it faulted, from the signal's saved registers: the unwinder cannot step past code
  // without unwind tables (a driver library) or a jump to a bad address, so say where that is and
  // where the call came from (the return address on top of the stack, for a call through a bad
  // pointer).
  if (context != nullptr) {
    const auto* uc = static_cast<const ucontext_t*>(context);
    const auto pc = static_cast<uintptr_t>(uc->uc_mcontext.gregs[REG_RIP]);
    const auto sp = static_cast<uintptr_t>(uc->uc_mcontext.gregs[REG_RSP]);
    describe_address("pc", pc);
    if (sp != 0 && sp % sizeof(uintptr_t) == 0) describe_address("[sp]", *reinterpret_cast<const uintptr_t*>(sp));
  }
#else
  (void)context;
#endif
  ::raise(sig);  // SA_RESETHAND: the default action now
}

void report_crashes() {
  void* warm[1];
  ::backtrace(warm, 1);  // loads the unwinder now, not inside the handler
  struct sigaction sa = {};
  sa.sa_sigaction = crash_handler;
  sa.sa_flags = SA_RESETHAND | SA_SIGINFO;
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
