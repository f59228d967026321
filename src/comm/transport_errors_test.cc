// Conformance: a rank that fails with an exception of some type makes its peers raise that same
// type, over every transport (TCP, shared memory, and the hybrid's shared-memory and TCP paths).
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <typeinfo>
#include <vector>

#include "chorus/comm/error.h"
#include "error_class.h"
#include "testing.h"
#include "transport.h"

namespace chorus::transport {
namespace {

using std::chrono::milliseconds;

std::unique_ptr<Transport> connect(const std::string& kind, Store* store, int rank, int size) {
  TcpOptions to;
  to.store = store;
  to.key_prefix = "conformance";
  to.group_name = "conformance";
  to.rank = rank;
  to.size = size;
  to.token = "conformance-token";
  to.deadline = net::deadline_after(milliseconds(20000));
  ShmOptions so;
  so.store = store;
  so.key_prefix = to.key_prefix;
  so.group_name = to.group_name;
  so.rank = rank;
  so.size = size;
  so.token = to.token;
  so.deadline = to.deadline;
  so.host_id = "conformance-host";
  if (kind == "tcp") return make_tcp_transport(to);
  if (kind == "shm") return make_shm_transport(so);
  HybridOptions ho;
  ho.tcp = to;
  ho.shm = so;
  ho.host_id = "conformance-host-" + std::to_string(rank * 2 / size);  // two simulated hosts
  return make_hybrid_transport(ho);
}

// The exception a rank that fails with `error_class` should make its peers raise.
const std::type_info& expected_type(uint8_t error_class) {
  switch (error_class) {
    case kErrTimeout: return typeid(TimeoutError);
    case kErrPeer: return typeid(PeerError);
    case kErrMismatch: return typeid(MismatchError);
    case kErrHandshake: return typeid(HandshakeError);
    case kErrUsage: return typeid(UsageError);
    default: return typeid(Error);
  }
}

TEST(ErrorClass, EveryClassRoundTripsThroughItsException) {
  for (uint8_t c : {kErrOther, kErrTimeout, kErrPeer, kErrMismatch, kErrHandshake, kErrUsage}) {
    try {
      throw_error(c, "boom");
    } catch (const std::exception& e) {
      EXPECT_EQ(typeid(e), expected_type(c)) << int(c);
      EXPECT_EQ(error_class_of(e), c);
      EXPECT_STREQ(e.what(), "boom");
    }
  }
  EXPECT_EQ(error_class_of(std::runtime_error("x")), kErrOther);
  try {
    std::rethrow_exception(make_error(200, "from a newer peer"));
  } catch (const std::exception& e) {
    EXPECT_EQ(typeid(e), typeid(Error));  // an unknown class degrades to the base type
  }
}

class Conformance : public ::testing::TestWithParam<std::string> {};

// Rank 1 aborts with each class in turn; every other rank, waiting on a receive from rank 1
// (over shared memory and, for the hybrid, also over TCP from the other host), raises that type
// and names rank 1 and its message.
TEST_P(Conformance, PeersRaiseTheTypeTheFailingRankRaised) {
  const std::string kind = GetParam();
  const int world = kind == "hybrid" ? 4 : 3;
  for (uint8_t c : {kErrOther, kErrTimeout, kErrPeer, kErrMismatch, kErrHandshake, kErrUsage}) {
    SCOPED_TRACE("error class " + std::to_string(c));
    const std::string failure = testing::run_ranks(world, [&](int rank, int size, std::shared_ptr<Store> store) {
      auto t = connect(kind, store.get(), rank, size);
      wire::Call call;
      call.op = wire::OpType::kRecv;
      call.count = 4;
      t->begin(call, net::deadline_after(milliseconds(20000)));
      if (rank == 1) {
        t->abort("rank 1 broke on purpose", c);
        // Stay until every peer has read the abort, so no close races it.
        std::vector<std::string> seen;
        for (int r = 0; r < size; ++r) {
          if (r != 1) seen.push_back("seen/" + std::to_string(r));
        }
        store->wait(seen, milliseconds(20000));
        return;
      }
      char buf[4];
      std::string got = "no exception";
      try {
        t->wait(t->recv(1, call, buf, sizeof buf));
      } catch (const std::exception& e) {
        if (typeid(e) != expected_type(c)) {
          got = std::string("wrong type ") + typeid(e).name() + ": " + e.what();
        } else if (std::string(e.what()).find("rank 1 broke on purpose") == std::string::npos) {
          got = std::string("message lacks the cause: ") + e.what();
        } else {
          got = "";
        }
      }
      store->set("seen/" + std::to_string(rank), "1");
      if (!got.empty()) throw std::runtime_error("rank " + std::to_string(rank) + ": " + got);
    });
    EXPECT_EQ(failure, "");
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, Conformance, ::testing::Values("tcp", "shm", "hybrid"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace chorus::transport
