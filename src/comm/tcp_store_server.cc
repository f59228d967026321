// TcpStoreServer: the thread that serves every client with one poll() loop (docs/store.md). It
// accepts connections (capping those that have not finished their handshake), reads and writes
// them without ever blocking on one, ends handshakes, lingers and parked waits at their deadlines,
// and reaps the dead. What the bytes it reads mean is tcp_store_requests.cc's business; the state
// both share is tcp_store_server.h.
#include "tcp_store_server.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "chorus/comm/error.h"
#include "chorus/comm/log.h"

namespace chorus {
namespace {

using store_protocol::kMaxKeyBytes;

// A connection must complete its handshake this soon after connecting.
constexpr std::chrono::milliseconds kHelloTimeout{10000};
// Connections that have not proved themselves yet (mid-handshake or being refused): past this many,
// the oldest is dropped, so a flood of idle or garbage connections cannot exhaust descriptors or
// starve the job's own clients, which finish their handshake in a round trip.
constexpr size_t kMaxUnprovenClients = 128;

uint32_t value_limit(size_t max_value_bytes) {
  return static_cast<uint32_t>(std::min<size_t>(max_value_bytes, UINT32_MAX));
}

}  // namespace

void TcpStoreServer::Impl::run() {
  try {
    loop();
  } catch (const std::exception& e) {
    log(std::string("stopped after an internal error: ") + e.what() +
        "; its clients see their connections close");
  }
  clients.clear();
  listen_fd.reset();
}

void TcpStoreServer::Impl::loop() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> ids;
  while (!stopping.load()) {
    fds.clear();
    ids.clear();
    fds.push_back({wake_fd.get(), POLLIN, 0});
    const bool accepting = net::Clock::now() >= accept_paused_until;
    net::Deadline next = accepting ? net::Deadline::max() : accept_paused_until;
    if (accepting) fds.push_back({listen_fd.get(), POLLIN, 0});
    const size_t first_client = fds.size();
    for (auto& [id, c] : clients) {
      short events = POLLIN;  // a closing client is read until it hangs up (see handshake::half_close)
      if (c->out_off < c->out.size()) events |= POLLOUT;
      fds.push_back({c->fd.get(), events, 0});
      ids.push_back(id);
      next = std::min(next, c->deadline);
    }
    const int timeout = next == net::Deadline::max() ? -1 : net::ms_until(next);
    const int n = ::poll(fds.data(), fds.size(), timeout);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw Error(std::string("poll failed: ") + std::strerror(errno));
    }
    if (fds[0].revents != 0) {
      uint64_t count = 0;
      while (::read(wake_fd.get(), &count, sizeof(count)) > 0) {
      }
    }
    if (stopping.load()) break;
    if (accepting && (fds[1].revents & POLLIN)) accept_clients();
    for (size_t i = 0; i < ids.size(); ++i) {
      const short revents = fds[first_client + i].revents;
      if (revents == 0) continue;
      auto found = clients.find(ids[i]);
      if (found == clients.end()) continue;  // evicted by accept_clients
      Client& c = *found->second;
      if (c.phase == Phase::kDead) continue;
      if (revents & POLLOUT) {
        flush(c);
        if (c.out.empty()) runnable.push_back(c.id);  // requests may wait behind that reply
      }
      if (c.phase == Phase::kClosing) {
        if (c.half_closed && (revents & (POLLIN | POLLERR | POLLHUP | POLLNVAL)) &&
            handshake::drain_until_closed(c.fd.get())) {
          c.phase = Phase::kDead;
        }
      } else if (c.phase != Phase::kDead && (revents & (POLLIN | POLLERR | POLLHUP | POLLNVAL))) {
        on_readable(c);
      }
    }
    expire(net::Clock::now());
    run_runnable();
    reap();
  }
}

