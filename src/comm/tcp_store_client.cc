// TcpStore, the client (docs/store.md): connects to the server (or hosts one in-process), proves the
// job token, then sends one request at a time on its connection and reads the reply, with the
// server's own deadline plus some slack for transit. A failure leaves the connection out of step,
// so it breaks the client: every later call fails fast with the original cause.
#include <arpa/inet.h>
#include <sys/socket.h>

#include <algorithm>
#include <mutex>

#include "chorus/comm/error.h"
#include "chorus/comm/log.h"
#include "chorus/comm/tcp_store.h"
#include "handshake.h"
#include "socket.h"
#include "store_internal.h"
#include "store_protocol.h"

namespace chorus {
namespace {

using store_protocol::Command;
using store_protocol::get_i64;
using store_protocol::get_u32;
using store_protocol::host_port;
using store_protocol::kMaxKeyBytes;
using store_protocol::kMaxKeyListBytes;
using store_protocol::kMaxKeysPerRequest;
using store_protocol::Status;
using store_protocol::value_too_large;
using store_protocol::Writer;

constexpr uint32_t kMaxErrorBytes = 64 * 1024;
// A reply's value comes from the authenticated server, which bounds what it stores; this only
// keeps a corrupt length from allocating more than a value can be.
constexpr uint32_t kMaxReplyValueBytes = UINT32_MAX;

// The server answers a wait by its timeout; the client gives the answer this long to arrive. A
// server that has died closes its connections, which fails a request at once; this bounds only a
// server that is alive but silent (stopped, hung). It was 2 s until a store thread on a loaded
// 2-core machine (a build beside a two-host Dask test) went 2.4 s without being scheduled and a
// healthy job failed: a live thread may be starved that long, so the bound is well above it.
constexpr std::chrono::milliseconds kReplySlack{10000};

bool is_ip_address(const std::string& host) {
  unsigned char buf[sizeof(in6_addr)];
  return inet_pton(AF_INET, host.c_str(), buf) == 1 || inet_pton(AF_INET6, host.c_str(), buf) == 1;
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
