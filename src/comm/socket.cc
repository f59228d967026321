#include "socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <sstream>
#include <thread>

#include "chorus/comm/error.h"

namespace chorus::net {

int ms_until(Deadline deadline) {
  auto now = Clock::now();
  if (deadline <= now) return 0;
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count() + 1;
  return ms > INT_MAX ? INT_MAX : static_cast<int>(ms);
}

Deadline deadline_after(std::chrono::milliseconds timeout) {
  auto now = Clock::now();
  if (timeout.count() <= 0) return now;
  if (timeout > std::chrono::hours(24 * 365)) return Deadline::max();
  return now + timeout;
}

std::string format_duration(Clock::duration d) {
  double s = std::chrono::duration<double>(d).count();
  std::ostringstream out;
  out.precision(3);
  if (s < 1.0) {
    out << std::fixed << s * 1000.0 << " ms";
  } else {
    out << std::fixed << s << " s";
  }
  return out.str();
}

void Fd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

std::string IoResult::describe() const {
  switch (code) {
    case kOk: return "ok";
    case kTimeout: return "timed out";
    case kClosed: return "connection closed by peer";
    case kError: return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")";
  }
  return "unknown";
}

namespace {

std::string sys_error(const std::string& what) {
  return what + ": " + std::strerror(errno) + " (errno " + std::to_string(errno) + ")";
}

struct AddrInfo {
  addrinfo* list = nullptr;
  ~AddrInfo() {
    if (list) freeaddrinfo(list);
  }
};

std::string sockaddr_string(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = {0};
  int port = 0;
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
    return std::string("[") + host + "]:" + std::to_string(port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

}  // namespace

Fd listen_tcp(const std::string& host, int port, int backlog) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  AddrInfo ai;
  std::string service = std::to_string(port);
  const char* node = (host.empty() || host == "*") ? nullptr : host.c_str();
  if (node == nullptr) hints.ai_family = AF_INET;
  int rc = getaddrinfo(node, service.c_str(), &hints, &ai.list);
  if (rc != 0) {
    throw Error("cannot resolve listen address '" + host + ":" + service + "': " + gai_strerror(rc));
  }
  std::string last = "no usable address";
  for (addrinfo* p = ai.list; p != nullptr; p = p->ai_next) {
    Fd fd(::socket(p->ai_family, p->ai_socktype | SOCK_CLOEXEC, p->ai_protocol));
    if (!fd.valid()) {
      last = sys_error("socket");
      continue;
    }
    int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd.get(), p->ai_addr, p->ai_addrlen) != 0) {
      last = sys_error("bind");
      continue;
    }
    if (::listen(fd.get(), backlog) != 0) {
      last = sys_error("listen");
      continue;
    }
    return fd;
  }
  throw Error("cannot listen on " + (host.empty() ? std::string("*") : host) + ":" + service +
              ": " + last + (port != 0 ? "; pick another port or use port 0 for the kernel's choice" : ""));
}

int local_port(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return -1;
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  return -1;
}

std::string local_host(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "";
  char host[INET6_ADDRSTRLEN] = {0};
  if (ss.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&ss)->sin_addr, host, sizeof(host));
  } else if (ss.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&ss)->sin6_addr, host, sizeof(host));
  }
  return host;
}

std::string peer_string(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  return sockaddr_string(ss);
}

namespace {

// Resolves host:port into ai. A name that does not exist is a configuration mistake: throws
// UsageError at once, naming the host and the fix. A temporary resolver failure returns false with
// *error set, for the caller to retry.
bool resolve(const std::string& host, int port, const std::string& what, AddrInfo* ai, std::string* error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  const std::string service = std::to_string(port);
  const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &ai->list);
  if (rc == 0) return true;
  if (rc == EAI_AGAIN || (rc == EAI_SYSTEM && (errno == EINTR || errno == EAGAIN))) {
    *error = "cannot resolve host '" + host + "' right now: " + gai_strerror(rc);
    return false;
  }
  throw UsageError("cannot resolve host '" + host + "' (the address of " + what + "): " +
                   (rc == EAI_SYSTEM ? std::string(std::strerror(errno)) : std::string(gai_strerror(rc))) +
                   "; check the host name (MASTER_ADDR, --rdzv-endpoint or the tcp:// URL), or give an IP address");
}

}  // namespace

Fd start_connect(const std::string& host, int port, const std::string& what, std::string* error) {
  AddrInfo ai;
  if (!resolve(host, port, what, &ai, error)) return Fd();
  for (addrinfo* p = ai.list; p != nullptr; p = p->ai_next) {
    Fd fd(::socket(p->ai_family, p->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, p->ai_protocol));
    if (!fd.valid()) {
      *error = sys_error("socket");
      continue;
    }
    if (::connect(fd.get(), p->ai_addr, p->ai_addrlen) == 0 || errno == EINPROGRESS) return fd;
    *error = sys_error("connect");
  }
  return Fd();
}

