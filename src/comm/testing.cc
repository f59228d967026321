#include "testing.h"

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

std::string run_ranks(int world,
                      const std::function<void(int rank, int world, std::shared_ptr<Store> store)>& fn,
                      std::chrono::milliseconds job_timeout) {
  SpawnOptions options;
  options.timeout = job_timeout;
  options.grace_period = std::chrono::milliseconds(500);
  try {
    spawn(world, [&](int rank, int world_size) {
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
