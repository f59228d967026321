// TCP transport: two sockets per peer, one for each direction, non-blocking, driven by poll() from
// the caller's thread. See docs/threading.md and docs/wire-format.md. This file holds the posting
// API and the progress engine that moves posted sends and receives; the failure paths are
// tcp_transport_errors.cc, the mesh setup tcp_transport_setup.cc, the class tcp_transport.h.
//
// Why one socket per direction: on a socket that carries both directions, this rank's sendmsg holds
// the socket lock while it copies, so the peer's incoming segments queue on the socket's backlog and
// are processed by whichever of this rank's calls releases the lock next; sending and receiving
// serialise. With a socket per direction they proceed independently (about 1.2-1.6x the
// bidirectional throughput over loopback on the 2-core reference machine).

#include "error_class.h"
#include "tcp_transport.h"

#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "chorus/comm/error.h"

namespace chorus::transport::detail {
namespace {

using net::Clock;
using net::Deadline;

constexpr size_t kDirectReadBytes = 32 * 1024; // payload tails this large are read in place
// A receive this far from done sleeps until that much is in (SO_RCVLOWAT), up to the cap, rather
// than waking for every segment that arrives (wake_for).
constexpr size_t kWakeForBytes = 16 * 1024;
constexpr size_t kWakeForCapBytes = 1024 * 1024;

}  // namespace

std::string TcpTransport::peer_name(int peer) const {
  const Conn& c = conns_[static_cast<size_t>(peer)];
  std::string addr = c.addr;
  if (addr.empty() && connector_) addr = connector_->address_of(peer);
  return "rank " + std::to_string(peer) + " (" + (addr.empty() ? "?" : addr) + ")";
}

// `fd` is the connection this rank opened to `peer` (outgoing) or the one it accepted from it.
void TcpTransport::attach(int peer, net::Fd fd, bool outgoing) {
  Conn& c = conns_[static_cast<size_t>(peer)];
  c.peer = peer;
  net::set_nodelay(fd.get());
  net::set_nonblocking(fd.get(), true);
  if (buffer_bytes_ > 0) net::set_buffer_sizes(fd.get(), buffer_bytes_);
  if (outgoing) {
    c.addr = net::peer_string(fd.get());
    c.tx = std::move(fd);
  } else {
    c.rx = std::move(fd);
  }
}

void TcpTransport::set_buffers(int bytes) {
  buffer_bytes_ = bytes;
  for (auto& c : conns_) {
    if (c.tx.valid()) net::set_buffer_sizes(c.tx.get(), bytes);
    if (c.rx.valid()) net::set_buffer_sizes(c.rx.get(), bytes);
  }
}

int TcpTransport::connections() const {
  int n = connector_ ? 1 : 0;
  for (const auto& c : conns_) n += (c.tx.valid() ? 1 : 0) + (c.rx.valid() ? 1 : 0);
  return n;
}

void TcpTransport::begin(const wire::Call& call, Deadline deadline) {
  call_ = call;
  start_ = Clock::now();
  deadline_ = deadline;
}

Ticket TcpTransport::send(int peer, const wire::Header& header, const void* data, size_t n) {
  Conn& c = conn(peer);
  if (!c.tx.valid() && connector_ && !closed_ && !aborted_) connector_->connect_to(peer);
  Ticket t = next_ticket_++;
  c.sends.push_back(SendItem{t, header, static_cast<const char*>(data), n});
  pending_.insert(t);
  return t;
}

Ticket TcpTransport::recv(int peer, const wire::Call& expect, void* data, size_t n) {
  Conn& c = conn(peer);
  Ticket t = next_ticket_++;
  c.recvs.push_back(RecvItem{t, expect, static_cast<char*>(data), n});
  pending_.insert(t);
  return t;
}

// Looks at the first unread message of each candidate (read ahead into its inbox) and sleeps in
// poll() on every peer's connection meanwhile, so that any peer's death or abort ends the wait as
// it ends an operation's. Control messages stay where they are: progress() handles them later.
int TcpTransport::probe_any(const std::vector<int>& peers, int64_t tag) {
  if (closed_ || aborted_) throw Ranked<PeerError>(prefix() + ": the transport is closed");
  for (;;) {
    bool can_still_send = false;
    for (int p : peers) {
      Conn& c = conn(p);
      if (c.inbox_size() >= sizeof(wire::Header)) {
        const wire::Header h = peek_header(c);
        if (h.magic != wire::kMessageMagic || h.kind == wire::Kind::kAbort) handle_control(c, h);  // throws
        if (h.kind == wire::Kind::kData && h.op == wire::OpType::kSend && h.arg == tag) return p;
        continue;  // its next message is another one, or a goodbye: it cannot send this one
      }
      if (!c.said_goodbye && !c.quiet_hup) can_still_send = true;
    }
    if (!can_still_send) {
      std::string blocked;  // candidates whose next message is another one
      for (int p : peers) {
        const Conn& c = conns_[static_cast<size_t>(p)];
        if (c.inbox_size() < sizeof(wire::Header)) continue;
        const wire::Header h = peek_header(c);
        if (h.kind == wire::Kind::kData) blocked += "; " + peer_name(p) + "'s next message is " + wire::describe(h);
      }
      throw Ranked<MismatchError>(prefix() + " from any source: no rank it could come from can send a message with tag " +
                          std::to_string(tag) + " (the others closed their group)" + blocked +
                          "; every recv from any source needs a matching send");
    }
    pfds_.clear();
    pfd_conn_.clear();
    for (auto& c : conns_) {
      if (!c.rx.valid() || c.quiet_hup) continue;
      wake_for(c, 0);  // a message's header is awaited
      pfds_.push_back(pollfd{c.rx.get(), static_cast<short>(POLLIN | POLLRDHUP), 0});
      pfd_conn_.push_back(&c);
    }
    const size_t first = pfds_.size();  // then the connector's: a sender may be connecting
    Deadline wake = deadline_;
    if (connector_) connector_->prepare(&pfds_, &wake);
    if (Clock::now() >= deadline_) fail_probe_timeout(peers, tag);
    const int rc = ::poll(pfds_.data(), pfds_.size(), net::ms_until(wake));
    if (rc < 0 && errno != EINTR) throw Ranked<Error>(prefix() + ": poll failed: " + std::strerror(errno));
    if (connector_ && pfds_.size() > first) connector_->serve(pfds_, first);
    for (size_t i = 0; i < first; ++i) {
      const short re = pfds_[i].revents;
      if (re == 0) continue;
      if (re & POLLIN) {
        read_ahead(*pfd_conn_[i]);
      } else {
        check_hangup(*pfd_conn_[i], re);
      }
    }
  }
}

void TcpTransport::wait(Ticket ticket) {
  while (pending_.count(ticket) != 0) progress();
}

void TcpTransport::wait_all() {
  while (!pending_.empty()) progress();
}

void TcpTransport::abort(const std::string& reason, uint8_t error_class) {
  if (closed_) return;
  wire::Header h;
  h.kind = wire::Kind::kAbort;
  h.arg = error_class;
  h.payload = reason.size();
  say_to_all(h, reason);
  // Half-close only; the sockets close with the group. (The abort travels on tx, which the peer
  // never writes to, so closing it later cannot reset the connection under the unread message.)
  for (auto& c : conns_) {
    if (c.tx.valid()) ::shutdown(c.tx.get(), SHUT_WR);
  }
  connector_.reset();  // peers that would connect now are refused: they learn this rank is gone
  aborted_ = true;
  pending_.clear();
  for (auto& c : conns_) {
    c.sends.clear();
    c.recvs.clear();
  }
}

void TcpTransport::close() {
  if (closed_) return;
  if (aborted_) {
    shutdown_all();
    return;
  }
  wire::Header h;
  h.kind = wire::Kind::kGoodbye;
  say_to_all(h, "");
  shutdown_all();
}

TcpTransport::Conn& TcpTransport::conn(int peer) {
  if (peer < 0 || peer >= size_ || peer == rank_) {
    throw UsageError("rank " + std::to_string(rank_) + ": invalid peer rank " + std::to_string(peer) +
                     " for a group of size " + std::to_string(size_));
  }
  return conns_[static_cast<size_t>(peer)];
}

// Best effort: the peer may already be gone; bounded so a full socket cannot stall us.
void TcpTransport::say_to_all(const wire::Header& h, const std::string& payload) {
  Deadline dl = Clock::now() + std::chrono::milliseconds(200);
  for (auto& c : conns_) {
    if (!c.tx.valid()) continue;
    if (!c.sends.empty() && c.sends.front().off > 0) {
      // Finish the message in flight (its buffer is still alive: the operation has not
      // returned), so the peer can read what comes after it.
      SendItem& f = c.sends.front();
      if (f.off < sizeof(wire::Header)) {
        const char* hp = reinterpret_cast<const char*>(&f.header);
        if (!net::write_full(c.tx.get(), hp + f.off, sizeof(wire::Header) - f.off, dl).ok()) continue;
        f.off = sizeof(wire::Header);
      }
      size_t done = f.off - sizeof(wire::Header);
      if (!net::write_full(c.tx.get(), f.data + done, f.n - done, dl).ok()) continue;
    }
    if (!net::write_full(c.tx.get(), &h, sizeof(h), dl).ok()) continue;
    if (!payload.empty()) net::write_full(c.tx.get(), payload.data(), payload.size(), dl);
  }
}

void TcpTransport::shutdown_all() {
  closed_ = true;
  connector_.reset();
  for (auto& c : conns_) {
    if (c.tx.valid()) ::shutdown(c.tx.get(), SHUT_WR);
  }
  for (auto& c : conns_) {
    c.tx.reset();
    c.rx.reset();
  }
  pending_.clear();
}

// Reads whatever is available into the inbox. Returns bytes read; 0 with *eof when closed.
size_t TcpTransport::fill_inbox(Conn& c, size_t want, bool* eof) {
  *eof = false;
  if (c.in_begin == c.in_end) c.in_begin = c.in_end = 0;
  if (c.inbox.size() - c.in_end < want) {
    std::memmove(c.inbox.data(), c.inbox.data() + c.in_begin, c.inbox_size());
    c.in_end -= c.in_begin;
    c.in_begin = 0;
  }
  if (c.inbox.size() - c.in_end < want) c.inbox.resize(std::max(c.inbox.size() * 2, c.in_end + want));
  size_t room = c.inbox.size() - c.in_end;
  for (;;) {
    ssize_t k = ::recv(c.rx.get(), c.inbox.data() + c.in_end, room, MSG_DONTWAIT);
    if (k > 0) {
      c.in_end += static_cast<size_t>(k);
      return static_cast<size_t>(k);
    }
    if (k == 0) {
      *eof = true;
      return 0;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    if (errno == ECONNRESET) {
      *eof = true;
      return 0;
    }
    fail_io(c, errno, "receiving from");
  }
}

// Makes what progress is possible on c's receives without blocking. Returns true if any.
bool TcpTransport::pump_recvs(Conn& c) {
  bool progressed = false;
  while (!c.recvs.empty()) {
    RecvItem& r = c.recvs.front();
    if (!r.have_header) {
      while (c.inbox_size() < sizeof(wire::Header)) {
        bool eof = false;
        if (fill_inbox(c, sizeof(wire::Header), &eof) == 0) {
          if (eof) fail_closed(c, "while this rank waited for its data");
          return progressed;
        }
        progressed = true;
      }
      wire::Header h = peek_header(c);
      if (handle_control(c, h)) {
        if (c.said_goodbye) fail_closed(c, "");
        continue;
      }
      if (!wire::same_call(h, r.expect)) {
        throw Ranked<MismatchError>(wire::mismatch_message("chorus: rank " + std::to_string(rank_), r.expect,
                                                   peer_name(c.peer), "called " + wire::describe(h)));
      }
      if (h.payload != r.n) {
        throw Ranked<MismatchError>(prefix() + ": " + peer_name(c.peer) + " sent " + std::to_string(h.payload) +
                            " bytes where this rank expected " + std::to_string(r.n) +
                            "; the ranks disagree about per-rank sizes, or about the options that shape an "
                            "algorithm's messages (allreduce_algorithm, segment_bytes, link_latency_us, "
                            "link_gbit_per_s, or CHORUS_ALLREDUCE_ALGORITHM, CHORUS_LINK_LATENCY_US, "
                            "CHORUS_LINK_GBIT in a rank's environment): give every rank the same");
      }
      c.in_begin += sizeof(wire::Header);
      r.have_header = true;
      progressed = true;
    }
    // Payload: first what the inbox already holds, then large tails straight into place.
    size_t take = std::min(c.inbox_size(), r.n - r.got);
    if (take > 0) {
      std::memcpy(r.data + r.got, c.inbox.data() + c.in_begin, take);
      c.in_begin += take;
      r.got += take;
      progressed = true;
    }
    while (r.got < r.n) {
      size_t left = r.n - r.got;
      if (left >= kDirectReadBytes) {
        ssize_t k = ::recv(c.rx.get(), r.data + r.got, left, MSG_DONTWAIT);
        if (k > 0) {
          r.got += static_cast<size_t>(k);
          progressed = true;
          continue;
        }
        if (k == 0) fail_closed(c, "in the middle of a message");
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return progressed;
        fail_io(c, errno, "receiving from");
      }
      bool eof = false;
      if (fill_inbox(c, left, &eof) == 0) {
        if (eof) fail_closed(c, "in the middle of a message");
        return progressed;
      }
      take = std::min(c.inbox_size(), left);
      std::memcpy(r.data + r.got, c.inbox.data() + c.in_begin, take);
      c.in_begin += take;
      r.got += take;
      progressed = true;
    }
    pending_.erase(r.ticket);
    c.recvs.pop_front();
  }
  return progressed;
}

// Sets c's rx socket to wake poll() once `bytes` (capped) have arrived, or at once when fewer than
// kWakeForBytes are awaited. Only ever the rest of a message whose header has been read: its sender
// has committed to every byte, and the kernel still wakes the reader on a hangup, under memory
// pressure, or when the receive window closes, so no rank waits on bytes that cannot come. Where
// ranks share cores every wake-up costs a turn behind the others on the core: at 8 namespace hosts
// on 2 cores over 10 Gbit/s, Rabenseifner at 1 MiB took about 9% less time (docs/benchmarks.md);
// over loopback with a core per rank it measured the same.
void TcpTransport::wake_for(Conn& c, size_t bytes) {
  const int want = bytes >= kWakeForBytes ? static_cast<int>(std::min(bytes, kWakeForCapBytes)) : 1;
  if (want == c.lowat || !c.rx.valid()) return;
  if (::setsockopt(c.rx.get(), SOL_SOCKET, SO_RCVLOWAT, &want, sizeof(want)) == 0) c.lowat = want;
}

bool TcpTransport::pump_sends(Conn& c) {
  bool progressed = false;
  if (c.said_goodbye) fail_closed(c, "");
  while (!c.sends.empty()) {
    SendItem& s = c.sends.front();
    const size_t total = sizeof(wire::Header) + s.n;
    iovec iov[2];
    int iovcnt = 0;
    if (s.off < sizeof(wire::Header)) {
      iov[iovcnt++] = {reinterpret_cast<char*>(&s.header) + s.off, sizeof(wire::Header) - s.off};
      if (s.n > 0) iov[iovcnt++] = {const_cast<char*>(s.data), s.n};
    } else {
      iov[iovcnt++] = {const_cast<char*>(s.data) + (s.off - sizeof(wire::Header)), total - s.off};
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(iovcnt);
    ssize_t k = ::sendmsg(c.tx.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return progressed;
      fail_io(c, errno, "sending to");
    }
    progressed = true;
    s.off += static_cast<size_t>(k);
    if (s.off == total) {
      pending_.erase(s.ticket);
      c.sends.pop_front();
    }
  }
  return progressed;
}

// Buffers what a peer sends while this rank has no receive posted for it (the inbox grows), so
// that a rank blocked in a send never blocks a peer that is itself blocked sending.
void TcpTransport::read_ahead(Conn& c) {
  bool eof = false;
  while (fill_inbox(c, kInboxBytes, &eof) > 0) {
  }
  if (!eof) return;
  if (c.inbox_size() >= sizeof(wire::Header)) {
    // A goodbye or an abort at the front speaks for itself; data belongs to a later operation,
    // which will see the end of the stream after it.
    if (handle_control(c, peek_header(c)) && !c.sends.empty()) fail_closed(c, "");
    c.quiet_hup = true;
    return;
  }
  fail_closed(c, c.sends.empty() ? "while this rank was in an operation with other peers"
                                 : "while this rank was sending to it");
}

// Moves what can move on every connection without blocking; true if anything did.
bool TcpTransport::pump_all() {
  bool progressed = false;
  for (auto& c : conns_) {
    if (!c.sends.empty() && c.tx.valid()) progressed |= pump_sends(c);
    if (!c.recvs.empty() && c.rx.valid()) progressed |= pump_recvs(c);
  }
  return progressed;
}

// One round: try every connection with work; if nothing moved, sleep in poll() until
// something can, watching idle connections for hangups (and, when lazy, the listener and the
// connections being made).
void TcpTransport::progress() {
  if (closed_ || aborted_) {
    throw Ranked<PeerError>(prefix() + ": the transport is closed");
  }
  if (pump_all() || pending_.empty()) return;
  if (spin_us_ > 0 && (spin_gate_ == nullptr || spin_gate_->load(std::memory_order_relaxed) > 0)) {
    auto until = Clock::now() + std::chrono::microseconds(spin_us_);
    while (Clock::now() < until) {
      if (pump_all()) return;
    }
  }
  pfds_.clear();
  pfd_conn_.clear();
  bool sending = false;
  for (const auto& c : conns_) sending |= !c.sends.empty();
  for (auto& c : conns_) {
    // tx is watched only while it has something to send; an error on it surfaces in sendmsg.
    if (!c.sends.empty() && c.tx.valid()) {
      pfds_.push_back(pollfd{c.tx.get(), POLLOUT, 0});
      pfd_conn_.push_back(nullptr);
    }
    if (!c.rx.valid()) continue;
    const bool in_payload = !c.recvs.empty() && c.recvs.front().have_header;
    wake_for(c, in_payload ? c.recvs.front().n - c.recvs.front().got : 0);
    const bool busy = !c.sends.empty() || !c.recvs.empty();
    if (!busy && c.quiet_hup) continue;
    // Every peer's rx is watched for hangups, so a peer's death fails this operation at once
    // even when the operation is waiting on someone else.
    short ev = c.quiet_hup ? 0 : POLLRDHUP;
    // While this rank is blocked sending, it also reads from every peer: a peer blocked sending
    // to it (send/recv posted in the same order on both sides, or a ring of sends) can go on.
    if (!c.recvs.empty() || (sending && !c.quiet_hup)) ev |= POLLIN;
    pfds_.push_back(pollfd{c.rx.get(), ev, 0});
    pfd_conn_.push_back(&c);
  }
  const size_t first = pfds_.size();  // the connector's entries follow
  Deadline wake = deadline_;
  if (connector_) connector_->prepare(&pfds_, &wake);
  if (Clock::now() >= deadline_) fail_timeout();
  int rc = ::poll(pfds_.data(), pfds_.size(), net::ms_until(wake));
  if (rc < 0 && errno != EINTR) {
    throw Ranked<Error>(prefix() + ": poll failed: " + std::strerror(errno));
  }
  if (rc == 0 && Clock::now() >= deadline_) fail_timeout();
  if (connector_ && pfds_.size() > first) connector_->serve(pfds_, first);
  for (size_t i = 0; i < first; ++i) {
    if (pfd_conn_[i] == nullptr) continue;  // a tx: the next round's sendmsg moves on or fails
    Conn& c = *pfd_conn_[i];
    short re = pfds_[i].revents;
    if (re == 0) continue;
    if (c.recvs.empty() && (re & POLLIN)) {
      read_ahead(c);
      continue;
    }
    // Receives see the end of the stream themselves; otherwise look at what the peer said.
    if (c.recvs.empty() && (re & (POLLRDHUP | POLLHUP | POLLERR))) check_hangup(c, re);
  }
}

}  // namespace chorus::transport::detail
