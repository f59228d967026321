// Internal: thin, deadline-aware wrappers over POSIX TCP sockets, shared by the store and the
// TCP transport. Nothing here throws for I/O outcomes: callers turn an IoResult into an error
// message that names their own context (rank, peer, operation).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
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

// Connects to host:port, retrying refused connections (the server may not be up yet) with backoff
// until `deadline`. Throws TimeoutError or chorus::Error naming the endpoint and the last error.
Fd connect_tcp(const std::string& host, int port, Deadline deadline, const std::string& what);

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