void TcpStoreServer::Impl::accept_clients() {
  for (int i = 0; i < 64; ++i) {
    int fd = ::accept4(listen_fd.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      // Out of file descriptors, most likely: let the backlog wait instead of spinning on it.
      log(std::string("accept failed: ") + std::strerror(errno) + "; pausing accepts for 100 ms");
      accept_paused_until = net::Clock::now() + std::chrono::milliseconds(100);
      return;
    }
    evict_unproven_beyond(kMaxUnprovenClients - 1);
    auto c = std::make_unique<Client>();
    c->id = next_id++;
    c->fd = net::Fd(fd);
    net::set_nodelay(fd);
    c->peer = net::peer_string(fd);
    c->hs = std::make_unique<handshake::Server>(options.token);
    c->deadline = net::deadline_after(kHelloTimeout);
    clients.emplace(c->id, std::move(c));
  }
}

// Keeps at most `keep` connections that have not proved themselves, dropping the oldest: a job's
// own clients finish their handshake in one round trip, so the oldest are the idle ones.
void TcpStoreServer::Impl::evict_unproven_beyond(size_t keep) {
  size_t count = 0;
  for (const auto& [id, c] : clients) count += c->unproven() ? 1 : 0;
  for (auto it = clients.begin(); count > keep && it != clients.end(); ++it) {
    Client& c = *it->second;
    if (!c.unproven()) continue;
    if (evicted.fetch_add(1) % 100 == 0) {
      log("too many connections without a finished handshake (" + std::to_string(count) + "); dropping the " +
          "oldest, " + c.peer + " (" + std::to_string(evicted.load()) + " dropped so far)");
    }
    c.phase = Phase::kDead;
    c.fd.reset();
    --count;
  }
  reap();
}

