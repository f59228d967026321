// TCP key-value store: one server, many clients. See docs/wire-format.md for the protocol.
//
// - TcpStoreServer runs one background thread that serves every client with poll(); it never
//   blocks on one client, never spins while idle, and survives malformed or truncated messages
//   and refused peers (it logs them to stderr and drops that connection only).
// - Every client connection opens with a handshake carrying the protocol version and the job
//   token; a client with the wrong token is refused and the refusal is logged.
// - TcpStore is a client (optionally owning an in-process server). It is thread-safe: calls are
//   serialised on its connection.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "chorus/comm/store.h"

namespace chorus {

struct TcpStoreServerOptions {
  std::string host = "";  // address to bind; "" = all interfaces
  int port = 0;           // 0 = let the kernel pick; read the result from port()
  std::string token;      // job token clients must present ("" = accept clients with "" only)
  bool quiet = false;     // do not log refused or malformed peers to stderr
};

class TcpStoreServer {
 public:
  explicit TcpStoreServer(TcpStoreServerOptions options);
  ~TcpStoreServer();  // stops the thread and closes every connection
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  int port() const;
  // Counters for tests and diagnostics.
  int64_t refused_connections() const;
  int64_t malformed_messages() const;
  // The bytes of every key and value held (what the store's memory grows with).
  int64_t stored_bytes() const;
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct TcpStoreOptions {
  std::string host = "127.0.0.1";  // server address to connect to
  int port = 0;                    // server port; with is_server and port 0 the kernel picks
  bool is_server = false;          // also host an in-process TcpStoreServer
  std::string token;               // job token presented in the handshake
  std::chrono::milliseconds timeout = Store::kDefaultTimeout;  // connect and operation timeout
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
