// TcpStore and TcpStoreServer beyond the conformance suite (store_test.cc): how the client names
// itself and its timeouts, connecting before the server starts, large values and the limit on them,
// and the server's handshake and defences against wrong tokens, other protocols, malformed or
// abandoned requests, and its own death. Part of the store_test executable.
#include "chorus/comm/tcp_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "chorus/comm/error.h"
#include "handshake.h"
#include "socket.h"
#include "store_test_util.h"

namespace chorus {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
using store_test::Clock;
using store_test::eventually;
using store_test::free_port;
using store_test::kLongTimeout;
using store_test::kShortTimeout;
using store_test::seconds_since;
using store_test::wait_child;

// ---- TcpStore and its server
// ----------------------------------------------------------------------

TcpStoreOptions client_options(int port, const std::string& token,
                               std::chrono::milliseconds timeout = kLongTimeout) {
  TcpStoreOptions options;
  options.host = "127.0.0.1";
  options.port = port;
  options.token = token;
  options.timeout = timeout;
  return options;
}

TcpStoreServerOptions server_options(const std::string& token) {
  TcpStoreServerOptions options;
  options.host = "127.0.0.1";
  options.token = token;
  options.quiet = true;
  return options;
}

// A raw connection to the server, past the handshake when `greet` is set.
net::Fd raw_connection(int port, const std::string& token, bool greet) {
  net::Fd fd = net::connect_tcp("127.0.0.1", port, net::deadline_after(3s), "test server");
  if (greet) {
    handshake::client_handshake(fd.get(), token, handshake::Hello{}, net::deadline_after(3s), "test server");
  }
  return fd;
}

void send_bytes(int fd, const std::string& bytes) {
  ASSERT_TRUE(net::write_full(fd, bytes.data(), bytes.size(), net::deadline_after(3s)).ok());
}

// True when the server closes `fd` (after whatever verdict it sends) before the deadline.
bool closed_by_server(int fd) {
  const net::Deadline deadline = net::deadline_after(3s);
  char byte;
  for (;;) {
    net::IoResult r = net::read_full(fd, &byte, 1, deadline);
    if (!r.ok()) return r.code == net::IoResult::kClosed;
  }
}

void expect_serves_good_clients(int port, const std::string& token) {
  TcpStore store(client_options(port, token));
  store.set("still", "serving");
  EXPECT_EQ(store.get("still"), "serving");
}

TEST(TcpStore, DescribesItselfAndItsLocalAddress) {
  TcpStoreServer server(server_options("t"));
  TcpStore store(client_options(server.port(), "t"));
  EXPECT_EQ(store.describe(), "TcpStore(127.0.0.1:" + std::to_string(server.port()) + ")");
  EXPECT_EQ(store.local_address(), "127.0.0.1");
  EXPECT_EQ(store.port(), server.port());
  EXPECT_EQ(store.host(), "127.0.0.1");
  EXPECT_EQ(store.timeout(), kLongTimeout);
}

TEST(TcpStore, TimeoutNamesTheStoreTheKeysAndTheTimeWaited) {
  TcpStoreServer server(server_options("t"));
  TcpStore store(client_options(server.port(), "t"));
  store.set("a", "1");
  try {
    store.wait({"a", "b"}, kShortTimeout);
    FAIL() << "wait for a missing key returned";
  } catch (const TimeoutError& e) {
    const std::string expected =
        "TcpStore(127.0.0.1:" + std::to_string(server.port()) + "): timed out after ";
    EXPECT_THAT(e.what(), HasSubstr(expected));
    EXPECT_THAT(e.what(), HasSubstr(" ms waiting for keys [a, b] (missing: b); "));
  }
  // The timed-out wait was answered by the server, so the connection is still in step.
  EXPECT_EQ(store.get("a"), "1");
}

TEST(TcpStore, LargeValuesRoundTrip) {
  TcpStoreServer server(server_options("t"));
  TcpStore writer(client_options(server.port(), "t"));
  TcpStore reader(client_options(server.port(), "t"));
  std::string value(16 << 20, '\0');
  for (size_t i = 0; i < value.size(); ++i) value[i] = static_cast<char>(i * 131 + 7);
  std::thread t([&] { EXPECT_EQ(reader.get("big"), value); });
  writer.set("big", value);
  t.join();
}

TEST(TcpStore, OversizedKeyIsRejectedBeforeSending) {
  TcpStoreServer server(server_options("t"));
  TcpStore store(client_options(server.port(), "t"));
  EXPECT_THROW(store.set(std::string(64 * 1024 + 1, 'k'), "v"), UsageError);
  store.set(std::string(64 * 1024, 'k'), "v");
  EXPECT_EQ(store.get(std::string(64 * 1024, 'k')), "v");
}

TEST(TcpStore, ConnectRetriesUntilTheServerStarts) {
  const int port = free_port();
  std::unique_ptr<TcpStoreServer> server;
  std::thread starter([&] {
    std::this_thread::sleep_for(200ms);
    auto options = server_options("late");
    options.port = port;
    server = std::make_unique<TcpStoreServer>(options);
  });
  TcpStore store(client_options(port, "late"));
  starter.join();
  store.set("k", "v");
  EXPECT_EQ(store.get("k"), "v");
}

// Threads of this process (the entries of /proc/self/task).
int thread_count() {
  int n = 0;
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("Threads:", 0) == 0) n = std::stoi(line.substr(8));
  }
  return n;
}