void TcpStoreServer::Impl::on_readable(Client& c) {
  char buf[64 * 1024];
  // Bounded, so that one busy client cannot starve the others; poll() brings us back.
  for (int round = 0; round < 16 && !c.eof &&
       (c.phase == Phase::kHello || c.phase == Phase::kServing); ++round) {
    char* dst = buf;
    size_t room = sizeof(buf);
    if (c.receiving_value) {
      dst = &c.value[c.value_got];
      room = c.value.size() - c.value_got;
    } else if (c.skip > 0) {
      room = static_cast<size_t>(std::min<uint64_t>(room, c.skip));
    } else if (c.phase == Phase::kHello) {
      room = std::min(room, c.hs->want());  // never read past the handshake
      if (room == 0) break;
    }
    ssize_t k = ::recv(c.fd.get(), dst, room, MSG_DONTWAIT);
    if (k > 0) {
      const size_t got = static_cast<size_t>(k);
      if (c.receiving_value) {
        c.value_got += got;
        if (c.value_got == c.value.size()) finish_direct_set(c);
      } else if (c.skip > 0) {
        c.skip -= got;
      } else {
        c.in.append(buf, got);
        process(c);
      }
      if (got < room) break;
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    c.eof = true;  // orderly close (k == 0) or a reset: either way the peer is gone
  }
  process(c);
  if (c.phase == Phase::kServing || c.phase == Phase::kHello) {
    size_t pending = c.in.size() - c.in_off;
    if (pending > max_request_bytes) {
      drop_malformed(c, std::to_string(pending) + " bytes sent without waiting for replies");
    } else if (c.eof) {
      if (c.phase == Phase::kHello) pending += c.hs->partial();
      if ((pending > 0 || c.receiving_value || c.skip > 0) && !c.parked && c.out_off == c.out.size()) {
        drop_malformed(c, "connection closed in the middle of a " +
                              std::string(c.phase == Phase::kHello ? "handshake" : "request") + " (" +
                              std::to_string(pending + c.value_got) + " bytes of it arrived)");
      } else if (c.phase == Phase::kHello) {
        log("closing " + c.peer + ": it hung up during the handshake (a client with another job token "
            "gives up this way only if it is not a chorus client)");
      }
      c.phase = Phase::kDead;
    }
  }
}

void TcpStoreServer::Impl::drop_malformed(Client& c, const std::string& why) {
  malformed.fetch_add(1);
  log("dropping " + c.peer + ": malformed message: " + why);
  c.phase = Phase::kDead;
}

void TcpStoreServer::Impl::send(Client& c, std::string bytes) {
  if (c.out_off == c.out.size()) {
    c.out = std::move(bytes);  // the usual case: no copy of a large reply
    c.out_off = 0;
  } else {
    c.out += bytes;
  }
  flush(c);
}

void TcpStoreServer::Impl::flush(Client& c) {
  while (c.out_off < c.out.size()) {
    ssize_t k = ::send(c.fd.get(), c.out.data() + c.out_off, c.out.size() - c.out_off,
                       MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      c.out_off += static_cast<size_t>(k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    c.phase = Phase::kDead;  // the peer is gone; its waits die with it
    return;
  }
  c.out.clear();
  c.out.shrink_to_fit();  // a large reply's buffer is not kept for the connection's lifetime
  c.out_off = 0;
  if (c.phase == Phase::kClosing && !c.half_closed) {
    handshake::half_close(c.fd.get());
    c.half_closed = true;
  }
}

void TcpStoreServer::Impl::expire(net::Deadline now) {
  for (auto& [id, c] : clients) {
    if (c->deadline > now || c->phase == Phase::kDead) continue;
    if (c->parked) {
      std::vector<std::string> keys = c->parked_keys;
      unpark(*c);
      reply_timeout(*c, keys);
    } else if (c->phase == Phase::kHello) {
      log("closing " + c->peer + ": no finished handshake within " + net::format_duration(kHelloTimeout));
      c->phase = Phase::kDead;
    } else if (c->phase == Phase::kClosing) {
      c->phase = Phase::kDead;
    }
  }
}

// Clients whose wait ended may have requests queued behind it.
void TcpStoreServer::Impl::run_runnable() {
  while (!runnable.empty()) {
    const uint64_t id = runnable.back();
    runnable.pop_back();
    auto it = clients.find(id);
    if (it != clients.end()) process(*it->second);
  }
}

void TcpStoreServer::Impl::reap() {
  for (auto it = clients.begin(); it != clients.end();) {
    if (it->second->phase == Phase::kDead) {
      if (it->second->parked) unpark(*it->second);
      it = clients.erase(it);
    } else {
      ++it;
    }
  }
  runnable.clear();
}

TcpStoreServer::TcpStoreServer(TcpStoreServerOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->max_value = value_limit(impl_->options.max_value_bytes);
  impl_->max_request_bytes = 1 + 3 * 4 + kMaxKeyBytes + 2 * uint64_t{impl_->max_value};
  impl_->listen_fd = net::listen_tcp(impl_->options.host, impl_->options.port);
  net::set_nonblocking(impl_->listen_fd.get(), true);
  impl_->port = net::local_port(impl_->listen_fd.get());
  impl_->name = "TcpStoreServer(" +
                store_protocol::host_port(impl_->options.host.empty() ? "*" : impl_->options.host, impl_->port) +
                ")";
  impl_->wake_fd = net::Fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!impl_->wake_fd.valid()) {
    throw Error(impl_->name + ": eventfd failed: " + std::strerror(errno));
  }
  if (impl_->options.start_serving) start();
}

void TcpStoreServer::start() {
  std::lock_guard<std::mutex> lock(impl_->stop_mu);
  if (impl_->thread.joinable() || impl_->stopping.load()) return;
  Impl* impl = impl_.get();
  impl_->thread = std::thread([impl] { impl->run(); });
}

TcpStoreServer::~TcpStoreServer() { stop(); }

int TcpStoreServer::port() const { return impl_->port; }
int64_t TcpStoreServer::refused_connections() const { return impl_->refused.load(); }
int64_t TcpStoreServer::malformed_messages() const { return impl_->malformed.load(); }
int64_t TcpStoreServer::stored_bytes() const { return impl_->key_bytes.load(); }
int64_t TcpStoreServer::dropped_unproven() const { return impl_->evicted.load(); }

void TcpStoreServer::stop() {
  std::lock_guard<std::mutex> lock(impl_->stop_mu);
  impl_->stopping.store(true);
  uint64_t one = 1;
  ssize_t ignored = ::write(impl_->wake_fd.get(), &one, sizeof(one));
  (void)ignored;  // the counter cannot overflow with one write per stop()
  if (impl_->thread.joinable()) impl_->thread.join();
}

}  // namespace chorus
