// The TCP transport's connections (docs/wire-format.md). Each rank publishes its listening address
// in the store, connects to other ranks and proves the job token on each connection, and accepts
// proven connections from them, all from one poll loop; strangers, other jobs and misconfigured
// ranks are refused with a reason. The full mesh connects every pair at setup. Lazy connections
// (docs/algorithms.md, "Connections at scale") connect the ring's neighbours at setup and every
// other pair when a send first needs it: the same state machines then run inside the transport's
// progress engine (TcpConnector), with the listener open for the group's life. The finished
// connections go to TcpTransport::attach (tcp_transport.h).
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/comm/log.h"
#include "chorus/comm/random.h"
#include "chorus/comm/rendezvous.h"
#include "chorus/comm/store.h"
#include "error_class.h"
#include "handshake.h"
#include "tcp_transport.h"

namespace chorus::transport {
namespace {

using detail::TcpTransport;
using net::Clock;
using net::Deadline;

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
class MeshSetup final : public detail::TcpConnector {
 public:
  MeshSetup(const TcpOptions& o, TcpTransport* t, std::string secret)
      : o_(o), t_(t), secret_(std::move(secret)), me_("rank " + std::to_string(o.rank)),
        out_(static_cast<size_t>(o.size)), seen_(static_cast<size_t>(o.size), false),
        expected_(static_cast<size_t>(o.size), false), gave_up_(static_cast<size_t>(o.size), false) {}

  void run() {
    const std::string host = o_.advertise_host.empty() ? "127.0.0.1" : o_.advertise_host;
    // Loopback-only jobs listen on loopback; otherwise on every interface of the advertised family.
    const bool ipv6 = host.find(':') != std::string::npos;
    listener_ = net::listen_tcp(host == "127.0.0.1" ? "127.0.0.1" : (ipv6 ? "::" : ""), 0);
    net::set_nonblocking(listener_.get(), true);
    listen_addr_ = (ipv6 ? "[" + host + "]" : host) + ":" + std::to_string(net::local_port(listener_.get()));
    o_.store->set(addr_key(o_.rank), listen_addr_);
    for (int p = 0; p < o_.size; ++p) out_[static_cast<size_t>(p)].peer = p;
    try {
      if (o_.lazy_connections) {
        // Every address is known before anyone connects, so a missing rank fails the setup and a
        // later connection needs nothing from the store; then the ring's neighbours, so that the
        // connections form one graph from the start and an abort relayed from a failing rank
        // reaches every rank.
        exchange_addresses();
        for (int p : {(o_.rank + 1) % o_.size, (o_.rank + o_.size - 1) % o_.size}) {
          if (!expected_[static_cast<size_t>(p)]) {
            expected_[static_cast<size_t>(p)] = true;
            connect_to(p);
          }
        }
      } else {
        for (int p = 0; p < o_.size; ++p) expected_[static_cast<size_t>(p)] = p != o_.rank;
      }
      for (int p = 0; p < o_.size; ++p) {
        if (expected_[static_cast<size_t>(p)]) ++outgoing_left_;
      }
      incoming_left_ = outgoing_left_;
      loop();
    } catch (const Error& e) {
      say_why(e);
      farewell(e.what());
      throw;
    }
    // Refused strangers: their verdicts are out and followed by an end of stream; drop what they
    // sent, so that closing sends no reset, but do not wait for them.
    for (auto& c : in_) {
      if (!c.fd.valid() || !c.closing) continue;
      flush_closing(c);
      handshake::drain_until_closed(c.fd.get());
      c.fd.reset();
    }
    // Lazy: a rank that finished its setup first may be connecting already; its handshake goes
    // on in the progress engine. (The full mesh has no other connection to wait for.)
    if (!o_.lazy_connections) in_.clear();
    in_.erase(std::remove_if(in_.begin(), in_.end(), [](const Incoming& c) { return !c.fd.valid(); }), in_.end());
    setup_done_ = true;
    o_.store = nullptr;  // the setup's store (a recording wrapper) is gone once it returns
  }

  // TcpConnector, used once the setup has returned (lazy connections only).
  void connect_to(int peer) override {
    Outgoing& c = out_[static_cast<size_t>(peer)];
    if (c.state != Outgoing::kIdle) return;
    c.state = Outgoing::kWaitRetry;
    c.retry_at = Clock::now();
  }

