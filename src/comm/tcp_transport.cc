// TCP transport: two sockets per peer, one for each direction, non-blocking, driven by poll() from
// the caller's thread. See docs/threading.md and docs/wire-format.md.
//
// Why one socket per direction: on a socket that carries both directions, this rank's sendmsg holds
// the socket lock while it copies, so the peer's incoming segments queue on the socket's backlog and
// are processed by whichever of this rank's calls releases the lock next; sending and receiving
// serialise. With a socket per direction they proceed independently (about 1.2-1.6x the
// bidirectional throughput over loopback on the 2-core reference machine).

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <sstream>
#include <unordered_set>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/comm/log.h"
#include "chorus/comm/random.h"
#include "chorus/comm/rendezvous.h"
#include "chorus/comm/store.h"
#include "handshake.h"
#include "transport.h"

namespace chorus::transport {
namespace {

using net::Clock;
using net::Deadline;

constexpr size_t kInboxBytes = 64 * 1024;     // read-ahead buffer per connection
constexpr size_t kDirectReadBytes = 32 * 1024; // payload tails this large are read in place
constexpr std::chrono::milliseconds kRelayWait(500);  // how long a failing peer's abort is looked for

struct Conn {
  int peer = -1;
  net::Fd tx;        // this rank -> peer: the connection this rank opened; only ever written
  net::Fd rx;        // peer -> this rank: the connection the peer opened; only ever read
  std::string addr;  // the peer's listening address
  std::deque<SendItem> sends;
  std::deque<RecvItem> recvs;
  std::vector<char> inbox = std::vector<char>(kInboxBytes);
  size_t in_begin = 0;
  size_t in_end = 0;
  bool said_goodbye = false;  // the peer sent a goodbye: it closed its group cleanly
  bool quiet_hup = false;     // a hangup was seen but data is still queued ahead of it

