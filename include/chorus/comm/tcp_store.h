// TCP key-value store: one server, many clients. See docs/wire-format.md for the protocol.
//
// - TcpStoreServer runs one background thread that serves every client with poll(); it never
//   blocks on one client, never spins while idle, and survives malformed or truncated messages
//   and refused peers (it logs them to stderr and drops that connection only).
// - Every client connection opens with a challenge-response handshake over the job token (the token
//   itself never crosses the wire; docs/wire-format.md); a client that cannot prove the token is
//   refused with the reason, and the refusal is logged. Connections that have not finished their
//   handshake are capped (the oldest are dropped) and get 10 s, so idle or garbage connections
//   cannot stall or exhaust the server.
// - Values are bounded by max_value_bytes on both sides: a larger one is a UsageError naming the
//   key, the size and the option. A large set is received straight into the stored string.
// - TcpStore is a client (optionally owning an in-process server). It is thread-safe: calls are
//   serialised on its connection.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "chorus/comm/store.h"

namespace chorus {

// The default bound on one value: far above what a rendezvous needs (addresses, counters), small
// enough that a client cannot make the server allocate without limit.
constexpr size_t kDefaultMaxValueBytes = size_t{256} << 20;

struct TcpStoreServerOptions {
  std::string host = "";  // address to bind; "" = all interfaces
  int port = 0;           // 0 = let the kernel pick; read the result from port()
  std::string token;      // job token clients must prove ("" = accept clients with "" only)
  bool quiet = false;     // do not log refused or malformed peers to stderr
  size_t max_value_bytes = kDefaultMaxValueBytes;  // largest value a client may set
  // false: the constructor binds and listens (port() is known, clients' connections wait in the
  // kernel's backlog) but starts no thread until start(). For forking workers first: fork() copies
  // only the calling thread, and a lock the server thread held at that moment (OpenSSL's random
  // generator during a handshake, the log's) would stay locked forever in the child.
  bool start_serving = true;
};

class TcpStoreServer {
 public:
  explicit TcpStoreServer(TcpStoreServerOptions options);
  ~TcpStoreServer();  // stops the thread and closes every connection
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  int port() const;
  // Starts serving (the server thread) if it has not started yet; see start_serving.
  void start();
  // Counters for tests and diagnostics.
  int64_t refused_connections() const;
  int64_t malformed_messages() const;
  // The bytes of every key and value held (what the store's memory grows with).
  int64_t stored_bytes() const;
  int64_t dropped_unproven() const;  // connections dropped by the cap on unfinished handshakes
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct TcpStoreOptions {
  std::string host = "127.0.0.1";  // server address to connect to
  int port = 0;                    // server port; with is_server and port 0 the kernel picks
  bool is_server = false;          // also host an in-process TcpStoreServer
  std::string token;               // job token proved in the handshake
  std::chrono::milliseconds timeout = Store::kDefaultTimeout;  // connect and operation timeout
  size_t max_value_bytes = kDefaultMaxValueBytes;  // larger values are refused before sending
  // While the server cannot be reached, a line on stderr this often says who waits, for what,
  // how long so far and until when; 0 = silent.
  std::chrono::milliseconds progress_interval{5000};
  std::string who;                 // names this client in those lines ("rank 1"); "" = "this process"
};

class TcpStore : public Store {
 public:
  explicit TcpStore(TcpStoreOptions options);
  ~TcpStore() override;

  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  using Store::wait;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;
  std::string describe() const override;

  // The server's port (the kernel's choice when is_server and port 0 were given).
  int port() const;
  const std::string& host() const;
  // The local address of this client's connection: the address peers can reach this host by.
  std::string local_address() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace chorus
