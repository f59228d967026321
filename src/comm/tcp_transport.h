// Internal: the TCP transport's class, shared by the files that implement it. tcp_transport.cc holds
// the posting API and the progress engine (poll, sendmsg, recv, read-ahead); tcp_transport_errors.cc
// holds what happens when a peer fails, says goodbye or is too slow (the errors raised, the abort
// relayed from a failing peer); tcp_transport_setup.cc makes the connections (all of them at setup,
// or, when lazy, the ring's at setup and each other one when first needed) and hands each one to
// attach(). Threading and wire format: docs/threading.md, docs/wire-format.md.
#pragma once

#include <poll.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "transport.h"

namespace chorus::transport::detail {

constexpr size_t kInboxBytes = 64 * 1024;  // read-ahead buffer per connection

// Makes the connections a lazy transport lacks, from inside its progress engine (the listener
// stays open, and every handshake is a non-blocking state machine beside the transfers, so two
// ranks that first send to each other at the same time do not deadlock). Implemented by the setup
// (tcp_transport_setup.cc); the transport owns it for the group's life.
class TcpConnector {
 public:
  virtual ~TcpConnector() = default;
  // Starts connecting to `peer` (this rank's outgoing connection), unless it is already under way.
  virtual void connect_to(int peer) = 0;
  // Appends what the connector waits for to `pfds` and lowers `wake` to its next timer.
  virtual void prepare(std::vector<pollfd>* pfds, net::Deadline* wake) = 0;
  // After poll(): serves the entries prepare() appended, from index `first` on. May attach
  // connections; throws if a peer refuses this rank or is gone.
  virtual void serve(const std::vector<pollfd>& pfds, size_t first) = 0;
  // For messages: the peer's listening address, and where this rank's connection to it stands.
  virtual std::string address_of(int peer) const = 0;
  virtual std::string outgoing_state(int peer) const = 0;
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
  std::string peer_name(int peer) const override;

  // `fd` is the connection this rank opened to `peer` (outgoing) or the one it accepted from it.
  void attach(int peer, net::Fd fd, bool outgoing);
  // SO_SNDBUF/SO_RCVBUF for every connection, those attached later included (0: autotuning).
  void set_buffers(int bytes);
  // Lazy connections: peers without a connection are connected through `connector` when first
  // needed. Without one (the full mesh), every connection is attached at setup.
  void set_connector(std::unique_ptr<TcpConnector> connector) { connector_ = std::move(connector); }
  // Descriptors this transport holds: its connections, and the listener when lazy.
  int connections() const;

  // Busy-polling pays off at every size while a thread waits on the group (small messages: the
  // latency of a wake-up; large ones: 15-20% more bandwidth over loopback, measured on the 2-core
  // reference machine), but not while the caller computes (DDP's backward): then the core belongs
  // to the computation, so the poll sleeps at once.
  void set_spin_gate(const std::atomic<int>* gate) override { spin_gate_ = gate; }

  void begin(const wire::Call& call, net::Deadline deadline) override;
  Ticket send(int peer, const wire::Header& header, const void* data, size_t n) override;
  Ticket recv(int peer, const wire::Call& expect, void* data, size_t n) override;
  int probe_any(const std::vector<int>& peers, int64_t tag) override;
  bool can_probe() const override { return true; }
  void wait(Ticket ticket) override;
  void wait_all() override;
  void abort(const std::string& reason, uint8_t error_class) override;
  void close() override;

 private:
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
    int lowat = 1;              // the rx socket's SO_RCVLOWAT (wake_for)

    size_t inbox_size() const { return in_end - in_begin; }
  };

  std::string prefix() const {
    return "chorus: rank " + std::to_string(rank_) + ": " + wire::describe(call_);
  }
  wire::Header peek_header(const Conn& c) const {
    wire::Header h;
    std::memcpy(&h, c.inbox.data() + c.in_begin, sizeof(h));
    return h;
  }

  // The progress engine (tcp_transport.cc).
  Conn& conn(int peer);
  void say_to_all(const wire::Header& h, const std::string& payload);
  void shutdown_all();
  size_t fill_inbox(Conn& c, size_t want, bool* eof);
  bool pump_recvs(Conn& c);
  void wake_for(Conn& c, size_t bytes);
  bool pump_sends(Conn& c);
  void read_ahead(Conn& c);
  bool pump_all();
  void progress();

  // Failures (tcp_transport_errors.cc).
  [[noreturn]] void fail_closed(Conn& c, const std::string& how);
  void relay_abort(Conn& c);
  [[noreturn]] void fail_io(Conn& c, int err, const char* what);
  bool handle_control(Conn& c, const wire::Header& h);
  void check_hangup(Conn& c, short revents);
  [[noreturn]] void fail_timeout();
  [[noreturn]] void fail_probe_timeout(const std::vector<int>& peers, int64_t tag);

  int rank_;
  int size_;
  int spin_us_;
  const std::atomic<int>* spin_gate_ = nullptr;  // threads blocked on the group; spin only if > 0
  std::vector<Conn> conns_;
  std::unique_ptr<TcpConnector> connector_;  // lazy: makes the missing connections
  int buffer_bytes_ = 0;
  std::unordered_set<Ticket> pending_;
  Ticket next_ticket_ = 1;
  wire::Call call_;
  net::Clock::time_point start_ = net::Clock::now();
  net::Deadline deadline_ = net::Deadline::max();
  bool closed_ = false;
  bool aborted_ = false;
  bool relaying_ = false;
  std::vector<pollfd> pfds_;
  std::vector<Conn*> pfd_conn_;  // the Conn of each rx in pfds_; nullptr for a tx
};

}  // namespace chorus::transport::detail
