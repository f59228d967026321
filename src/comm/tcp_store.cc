// TcpStore: the client, and the server that one background thread runs with poll().
// The protocol (handshake, requests, replies, limits) is described in docs/store.md.
#include "chorus/comm/tcp_store.h"

#include <arpa/inet.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "chorus/comm/error.h"
#include "chorus/comm/log.h"
#include "handshake.h"
#include "socket.h"
#include "store_internal.h"
#include "store_protocol.h"

namespace chorus {
namespace {

using store_protocol::Command;
using store_protocol::kMaxKeyBytes;
using store_protocol::kMaxKeyListBytes;
using store_protocol::kMaxKeysPerRequest;
using store_protocol::Parse;
using store_protocol::Request;
using store_protocol::Status;

// ---- Wire format (store_protocol.h) -------------------------------------------------------------

constexpr uint32_t kMaxErrorBytes = 64 * 1024;
// A reply's value comes from the authenticated server, which bounds what it stores; this only
// keeps a corrupt length from allocating more than a value can be.
constexpr uint32_t kMaxReplyValueBytes = UINT32_MAX;
// A set whose value is at least this large is received straight into the string the store keeps,
// so the server holds the value once, not twice (input buffer and stored copy).
constexpr uint32_t kDirectValueBytes = 64 * 1024;

// The server answers a wait by its timeout; the client gives the answer this long to arrive.
constexpr std::chrono::milliseconds kReplySlack{2000};
// A connection must complete its handshake this soon after connecting.
constexpr std::chrono::milliseconds kHelloTimeout{10000};
// Connections that have not proved themselves yet (mid-handshake or being refused): past this many,
// the oldest is dropped, so a flood of idle or garbage connections cannot exhaust descriptors or
// starve the job's own clients, which finish their handshake in a round trip.
constexpr size_t kMaxUnprovenClients = 128;
// How long a refused peer has to take its verdict before the server closes the connection.
constexpr std::chrono::milliseconds kLingerTimeout{1000};

uint32_t value_limit(size_t max_value_bytes) {
  return static_cast<uint32_t>(std::min<size_t>(max_value_bytes, UINT32_MAX));
}

std::string value_too_large(const std::string& who, const std::string& key, uint64_t size, uint64_t limit,
                            const char* option) {
  return who + ": the value for key '" + detail::format_key(key) + "' has " + std::to_string(size) +
         " bytes, more than " + option + " = " + std::to_string(limit) +
         "; raise that option (on the server and the clients) or keep large data out of the store";
}

class Writer {
 public:
  Writer& u8(uint8_t v) {
    out_.push_back(static_cast<char>(v));
    return *this;
  }
  Writer& u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    return *this;
  }
  Writer& i64(int64_t v) {
    uint64_t u = static_cast<uint64_t>(v);
    for (int i = 0; i < 8; ++i) out_.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
    return *this;
  }
  Writer& str(const std::string& s) {
    u32(static_cast<uint32_t>(s.size()));
    out_ += s;
    return *this;
  }
  Writer& keys(const std::vector<std::string>& keys) {
    u32(static_cast<uint32_t>(keys.size()));
    for (const auto& k : keys) str(k);
    return *this;
  }
  std::string& bytes() { return out_; }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}
int64_t get_i64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return static_cast<int64_t>(v);
}

// Reads fields from the front of a buffer that may hold only part of a message. Every length is
// checked against its limit as soon as its prefix arrives, before anything is allocated for it.
// With copy = false it only measures, so a message arriving in many pieces is copied once.
class Reader {
 public:
  Reader(const char* data, size_t n, bool copy) : p_(data), n_(n), copy_(copy) {}