  size_t inbox_size() const { return in_end - in_begin; }
};

class TcpTransport final : public Transport {
 public:
  TcpTransport(int rank, int size, int spin_us) : rank_(rank), size_(size), spin_us_(spin_us) {
    conns_.resize(static_cast<size_t>(size));
  }
  ~TcpTransport() override { close(); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string kind() const override { return "tcp"; }
  std::string peer_name(int peer) const override {
    const Conn& c = conns_[static_cast<size_t>(peer)];
    return "rank " + std::to_string(peer) + " (" + (c.addr.empty() ? "?" : c.addr) + ")";
  }

  // `fd` is the connection this rank opened to `peer` (outgoing) or the one it accepted from it.
  void attach(int peer, net::Fd fd, bool outgoing) {
    Conn& c = conns_[static_cast<size_t>(peer)];
    c.peer = peer;
    net::set_nodelay(fd.get());
    net::set_nonblocking(fd.get(), true);
    if (outgoing) {
      c.addr = net::peer_string(fd.get());
      c.tx = std::move(fd);
    } else {
      c.rx = std::move(fd);
    }
  }

  void set_buffers(int bytes) {
    for (auto& c : conns_) {
      if (c.tx.valid()) net::set_buffer_sizes(c.tx.get(), bytes);
      if (c.rx.valid()) net::set_buffer_sizes(c.rx.get(), bytes);
    }
  }

  // Busy-polling pays off at every size while a thread waits on the group (small messages: the
  // latency of a wake-up; large ones: 15-20% more bandwidth over loopback, measured on the 2-core
  // reference machine), but not while the caller computes (DDP's backward): then the core belongs
  // to the computation, so the poll sleeps at once.
  void set_spin_gate(const std::atomic<int>* gate) override { spin_gate_ = gate; }

  void begin(const wire::Call& call, Deadline deadline) override {
    call_ = call;
    start_ = Clock::now();
    deadline_ = deadline;
  }

  Ticket send(int peer, const wire::Header& header, const void* data, size_t n) override {
    Conn& c = conn(peer);
    Ticket t = next_ticket_++;
    c.sends.push_back(SendItem{t, header, static_cast<const char*>(data), n});
    pending_.insert(t);
    return t;
  }

  Ticket recv(int peer, const wire::Call& expect, void* data, size_t n) override {
    Conn& c = conn(peer);
    Ticket t = next_ticket_++;
    c.recvs.push_back(RecvItem{t, expect, static_cast<char*>(data), n});
    pending_.insert(t);
    return t;
  }

  void wait(Ticket ticket) override {
    while (pending_.count(ticket) != 0) progress();
  }

  void wait_all() override {
    while (!pending_.empty()) progress();
  }

  void abort(const std::string& reason, uint8_t error_class) override {
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
    aborted_ = true;
    pending_.clear();
    for (auto& c : conns_) {
      c.sends.clear();
      c.recvs.clear();
    }
  }

  void close() override {
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

 private:
  Conn& conn(int peer) {
    if (peer < 0 || peer >= size_ || peer == rank_) {
      throw UsageError("rank " + std::to_string(rank_) + ": invalid peer rank " + std::to_string(peer) +
                       " for a group of size " + std::to_string(size_));
    }
    return conns_[static_cast<size_t>(peer)];
  }

  std::string prefix() const {
    return "chorus: rank " + std::to_string(rank_) + ": " + wire::describe(call_);
  }

  // Best effort: the peer may already be gone; bounded so a full socket cannot stall us.
  void say_to_all(const wire::Header& h, const std::string& payload) {
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

  void shutdown_all() {
    closed_ = true;
    for (auto& c : conns_) {
      if (c.tx.valid()) ::shutdown(c.tx.get(), SHUT_WR);
    }
    for (auto& c : conns_) {
      c.tx.reset();
      c.rx.reset();
    }
    pending_.clear();
  }

  [[noreturn]] void fail_closed(Conn& c, const std::string& how) {
    relay_abort(c);
    std::string why = c.said_goodbye
        ? " has closed its process group (it finished or destroyed the group) but this operation "
          "still needs it; check that every rank runs the same operations"
        : " closed its connection " + how +
          ": its process probably died (killed, crashed, or exited without closing its group)";
    throw PeerError(prefix() + ": peer " + peer_name(c.peer) + why + " [after " +
                    net::format_duration(Clock::now() - start_) + "]");
  }

  // A peer that failed sends an abort message before it shuts its side down; if one is waiting
  // between messages on this connection, raise the peer's own error, which names the root cause.
  // A peer that fails finishes the message it is sending before its abort (say_to_all), and
  // messages this rank has not asked for yet may be queued ahead of it: they are skipped (the
  // operation fails anyway), for at most kRelayWait.
  void relay_abort(Conn& c) {
    if (relaying_ || !c.rx.valid()) return;
    relaying_ = true;
    const Deadline dl = Clock::now() + kRelayWait;
    try {
      size_t skip = 0;  // payload bytes of the message being received still to come
      if (!c.recvs.empty() && c.recvs.front().have_header) skip = c.recvs.front().n - c.recvs.front().got;
      for (bool eof = false;;) {
        const size_t k = std::min(skip, c.inbox_size());
        c.in_begin += k;
        skip -= k;
        if (skip == 0 && c.inbox_size() >= sizeof(wire::Header)) {
          const wire::Header h = peek_header(c);
          if (h.magic != wire::kMessageMagic || h.kind != wire::Kind::kData) break;  // control: read below
          c.in_begin += sizeof(h);
          skip = h.payload;
          continue;
        }
        if (eof || Clock::now() >= dl) break;
        if (fill_inbox(c, skip > 0 ? std::min(skip, kInboxBytes) : sizeof(wire::Header), &eof) == 0 && !eof) {
          pollfd p{c.rx.get(), POLLIN, 0};
          ::poll(&p, 1, 1);
        }
      }
    } catch (const Error&) {
    }
    relaying_ = false;
    if (c.inbox_size() >= sizeof(wire::Header)) {
      wire::Header h = peek_header(c);
      if (h.magic == wire::kMessageMagic && h.kind == wire::Kind::kAbort) handle_control(c, h);
      if (h.magic == wire::kMessageMagic && h.kind == wire::Kind::kGoodbye) c.said_goodbye = true;
    }
  }

  [[noreturn]] void fail_io(Conn& c, int err, const char* what) {
    if (err == EPIPE || err == ECONNRESET) fail_closed(c, std::string("(") + std::strerror(err) + ")");
    throw PeerError(prefix() + ": " + what + " " + peer_name(c.peer) + " failed: " +
                    std::strerror(err) + " (errno " + std::to_string(err) + ")");
  }

  // Reads whatever is available into the inbox. Returns bytes read; 0 with *eof when closed.
  size_t fill_inbox(Conn& c, size_t want, bool* eof) {
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

  wire::Header peek_header(const Conn& c) const {
    wire::Header h;
    std::memcpy(&h, c.inbox.data() + c.in_begin, sizeof(h));
    return h;
  }

  // Handles an abort or goodbye at the front of the inbox; returns false for a data header.
  bool handle_control(Conn& c, const wire::Header& h) {
    if (h.magic != wire::kMessageMagic) {
      throw PeerError(prefix() + ": received a corrupt message header from " + peer_name(c.peer) +
                      " (bad magic); the stream is out of sync");
    }
    if (h.kind == wire::Kind::kGoodbye) {
      c.in_begin += sizeof(h);
      c.said_goodbye = true;
      return true;
    }
    if (h.kind != wire::Kind::kAbort) return false;
    c.in_begin += sizeof(h);
    std::string text(std::min<uint64_t>(h.payload, 1 << 20), '\0');
    size_t have = std::min(text.size(), c.inbox_size());
    std::memcpy(text.data(), c.inbox.data() + c.in_begin, have);
    c.in_begin += have;
    if (have < text.size()) {
      net::read_full(c.rx.get(), text.data() + have, text.size() - have,
                     Clock::now() + std::chrono::milliseconds(500));
    }
    throw_error(h.arg, prefix() + ": failed because " + peer_name(c.peer) + " failed: " + text);
  }

  // Makes what progress is possible on c's receives without blocking. Returns true if any.
  bool pump_recvs(Conn& c) {
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
          throw MismatchError(wire::mismatch_message("chorus: rank " + std::to_string(rank_), r.expect,
                                                     peer_name(c.peer), "called " + wire::describe(h)));
        }
        if (h.payload != r.n) {
          throw MismatchError(prefix() + ": " + peer_name(c.peer) + " sent " + std::to_string(h.payload) +
                              " bytes where this rank expected " + std::to_string(r.n) +
                              "; the ranks disagree about per-rank sizes");
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

  bool pump_sends(Conn& c) {
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
  void read_ahead(Conn& c) {
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

  // A connection with nothing posted reported a hangup or error: learn whether the peer said
  // goodbye, aborted, or died.
  void check_hangup(Conn& c, short revents) {
    if (revents & POLLERR) {
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(c.rx.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) fail_io(c, err, "connection to");
    }
    bool eof = false;
    while (c.inbox_size() < sizeof(wire::Header)) {
      if (fill_inbox(c, sizeof(wire::Header), &eof) == 0) break;
    }
    if (c.inbox_size() >= sizeof(wire::Header)) {
      wire::Header h = peek_header(c);
      if (handle_control(c, h)) {
        if (!c.sends.empty()) fail_closed(c, "");
        c.quiet_hup = true;  // goodbye: benign until an operation needs this peer
        return;
      }
      c.quiet_hup = true;  // data queued for a later operation; that operation will see the end
      return;
    }
    if (eof) {
      fail_closed(c, c.sends.empty() ? "while this rank was in an operation with other peers"
                                     : "while this rank was sending to it");
    }
    if (revents & POLLHUP) fail_closed(c, "(hangup)");
  }

  [[noreturn]] void fail_timeout() {
    std::ostringstream out;
    out << prefix() << ": timed out after " << net::format_duration(Clock::now() - start_);
    const char* sep = " waiting for ";
    for (const auto& c : conns_) {
      if (!c.recvs.empty()) {
        const RecvItem& r = c.recvs.front();
        out << sep << peer_name(c.peer) << " to send "
            << (r.have_header ? std::to_string(r.n - r.got) + " more of " + std::to_string(r.n) + " bytes"
                              : "its next message");
        sep = "; and for ";
      } else if (!c.sends.empty()) {
        out << sep << peer_name(c.peer) << " to take " << (sizeof(wire::Header) + c.sends.front().n - c.sends.front().off)
            << " more bytes (it has not posted the matching receive)";
        sep = "; and for ";
      }
    }
    out << ". The peer may be stuck or slower, or may be calling a different collective; if it is "
           "legitimately slow, raise the timeout in the group's Options";
    throw TimeoutError(out.str());
  }

  // One round: try every connection with work; if nothing moved, sleep in poll() until
  // something can, watching idle connections for hangups.
  void progress() {
    if (closed_ || aborted_) {
      throw PeerError(prefix() + ": the transport is closed");
    }
    bool progressed = false;
    for (auto& c : conns_) {
      if (!c.rx.valid()) continue;
      if (!c.sends.empty()) progressed |= pump_sends(c);
      if (!c.recvs.empty()) progressed |= pump_recvs(c);
    }
    if (progressed || pending_.empty()) return;
    if (spin_us_ > 0 && (spin_gate_ == nullptr || spin_gate_->load(std::memory_order_relaxed) > 0)) {
      auto until = Clock::now() + std::chrono::microseconds(spin_us_);
      while (Clock::now() < until) {
        for (auto& c : conns_) {
          if (!c.rx.valid()) continue;
          if (!c.sends.empty()) progressed |= pump_sends(c);
          if (!c.recvs.empty()) progressed |= pump_recvs(c);
        }
        if (progressed) return;
      }
    }
    pfds_.clear();
    pfd_conn_.clear();
    bool sending = false;
    for (const auto& c : conns_) sending |= !c.sends.empty();
    for (auto& c : conns_) {
      if (!c.rx.valid()) continue;
      // tx is watched only while it has something to send; an error on it surfaces in sendmsg.
      if (!c.sends.empty()) {
        pfds_.push_back(pollfd{c.tx.get(), POLLOUT, 0});
        pfd_conn_.push_back(nullptr);
      }
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
    if (Clock::now() >= deadline_) fail_timeout();
    int rc = ::poll(pfds_.data(), pfds_.size(), net::ms_until(deadline_));
    if (rc < 0 && errno != EINTR) {
      throw Error(prefix() + ": poll failed: " + std::strerror(errno));
    }
    if (rc == 0 && Clock::now() >= deadline_) fail_timeout();
    for (size_t i = 0; i < pfds_.size(); ++i) {
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

  int rank_;
  int size_;
  int spin_us_;
  const std::atomic<int>* spin_gate_ = nullptr;  // threads blocked on the group; spin only if > 0
  std::vector<Conn> conns_;
  std::unordered_set<Ticket> pending_;
  Ticket next_ticket_ = 1;
  wire::Call call_;
  Clock::time_point start_ = Clock::now();
  Deadline deadline_ = Deadline::max();
  bool closed_ = false;
  bool aborted_ = false;
  bool relaying_ = false;
  std::vector<pollfd> pfds_;
  std::vector<Conn*> pfd_conn_;  // the Conn of each rx in pfds_; nullptr for a tx
};

std::string hello_payload(const TcpOptions& o, int to) {
  return "group=" + o.group_name + "\nworld_size=" + std::to_string(o.size) + "\nfrom=" +
         std::to_string(o.rank) + "\nto=" + std::to_string(to);
}

// Parses "k=v\n..." into the four fields; false if any is missing.
bool parse_payload(const std::string& p, std::string* group, int* world, int* from, int* to) {
  std::istringstream in(p);
  std::string line;
  int found = 0;
  while (std::getline(in, line)) {
    auto eq = line.find('=');
    if (eq == std::string::npos) return false;
    std::string k = line.substr(0, eq), v = line.substr(eq + 1);
    try {
      if (k == "group") { *group = v; found |= 1; }
      else if (k == "world_size") { *world = std::stoi(v); found |= 2; }
      else if (k == "from") { *from = std::stoi(v); found |= 4; }
      else if (k == "to") { *to = std::stoi(v); found |= 8; }
    } catch (...) {
      return false;
    }
  }
  return found == 15;
}



// A connection to the listener may be a rank of this group, a rank of another job, or anything
// else (a port scanner, an idle client). None may hold up the group: every connection is served
// concurrently by one poll loop, has its own short budget, and past a cap the oldest unproven one is
// dropped. Peers prove the job token before anything about the group is checked.
constexpr auto kIncomingBudget = std::chrono::seconds(5);
constexpr size_t kMaxUnprovenIncoming = 64;
// A refused peer gets this long to read its verdict and close before this side closes.
constexpr auto kLinger = std::chrono::milliseconds(1000);
// How often the store is asked for the addresses still missing: fast at first, then backing off.
constexpr auto kFirstStorePoll = std::chrono::milliseconds(2);
constexpr auto kMaxStorePoll = std::chrono::milliseconds(100);

// The setup of one rank's mesh: publish this rank's address; connect to every other rank and prove
// the token on that connection; accept one proven connection from every other rank. All of it
// runs at once from one poll loop, so no peer, slow or absent or hostile, delays the others, and a
// timeout names exactly the ranks that did not do their part.
class MeshSetup {
 public:
  MeshSetup(const TcpOptions& o, TcpTransport* t, std::string secret)
      : o_(o), t_(t), secret_(std::move(secret)), me_("rank " + std::to_string(o.rank)),
        out_(static_cast<size_t>(o.size)), seen_(static_cast<size_t>(o.size), false) {}

  void run() {
    const std::string host = o_.advertise_host.empty() ? "127.0.0.1" : o_.advertise_host;
    // Loopback-only jobs listen on loopback; otherwise on every interface of the advertised family.
    const bool ipv6 = host.find(':') != std::string::npos;
    listener_ = net::listen_tcp(host == "127.0.0.1" ? "127.0.0.1" : (ipv6 ? "::" : ""), 0);
    net::set_nonblocking(listener_.get(), true);
    listen_addr_ = (ipv6 ? "[" + host + "]" : host) + ":" + std::to_string(net::local_port(listener_.get()));
    o_.store->set(o_.key_prefix + "/addr/" + std::to_string(o_.rank), listen_addr_);
    for (int p = 0; p < o_.size; ++p) {
      if (p != o_.rank) ++outgoing_left_;
    }
    incoming_left_ = outgoing_left_;
    try {
      loop();
    } catch (const Error& e) {
      farewell(e.what());
      throw;
    }
    // Refused strangers: their verdicts are out and followed by an end of stream; drop what they
    // sent, so that closing sends no reset, but do not wait for them.
    for (auto& c : in_) {
      if (!c.fd.valid() || !c.closing) continue;
      flush_closing(c);
      handshake::drain_until_closed(c.fd.get());
    }
    in_.clear();
  }

 private:
  struct Outgoing {
    enum State { kNeedAddr, kWaitRetry, kConnecting, kHandshaking, kDone };
    State state = kNeedAddr;
    std::string addr, host;
    int port = 0;
    net::Fd fd;
    std::unique_ptr<handshake::Client> hs;
    std::string out;  // bytes still to send (hello, proof)
    Deadline retry_at{};
    std::chrono::milliseconds backoff{5};
    std::string last_error;
    std::string what() const { return "rank " + std::to_string(peer) + " at " + addr; }
    int peer = -1;
  };
  struct Incoming {
    net::Fd fd;
    std::string from;  // the peer's address
    std::unique_ptr<handshake::Server> hs;
    std::string out;
    Deadline until{};  // the handshake budget, or the end of the linger once closing
    bool closing = false;
    bool half_closed = false;
  };

  std::string prefix() const { return "chorus: " + me_ + ": group '" + o_.group_name + "' setup"; }

  // One log line about a connection this rank dropped or refused; a flood of them is summed up.
  void note(const std::string& what, const std::string& from, const std::string& why) {
    ++noted_;
    if (noted_ <= 5 || noted_ % 100 == 0) {
      const std::string tail = noted_ == 5  ? " (further lines like this are suppressed; every 100th is shown)"
                               : noted_ > 5 ? " (" + std::to_string(noted_) + " so far)"
                                            : "";
      chorus::log(LogLevel::kWarning, me_ + ": " + what + " a connection from " + from + ": " + why + tail);
    }
  }

  void loop() {
    for (int p = 0; p < o_.size; ++p) out_[static_cast<size_t>(p)].peer = p;
    auto store_poll = kFirstStorePoll;
    Deadline next_store_check = Clock::now();
    std::vector<pollfd> pfds;
    std::vector<std::pair<int, size_t>> what;  // per pollfd: 0 listener, 1 outgoing peer, 2 incoming index
    while (outgoing_left_ > 0 || incoming_left_ > 0) {
      Deadline now = Clock::now();
      if (now >= o_.deadline) fail_timeout();
      if (missing_addresses() > 0 && now >= next_store_check) {
        look_up_addresses();
        store_poll = std::min(store_poll * 2, std::chrono::duration_cast<std::chrono::milliseconds>(kMaxStorePoll));
        next_store_check = Clock::now() + store_poll;
      }
      Deadline wake = o_.deadline;
      if (missing_addresses() > 0) wake = std::min(wake, next_store_check);
      for (auto& c : out_) {
        if (c.state == Outgoing::kWaitRetry) {
          if (Clock::now() >= c.retry_at) start_connect(c);
          if (c.state == Outgoing::kWaitRetry) wake = std::min(wake, c.retry_at);
        }
      }
      expire_incoming();
      pfds.clear();
      what.clear();
      pfds.push_back(pollfd{listener_.get(), POLLIN, 0});
      what.emplace_back(0, 0);
      for (auto& c : out_) {
        if (c.state == Outgoing::kConnecting) {
          pfds.push_back(pollfd{c.fd.get(), POLLOUT, 0});
        } else if (c.state == Outgoing::kHandshaking) {
          pfds.push_back(pollfd{c.fd.get(), static_cast<short>(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
        } else {
          continue;
        }
        what.emplace_back(1, static_cast<size_t>(c.peer));
      }
      for (size_t i = 0; i < in_.size(); ++i) {
        pfds.push_back(pollfd{in_[i].fd.get(), static_cast<short>(POLLIN | (in_[i].out.empty() ? 0 : POLLOUT)), 0});
        what.emplace_back(2, i);
        wake = std::min(wake, in_[i].until);
      }
      int rc = ::poll(pfds.data(), pfds.size(), net::ms_until(wake));
      if (rc < 0 && errno != EINTR) throw Error(prefix() + ": poll failed: " + std::strerror(errno));
      for (size_t i = 0; rc > 0 && i < pfds.size(); ++i) {
        const short re = pfds[i].revents;
        if (re == 0) continue;
        if (what[i].first == 1) serve_outgoing(out_[what[i].second], re);
        if (what[i].first == 2) serve_incoming(in_[what[i].second], re);
      }
      // Accepting last: it may drop (and so move) the oldest incoming connections.
      if (rc > 0 && (pfds[0].revents & POLLIN)) accept_all();
      in_.erase(std::remove_if(in_.begin(), in_.end(), [](const Incoming& c) { return !c.fd.valid(); }), in_.end());
    }
  }

  int missing_addresses() const {
    int n = 0;
    for (const auto& c : out_) n += c.peer != o_.rank && c.state == Outgoing::kNeedAddr ? 1 : 0;
    return n;
  }

  void look_up_addresses() {
    for (auto& c : out_) {
      if (c.peer == o_.rank || c.state != Outgoing::kNeedAddr) continue;
      const std::string key = o_.key_prefix + "/addr/" + std::to_string(c.peer);
      if (!o_.store->check({key})) continue;
      c.addr = o_.store->get(key);
      if (const std::string bad = split_host_port(c.addr, &c.host, &c.port); !bad.empty()) {
        throw HandshakeError(prefix() + ": rank " + std::to_string(c.peer) + " published a listen address this rank "
                             "cannot use: " + bad + " (store key " + key + "; another job writing the same keys?)");
      }
      c.state = Outgoing::kWaitRetry;
      c.retry_at = Clock::now();
    }
  }

  void start_connect(Outgoing& c) {
    c.fd = net::start_connect(c.host, c.port, c.what(), &c.last_error);
    if (!c.fd.valid()) {
      retry_later(c);
      return;
    }
    c.state = Outgoing::kConnecting;
  }

  void retry_later(Outgoing& c) {
    c.fd.reset();
    c.state = Outgoing::kWaitRetry;
    c.retry_at = Clock::now() + c.backoff;
    c.backoff = std::min(c.backoff * 2, std::chrono::milliseconds(250));
  }

  void serve_outgoing(Outgoing& c, short re) {
    if (c.state == Outgoing::kConnecting) {
      const int err = net::connect_result(c.fd.get());
      if (err != 0) {
        c.last_error = std::string("connect: ") + std::strerror(err) + " (errno " + std::to_string(err) + ")";
        retry_later(c);  // the peer may be about to listen, or restarting; the deadline decides
        return;
      }
      handshake::Hello hello;
      hello.kind = handshake::PeerKind::kTransport;
      hello.payload = hello_payload(o_, c.peer);
      c.hs = std::make_unique<handshake::Client>(secret_, hello);
      c.out = c.hs->hello_bytes();
      c.state = Outgoing::kHandshaking;
      re = POLLOUT;
    }
    if (re & POLLOUT) send_some(c.fd.get(), &c.out);
    if (!(re & (POLLIN | POLLHUP | POLLERR))) return;
    char buf[256];
    while (!c.hs->done()) {
      if (c.hs->state() == handshake::Client::kSendProof) {
        c.out += c.hs->take_proof();
        send_some(c.fd.get(), &c.out);
        continue;
      }
      const size_t want = std::min(sizeof(buf), c.hs->want());
      ssize_t k = ::recv(c.fd.get(), buf, want, MSG_DONTWAIT);
      if (k > 0) {
        c.hs->feed(buf, static_cast<size_t>(k));
        continue;
      }
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      throw PeerError(prefix() + ": " + c.what() + " closed the connection during the handshake, before its "
                      "verdict (" + (k == 0 ? std::string("end of stream") : std::strerror(errno)) +
                      "); its process probably exited");
    }
    handshake::raise_unless_accepted(*c.hs, c.what());
    c.hs.reset();
    c.state = Outgoing::kDone;
    t_->attach(c.peer, std::move(c.fd), /*outgoing=*/true);
    --outgoing_left_;
  }

  // Sends what the kernel takes now; the rest waits for POLLOUT. Handshake messages are tiny, so
  // in practice everything goes at once.
  static void send_some(int fd, std::string* out) {
    while (!out->empty()) {
      ssize_t k = ::send(fd, out->data(), out->size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k > 0) {
        out->erase(0, static_cast<size_t>(k));
        continue;
      }
      if (k < 0 && errno == EINTR) continue;
      return;  // EAGAIN: later; an error: the reading side reports it
    }
  }

  void accept_all() {
    for (int i = 0; i < 64; ++i) {
      int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        return;  // EAGAIN, or out of descriptors: the backlog waits for the next round
      }
      if (in_.size() >= kMaxUnprovenIncoming) {
        // The oldest connection that has not proved itself: a rank of this job proves itself in
        // one round trip, so this is an idle or garbage one.
        note("dropped", in_.front().from,
             "more than " + std::to_string(kMaxUnprovenIncoming) + " connections without a finished handshake; "
             "this was the oldest");
        in_.erase(in_.begin());
      }
      Incoming c;
      c.fd = net::Fd(fd);
      c.from = net::peer_string(fd);
      c.hs = std::make_unique<handshake::Server>(secret_);
      c.until = std::min(o_.deadline, Clock::now() + kIncomingBudget);
      in_.push_back(std::move(c));
    }
  }

  void expire_incoming() {
    const Deadline now = Clock::now();
    for (auto& c : in_) {
      if (!c.fd.valid() || c.until > now) continue;
      if (!c.closing) {
        note("dropped", c.from, "no finished handshake within " + net::format_duration(kIncomingBudget));
      }
      c.fd.reset();
    }
  }

  void refuse(Incoming& c, const std::string& reason) {
    c.out += handshake::Server::refusal(reason);
    c.closing = true;
    c.until = Clock::now() + kLinger;
    flush_closing(c);
  }

  // A closing connection: verdict out, then half-closed, then read until the peer hangs up.
  void flush_closing(Incoming& c) {
    send_some(c.fd.get(), &c.out);
    if (c.out.empty() && !c.half_closed) {
      handshake::half_close(c.fd.get());
      c.half_closed = true;
    }
  }

  void serve_incoming(Incoming& c, short re) {
    if (!c.fd.valid()) return;
    if (c.closing) {
      flush_closing(c);
      if (c.half_closed && handshake::drain_until_closed(c.fd.get())) c.fd.reset();
      return;
    }
    if (re & POLLOUT) send_some(c.fd.get(), &c.out);
    char buf[512];
    while (c.hs->want() > 0) {
      const size_t want = std::min(sizeof(buf), c.hs->want());
      ssize_t k = ::recv(c.fd.get(), buf, want, MSG_DONTWAIT);
      if (k > 0) {
        c.hs->feed(buf, static_cast<size_t>(k));
        continue;
      }
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      note("dropped", c.from, "it closed during the handshake");
      c.fd.reset();
      return;
    }
    switch (c.hs->state()) {
      case handshake::Server::kBad:
        note("refused", c.from, c.hs->error());
        refuse(c, c.hs->error());
        return;
      case handshake::Server::kHello:
        if (c.hs->hello().kind != handshake::PeerKind::kTransport) {
          refuse(c, "this port carries chorus transport connections, not store clients");
        } else if (c.hs->hello().version != handshake::kProtocolVersion) {
          refuse(c, "protocol version " + std::to_string(c.hs->hello().version) + " is not " +
                        std::to_string(handshake::kProtocolVersion) + "; all ranks must run the same chorus version");
        } else {
          c.out += c.hs->challenge();
          send_some(c.fd.get(), &c.out);
        }
        return;
      case handshake::Server::kProof:
        judge(c);
        return;
      default:
        return;
    }
  }

  // A peer that proved the token: check that it is the rank this group expects.
  void judge(Incoming& c) {
    if (!c.hs->proven()) {
      const std::string reason =
          "job token mismatch: the connecting process belongs to another job (its proof of the job token did "
          "not match; check CHORUS_JOB_TOKEN)";
      note("refused", c.from, reason);
      refuse(c, reason);
      return;
    }
    std::string group;
    int world = -1, from = -1, to = -1;
    std::string refusal;
    if (!parse_payload(c.hs->hello().payload, &group, &world, &from, &to)) {
      refusal = "malformed transport hello";
    } else if (group != o_.group_name) {
      refusal = "group mismatch: peer is in group '" + group + "', this rank in '" + o_.group_name + "'";
    } else if (world != o_.size) {
      refusal = "world size mismatch: rank " + std::to_string(from) + " has world size " + std::to_string(world) +
                " but " + me_ + " has " + std::to_string(o_.size);
    } else if (to != o_.rank) {
      refusal = "rank mismatch: peer wanted rank " + std::to_string(to) + " but reached " + me_;
    } else if (from < 0 || from == o_.rank || from >= o_.size || seen_[static_cast<size_t>(from)]) {
      refusal = "unexpected or duplicate connection from rank " + std::to_string(from) +
                " (two processes with the same RANK?)";
    }
    if (!refusal.empty()) {
      chorus::log(LogLevel::kWarning, me_ + ": refused a connection from " + c.from + ": " + refusal);
      refuse(c, refusal);
      // A process of this job (it knows the token) with another configuration: fail loudly here
      // too instead of waiting for a rank that will never come.
      if (group == o_.group_name) throw HandshakeError(prefix() + ": " + refusal);
      return;
    }
    const std::string accept = c.hs->accept();
    net::IoResult w = net::write_full(c.fd.get(), accept.data(), accept.size(), o_.deadline);
    if (!w.ok()) {
      chorus::log(LogLevel::kWarning, me_ + ": lost the connection from rank " + std::to_string(from) + " (" + c.from +
                                  ") while accepting it: " + w.describe());
      c.fd.reset();
      return;
    }
    seen_[static_cast<size_t>(from)] = true;
    t_->attach(from, std::move(c.fd), /*outgoing=*/false);
    --incoming_left_;
  }

  // Setup failed: every connection waiting here, in the backlog, or about to come from a rank that
  // is known to be alive (it published its address) learns why before this rank closes its
  // listener. A connection left in the backlog would be reset, and a rank that connects after the
  // listener is gone would see only "connection refused" until its deadline.
  void farewell(const std::string& why) {
    // This rank's own connections go first: a peer lingering over the refusal it sent on one of
    // them waits for this side to hang up.
    for (auto& c : out_) c.fd.reset();
    int awaited = 0;  // live ranks that have not connected yet
    for (const auto& c : out_) {
      if (c.peer != o_.rank && !seen_[static_cast<size_t>(c.peer)] && c.state != Outgoing::kNeedAddr) ++awaited;
    }
    const std::string reason = me_ + " gave up setting up group '" + o_.group_name + "': " + why;
    const Deadline until = Clock::now() + kLinger;
    std::vector<pollfd> pfds;
    for (;;) {
      try {
        accept_all();
      } catch (const std::exception&) {
      }
      for (auto& c : in_) {
        if (c.fd.valid() && !c.closing) {
          refuse(c, reason);
          --awaited;
        }
      }
      pfds.clear();
      if (awaited > 0) pfds.push_back(pollfd{listener_.get(), POLLIN, 0});
      for (auto& c : in_) {
        if (c.fd.valid()) pfds.push_back(pollfd{c.fd.get(), static_cast<short>(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
      }
      if (pfds.empty() || Clock::now() >= until) break;
      if (::poll(pfds.data(), pfds.size(), net::ms_until(until)) <= 0) continue;
      for (auto& c : in_) serve_incoming(c, POLLIN | POLLOUT);
      in_.erase(std::remove_if(in_.begin(), in_.end(), [](const Incoming& c) { return !c.fd.valid(); }), in_.end());
    }
    in_.clear();
  }

  [[noreturn]] void fail_timeout() {
    std::vector<std::string> absent, unreachable, unanswered, unconnected;
    for (const auto& c : out_) {
      if (c.peer == o_.rank) continue;
      const std::string r = std::to_string(c.peer);
      switch (c.state) {
        case Outgoing::kNeedAddr: absent.push_back(r); break;
        case Outgoing::kWaitRetry:
        case Outgoing::kConnecting: unreachable.push_back(c.what() + " (" + c.last_error + ")"); break;
        case Outgoing::kHandshaking: unanswered.push_back(c.what()); break;
        case Outgoing::kDone:
          if (!seen_[static_cast<size_t>(c.peer)]) unconnected.push_back(r);
          break;
      }
    }
    auto join = [](const std::vector<std::string>& v) {
      std::string s;
      for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
      return s;
    };
    std::string out = prefix() + " timed out";
    if (!absent.empty()) {
      out += "; rank(s) [" + join(absent) + "] never published an address in the store: they are missing (not "
             "started, crashed before creating the group, or creating another group)";
    }
    if (!unreachable.empty()) out += "; could not connect to " + join(unreachable) + ": the process probably exited";
    if (!unanswered.empty()) out += "; no answer to this rank's handshake from " + join(unanswered);
    if (!unconnected.empty()) {
      out += "; rank(s) [" + join(unconnected) + "] have not connected to this rank at " + listen_addr_;
    }
    throw TimeoutError(out + "; is every rank running, in the same group, and able to reach the others?");
  }

  const TcpOptions& o_;
  TcpTransport* t_;
  std::string secret_;
  std::string me_;
  net::Fd listener_;
  std::string listen_addr_;
  std::vector<Outgoing> out_;
  std::vector<Incoming> in_;
  std::vector<bool> seen_;
  int outgoing_left_ = 0;
  int incoming_left_ = 0;
  int64_t noted_ = 0;
};

// The key every connection of the group proves: the job token, or, when the caller has none (a
// group built on a store it made itself), a random one shared through that store.
std::string group_secret(const TcpOptions& o) {
  if (!o.token.empty()) return o.token;
  const std::string mine = random_token();
  return o.store->compare_set(o.key_prefix + "/secret", "", mine);
}

}  // namespace

std::unique_ptr<Transport> make_tcp_transport(const TcpOptions& o) {
  if (o.store == nullptr) throw UsageError("make_tcp_transport: a store is required");
  auto t = std::make_unique<TcpTransport>(o.rank, o.size, o.spin_us);
  if (o.size == 1) return t;
  MeshSetup(o, t.get(), group_secret(o)).run();
  if (o.socket_buffer_bytes > 0) t->set_buffers(o.socket_buffer_bytes);
  return t;
}

}  // namespace chorus::transport
