// Test helpers shared by the S3 tests: a child process (s3rver, the 503 stand-in) read through a
// pipe, s3rver on loopback with a request log, temporary directories. Test code only.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "chorus/data/s3.h"

#ifndef CHORUS_S3_TEST_DIR
#error "CHORUS_S3_TEST_DIR (tests/s3) must be defined"
#endif

namespace chorus::data::s3_testing {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// curl honours http_proxy & co.; these tests talk to 127.0.0.1 directly.
inline const bool kNoProxy = [] {
  for (const char* v : {"http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"}) {
    ::unsetenv(v);
  }
  return true;
}();

inline std::string temp_dir() {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/chorus-s3-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  return tmpl;
}

inline std::vector<std::uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

// A child process whose stdout we read; SIGKILLed and reaped in the destructor (and killed by
// the kernel if this test process dies first).
class Child {
 public:
  explicit Child(std::vector<std::string> argv) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
    pid_ = ::fork();
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // no server outlives a test killed by ctest's timeout
      ::dup2(fds[1], 1);
      std::vector<char*> args;
      for (std::string& a : argv) args.push_back(a.data());
      args.push_back(nullptr);
      ::execvp(args[0], args.data());
      ::_exit(127);
    }
    ::close(fds[1]);
    out_ = fds[0];
  }
  ~Child() {
    kill();
    ::close(out_);
  }
  void kill() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }
  // SIGSTOP: the server stops answering, while the kernel still accepts its connections.
  void freeze() {
    if (pid_ > 0) ::kill(pid_, SIGSTOP);
  }
  // Reads stdout until "PORT <n>"; -1 if it does not come within the timeout.
  int wait_for_port(std::chrono::milliseconds timeout) {
    auto until = Clock::now() + timeout;
    while (Clock::now() < until) {
      read_available(50ms);
      auto at = text_.find("PORT ");
      if (at != std::string::npos && text_.find('\n', at) != std::string::npos) return std::atoi(text_.c_str() + at + 5);
    }
    return -1;
  }
  // Everything written so far (waits up to quiet for more).
  const std::string& output(std::chrono::milliseconds quiet = 200ms) {
    read_available(quiet);
    return text_;
  }

 private:
  void read_available(std::chrono::milliseconds wait) {
    struct pollfd p = {out_, POLLIN, 0};
    while (::poll(&p, 1, static_cast<int>(wait.count())) > 0) {
      char buf[4096];
      ssize_t n = ::read(out_, buf, sizeof buf);
      if (n <= 0) break;
      text_.append(buf, static_cast<std::size_t>(n));
    }
  }
  pid_t pid_ = -1;
  int out_ = -1;
  std::string text_;
};

inline int count_substr(const std::string& text, const std::string& what) {
  int n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// A port nothing listens on: bound by us, then closed.
inline int closed_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

inline const char* kBucket = "chorus-test";

struct S3rver {
  std::string dir = temp_dir();
  std::string log = dir + "/requests.log";
  std::unique_ptr<Child> child;
  std::string endpoint;

  // fail_first > 0: the first fail_first GETs of each object are answered 503 SlowDown.
  explicit S3rver(int fail_first = 0) {
    std::string script = std::string(CHORUS_S3_TEST_DIR) + "/s3rver_run.js";
    if (!std::filesystem::exists(std::string(CHORUS_S3_TEST_DIR) + "/node_modules/s3rver")) {
      throw std::runtime_error("s3rver is not installed in tests/s3/node_modules: run scripts/install-deps");
    }
    std::filesystem::create_directories(dir + "/data");
    std::ofstream(log).flush();
    // s3rver's continuation tokens are DES-encrypted; OpenSSL 3 keeps DES in its legacy provider.
    std::vector<std::string> argv = {"node", "--openssl-legacy-provider", script};
    if (fail_first > 0) argv.push_back("--fail-first=" + std::to_string(fail_first));
    for (const std::string& a : {dir + "/data", log, std::string(kBucket)}) argv.push_back(a);
    child = std::make_unique<Child>(argv);
    int port = child->wait_for_port(20s);
    if (port <= 0) throw std::runtime_error("s3rver did not start: " + child->output());
    endpoint = "http://127.0.0.1:" + std::to_string(port);
  }
  ~S3rver() {
    child.reset();
    std::filesystem::remove_all(dir);
  }
  std::string requests() const {
    std::ifstream in(log);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  // GET requests for objects (listings carry list-type=2).
  int object_gets() const {
    int n = 0;
    std::istringstream lines(requests());
    for (std::string line; std::getline(lines, line);) {
      if (line.rfind("GET /", 0) == 0 && line.find("list-type=") == std::string::npos) ++n;
    }
    return n;
  }
  // Object GETs s3rver answered (not the injected 503s), by URL path ("/bucket/key", encoded).
  std::map<std::string, int> served_gets() const {
    std::map<std::string, int> by_path;
    std::istringstream lines(requests());
    for (std::string line; std::getline(lines, line);) {
      if (line.rfind("GET /", 0) != 0 || line.find("list-type=") != std::string::npos) continue;
      if (line.size() > 4 && line.compare(line.size() - 4, 4, " 503") == 0) continue;
      ++by_path[line.substr(4, line.find('?') == std::string::npos ? std::string::npos : line.find('?') - 4)];
    }
    return by_path;
  }
  int injected_503s() const { return count_substr(requests(), " 503\n"); }
  S3Options options() const {
    S3Options o;
    o.access_key_id = "S3RVER";  // s3rver's built-in account
    o.secret_access_key = "S3RVER";
    o.endpoint = endpoint;
    o.connect_timeout = 1000ms;
    o.request_timeout = 5000ms;
    o.deadline = 10000ms;
    o.backoff_base = 20ms;
    o.backoff_max = 200ms;
    return o;
  }
};

inline std::vector<std::uint8_t> fixture_bytes(std::size_t size, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::uint8_t> b(size);
  for (auto& x : b) x = static_cast<std::uint8_t>(rng());
  return b;
}

}  // namespace chorus::data::s3_testing
