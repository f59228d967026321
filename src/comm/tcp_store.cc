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
#include "handshake.h"
#include "socket.h"
#include "store_internal.h"

namespace chorus {
namespace {

using handshake::Parse;

// ---- Wire format -------------------------------------------------------------------------------
// request: u8 command, then its fields; reply: u8 status, then the command's fields.
// Strings are u32 length + bytes, numbers i64, lists u32 count + strings; all little-endian.

enum class Command : uint8_t {
  kSet = 1,         // key, value                    -> OK
  kGet = 2,         // timeout_ms, key               -> OK value | TIMEOUT missing
  kAdd = 3,         // key, delta                    -> OK i64 | ERROR message
  kCompareSet = 4,  // key, expected, desired        -> OK value
  kWait = 5,        // timeout_ms, keys              -> OK | TIMEOUT missing
  kCheck = 6,       // keys                          -> OK u8
  kDelete = 7,      // key                           -> OK u8
  kNumKeys = 8,     //                               -> OK i64
};

enum class Status : uint8_t { kOk = 0, kTimeout = 1, kError = 2 };

constexpr uint32_t kMaxKeyBytes = 64 * 1024;
constexpr uint32_t kMaxValueBytes = 1u << 30;
constexpr uint32_t kMaxKeysPerRequest = 64 * 1024;
constexpr uint64_t kMaxKeyListBytes = 16u << 20;  // all keys of one wait or check together
constexpr uint32_t kMaxErrorBytes = 64 * 1024;
// compare_set carries the largest request: a key and two values.
constexpr uint64_t kMaxRequestBytes = 1 + 3 * 4 + kMaxKeyBytes + 2 * uint64_t{kMaxValueBytes};

// The server answers a wait by its timeout; the client gives the answer this long to arrive.
constexpr std::chrono::milliseconds kReplySlack{2000};
// A connection must complete its hello this soon after connecting.
constexpr std::chrono::milliseconds kHelloTimeout{30000};
// How long a refused peer has to take its verdict before the server closes the connection.
constexpr std::chrono::milliseconds kLingerTimeout{1000};

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

struct Request {
  Command cmd = Command::kNumKeys;
  std::string key;
  std::string value;     // set's value; compare_set's desired value
  std::string expected;  // compare_set
  int64_t number = 0;    // add's delta; get's and wait's timeout in ms
  std::vector<std::string> keys;
};

bool read_request(Reader& r, Request* req) {
  uint8_t cmd = 0;
  if (!r.u8(&cmd)) return false;
  req->cmd = static_cast<Command>(cmd);
  switch (req->cmd) {
    case Command::kSet:
      return r.str(&req->key, kMaxKeyBytes, "key") && r.str(&req->value, kMaxValueBytes, "value");
    case Command::kGet:
      return r.i64(&req->number) && r.str(&req->key, kMaxKeyBytes, "key");
    case Command::kAdd:
      return r.str(&req->key, kMaxKeyBytes, "key") && r.i64(&req->number);
    case Command::kCompareSet:
      return r.str(&req->key, kMaxKeyBytes, "key") &&
             r.str(&req->expected, kMaxValueBytes, "expected value") &&
             r.str(&req->value, kMaxValueBytes, "desired value");
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

// Parses one request from the front of [data, data + n).
Parse parse_request(const char* data, size_t n, Request* req, size_t* consumed,
                    std::string* error) {
  Reader measure(data, n, /*copy=*/false);
  Request scratch;
  if (!read_request(measure, &scratch)) {
    if (!measure.bad()) return Parse::kNeedMore;
    *error = measure.error();
    return Parse::kBad;
  }
  Reader r(data, n, /*copy=*/true);
  read_request(r, req);
  *consumed = r.consumed();
  return Parse::kOk;
}

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
    std::string in;  // received bytes; [in_off, end) not yet parsed
    size_t in_off = 0;
    std::string out;  // reply bytes; [out_off, end) not yet sent
    size_t out_off = 0;
    bool eof = false;
    // kHello: end of the hello; parked: end of the wait; kClosing: end of the linger.
    net::Deadline deadline = net::Deadline::max();
    bool parked = false;  // a get or wait is waiting for keys; later requests queue behind it
    Command parked_cmd = Command::kWait;
    std::vector<std::string> parked_keys;
  };

  TcpStoreServerOptions options;
  std::string name;  // "TcpStoreServer(127.0.0.1:4242)", for the log
  net::Fd listen_fd;
  net::Fd wake_fd;  // eventfd; stop() writes it to end the thread's poll()
  int port = 0;
  std::atomic<bool> stopping{false};
  std::atomic<int64_t> refused{0};
  std::atomic<int64_t> malformed{0};
  std::atomic<int64_t> key_bytes{0};  // the bytes of every key and value in `data`
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
    if (!options.quiet) std::fprintf(stderr, "[chorus] %s: %s\n", name.c_str(), line.c_str());
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
        short events = 0;
        if (c->phase != Phase::kClosing) events |= POLLIN;
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
        Client& c = *clients.at(ids[i]);
        if (c.phase == Phase::kDead) continue;
        if (revents & POLLOUT) {
          flush(c);
          if (c.out.empty()) runnable.push_back(c.id);  // requests may wait behind that reply
        }
        if (c.phase == Phase::kClosing) {
          if (revents & (POLLERR | POLLHUP | POLLNVAL)) c.phase = Phase::kDead;
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
      auto c = std::make_unique<Client>();
      c->id = next_id++;
      c->fd = net::Fd(fd);
      net::set_nodelay(fd);
      c->peer = net::peer_string(fd);
      c->deadline = net::deadline_after(kHelloTimeout);
      clients.emplace(c->id, std::move(c));
    }
  }

