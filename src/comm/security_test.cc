// The rendezvous cannot be joined or stalled by a stranger: the token never crosses the wire, a
// recorded handshake cannot be replayed, a refused peer always learns why, and idle or garbage
// connections to the store and transport ports do not slow a group's setup.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/comm/process_group.h"
#include "chorus/comm/spawn.h"
#include "chorus/comm/tcp_store.h"
#include "handshake.h"
#include "socket.h"

namespace chorus {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

TcpStoreServerOptions quiet_server(const std::string& token) {
  TcpStoreServerOptions o;
  o.host = "127.0.0.1";
  o.token = token;
  o.quiet = true;
  return o;
}

net::Fd connect_to(int port) { return net::connect_tcp("127.0.0.1", port, net::deadline_after(3s), "test server"); }

std::string read_exactly(int fd, size_t n) {
  std::string out(n, '\0');
  net::IoResult r = net::read_full(fd, &out[0], n, net::deadline_after(3s));
  if (!r.ok()) throw std::runtime_error("read failed: " + r.describe());
  return out;
}

void write_all(int fd, const std::string& bytes) {
  if (!net::write_full(fd, bytes.data(), bytes.size(), net::deadline_after(3s)).ok()) {
    throw std::runtime_error("write failed");
  }
}

// Reads a verdict: its status and reason.
std::pair<int, std::string> read_verdict(int fd) {
  const std::string head = read_exactly(fd, 5);
  uint32_t len = 0;
  for (int i = 0; i < 4; ++i) len |= static_cast<uint32_t>(static_cast<uint8_t>(head[1 + i])) << (8 * i);
  return {static_cast<uint8_t>(head[0]), read_exactly(fd, len)};
}

TEST(Handshake, TheTokenNeverCrossesTheWireAndARecordedOneCannotBeReplayed) {
  const std::string token = random_token();
  TcpStoreServer server(quiet_server(token));

  // A legitimate handshake, recorded byte for byte.
  net::Fd fd = connect_to(server.port());
  handshake::Client client(token, handshake::Hello{});
  const std::string hello = client.hello_bytes();
  write_all(fd.get(), hello);
  const std::string challenge = read_exactly(fd.get(), 1 + handshake::kNonceBytes);
  client.feed(challenge.data(), 1);
  client.feed(challenge.data() + 1, handshake::kNonceBytes);
  ASSERT_EQ(client.state(), handshake::Client::kSendProof);
  const std::string proof = client.take_proof();
  write_all(fd.get(), proof);
  while (!client.done()) {
    const std::string b = read_exactly(fd.get(), client.want());
    client.feed(b.data(), b.size());
  }
  ASSERT_EQ(client.state(), handshake::Client::kAccepted) << client.reason() << client.error();
  for (const std::string* sent : {&hello, &proof}) {
    EXPECT_EQ(sent->find(token), std::string::npos);
    EXPECT_EQ(sent->find(token.substr(0, 8)), std::string::npos);
  }

  // The recorded client messages, replayed on a new connection: the server's fresh nonce makes the
  // recorded proof worthless.
  net::Fd replay = connect_to(server.port());
  write_all(replay.get(), hello);
  const std::string second = read_exactly(replay.get(), 1 + handshake::kNonceBytes);
  EXPECT_EQ(second[0], static_cast<char>(handshake::kStatusChallenge));
  EXPECT_NE(second, challenge);
  write_all(replay.get(), proof);
  auto [status, reason] = read_verdict(replay.get());
  EXPECT_EQ(status, handshake::kStatusRefused);
  EXPECT_THAT(reason, HasSubstr("job token mismatch"));
  EXPECT_EQ(server.refused_connections(), 1);

  // Nor can a stranger pass for the server: an acceptance without the server's proof is refused.
  handshake::Client fooled(token, handshake::Hello{});
  const std::string fake = std::string(1, char(handshake::kStatusChallenge)) + std::string(32, 'n');
  fooled.feed(fake.data(), 1);
  fooled.feed(fake.data() + 1, 32);
  fooled.take_proof();
  const std::string accept = handshake::encode_verdict(true, "") + std::string(32, 'm');
  for (char ch : accept) {
    if (!fooled.done()) fooled.feed(&ch, 1);
  }
  EXPECT_EQ(fooled.state(), handshake::Client::kBad);
  EXPECT_THAT(fooled.error(), HasSubstr("without proving it knows the job token"));
}

// A refused client that keeps sending (unread bytes in the server's receive buffer) still reads the
// reason: the server half-closes and drains instead of resetting the connection under the verdict.
TEST(Handshake, ARefusedPeerAlwaysLearnsWhy) {
  TcpStoreServer server(quiet_server(random_token()));
  for (int i = 0; i < 50; ++i) {
    net::Fd fd = connect_to(server.port());
    handshake::Client client("wrong", handshake::Hello{});
    write_all(fd.get(), client.hello_bytes());
    const std::string challenge = read_exactly(fd.get(), 1 + handshake::kNonceBytes);
    client.feed(challenge.data(), 1);
    client.feed(challenge.data() + 1, handshake::kNonceBytes);
    write_all(fd.get(), client.take_proof() + std::string(64 << 10, 'x'));  // and a request it should not send yet
    auto [status, reason] = read_verdict(fd.get());
    ASSERT_EQ(status, handshake::kStatusRefused) << "attempt " << i;
    ASSERT_THAT(reason, HasSubstr("job token mismatch")) << "attempt " << i;
  }
}

// Opens `n` connections that each misbehave in one way: say nothing, send garbage, or start a hello
// and stall. They stay open until the vector is destroyed.
void flood(int port, int n, std::vector<net::Fd>* held) {
  const std::string stalled = handshake::Client("guess", handshake::Hello{}).hello_bytes().substr(0, 20);
  for (int i = 0; i < n; ++i) {
    net::Fd fd = connect_to(port);
    if (i % 3 == 1) {
      write_all(fd.get(), "GET / HTTP/1.1\r\nHost: x\r\n\r\n" + std::string(1000, '\xff'));
    } else if (i % 3 == 2) {
      write_all(fd.get(), stalled);
    }
    held->push_back(std::move(fd));
  }
}

// Seconds from rank 1's start until both ranks have their group, with the store and rank 0's
// transport listener flooded by `junk` connections each before rank 1 starts.
double two_rank_setup_seconds(int junk, const std::string& group) {
  const std::string token = random_token();
  TcpStoreServer server(quiet_server(token));
  std::vector<net::Fd> held;
  flood(server.port(), junk, &held);
  auto store_for = [&](int rank) {
    TcpStoreOptions o;
    o.port = server.port();
    o.token = token;
    o.timeout = 30s;
    o.who = "rank " + std::to_string(rank);
    return std::make_shared<TcpStore>(o);
  };
  ProcessGroupOptions po;
  po.transport = "tcp";
  po.token = token;
  po.timeout = 30s;
  po.group_name = group;
  std::atomic<int> ready{0};
  std::string errors[2];
  auto rank_main = [&](int rank) {
    try {
      ProcessGroup pg(store_for(rank), rank, 2, po);
      float x = 1;
      pg.allreduce(&x, 1, DataType::kFloat32)->wait();
      if (x != 2) errors[rank] = "wrong allreduce result";
      ready.fetch_add(1);
      while (ready.load() < 2) std::this_thread::sleep_for(1ms);
    } catch (const std::exception& e) {
      errors[rank] = e.what();
      ready.fetch_add(1);
    }
  };
  std::thread r0(rank_main, 0);
  // Rank 0 is now listening: flood its transport port too before rank 1 comes.
  auto probe = store_for(2);
  const std::string addr = probe->get("chorus/pg/" + group + "/addr/0");
  flood(std::stoi(addr.substr(addr.rfind(':') + 1)), junk, &held);
  const auto start = Clock::now();
  std::thread r1(rank_main, 1);
  r1.join();
  r0.join();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  return seconds;
}

TEST(Flood, IdleAndGarbageConnectionsDoNotSlowGroupSetup) {
  const double baseline = two_rank_setup_seconds(0, "quiet");
  const double flooded = two_rank_setup_seconds(200, "flooded");
  std::printf("two-rank setup: %.3f s without junk, %.3f s with 200 idle, garbage and stalled connections "
              "to the store and to rank 0's listener\n",
              baseline, flooded);
  // Before: each idle connection held the accept loop for its 5 s read timeout, one after another.
  EXPECT_LT(flooded, baseline + 1.0);
  EXPECT_LT(flooded, 2.0);
}

}  // namespace
}  // namespace chorus