int connect_result(int fd) {
  int soerr = 0;
  socklen_t len = sizeof(soerr);
  if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len) != 0) return errno;
  return soerr;
}

Fd connect_tcp(const std::string& host, int port, Deadline deadline, const std::string& what,
               const ConnectProgress* progress) {
  const auto start = Clock::now();
  const std::string endpoint = host + ":" + std::to_string(port);
  std::string last = "no attempt made";
  auto backoff = std::chrono::milliseconds(5);
  // One attempt waits this long at most for an answer to its SYN (a host that drops packets gives
  // none), so that the progress lines keep coming and a later attempt can succeed.
  constexpr auto kAttempt = std::chrono::seconds(2);
  auto next_report = progress != nullptr ? start + progress->interval : Deadline::max();
  for (;;) {
    std::string error;
    Fd fd = start_connect(host, port, what, &error);
    if (fd.valid()) {
      pollfd pfd{fd.get(), POLLOUT, 0};
      int pr = ::poll(&pfd, 1, ms_until(std::min<Deadline>(deadline, Clock::now() + kAttempt)));
      const int err = pr > 0 ? connect_result(fd.get()) : ETIMEDOUT;
      if (err == 0) {
        set_nonblocking(fd.get(), false);
        return fd;
      }
      errno = err;
      error = err == ETIMEDOUT ? std::string("connect timed out (no answer from the host)") : sys_error("connect");
    }
    last = error;
    auto now = Clock::now();
    if (now >= deadline) break;
    if (now >= next_report && progress->report) {
      progress->report("chorus: " + (progress->who.empty() ? std::string("this process") : progress->who) +
                       ": still waiting for " + what + " at " + endpoint + ": " + format_duration(now - start) +
                       " so far, " +
                       (deadline == Deadline::max() ? std::string("with no deadline")
                                                    : "giving up after " + format_duration(deadline - start)) +
                       " (last error: " + last + ")");
      next_report = now + progress->interval;
    }
    // Sleep no further than the deadline, so the last attempt happens right at it.
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(250));
  }
  throw TimeoutError("could not connect to " + what + " at " + endpoint + " within " +
                     format_duration(Clock::now() - start) + " (last error: " + last +
                     "); check that the address is reachable and the server is running");
}

Fd accept_until(int listen_fd, Deadline deadline) {
  for (;;) {
    pollfd pfd{listen_fd, POLLIN, 0};
    int pr = ::poll(&pfd, 1, ms_until(deadline));
    if (pr < 0 && errno == EINTR) continue;
    if (pr <= 0) return Fd();
    int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) return Fd(fd);
    if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED) continue;
    throw Error(sys_error("accept"));
  }
}

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

void set_nonblocking(int fd, bool nonblocking) {
  int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags < 0) return;
  flags = nonblocking ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK);
  ::fcntl(fd, F_SETFL, flags);
}

void set_buffer_sizes(int fd, int bytes) {
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes));
}

void set_keepalive(int fd) {
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
}

IoResult write_full(int fd, const void* data, size_t n, Deadline deadline) {
  IoResult r;
  auto* p = static_cast<const char*>(data);
  while (r.done < n) {
    ssize_t k = ::send(fd, p + r.done, n - r.done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      r.done += static_cast<size_t>(k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd pfd{fd, POLLOUT, 0};
      int pr = ::poll(&pfd, 1, ms_until(deadline));
      if (pr == 0) {
        r.code = IoResult::kTimeout;
        return r;
      }
      continue;
    }
    if (k < 0 && (errno == EPIPE || errno == ECONNRESET)) {
      r.code = IoResult::kClosed;
      r.err = errno;
      return r;
    }
    r.code = IoResult::kError;
    r.err = errno;
    return r;
  }
  return r;
}

IoResult read_full(int fd, void* data, size_t n, Deadline deadline) {
  IoResult r;
  auto* p = static_cast<char*>(data);
  while (r.done < n) {
    ssize_t k = ::recv(fd, p + r.done, n - r.done, MSG_DONTWAIT);
    if (k > 0) {
      r.done += static_cast<size_t>(k);
      continue;
    }
    if (k == 0) {
      r.code = IoResult::kClosed;
      return r;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      pollfd pfd{fd, POLLIN, 0};
      int pr = ::poll(&pfd, 1, ms_until(deadline));
      if (pr == 0) {
        r.code = IoResult::kTimeout;
        return r;
      }
      continue;
    }
    if (errno == ECONNRESET) {
      r.code = IoResult::kClosed;
      r.err = errno;
      return r;
    }
    r.code = IoResult::kError;
    r.err = errno;
    return r;
  }
  return r;
}

}  // namespace chorus::net