  void on_readable(Client& c) {
    char buf[64 * 1024];
    // Bounded, so that one busy client cannot starve the others; poll() brings us back.
    for (int round = 0; round < 16 && !c.eof; ++round) {
      ssize_t k = ::recv(c.fd.get(), buf, sizeof(buf), MSG_DONTWAIT);
      if (k > 0) {
        c.in.append(buf, static_cast<size_t>(k));
        if (static_cast<size_t>(k) < sizeof(buf)) break;
        continue;
      }
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      c.eof = true;  // orderly close (k == 0) or a reset: either way the peer is gone
    }
    process(c);
    if (c.phase == Phase::kServing || c.phase == Phase::kHello) {
      const size_t pending = c.in.size() - c.in_off;
      if (pending > kMaxRequestBytes) {
        drop_malformed(c, std::to_string(pending) + " bytes sent without waiting for replies");
      } else if (c.eof) {
        if (pending > 0 && !c.parked && c.out_off == c.out.size()) {
          drop_malformed(c, "connection closed in the middle of a " +
                                std::string(c.phase == Phase::kHello ? "hello" : "request") + " (" +
                                std::to_string(pending) + " bytes of it arrived)");
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
      while ((c.phase == Phase::kHello || c.phase == Phase::kServing) && !c.parked &&
             c.out_off == c.out.size() && c.in_off < c.in.size()) {
        const char* p = c.in.data() + c.in_off;
        const size_t n = c.in.size() - c.in_off;
        size_t consumed = 0;
        std::string error;
        if (c.phase == Phase::kHello) {
          handshake::Hello hello;
          Parse parse = handshake::parse_hello(p, n, &hello, &consumed, &error);
          if (parse == Parse::kNeedMore) break;
          if (parse == Parse::kBad) {
            malformed.fetch_add(1);
            log("dropping " + c.peer + ": malformed hello: " + error);
            refuse(c, error);
            break;
          }
          c.in_off += consumed;
          greet(c, hello);
        } else {
          Request req;
          Parse parse = parse_request(p, n, &req, &consumed, &error);
          if (parse == Parse::kNeedMore) break;
          if (parse == Parse::kBad) {
            drop_malformed(c, error);
            break;
          }
          c.in_off += consumed;
          execute(c, req);
        }
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

  void greet(Client& c, const handshake::Hello& hello) {
    std::string reason;
    if (hello.version != handshake::kProtocolVersion) {
      reason = "protocol version mismatch: the client speaks version " +
               std::to_string(hello.version) + ", this store speaks version " +
               std::to_string(handshake::kProtocolVersion) +
               "; run the same chorus build on every host";
    } else if (hello.kind != handshake::PeerKind::kStoreClient) {
      reason =
          "this port serves a chorus TcpStore, not transport connections; check the address "
          "and port the peer was given";
    } else if (!handshake::tokens_equal(hello.token, options.token)) {
      reason =
          "job token mismatch: this store belongs to another job; set CHORUS_JOB_TOKEN to the "
          "job's token";
    }
    if (!reason.empty()) {
      refused.fetch_add(1);
      log("refused " + c.peer + ": " + reason);
      refuse(c, reason);
      return;
    }
    c.phase = Phase::kServing;
    c.deadline = net::Deadline::max();
    send(c, handshake::encode_verdict(true, ""));
  }

  // Sends a refusal verdict, then closes once it is out (or the linger time is up).
  void refuse(Client& c, const std::string& reason) {
    c.phase = Phase::kClosing;
    c.deadline = net::deadline_after(kLingerTimeout);
    send(c, handshake::encode_verdict(false, reason));
  }

  void send(Client& c, const std::string& bytes) {
    c.out += bytes;
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
    c.out_off = 0;
    if (c.phase == Phase::kClosing) c.phase = Phase::kDead;
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
        send(c, w.u8(uint8_t(Status::kOk)).bytes());
        notify(req.key);
        return;
      case Command::kGet: {
        auto it = data.find(req.key);
        if (it != data.end()) {
          send(c, w.u8(uint8_t(Status::kOk)).str(it->second).bytes());
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
          send(c, w.u8(uint8_t(Status::kError)).str(error).bytes());
          return;
        }
        put(req.key, std::to_string(result));
        send(c, w.u8(uint8_t(Status::kOk)).i64(result).bytes());
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
          send(c, w.u8(uint8_t(Status::kOk)).str(*now).bytes());
          return;
        }
        send(c, w.u8(uint8_t(Status::kOk)).str(put(req.key, std::move(req.value))).bytes());
        notify(req.key);
        return;
      }
      case Command::kWait:
        if (has_all(req.keys)) {
          send(c, w.u8(uint8_t(Status::kOk)).bytes());
        } else {
          park(c, Command::kWait, std::move(req.keys), req.number);
        }
        return;
      case Command::kCheck:
        send(c, w.u8(uint8_t(Status::kOk)).u8(has_all(req.keys) ? 1 : 0).bytes());
        return;
      case Command::kDelete: {
        const bool erased = erase(req.key);
        send(c, w.u8(uint8_t(Status::kOk)).u8(erased ? 1 : 0).bytes());
        return;
      }
      case Command::kNumKeys:
        send(c, w.u8(uint8_t(Status::kOk)).i64(static_cast<int64_t>(data.size())).bytes());
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
    send(c, Writer().u8(uint8_t(Status::kTimeout)).keys(missing).bytes());
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
      if (c.phase == Phase::kServing) send(c, w.bytes());
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
        log("closing " + c->peer + ": no hello within " + net::format_duration(kHelloTimeout));
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
  Impl* impl = impl_.get();
  impl_->thread = std::thread([impl] { impl->run(); });
}

TcpStoreServer::~TcpStoreServer() { stop(); }

int TcpStoreServer::port() const { return impl_->port; }
int64_t TcpStoreServer::refused_connections() const { return impl_->refused.load(); }
int64_t TcpStoreServer::malformed_messages() const { return impl_->malformed.load(); }
int64_t TcpStoreServer::stored_bytes() const { return impl_->key_bytes.load(); }

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
  void check_value(const std::string& value) const {
    if (value.size() > kMaxValueBytes) {
      throw UsageError(name + ": value of " + std::to_string(value.size()) +
                       " bytes exceeds the limit of " + std::to_string(kMaxValueBytes));
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
  timeout_ = s.options.timeout;
  if (s.options.is_server) {
    TcpStoreServerOptions server;
    server.host = is_ip_address(s.options.host) ? s.options.host : "";
    server.port = s.options.port;
    server.token = s.options.token;
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
  s.fd = net::connect_tcp(s.options.host, s.port, deadline, "the TcpStore server");
  net::set_nodelay(s.fd.get());
  net::set_keepalive(s.fd.get());
  handshake::Hello hello;
  hello.kind = handshake::PeerKind::kStoreClient;
  hello.version = handshake::kProtocolVersion;
  hello.token = s.options.token;
  handshake::client_handshake(s.fd.get(), hello, deadline,
                              "the TcpStore server at " + host_port(s.options.host, s.port));
  s.local_address = net::local_host(s.fd.get());
}

TcpStore::~TcpStore() = default;

void TcpStore::set(const std::string& key, const std::string& value) {
  impl_->check_key(key);
  impl_->check_value(value);
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl::Call call(*impl_, "set('" + detail::format_key(key) + "')", with_slack(timeout_));
  call.send(Writer().u8(uint8_t(Command::kSet)).str(key).str(value).bytes());
  call.expect_ok();
}

std::string TcpStore::get(const std::string& key) {
  impl_->check_key(key);
  const std::chrono::milliseconds timeout = timeout_;
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl::Call call(*impl_, "get('" + detail::format_key(key) + "')", with_slack(timeout));
  call.send(Writer().u8(uint8_t(Command::kGet)).i64(timeout_ms(timeout)).str(key).bytes());
  if (call.status() == Status::kTimeout) {
    std::vector<std::string> missing = call.keys();
    throw TimeoutError(
        detail::wait_timeout_message(impl_->name, {key}, missing, call.elapsed(), Impl::kWaitHint));
  }
  return call.str(kMaxValueBytes);
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  impl_->check_key(key);
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl::Call call(*impl_, "add('" + detail::format_key(key) + "')", with_slack(timeout_));
  call.send(Writer().u8(uint8_t(Command::kAdd)).str(key).i64(delta).bytes());
  call.expect_ok();
  return call.i64();
}

std::string TcpStore::compare_set(const std::string& key, const std::string& expected,
                                  const std::string& desired) {
  impl_->check_key(key);
  impl_->check_value(expected);
  impl_->check_value(desired);
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl::Call call(*impl_, "compare_set('" + detail::format_key(key) + "')", with_slack(timeout_));
  call.send(Writer().u8(uint8_t(Command::kCompareSet)).str(key).str(expected).str(desired).bytes());
  call.expect_ok();
  return call.str(kMaxValueBytes);
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
  Impl::Call call(*impl_, "check([" + detail::join_keys(keys) + "])", with_slack(timeout_));
  call.send(Writer().u8(uint8_t(Command::kCheck)).keys(keys).bytes());
  call.expect_ok();
  return call.u8() != 0;
}

bool TcpStore::delete_key(const std::string& key) {
  impl_->check_key(key);
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl::Call call(*impl_, "delete_key('" + detail::format_key(key) + "')", with_slack(timeout_));
  call.send(Writer().u8(uint8_t(Command::kDelete)).str(key).bytes());
  call.expect_ok();
  return call.u8() != 0;
}

int64_t TcpStore::num_keys() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl::Call call(*impl_, "num_keys()", with_slack(timeout_));
  call.send(Writer().u8(uint8_t(Command::kNumKeys)).bytes());
  call.expect_ok();
  return call.i64();
}

std::string TcpStore::describe() const { return impl_->name; }
int TcpStore::port() const { return impl_->port; }
const std::string& TcpStore::host() const { return impl_->options.host; }
std::string TcpStore::local_address() const { return impl_->local_address; }

}  // namespace chorus
