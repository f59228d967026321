// Helpers of the store tests (store_test_util.h).
#include "store_test_util.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <thread>

#include "socket.h"

namespace chorus::store_test {

using namespace std::chrono_literals;

std::string temp_path() {
  const char* dir = std::getenv("TMPDIR");
  std::string pattern =
      std::string(dir != nullptr && dir[0] != '\0' ? dir : "/tmp") + "/chorus-store-test-XXXXXX";
  int fd = ::mkstemp(pattern.data());
  if (fd < 0) throw std::runtime_error("mkstemp failed for " + pattern);
  ::close(fd);
  return pattern;
}

int free_port() {
  net::Fd fd = net::listen_tcp("127.0.0.1", 0);
  return net::local_port(fd.get());
}

bool eventually(const std::function<bool()>& condition, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (condition()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return condition();
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

int wait_child(pid_t pid, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    int status = 0;
    pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (r < 0) return -2;
    if (Clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(2ms);
  }
}

std::vector<pid_t> fork_children(int n, const std::function<void(int)>& fn) {
  std::vector<pid_t> pids;
  for (int i = 0; i < n; ++i) {
    pid_t pid = ::fork();
    if (pid == 0) {
      int code = 0;
      try {
        fn(i);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "child %d: %s\n", i, e.what());
        code = 1;
      }
      ::_exit(code);
    }
    if (pid > 0) pids.push_back(pid);
  }
  return pids;
}

}  // namespace chorus::store_test
