// Internal: the TcpStore server's state (TcpStoreServer::Impl), shared by the two files that run it:
// tcp_store_server.cc holds the server thread's poll loop, its connections and their socket I/O;
// tcp_store_requests.cc holds what a connection's bytes mean there (the handshake's verdicts, the
// requests, the data and the parked waits). The members under `Owned by the server thread` are
// touched by that thread only; the counters are atomics that TcpStoreServer's getters read.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "chorus/comm/log.h"
#include "chorus/comm/tcp_store.h"
#include "handshake.h"
#include "socket.h"
#include "store_protocol.h"

namespace chorus {

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
    store_protocol::Command parked_cmd = store_protocol::Command::kWait;
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

  // The server thread (tcp_store_server.cc): poll every connection, accept, read, write, expire.
  void run();
  void loop();
  void accept_clients();
  void evict_unproven_beyond(size_t keep);
  void on_readable(Client& c);
  void drop_malformed(Client& c, const std::string& why);
  void send(Client& c, std::string bytes);
  void flush(Client& c);
  void expire(net::Deadline now);
  void run_runnable();
  void reap();

  // What the bytes mean (tcp_store_requests.cc): handshake verdicts, requests, data, parked waits.
  void process(Client& c);
  void handshake_step(Client& c);
  void refuse(Client& c, const std::string& reason);
  bool start_large_set(Client& c, const char* p, size_t n);
  void finish_direct_set(Client& c);
  const std::string& put(const std::string& key, std::string value);
  bool erase(const std::string& key);
  bool has_all(const std::vector<std::string>& keys) const;
  void execute(Client& c, store_protocol::Request& req);
  void park(Client& c, store_protocol::Command cmd, std::vector<std::string> keys, int64_t timeout);
  void unpark(Client& c);
  void reply_timeout(Client& c, const std::vector<std::string>& keys);
  void notify(const std::string& key);
};

}  // namespace chorus