// start_serving = false: bound and listening (the port is known) with no thread, so a process can
// fork first; a client that connects meanwhile waits in the backlog and is served after start().
TEST(TcpStoreServer, DeferredStartRunsNoThreadUntilStart) {
  const int before = thread_count();
  auto options = server_options("deferred");
  options.start_serving = false;
  TcpStoreServer server(options);
  EXPECT_GT(server.port(), 0);
  EXPECT_EQ(thread_count(), before);
  std::atomic<bool> connected{false};
  std::string got;
  std::thread client([&] {
    TcpStore store(client_options(server.port(), "deferred"));
    connected = true;
    store.set("k", "v");
    got = store.get("k");
  });
  std::this_thread::sleep_for(300ms);
  EXPECT_FALSE(connected.load());  // its handshake waits for the server thread
  server.start();
  server.start();  // a second call does nothing
  client.join();
  EXPECT_TRUE(connected.load());
  EXPECT_EQ(got, "v");
}

TEST(TcpStore, ConnectTimesOutNamingTheAddress) {
  const int port = free_port();
  const auto start = Clock::now();
  try {
    TcpStore store(client_options(port, "t", kShortTimeout));
    FAIL() << "connected to nothing";
  } catch (const TimeoutError& e) {
    EXPECT_LT(seconds_since(start), 2.0);
    EXPECT_THAT(e.what(), HasSubstr("127.0.0.1:" + std::to_string(port)));
  }
}

TEST(TcpStore, IsServerHostsItsOwnServerOnAKernelPickedPort) {
  TcpStoreOptions options = client_options(0, "own");
  options.is_server = true;
  TcpStore host(options);
  ASSERT_GT(host.port(), 0);
  TcpStore peer(client_options(host.port(), "own"));
  host.set("x", "y");
  EXPECT_EQ(peer.get("x"), "y");
}

TEST(TcpStoreServer, RefusesAWrongTokenAndKeepsServing) {
  auto options = server_options("right-token");
  TcpStoreServer server(options);
  try {
    TcpStore store(client_options(server.port(), "wrong-token"));
    FAIL() << "a client with the wrong token was accepted";
  } catch (const HandshakeError& e) {
    EXPECT_THAT(e.what(), HasSubstr("job token mismatch"));
    EXPECT_THAT(e.what(), HasSubstr("CHORUS_JOB_TOKEN"));
    EXPECT_THAT(e.what(), HasSubstr("127.0.0.1:" + std::to_string(server.port())));
  }
  EXPECT_EQ(server.refused_connections(), 1);
  EXPECT_EQ(server.malformed_messages(), 0);
  expect_serves_good_clients(server.port(), "right-token");
}

TEST(TcpStoreServer, RefusesAnotherProtocolVersionOrKind) {
  TcpStoreServer server(server_options("t"));
  {
    net::Fd fd = raw_connection(server.port(), "t", false);
    handshake::Hello hello;
    hello.version = handshake::kProtocolVersion + 1;
    try {
      handshake::client_handshake(fd.get(), "t", hello, net::deadline_after(3s), "test server");
      FAIL() << "a newer protocol version was accepted";
    } catch (const HandshakeError& e) {
      EXPECT_THAT(e.what(), HasSubstr("protocol version"));
    }
  }
  {
    net::Fd fd = raw_connection(server.port(), "t", false);
    handshake::Hello hello;
    hello.kind = handshake::PeerKind::kTransport;
    try {
      handshake::client_handshake(fd.get(), "t", hello, net::deadline_after(3s), "test server");
      FAIL() << "a transport connection was accepted";
    } catch (const HandshakeError& e) {
      EXPECT_THAT(e.what(), HasSubstr("TcpStore"));
    }
  }
  EXPECT_EQ(server.refused_connections(), 2);
  expect_serves_good_clients(server.port(), "t");
}