  void prepare(std::vector<pollfd>* pfds, Deadline* wake) override {
    if (!setup_done_ && missing_addresses() > 0 && Clock::now() >= next_store_check_) {
      look_up_addresses();
      store_poll_ = std::min(store_poll_ * 2, std::chrono::duration_cast<std::chrono::milliseconds>(kMaxStorePoll));
      next_store_check_ = Clock::now() + store_poll_;
    }
    if (!setup_done_ && missing_addresses() > 0) *wake = std::min(*wake, next_store_check_);
    for (auto& c : out_) {
      if (c.state == Outgoing::kWaitRetry) {
        if (Clock::now() >= c.retry_at) start_connect(c);
        if (c.state == Outgoing::kWaitRetry) *wake = std::min(*wake, c.retry_at);
      }
    }
    expire_incoming();
    what_.clear();
    pfds->push_back(pollfd{listener_.get(), POLLIN, 0});
    what_.emplace_back(0, 0);
    for (auto& c : out_) {
      if (c.state == Outgoing::kConnecting) {
        pfds->push_back(pollfd{c.fd.get(), POLLOUT, 0});
      } else if (c.state == Outgoing::kHandshaking) {
        pfds->push_back(pollfd{c.fd.get(), static_cast<short>(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
      } else {
        continue;
      }
      what_.emplace_back(1, static_cast<size_t>(c.peer));
    }
    for (size_t i = 0; i < in_.size(); ++i) {
      pfds->push_back(pollfd{in_[i].fd.get(), static_cast<short>(POLLIN | (in_[i].out.empty() ? 0 : POLLOUT)), 0});
      what_.emplace_back(2, i);
      *wake = std::min(*wake, in_[i].until);
    }
  }

  void serve(const std::vector<pollfd>& pfds, size_t first) override {
    for (size_t i = 0; i < what_.size() && first + i < pfds.size(); ++i) {
      const short re = pfds[first + i].revents;
      if (re == 0) continue;
      if (what_[i].first == 1) serve_outgoing(out_[what_[i].second], re);
      if (what_[i].first == 2) serve_incoming(in_[what_[i].second], re);
    }
    // Accepting last: it may drop (and so move) the oldest incoming connections.
    if (first < pfds.size() && (pfds[first].revents & POLLIN)) accept_all();
    in_.erase(std::remove_if(in_.begin(), in_.end(), [](const Incoming& c) { return !c.fd.valid(); }), in_.end());
  }

  std::string address_of(int peer) const override { return out_[static_cast<size_t>(peer)].addr; }

  std::string outgoing_state(int peer) const override {
    const Outgoing& c = out_[static_cast<size_t>(peer)];
    switch (c.state) {
      case Outgoing::kNeedAddr: return "its address is not known";
      case Outgoing::kIdle: return "not started";
      case Outgoing::kWaitRetry:
        return "connecting to " + c.addr + (c.last_error.empty() ? "" : ", last try: " + c.last_error);
      case Outgoing::kConnecting: return "connecting to " + c.addr;
      case Outgoing::kHandshaking: return "no answer yet to this rank's handshake at " + c.addr;
      case Outgoing::kDone: return "connected";
    }
    return "";
  }

 private:
  struct Outgoing {
    // kIdle: the address is known, no connection is wanted yet (lazy connections).
    enum State { kNeedAddr, kIdle, kWaitRetry, kConnecting, kHandshaking, kDone };
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

  std::string prefix() const {
    return "chorus: " + me_ + ": group '" + o_.group_name + "'" + (setup_done_ ? "" : " setup");
  }
  std::string addr_key(int rank) const { return o_.key_prefix + "/addr/" + std::to_string(rank); }
  std::string gave_up_key(int rank) const { return o_.key_prefix + "/gave_up/" + std::to_string(rank); }

  // This rank's setup failed: say why in the store before closing, for a peer whose connection
  // closes under it now (raise_if_gave_up). The listen address ties the reason to this attempt,
  // so a group set up again under the same name never reads it. Best effort: the store may be
  // what failed.
  void say_why(const Error& e) {
    try {
      o_.store->set(gave_up_key(o_.rank),
                    listen_addr_ + "\n" + static_cast<char>('0' + error_class_of(e)) + e.what());
    } catch (const std::exception&) {
    }
  }

  // During the setup, a peer closed or refused this rank's connection: if it gave up its setup
  // (say_why) at the address this rank reached, raise its reason in its class, not a bare
  // "connection closed" that hides it. Ranks give up at their own times (one sees a mismatch in
  // the store while another is still handshaking with it), so which rank learns the reason from
  // the handshake and which from here is a race; the error is the same either way.
  void raise_if_gave_up(const Outgoing& c, const std::string& how) {
    if (setup_done_ || o_.store == nullptr) return;
    std::string why;
    try {
      if (!o_.store->check({gave_up_key(c.peer)})) return;
      why = o_.store->get(gave_up_key(c.peer));
    } catch (const std::exception&) {
      return;  // the store's own failure surfaces elsewhere; report the connection's
    }
    const size_t nl = why.find('\n');
    if (nl == std::string::npos || why.compare(0, nl, c.addr) != 0 || nl + 1 >= why.size()) return;
    gave_up_[static_cast<size_t>(c.peer)] = true;  // farewell need not wait for it to connect
    throw_ranked_error(static_cast<uint8_t>(why[nl + 1] - '0'),
                       prefix() + ": " + c.what() + " " + how + " because its setup failed: " + why.substr(nl + 2));
  }

  // How long a handshake step may take: the setup's deadline, or a fixed budget afterwards.
  Deadline io_deadline() const {
    return setup_done_ ? Clock::now() + kIncomingBudget : std::min(o_.deadline, Clock::now() + kIncomingBudget);
  }

  // Lazy connections: rank 0 waits for every address and publishes them as one key (after its
  // world size, which every rank checks against its own), which the others read, so the store
  // serves O(W) requests rather than W per rank. A rank that never publishes is named by every
  // rank when the setup times out.
  void exchange_addresses() {
    const std::string all_key = o_.key_prefix + "/addrs";
    const auto left = [&] {
      return std::max(std::chrono::milliseconds(1),
                      std::chrono::duration_cast<std::chrono::milliseconds>(o_.deadline - Clock::now()));
    };
    std::string all;
    try {
      if (o_.rank == 0) {
        std::vector<std::string> keys;
        for (int p = 0; p < o_.size; ++p) keys.push_back(addr_key(p));
        o_.store->wait(keys, left());
        all = "world_size=" + std::to_string(o_.size) + "\n";
        for (const auto& k : keys) all += o_.store->get(k) + "\n";
        o_.store->set(all_key, all);
      } else {
        o_.store->wait({all_key}, left());
        all = o_.store->get(all_key);
      }
    } catch (const TimeoutError&) {
      std::string absent;
      for (int p = 0; p < o_.size; ++p) {
        if (!o_.store->check({addr_key(p)})) absent += (absent.empty() ? "" : ", ") + std::to_string(p);
      }
      throw Ranked<TimeoutError>(prefix() + " timed out; rank(s) [" + absent + "] never published an address in the "
                                 "store: they are missing (not started, crashed before creating the group, or "
                                 "creating another group); is every rank running, in the same group?");
    }
    const std::string world = "world_size=" + std::to_string(o_.size) + "\n";
    if (all.compare(0, world.size(), world) != 0) {
      throw Ranked<HandshakeError>(prefix() + ": world size mismatch: rank 0 published the group's addresses for " +
                                   printable(all.substr(0, all.find('\n'))) + " but " + me_ + " has world size " +
                                   std::to_string(o_.size) + " (store key " + all_key + "); every rank must be given "
                                   "the same world size");
    }
    size_t begin = world.size();
    for (int p = 0; p < o_.size; ++p) {
      const size_t end = all.find('\n', begin);
      if (end == std::string::npos) {
        throw Ranked<HandshakeError>(prefix() + ": the address list in the store (key " + all_key + ") has fewer "
                                     "than " + std::to_string(o_.size) + " entries; another job writing the same keys?");
      }
      Outgoing& c = out_[static_cast<size_t>(p)];
      c.addr = all.substr(begin, end - begin);
      begin = end + 1;
      if (p == o_.rank) continue;
      if (const std::string bad = split_host_port(c.addr, &c.host, &c.port); !bad.empty()) {
        throw Ranked<HandshakeError>(prefix() + ": rank " + std::to_string(p) + " published a listen address this rank "
                                     "cannot use: " + bad + " (store key " + all_key + ")");
      }
      c.state = Outgoing::kIdle;
    }
  }

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
    std::vector<pollfd> pfds;
    while (outgoing_left_ > 0 || incoming_left_ > 0) {
      if (Clock::now() >= o_.deadline) fail_timeout();
      Deadline wake = o_.deadline;
      pfds.clear();
      prepare(&pfds, &wake);
      int rc = ::poll(pfds.data(), pfds.size(), net::ms_until(wake));
      if (rc < 0 && errno != EINTR) throw Ranked<Error>(prefix() + ": poll failed: " + std::strerror(errno));
      if (rc > 0) serve(pfds, 0);
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
        throw Ranked<HandshakeError>(prefix() + ": rank " + std::to_string(c.peer) + " published a listen address this rank "
                             "cannot use: " + bad + " (store key " + key + "; another job writing the same keys?)");
      }
      c.state = Outgoing::kWaitRetry;
      c.retry_at = Clock::now();
    }
  }

  void start_connect(Outgoing& c) {
    c.fd = net::start_connect(c.host, c.port, c.what(), &c.last_error);
    if (!c.fd.valid()) {
      raise_if_gave_up(c, "refused the connection");
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
        if (setup_done_) {
          // Every rank listened before it published its address and keeps listening while its
          // group lives: a refusal now means the process has exited or closed its group.
          throw Ranked<PeerError>(prefix() + ": cannot connect to " + c.what() + " (" + c.last_error + "), which " +
                                  "this rank sends to for the first time: its process has probably exited or "
                                  "closed its group");
        }
        raise_if_gave_up(c, "refused the connection");
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
      const int err = errno;
      raise_if_gave_up(c, "closed the connection during the handshake");
      throw Ranked<PeerError>(prefix() + ": " + c.what() + " closed the connection during the handshake, before its "
                      "verdict (" + (k == 0 ? std::string("end of stream") : std::strerror(err)) +
                      "); its process probably exited");
    }
    handshake::raise_unless_accepted(*c.hs, c.what());
    c.hs.reset();
    c.state = Outgoing::kDone;
    t_->attach(c.peer, std::move(c.fd), /*outgoing=*/true);
    if (expected_[static_cast<size_t>(c.peer)]) --outgoing_left_;
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
      c.until = io_deadline();
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
      if (group == o_.group_name) throw Ranked<HandshakeError>(prefix() + ": " + refusal);
      return;
    }
    const std::string accept = c.hs->accept();
    net::IoResult w = net::write_full(c.fd.get(), accept.data(), accept.size(), io_deadline());
    if (!w.ok()) {
      chorus::log(LogLevel::kWarning, me_ + ": lost the connection from rank " + std::to_string(from) + " (" + c.from +
                                  ") while accepting it: " + w.describe());
      c.fd.reset();
      return;
    }
    seen_[static_cast<size_t>(from)] = true;
    t_->attach(from, std::move(c.fd), /*outgoing=*/false);
    if (expected_[static_cast<size_t>(from)]) --incoming_left_;  // lazy: others may connect early
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
      const auto p = static_cast<size_t>(c.peer);
      if (c.peer != o_.rank && !seen_[p] && !gave_up_[p] && c.state != Outgoing::kNeedAddr) ++awaited;
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
        case Outgoing::kIdle: break;
        case Outgoing::kWaitRetry:
        case Outgoing::kConnecting: unreachable.push_back(c.what() + " (" + c.last_error + ")"); break;
        case Outgoing::kHandshaking: unanswered.push_back(c.what()); break;
        case Outgoing::kDone:
          if (expected_[static_cast<size_t>(c.peer)] && !seen_[static_cast<size_t>(c.peer)]) unconnected.push_back(r);
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
    throw Ranked<TimeoutError>(out + "; is every rank running, in the same group, and able to reach the others?");
  }

  TcpOptions o_;
  TcpTransport* t_;
  std::string secret_;
  std::string me_;
  net::Fd listener_;
  std::string listen_addr_;
  std::vector<Outgoing> out_;
  std::vector<Incoming> in_;
  std::vector<bool> seen_;
  std::vector<bool> expected_;  // peers whose connections the setup waits for (all, or the ring's)
  std::vector<bool> gave_up_;   // peers whose setup failed (raise_if_gave_up)
  std::vector<std::pair<int, size_t>> what_;  // per pollfd of prepare(): 0 listener, 1 outgoing peer, 2 incoming
  bool setup_done_ = false;
  std::chrono::milliseconds store_poll_ = kFirstStorePoll;
  Deadline next_store_check_ = Clock::now();
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
  auto setup = std::make_unique<MeshSetup>(o, t.get(), group_secret(o));
  setup->run();
  if (o.socket_buffer_bytes > 0) t->set_buffers(o.socket_buffer_bytes);
  if (o.lazy_connections) t->set_connector(std::move(setup));
  return t;
}

}  // namespace chorus::transport