  bool u8(uint8_t* v) {
    if (!have(1)) return false;
    *v = static_cast<uint8_t>(p_[pos_]);
    pos_ += 1;
    return true;
  }
  bool u32(uint32_t* v) {
    if (!have(4)) return false;
    *v = get_u32(p_ + pos_);
    pos_ += 4;
    return true;
  }
  bool i64(int64_t* v) {
    if (!have(8)) return false;
    *v = get_i64(p_ + pos_);
    pos_ += 8;
    return true;
  }
  bool str(std::string* s, uint32_t limit, const char* what) {
    uint32_t len = 0;
    if (!u32(&len)) return false;
    if (len > limit) {
      return fail(std::string(what) + " length " + std::to_string(len) + " exceeds the limit of " +
                  std::to_string(limit) + " bytes");
    }
    if (!have(len)) return false;
    if (copy_) s->assign(p_ + pos_, len);
    pos_ += len;
    return true;
  }
  bool keys(std::vector<std::string>* keys) {
    uint32_t count = 0;
    if (!u32(&count)) return false;
    if (count > kMaxKeysPerRequest) {
      return fail("key count " + std::to_string(count) + " exceeds the limit of " +
                  std::to_string(kMaxKeysPerRequest));
    }
    const size_t start = pos_;
    if (copy_) keys->resize(count);
    std::string skipped;
    for (uint32_t i = 0; i < count; ++i) {
      if (!str(copy_ ? &(*keys)[i] : &skipped, kMaxKeyBytes, "key")) return false;
      if (pos_ - start > kMaxKeyListBytes) {
        return fail("key list exceeds the limit of " + std::to_string(kMaxKeyListBytes) + " bytes");
      }
    }
    return true;
  }
  bool fail(std::string error) {
    error_ = std::move(error);
    return false;
  }
  bool bad() const { return !error_.empty(); }
  const std::string& error() const { return error_; }
  size_t consumed() const { return pos_; }

 private:
  bool have(size_t n) const { return n_ - pos_ >= n; }
  const char* p_;
  size_t n_;
  bool copy_;
  size_t pos_ = 0;
  std::string error_;
};

bool read_request(Reader& r, Request* req, uint32_t max_value) {
  uint8_t cmd = 0;
  if (!r.u8(&cmd)) return false;
  req->cmd = static_cast<Command>(cmd);
  switch (req->cmd) {
    case Command::kSet:
      return r.str(&req->key, kMaxKeyBytes, "key") && r.str(&req->value, max_value, "value");
    case Command::kGet:
      return r.i64(&req->number) && r.str(&req->key, kMaxKeyBytes, "key");
    case Command::kAdd:
      return r.str(&req->key, kMaxKeyBytes, "key") && r.i64(&req->number);
    case Command::kCompareSet:
      return r.str(&req->key, kMaxKeyBytes, "key") &&
             r.str(&req->expected, max_value, "expected value") &&
             r.str(&req->value, max_value, "desired value");
    case Command::kWait:
      return r.i64(&req->number) && r.keys(&req->keys);
    case Command::kCheck:
      return r.keys(&req->keys);
    case Command::kDelete:
      return r.str(&req->key, kMaxKeyBytes, "key");
    case Command::kNumKeys:
      return true;
  }
  return r.fail("unknown command " + std::to_string(cmd));
}

}  // namespace

Parse store_protocol::parse_request(const char* data, size_t n, uint32_t max_value, Request* req,
                                    size_t* consumed, std::string* error) {
  Reader measure(data, n, /*copy=*/false);
  Request scratch;
  if (!read_request(measure, &scratch, max_value)) {
    if (!measure.bad()) return Parse::kNeedMore;
    *error = measure.error();
    return Parse::kBad;
  }
  Reader r(data, n, /*copy=*/true);
  read_request(r, req, max_value);
  *consumed = r.consumed();
  return Parse::kOk;
}

namespace {

bool is_ip_address(const std::string& host) {
  unsigned char buf[sizeof(in6_addr)];
  return inet_pton(AF_INET, host.c_str(), buf) == 1 || inet_pton(AF_INET6, host.c_str(), buf) == 1;
}

std::string host_port(const std::string& host, int port) {
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

int64_t timeout_ms(std::chrono::milliseconds timeout) {
  return std::max<int64_t>(0, timeout.count());
}

// How long the client waits for a reply: the server's own deadline plus transit.
std::chrono::milliseconds with_slack(std::chrono::milliseconds timeout) {
  if (timeout > std::chrono::hours(24 * 365)) return timeout;  // no deadline at all
  return std::max(timeout, std::chrono::milliseconds(0)) + kReplySlack;
}

}  // namespace

// ---- Server ------------------------------------------------------------------------------------

struct TcpStoreServer::Impl {
  enum class Phase { kHello, kServing, kClosing, kDead };

