// Internal: thin, deadline-aware wrappers over POSIX TCP sockets, shared by the store and the
// TCP transport. Nothing here throws for I/O outcomes: callers turn an IoResult into an error
// message that names their own context (rank, peer, operation).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

namespace chorus::net {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// Milliseconds from now until `deadline`, clamped to [0, INT_MAX]; for poll().
int ms_until(Deadline deadline);
Deadline deadline_after(std::chrono::milliseconds timeout);
std::string format_duration(Clock::duration d);  // "1.503 s", "250 ms"

// An owned file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

struct IoResult {
  enum Code { kOk, kTimeout, kClosed, kError };
  Code code = kOk;
  int err = 0;       // errno for kError
  size_t done = 0;   // bytes transferred before the outcome
  bool ok() const { return code == kOk; }
  // "timed out", "connection closed by peer", "Connection reset by peer (errno 104)".
  std::string describe() const;
};

// Listens on host:port (host "" or "0.0.0.0" = all interfaces; port 0 = kernel's choice).
// Throws chorus::Error naming the address and the system error.
Fd listen_tcp(const std::string& host, int port, int backlog = 1024);
int local_port(int fd);
std::string local_host(int fd);   // numeric address this socket is bound to
std::string peer_string(int fd);  // "10.0.0.2:51234"

// While connect_tcp waits for a server that is not there yet, report(line) is called every
// `interval` with one line saying who waits for what, how long so far, the deadline and the last error.
struct ConnectProgress {
  std::chrono::milliseconds interval{5000};
  std::string who;  // "rank 1"
  std::function<void(const std::string& line)> report;
};

// Connects to host:port, retrying refused connections (the server may not be up yet) with backoff
// until `deadline`. A host name that does not resolve fails at once (UsageError naming the host and
// the fix); a temporary resolver failure is retried. Throws TimeoutError naming the endpoint and the
// last error when the deadline passes.
Fd connect_tcp(const std::string& host, int port, Deadline deadline, const std::string& what,
               const ConnectProgress* progress = nullptr);

// One non-blocking connection attempt for callers that drive many from a poll loop: returns a
// socket whose connect is in progress or done (watch it for POLLOUT, then connect_result()), or an
// invalid Fd with *error set. A name that does not resolve throws UsageError as connect_tcp does.
Fd start_connect(const std::string& host, int port, const std::string& what, std::string* error);
// 0 when the connection started by start_connect is established, else its errno.
int connect_result(int fd);

// Accepts one connection before `deadline`; returns an invalid Fd on timeout.
Fd accept_until(int listen_fd, Deadline deadline);

void set_nodelay(int fd);
void set_nonblocking(int fd, bool nonblocking);
void set_buffer_sizes(int fd, int bytes);
void set_keepalive(int fd);

// Blocking-style full transfers on a socket of either mode, bounded by `deadline`.
IoResult write_full(int fd, const void* data, size_t n, Deadline deadline);
IoResult read_full(int fd, void* data, size_t n, Deadline deadline);

}  // namespace chorus::net
