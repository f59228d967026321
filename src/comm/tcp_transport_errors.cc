// TcpTransport's failure paths: what this rank raises when a peer closes its connection (died, or
// closed its group while this rank still needs it), fails (its abort message is relayed so that the
// error names the root cause), breaks the stream, or is too slow (a timeout that names every peer
// still awaited and what for). The progress engine that calls these is tcp_transport.cc.
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>

#include "chorus/comm/error.h"
#include "tcp_transport.h"

namespace chorus::transport::detail {
namespace {

using net::Clock;
using net::Deadline;

constexpr std::chrono::milliseconds kRelayWait(500);  // how long a failing peer's abort is looked for

}  // namespace

void TcpTransport::fail_closed(Conn& c, const std::string& how) {
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
void TcpTransport::relay_abort(Conn& c) {
  if (relaying_ || !c.rx.valid()) return;
  relaying_ = true;
  wake_for(c, 0);  // it reads whatever comes, a little at a time
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

void TcpTransport::fail_io(Conn& c, int err, const char* what) {
  if (err == EPIPE || err == ECONNRESET) fail_closed(c, std::string("(") + std::strerror(err) + ")");
  throw PeerError(prefix() + ": " + what + " " + peer_name(c.peer) + " failed: " +
                  std::strerror(err) + " (errno " + std::to_string(err) + ")");
}

// Handles an abort or goodbye at the front of the inbox; returns false for a data header.
bool TcpTransport::handle_control(Conn& c, const wire::Header& h) {
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

// A connection with nothing posted reported a hangup or error: learn whether the peer said
// goodbye, aborted, or died.
void TcpTransport::check_hangup(Conn& c, short revents) {
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

void TcpTransport::fail_timeout() {
  std::ostringstream out;
  out << prefix() << ": timed out after " << net::format_duration(Clock::now() - start_);
  const char* sep = " waiting for ";
  for (const auto& c : conns_) {
    if (!c.recvs.empty() && !c.rx.valid()) {
      out << sep << peer_name(c.peer) << " to connect to this rank and send its next message (it has not "
          << "connected yet: it has not reached its matching send, or cannot reach this rank's address)";
      sep = "; and for ";
    } else if (!c.recvs.empty()) {
      const RecvItem& r = c.recvs.front();
      out << sep << peer_name(c.peer) << " to send "
          << (r.have_header ? std::to_string(r.n - r.got) + " more of " + std::to_string(r.n) + " bytes"
                            : "its next message");
      sep = "; and for ";
    } else if (!c.sends.empty() && !c.tx.valid()) {
      out << sep << peer_name(c.peer) << " to take this rank's connection ("
          << (connector_ ? connector_->outgoing_state(c.peer) : std::string("not connected")) << ")";
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

void TcpTransport::fail_probe_timeout(const std::vector<int>& peers, int64_t tag) {
  std::ostringstream out;
  out << prefix() << " from any source: timed out after " << net::format_duration(Clock::now() - start_)
      << " waiting for any of ";
  for (size_t i = 0; i < peers.size(); ++i) out << (i == 0 ? "" : ", ") << peer_name(peers[i]);
  out << " to send a message with tag " << tag
      << ". No rank sent one: check that some rank sends to this one with that tag; if one is "
         "legitimately slow, raise the timeout in the group's Options";
  throw TimeoutError(out.str());
}

}  // namespace chorus::transport::detail