  struct Client {
    uint64_t id = 0;
    net::Fd fd;
    std::string peer;
    Phase phase = Phase::kHello;
    std::unique_ptr<handshake::Server> hs;  // while kHello
    std::string in;  // received bytes; [in_off, end) not yet parsed
    size_t in_off = 0;
    std::string out;  // reply bytes; [out_off, end) not yet sent
    size_t out_off = 0;
    bool eof = false;
    bool half_closed = false;  // kClosing: the verdict is out; waiting for the peer to close
    // A large set's value, received in place (value.size() is its length, value_got what arrived).
    std::string value_key;
    std::string value;
    size_t value_got = 0;
    bool receiving_value = false;
    uint64_t skip = 0;  // bytes of a refused oversized value still to read and drop
    // kHello: end of the handshake; parked: end of the wait; kClosing: end of the linger.
    net::Deadline deadline = net::Deadline::max();
    bool parked = false;  // a get or wait is waiting for keys; later requests queue behind it
    Command parked_cmd = Command::kWait;
    std::vector<std::string> parked_keys;

    bool unproven() const { return phase == Phase::kHello || phase == Phase::kClosing; }
  };

  TcpStoreServerOptions options;
  uint32_t max_value = 0;         // options.max_value_bytes as the wire's u32
  uint64_t max_request_bytes = 0;  // compare_set carries the largest request: a key and two values
  std::string name;  // "TcpStoreServer(127.0.0.1:4242)", for the log
  net::Fd listen_fd;
  net::Fd wake_fd;  // eventfd; stop() writes it to end the thread's poll()
  int port = 0;
  std::atomic<bool> stopping{false};
  std::atomic<int64_t> refused{0};
  std::atomic<int64_t> malformed{0};
  std::atomic<int64_t> key_bytes{0};  // the bytes of every key and value in `data`
  std::atomic<int64_t> evicted{0};
  std::mutex stop_mu;
  std::thread thread;

  // Owned by the server thread.
  std::map<uint64_t, std::unique_ptr<Client>> clients;
  uint64_t next_id = 1;
  std::unordered_map<std::string, std::string> data;
  std::unordered_map<std::string, std::vector<uint64_t>> watchers;  // key -> parked clients
  std::vector<uint64_t> runnable;  // clients unblocked (wait ended, reply sent): requests may queue
  net::Deadline accept_paused_until{};

  void log(const std::string& line) const {
    if (!options.quiet) chorus::log(LogLevel::kWarning, name + ": " + line);
  }

  void run() {
    try {
      loop();
    } catch (const std::exception& e) {
      log(std::string("stopped after an internal error: ") + e.what() +
          "; its clients see their connections close");
    }
    clients.clear();
    listen_fd.reset();
  }