TEST(TcpStoreServer, SurvivesMalformedMessages) {
  TcpStoreServer server(server_options("t"));
  const int port = server.port();
  int64_t expected = 0;
  auto expect_dropped = [&](const std::string& what) {
    ++expected;
    EXPECT_TRUE(eventually([&] { return server.malformed_messages() == expected; })) << what;
  };
  {  // Not a hello at all.
    net::Fd fd = raw_connection(port, "t", false);
    send_bytes(fd.get(), "GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    EXPECT_TRUE(closed_by_server(fd.get()));
    expect_dropped("garbage instead of a hello");
  }
  {  // A hello cut short.
    net::Fd fd = raw_connection(port, "t", false);
    send_bytes(fd.get(), handshake::Client("t", handshake::Hello{}).hello_bytes().substr(0, 7));
    fd.reset();
    expect_dropped("truncated hello");
  }
  {  // A request cut short: set with a 5-byte key of which 2 bytes arrive.
    net::Fd fd = raw_connection(port, "t", true);
    send_bytes(fd.get(), std::string("\x01\x05\x00\x00\x00"
                                     "ab",
                                     7));
    fd.reset();
    expect_dropped("truncated request");
  }
  {  // A key length of 4 GiB: refused before anything is allocated.
    net::Fd fd = raw_connection(port, "t", true);
    send_bytes(fd.get(), std::string("\x01\xff\xff\xff\xff", 5));
    EXPECT_TRUE(closed_by_server(fd.get()));
    expect_dropped("huge key length");
  }
  {  // A compare_set whose expected value is over max_value_bytes (a set gets an error reply instead).
    net::Fd fd = raw_connection(port, "t", true);
    send_bytes(fd.get(), std::string("\x04\x01\x00\x00\x00k\x01\x00\x00\x40", 10));
    EXPECT_TRUE(closed_by_server(fd.get()));
    expect_dropped("huge value length");
  }
  {  // A wait for 2^31 keys.
    net::Fd fd = raw_connection(port, "t", true);
    send_bytes(fd.get(), std::string("\x05\x10\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x80", 13));
    EXPECT_TRUE(closed_by_server(fd.get()));
    expect_dropped("huge key count");
  }
  {  // An unknown command.
    net::Fd fd = raw_connection(port, "t", true);
    send_bytes(fd.get(), "\x63");
    EXPECT_TRUE(closed_by_server(fd.get()));
    expect_dropped("unknown command");
  }
  EXPECT_EQ(server.refused_connections(), 0);
  expect_serves_good_clients(port, "t");
}

TEST(TcpStoreServer, ForgetsAWaiterThatHangsUp) {
  TcpStoreServer server(server_options("t"));
  {
    net::Fd fd = raw_connection(server.port(), "t", true);
    // get("k") with a 10 s timeout, then hang up while it is parked.
    send_bytes(fd.get(), std::string("\x02\x10\x27\x00\x00\x00\x00\x00\x00\x01\x00\x00\x00k", 14));
  }
  std::this_thread::sleep_for(50ms);
  TcpStore store(client_options(server.port(), "t"));
  store.set("k", "v");
  EXPECT_EQ(store.get("k"), "v");
  EXPECT_EQ(server.malformed_messages(), 0);
}

TEST(TcpStoreServer, IdleServerDoesNotSpin) {
  TcpStoreServer server(server_options("t"));
  TcpStore idle(client_options(server.port(), "t"));
  TcpStore waiter(client_options(server.port(), "t"));
  idle.set("x", "1");
  std::thread parked([&] { EXPECT_THROW(waiter.wait({"never"}, 1500ms), TimeoutError); });
  std::this_thread::sleep_for(100ms);
  auto cpu = [] {
    timespec ts{};
    ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
  };
  const double before = cpu();
  std::this_thread::sleep_for(500ms);
  const double used = cpu() - before;
  EXPECT_LT(used, 0.05) << "the process used " << used << " s of CPU in 0.5 s while idle";
  parked.join();
}

TEST(TcpStore, ServerStoppingFailsPendingAndLaterCallsFast) {
  auto server = std::make_unique<TcpStoreServer>(server_options("t"));
  const int port = server->port();
  TcpStore blocked(client_options(port, "t", 20s));
  TcpStore idle(client_options(port, "t", 20s));
  idle.set("k", "v");
  std::thread stopper([&] {
    std::this_thread::sleep_for(100ms);
    server.reset();
  });
  const auto start = Clock::now();
  try {
    blocked.get("never");
    FAIL() << "get returned with the server gone";
  } catch (const PeerError& e) {
    EXPECT_LT(seconds_since(start), 2.0);
    EXPECT_THAT(e.what(), HasSubstr("127.0.0.1:" + std::to_string(port)));
  }
  stopper.join();
  const auto later = Clock::now();
  EXPECT_THROW(idle.get("k"), PeerError);
  EXPECT_THROW(idle.set("k", "v"), PeerError);  // broken: fails fast with the original cause
  EXPECT_THROW(blocked.num_keys(), PeerError);
  EXPECT_LT(seconds_since(later), 1.0);
}

// Forks a process that serves a TcpStoreServer (token "t") until killed; sets *pid and *port.
void fork_store_server(pid_t* pid, int* port) {
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  *pid = ::fork();
  ASSERT_GE(*pid, 0);
  if (*pid == 0) {
    ::close(pipe_fds[0]);
    try {
      TcpStoreServer server(server_options("t"));
      int p = server.port();
      if (::write(pipe_fds[1], &p, sizeof(p)) != sizeof(p)) ::_exit(1);
      for (;;) ::pause();
    } catch (...) {
      ::_exit(1);
    }
  }
  ::close(pipe_fds[1]);
  ASSERT_EQ(::read(pipe_fds[0], port, sizeof(*port)), static_cast<ssize_t>(sizeof(*port)));
  ::close(pipe_fds[0]);
}

TEST(TcpStore, ServerProcessKilledFailsCallsFast) {
  pid_t pid = -1;
  int port = 0;
  ASSERT_NO_FATAL_FAILURE(fork_store_server(&pid, &port));
  TcpStore store(client_options(port, "t", 20s));
  store.set("k", "v");
  ::kill(pid, SIGKILL);
  wait_child(pid, 5s);
  const auto start = Clock::now();
  try {
    store.get("k2");
    FAIL() << "get returned with the server killed";
  } catch (const PeerError& e) {
    EXPECT_LT(seconds_since(start), 2.0);
    EXPECT_THAT(e.what(), HasSubstr("127.0.0.1:" + std::to_string(port)));
  }
}

TEST(TcpStore, ValueOverTheLimitIsAUsageErrorNamingKeySizeAndOption) {
  auto so = server_options("t");
  so.max_value_bytes = 1 << 20;
  TcpStoreServer server(so);
  // The client's own limit: refused before sending.
  auto small = client_options(server.port(), "t");
  small.max_value_bytes = 1 << 20;
  TcpStore client(small);
  try {
    client.set("big/key", std::string((1 << 20) + 1, 'x'));
    FAIL() << "a value over the client's limit was sent";
  } catch (const UsageError& e) {
    EXPECT_THAT(e.what(), HasSubstr("'big/key'"));
    EXPECT_THAT(e.what(), HasSubstr("1048577 bytes"));
    EXPECT_THAT(e.what(), HasSubstr("TcpStoreOptions::max_value_bytes = 1048576"));
  }
  // A client with a larger limit than the server's: the server answers with an error, reads and
  // drops the value, and the connection stays in step.
  auto large = client_options(server.port(), "t");
  large.max_value_bytes = 8 << 20;
  TcpStore other(large);
  try {
    other.set("big/key", std::string(3 << 20, 'x'));
    FAIL() << "a value over the server's limit was stored";
  } catch (const UsageError& e) {
    EXPECT_THAT(e.what(), HasSubstr("'big/key'"));
    EXPECT_THAT(e.what(), HasSubstr("3145728 bytes"));
    EXPECT_THAT(e.what(), HasSubstr("TcpStoreServerOptions::max_value_bytes = 1048576"));
  }
  other.set("small", std::string(1 << 20, 'y'));  // exactly the limit
  EXPECT_EQ(other.get("small").size(), size_t{1} << 20);
  EXPECT_FALSE(other.check({"big/key"}));
  EXPECT_EQ(server.malformed_messages(), 0);
}

// The largest resident set the process `pid` has had, in bytes.
int64_t peak_rss(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

// A large set is received straight into the stored string: the server holds it once, not once in
// its input buffer and again in the map.
TEST(TcpStoreServer, LargeSetIsHeldOnceNotTwice) {
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "measures the server's resident memory, which a sanitizer's shadow memory inflates";
#endif
  pid_t pid = -1;
  int port = 0;
  ASSERT_NO_FATAL_FAILURE(fork_store_server(&pid, &port));
  {
    TcpStore store(client_options(port, "t", 30s));
    store.set("small", "x");
    const int64_t before = peak_rss(pid);
    const size_t size = kDefaultMaxValueBytes;  // 256 MiB, the largest value allowed by default
    store.set("big", std::string(size, 'v'));
    EXPECT_EQ(store.check({"big"}), true);
    const int64_t grew = peak_rss(pid) - before;
    EXPECT_GE(grew, static_cast<int64_t>(size) * 9 / 10);  // it is really stored
    EXPECT_LT(grew, static_cast<int64_t>(size) * 12 / 10) << "the server's peak grew by " << grew << " bytes for a "
                                                          << size << "-byte value";
  }
  ::kill(pid, SIGKILL);
  wait_child(pid, 5s);
}

}  // namespace
}  // namespace chorus