  void loop() {
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

  void accept_clients() {
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
  void evict_unproven_beyond(size_t keep) {
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

  void on_readable(Client& c) {
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

  void drop_malformed(Client& c, const std::string& why) {
    malformed.fetch_add(1);
    log("dropping " + c.peer + ": malformed message: " + why);
    c.phase = Phase::kDead;
  }

  // Handles the complete messages at the front of c.in, one at a time: a client's requests are
  // answered in order, so a parked wait or an unsent reply holds back the ones behind it.
  void process(Client& c) {
    try {
      while ((c.phase == Phase::kHello || c.phase == Phase::kServing) && !c.parked && !c.receiving_value &&
             c.skip == 0 && c.out_off == c.out.size() && c.in_off < c.in.size()) {
        const char* p = c.in.data() + c.in_off;
        const size_t n = c.in.size() - c.in_off;
        if (c.phase == Phase::kHello) {
          const size_t take = std::min(n, c.hs->want());
          c.hs->feed(p, take);
          c.in_off += take;
          handshake_step(c);
          continue;
        }
        if (start_large_set(c, p, n)) continue;
        size_t consumed = 0;
        std::string error;
        Request req;
        Parse parse = store_protocol::parse_request(p, n, max_value, &req, &consumed, &error);
        if (parse == Parse::kNeedMore) break;
        if (parse == Parse::kBad) {
          drop_malformed(c, error);
          break;
        }
        c.in_off += consumed;
        execute(c, req);
      }
    } catch (const std::exception& e) {  // std::bad_alloc for a huge value, most likely
      log("dropping " + c.peer + ": " + e.what());
      c.phase = Phase::kDead;
    }
    if (c.in_off == c.in.size()) {
      c.in.clear();
      c.in_off = 0;
    } else if (c.in_off > (1u << 20) && c.in_off > c.in.size() / 2) {
      c.in.erase(0, c.in_off);
      c.in_off = 0;
    }
  }

  // The server's half of the challenge-response (handshake.h), one step per complete message.
  void handshake_step(Client& c) {
    handshake::Server& hs = *c.hs;
    if (hs.state() == handshake::Server::kBad) {
      malformed.fetch_add(1);
      log("dropping " + c.peer + ": malformed hello: " + hs.error());
      refuse(c, hs.error());
    } else if (hs.state() == handshake::Server::kHello) {
      std::string reason;
      if (hs.hello().version != handshake::kProtocolVersion) {
        reason = "protocol version mismatch: the client speaks version " + std::to_string(hs.hello().version) +
                 ", this store speaks version " + std::to_string(handshake::kProtocolVersion) +
                 "; run the same chorus build on every host";
      } else if (hs.hello().kind != handshake::PeerKind::kStoreClient) {
        reason = "this port serves a chorus TcpStore, not transport connections; check the address "
                 "and port the peer was given";
      }
      if (!reason.empty()) {
        refused.fetch_add(1);
        log("refused " + c.peer + ": " + reason);
        refuse(c, reason);
        return;
      }
      send(c, hs.challenge());
    } else if (hs.state() == handshake::Server::kProof) {
      if (!hs.proven()) {
        const std::string reason =
            "job token mismatch: this store belongs to another job (its proof of the job token did not "
            "match); set CHORUS_JOB_TOKEN to the job's token";
        refused.fetch_add(1);
        log("refused " + c.peer + ": " + reason);
        refuse(c, reason);
        return;
      }
      send(c, hs.accept());
      c.hs.reset();
      c.phase = Phase::kServing;
      c.deadline = net::Deadline::max();
    }
  }

  // Sends a refusal verdict, then half-closes once it is out and reads until the peer closes (or the
  // linger time is up), so the verdict is never destroyed by a reset.
  void refuse(Client& c, const std::string& reason) {
    c.phase = Phase::kClosing;
    c.deadline = net::deadline_after(kLingerTimeout);
    c.in.clear();
    c.in_off = 0;
    send(c, handshake::Server::refusal(reason));
  }

  void send(Client& c, std::string bytes) {
    if (c.out_off == c.out.size()) {
      c.out = std::move(bytes);  // the usual case: no copy of a large reply
      c.out_off = 0;
    } else {
      c.out += bytes;
    }
    flush(c);
  }

  void flush(Client& c) {
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

  // A set with a large value: once its key and value length have arrived, the value is read straight
  // into the string the store will keep (or, beyond max_value_bytes, read and dropped after an error
  // reply naming the key, the size and the option). Returns false for any other request.
  bool start_large_set(Client& c, const char* p, size_t n) {
    if (n < 5 || static_cast<uint8_t>(p[0]) != uint8_t(Command::kSet)) return false;
    const uint32_t key_len = get_u32(p + 1);
    if (key_len > kMaxKeyBytes || n < 9 + size_t{key_len}) return false;
    const uint32_t value_len = get_u32(p + 5 + key_len);
    const size_t have = n - 9 - key_len;
    const bool too_large = value_len > max_value;
    if (!too_large && (value_len < kDirectValueBytes || have >= value_len)) return false;
    const std::string key(p + 5, key_len);
    c.in_off += 9 + key_len;
    const size_t now = std::min<size_t>(have, value_len);
    if (too_large) {
      send(c, Writer()
                  .u8(uint8_t(Status::kError))
                  .str(value_too_large(name, key, value_len, max_value, "TcpStoreServerOptions::max_value_bytes"))
                  .take());
      c.in_off += now;
      c.skip = value_len - now;
      return true;
    }
    c.value_key = key;
    c.value.resize(value_len);  // allocated once, at its final size
    std::memcpy(&c.value[0], p + 9 + key_len, now);
    c.in_off += now;
    c.value_got = now;
    c.receiving_value = true;
    return true;
  }

  void finish_direct_set(Client& c) {
    c.receiving_value = false;
    c.value_got = 0;
    put(c.value_key, std::move(c.value));
    c.value = std::string();
    send(c, Writer().u8(uint8_t(Status::kOk)).take());
    notify(c.value_key);
    runnable.push_back(c.id);  // requests may have queued behind the value
  }

  // Every write and delete of `data` goes through these two, which keep key_bytes.
  const std::string& put(const std::string& key, std::string value) {
    auto [it, added] = data.try_emplace(key);
    key_bytes += static_cast<int64_t>(value.size()) - static_cast<int64_t>(it->second.size()) +
                 (added ? static_cast<int64_t>(key.size()) : 0);
    it->second = std::move(value);
    return it->second;
  }
  bool erase(const std::string& key) {
    auto it = data.find(key);
    if (it == data.end()) return false;
    key_bytes -= static_cast<int64_t>(key.size() + it->second.size());
    data.erase(it);
    return true;
  }

  bool has_all(const std::vector<std::string>& keys) const {
    for (const auto& k : keys) {
      if (data.count(k) == 0) return false;
    }
    return true;
  }

  void execute(Client& c, Request& req) {
    Writer w;
    switch (req.cmd) {
      case Command::kSet:
        put(req.key, std::move(req.value));
        send(c, w.u8(uint8_t(Status::kOk)).take());
        notify(req.key);
        return;
      case Command::kGet: {
        auto it = data.find(req.key);
        if (it != data.end()) {
          send(c, w.u8(uint8_t(Status::kOk)).str(it->second).take());
        } else {
          park(c, Command::kGet, {req.key}, req.number);
        }
        return;
      }
      case Command::kAdd: {
        auto it = data.find(req.key);
        int64_t result = 0;
        std::string error;
        if (!detail::add_to_value(req.key, it == data.end() ? nullptr : &it->second, req.number,
                                  &result, &error)) {
          send(c, w.u8(uint8_t(Status::kError)).str(error).take());
          return;
        }
        put(req.key, std::to_string(result));
        send(c, w.u8(uint8_t(Status::kOk)).i64(result).take());
        notify(req.key);
        return;
      }
      case Command::kCompareSet: {
        auto it = data.find(req.key);
        const std::string* now = nullptr;
        if (it == data.end()) {
          if (!req.expected.empty()) now = &req.expected;
        } else if (it->second != req.expected) {
          now = &it->second;
        }
        if (now != nullptr) {
          send(c, w.u8(uint8_t(Status::kOk)).str(*now).take());
          return;
        }
        send(c, w.u8(uint8_t(Status::kOk)).str(put(req.key, std::move(req.value))).take());
        notify(req.key);
        return;
      }
      case Command::kWait:
        if (has_all(req.keys)) {
          send(c, w.u8(uint8_t(Status::kOk)).take());
        } else {
          park(c, Command::kWait, std::move(req.keys), req.number);
        }
        return;
      case Command::kCheck:
        send(c, w.u8(uint8_t(Status::kOk)).u8(has_all(req.keys) ? 1 : 0).take());
        return;
      case Command::kDelete: {
        const bool erased = erase(req.key);
        send(c, w.u8(uint8_t(Status::kOk)).u8(erased ? 1 : 0).take());
        return;
      }
      case Command::kNumKeys:
        send(c, w.u8(uint8_t(Status::kOk)).i64(static_cast<int64_t>(data.size())).take());
        return;
    }
  }

  // Parks a get or wait until its keys exist or its timeout passes; either way it gets a reply,
  // so the client's stream stays in step.
  void park(Client& c, Command cmd, std::vector<std::string> keys, int64_t timeout) {
    if (timeout <= 0) {
      reply_timeout(c, keys);
      return;
    }
    c.parked = true;
    c.parked_cmd = cmd;
    c.parked_keys = std::move(keys);
    c.deadline = net::deadline_after(std::chrono::milliseconds(timeout));
    std::unordered_set<std::string> seen;
    for (const auto& k : c.parked_keys) {
      if (seen.insert(k).second) watchers[k].push_back(c.id);
    }
  }

  void unpark(Client& c) {
    std::unordered_set<std::string> seen;
    for (const auto& k : c.parked_keys) {
      if (!seen.insert(k).second) continue;
      auto it = watchers.find(k);
      if (it == watchers.end()) continue;
      auto& ids = it->second;
      ids.erase(std::remove(ids.begin(), ids.end(), c.id), ids.end());
      if (ids.empty()) watchers.erase(it);
    }
    c.parked = false;
    c.parked_keys.clear();
    c.deadline = net::Deadline::max();
    runnable.push_back(c.id);
  }

  void reply_timeout(Client& c, const std::vector<std::string>& keys) {
    std::vector<std::string> missing;
    for (const auto& k : keys) {
      if (data.count(k) == 0) missing.push_back(k);
    }
    send(c, Writer().u8(uint8_t(Status::kTimeout)).keys(missing).take());
  }

  // `key` was written: answer the parked waits that it completes.
  void notify(const std::string& key) {
    auto it = watchers.find(key);
    if (it == watchers.end()) return;
    const std::vector<uint64_t> ids = it->second;  // unpark() edits the list
    for (uint64_t id : ids) {
      auto found = clients.find(id);
      if (found == clients.end()) continue;
      Client& c = *found->second;
      if (!c.parked || !has_all(c.parked_keys)) continue;
      Writer w;
      w.u8(uint8_t(Status::kOk));
      if (c.parked_cmd == Command::kGet) w.str(data.at(c.parked_keys[0]));
      unpark(c);
      if (c.phase == Phase::kServing) send(c, w.take());
    }
  }

  void expire(net::Deadline now) {
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
  void run_runnable() {
    while (!runnable.empty()) {
      const uint64_t id = runnable.back();
      runnable.pop_back();
      auto it = clients.find(id);
      if (it != clients.end()) process(*it->second);
    }
  }

  void reap() {
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
};

TcpStoreServer::TcpStoreServer(TcpStoreServerOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->max_value = value_limit(impl_->options.max_value_bytes);
  impl_->max_request_bytes = 1 + 3 * 4 + kMaxKeyBytes + 2 * uint64_t{impl_->max_value};
  impl_->listen_fd = net::listen_tcp(impl_->options.host, impl_->options.port);
  net::set_nonblocking(impl_->listen_fd.get(), true);
  impl_->port = net::local_port(impl_->listen_fd.get());
  impl_->name = "TcpStoreServer(" +
                host_port(impl_->options.host.empty() ? "*" : impl_->options.host, impl_->port) +
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

// ---- Client ------------------------------------------------------------------------------------

struct TcpStore::Impl {
  TcpStoreOptions options;
  std::unique_ptr<TcpStoreServer> server;  // when is_server
  int port = 0;
  std::string name;  // "TcpStore(127.0.0.1:4242)"
  std::string local_address;

  std::mutex mu;  // one request at a time on `fd`
  net::Fd fd;
  std::string broken;  // why `fd` is unusable; "" while it is fine

  // One request and its reply. A failure leaves the stream out of step, so it breaks the
  // connection: every later call fails fast with the original cause.
  class Call {
   public:
    Call(Impl& store, std::string op, std::chrono::milliseconds allowed)
        : s_(store),
          op_(std::move(op)),
          start_(net::Clock::now()),
          deadline_(net::deadline_after(allowed)) {
      if (!s_.broken.empty()) {
        throw PeerError(s_.name + ": " + op_ +
                        " failed: the connection to the store broke earlier: " + s_.broken);
      }
    }

    void send(const std::string& bytes) {
      net::IoResult r = net::write_full(s_.fd.get(), bytes.data(), bytes.size(), deadline_);
      if (!r.ok()) fail(r);
    }
    // A request ending in a large string: its head, then the string itself, so it is never copied.
    void send(const std::string& head, const std::string& tail) {
      send(head);
      send(tail);
    }

    // Reads the reply's status; an ERROR reply becomes a UsageError with the server's message.
    Status status() {
      const uint8_t s = u8();
      if (s == uint8_t(Status::kError)) {
        throw UsageError(s_.name + ": " + str(kMaxErrorBytes));
      }
      if (s != uint8_t(Status::kOk) && s != uint8_t(Status::kTimeout)) {
        protocol_error("unknown status " + std::to_string(s));
      }
      return static_cast<Status>(s);
    }
    void expect_ok() {
      if (status() != Status::kOk) protocol_error("unexpected TIMEOUT reply");
    }

    uint8_t u8() {
      uint8_t v = 0;
      read(&v, 1);
      return v;
    }
    uint32_t u32() {
      char b[4];
      read(b, 4);
      return get_u32(b);
    }
    int64_t i64() {
      char b[8];
      read(b, 8);
      return get_i64(b);
    }
    std::string str(uint32_t limit) {
      const uint32_t len = u32();
      if (len > limit) protocol_error("reply field of " + std::to_string(len) + " bytes");
      std::string s(len, '\0');
      if (len > 0) read(&s[0], len);
      return s;
    }
    std::vector<std::string> keys() {
      const uint32_t count = u32();
      if (count > kMaxKeysPerRequest) {
        protocol_error("reply with " + std::to_string(count) + " keys");
      }
      std::vector<std::string> out(count);
      for (auto& k : out) k = str(kMaxKeyBytes);
      return out;
    }

    net::Clock::duration elapsed() const { return net::Clock::now() - start_; }

   private:
    void read(void* p, size_t n) {
      net::IoResult r = net::read_full(s_.fd.get(), p, n, deadline_);
      if (!r.ok()) fail(r);
    }

    [[noreturn]] void fail(const net::IoResult& r) {
      if (r.code == net::IoResult::kTimeout) {
        s_.broken = s_.name + ": no reply to " + op_ + " within " +
                    net::format_duration(elapsed()) + " (the store timeout plus " +
                    net::format_duration(kReplySlack) +
                    " of slack); the store server is not responding";
        throw TimeoutError(s_.broken);
      }
      s_.broken = s_.name + ": lost the connection to the store server during " + op_ + ": " +
                  r.describe() + "; the process hosting the store (rank 0 or the launcher) has " +
                  "probably exited";
      throw PeerError(s_.broken);
    }

    [[noreturn]] void protocol_error(const std::string& what) {
      s_.broken = s_.name + ": malformed reply to " + op_ + " (" + what +
                  "); is this port really a chorus TcpStore of the same version?";
      throw PeerError(s_.broken);
    }

    Impl& s_;
    std::string op_;
    net::Clock::time_point start_;
    net::Deadline deadline_;
  };

  void check_key(const std::string& key) const {
    if (key.size() > kMaxKeyBytes) {
      throw UsageError(name + ": key of " + std::to_string(key.size()) +
                       " bytes exceeds the limit of " + std::to_string(kMaxKeyBytes));
    }
  }
  void check_value(const std::string& key, const std::string& value) const {
    if (value.size() > options.max_value_bytes || value.size() > UINT32_MAX) {
      throw UsageError(value_too_large(name, key, value.size(), std::min<uint64_t>(options.max_value_bytes, UINT32_MAX),
                                       "TcpStoreOptions::max_value_bytes"));
    }
  }
  void check_keys(const std::vector<std::string>& keys) const {
    uint64_t bytes = 0;
    for (const auto& k : keys) {
      check_key(k);
      bytes += 4 + k.size();
    }
    if (keys.size() > kMaxKeysPerRequest || bytes > kMaxKeyListBytes) {
      throw UsageError(name + ": " + std::to_string(keys.size()) + " keys (" +
                       std::to_string(bytes) + " bytes) in one request exceed the limits of " +
                       std::to_string(kMaxKeysPerRequest) + " keys and " +
                       std::to_string(kMaxKeyListBytes) + " bytes");
    }
  }

  static constexpr const char* kWaitHint =
      "check that every rank reached this point and uses the same store (MASTER_ADDR/MASTER_PORT)";
};

TcpStore::TcpStore(TcpStoreOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.options = std::move(options);
  set_timeout(s.options.timeout);
  if (s.options.is_server) {
    TcpStoreServerOptions server;
    server.host = is_ip_address(s.options.host) ? s.options.host : "";
    server.port = s.options.port;
    server.token = s.options.token;
    server.max_value_bytes = s.options.max_value_bytes;
    s.server = std::make_unique<TcpStoreServer>(server);
    s.port = s.server->port();
  } else {
    s.port = s.options.port;
    if (s.port <= 0 || s.port > 65535) {
      throw UsageError("TcpStore: port " + std::to_string(s.port) +
                       " is not a valid server port; give "
                       "the port the store server listens on (is_server with port 0 picks one)");
    }
  }
  s.name = "TcpStore(" + host_port(s.options.host, s.port) + ")";
  const net::Deadline deadline = net::deadline_after(s.options.timeout);
  net::ConnectProgress progress;
  progress.interval = s.options.progress_interval;
  progress.who = s.options.who;
  progress.report = [](const std::string& line) { chorus::log(LogLevel::kInfo, line); };
  s.fd = net::connect_tcp(s.options.host, s.port, deadline, "the TcpStore server",
                          s.options.progress_interval.count() > 0 ? &progress : nullptr);
  net::set_nodelay(s.fd.get());
  net::set_keepalive(s.fd.get());
  handshake::Hello hello;
  hello.kind = handshake::PeerKind::kStoreClient;
  handshake::client_handshake(s.fd.get(), s.options.token, hello, deadline,
                              "the TcpStore server at " + host_port(s.options.host, s.port));
  s.local_address = net::local_host(s.fd.get());
}

TcpStore::~TcpStore() = default;

void TcpStore::set(const std::string& key, const std::string& value) {
  impl_->check_key(key);
  impl_->check_value(key, value);
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl::Call call(*impl_, "set('" + detail::format_key(key) + "')", with_slack(timeout()));
  call.send(Writer().u8(uint8_t(Command::kSet)).str(key).u32(static_cast<uint32_t>(value.size())).bytes(), value);
  call.expect_ok();
}

std::string TcpStore::get(const std::string& key) {
  impl_->check_key(key);
  const std::chrono::milliseconds timeout = Store::timeout();
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl::Call call(*impl_, "get('" + detail::format_key(key) + "')", with_slack(timeout));
  call.send(Writer().u8(uint8_t(Command::kGet)).i64(timeout_ms(timeout)).str(key).bytes());
  if (call.status() == Status::kTimeout) {
    std::vector<std::string> missing = call.keys();
    throw TimeoutError(
        detail::wait_timeout_message(impl_->name, {key}, missing, call.elapsed(), Impl::kWaitHint));
  }
  return call.str(kMaxReplyValueBytes);
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  impl_->check_key(key);
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl::Call call(*impl_, "add('" + detail::format_key(key) + "')", with_slack(timeout()));
  call.send(Writer().u8(uint8_t(Command::kAdd)).str(key).i64(delta).bytes());
  call.expect_ok();
  return call.i64();
}

std::string TcpStore::compare_set(const std::string& key, const std::string& expected,
                                  const std::string& desired) {
  impl_->check_key(key);
  impl_->check_value(key, expected);
  impl_->check_value(key, desired);
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl::Call call(*impl_, "compare_set('" + detail::format_key(key) + "')", with_slack(timeout()));
  call.send(Writer().u8(uint8_t(Command::kCompareSet)).str(key).str(expected).str(desired).bytes());
  call.expect_ok();
  return call.str(kMaxReplyValueBytes);
}

void TcpStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  impl_->check_keys(keys);
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl::Call call(*impl_, "wait([" + detail::join_keys(keys) + "])", with_slack(timeout));
  call.send(Writer().u8(uint8_t(Command::kWait)).i64(timeout_ms(timeout)).keys(keys).bytes());
  if (call.status() == Status::kTimeout) {
    std::vector<std::string> missing = call.keys();
    throw TimeoutError(
        detail::wait_timeout_message(impl_->name, keys, missing, call.elapsed(), Impl::kWaitHint));
  }
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  impl_->check_keys(keys);
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl::Call call(*impl_, "check([" + detail::join_keys(keys) + "])", with_slack(timeout()));
  call.send(Writer().u8(uint8_t(Command::kCheck)).keys(keys).bytes());
  call.expect_ok();
  return call.u8() != 0;
}

bool TcpStore::delete_key(const std::string& key) {
  impl_->check_key(key);
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl::Call call(*impl_, "delete_key('" + detail::format_key(key) + "')", with_slack(timeout()));
  call.send(Writer().u8(uint8_t(Command::kDelete)).str(key).bytes());
  call.expect_ok();
  return call.u8() != 0;
}

int64_t TcpStore::num_keys() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl::Call call(*impl_, "num_keys()", with_slack(timeout()));
  call.send(Writer().u8(uint8_t(Command::kNumKeys)).bytes());
  call.expect_ok();
  return call.i64();
}

std::string TcpStore::describe() const { return impl_->name; }
int TcpStore::port() const { return impl_->port; }
const std::string& TcpStore::host() const { return impl_->options.host; }
std::string TcpStore::local_address() const { return impl_->local_address; }

}  // namespace chorus
