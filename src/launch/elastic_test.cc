// The elastic rendezvous: the pure parts (--nnodes text, node ranks, a round's plan) and the
// rounds themselves, with agents as threads, each with its own client of a real TcpStoreServer.
#include "elastic.h"

#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <set>
#include <thread>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/comm/tcp_store.h"

namespace chorus::launch::detail {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

TEST(NodeCount, FixedAndElasticForms) {
  const NodeCount fixed = parse_node_count("3");
  EXPECT_EQ(fixed.min, 3);
  EXPECT_EQ(fixed.max, 3);
  EXPECT_FALSE(fixed.elastic);
  const NodeCount range = parse_node_count("2:4");
  EXPECT_EQ(range.min, 2);
  EXPECT_EQ(range.max, 4);
  EXPECT_TRUE(range.elastic);
  EXPECT_TRUE(parse_node_count("2:2").elastic);
  for (const char* bad : {"0", "3:2", "a", "2:", ":3", "-1:2", "1:2:3", "", "0:2", "9999999"}) {
    try {
      parse_node_count(bad);
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("--nnodes"), std::string::npos) << e.what();
    }
  }
}

TEST(NodeInfo, RoundTripsAndRefusesDamage) {
  const NodeInfo n{"host a pid 42", 3, true, 1};
  const NodeInfo back = decode_node_info(encode(n));
  EXPECT_EQ(back.id, n.id);
  EXPECT_EQ(back.nproc, 3);
  EXPECT_TRUE(back.store_host);
  EXPECT_EQ(back.previous_rank, 1);
  for (const char* bad : {"", "x 0 -1 h", "0 0 -1 h", "1 2 -1 h", "1 0 -2 h", "1 0 -1"}) {
    EXPECT_THROW(decode_node_info(bad), Error) << "'" << bad << "'";
  }
}

TEST(Ranks, StoreHostFirstThenOldRanksThenNewcomersInJoinOrder) {
  // Join order: a newcomer, old rank 2, the store's host (old rank 0), another newcomer, old rank 1.
  const std::vector<NodeInfo> joined = {
      {"new1", 1, false, -1}, {"old2", 1, false, 2}, {"host", 1, true, 0}, {"new2", 1, false, -1}, {"old1", 1, false, 1}};
  EXPECT_EQ(assign_node_ranks(joined), (std::vector<int>{3, 2, 0, 4, 1}));
  // A fresh job: the host first, everyone else in join order.
  const std::vector<NodeInfo> fresh = {{"a", 1, false, -1}, {"b", 1, false, -1}, {"host", 1, true, -1}};
  EXPECT_EQ(assign_node_ranks(fresh), (std::vector<int>{1, 2, 0}));
}

TEST(Ranks, PlanCountsEveryNodesWorkers) {
  const std::vector<NodeInfo> joined = {{"b", 3, false, 1}, {"host", 2, true, 0}, {"c", 4, false, -1}};
  const RoundPlan p = plan_round(7, joined, 0);
  EXPECT_EQ(p.round, 7);
  EXPECT_EQ(p.node_rank, 1);
  EXPECT_EQ(p.world_size, 9);
  EXPECT_EQ(p.rank_offset, 2);
  EXPECT_EQ(p.nodes[0].id, "host");
  EXPECT_EQ(plan_round(7, joined, 2).rank_offset, 5);
  EXPECT_EQ(plan_round(7, joined, 1).rank_offset, 0);
}

// A store server on a port the kernel picks, and one client per agent.
class Rounds : public ::testing::Test {
 protected:
  Rounds() {
    TcpStoreServerOptions so;
    so.host = "127.0.0.1";
    so.quiet = true;
    server_ = std::make_unique<TcpStoreServer>(so);
  }
  std::shared_ptr<Store> client() {
    TcpStoreOptions co;
    co.port = server_->port();
    co.timeout = 5s;
    return std::make_shared<TcpStore>(co);
  }
  static ElasticOptions options(int min, int max, std::chrono::milliseconds last_call = 200ms) {
    ElasticOptions o;
    o.min_nodes = min;
    o.max_nodes = max;
    o.last_call = last_call;
    o.timeout = 5s;
    o.poll = 10ms;
    return o;
  }
  // An agent's thread joining one round.
  std::future<std::optional<RoundPlan>> join(ElasticRendezvous* r, NodeInfo me) {
    return std::async(std::launch::async, [r, me] { return r->join(me, [] { return false; }); });
  }
  std::unique_ptr<TcpStoreServer> server_;
};

TEST_F(Rounds, AFullRoundClosesAtOnceAndEveryAgentGetsTheSamePlan) {
  const auto o = options(2, 3, 30s);  // a last call longer than the test: only MAX closes it
  ElasticRendezvous a(client(), o), b(client(), o), c(client(), o);
  const auto start = Clock::now();
  auto fa = join(&a, {"a", 1, true, -1});
  auto fb = join(&b, {"b", 2, false, -1});
  auto fc = join(&c, {"c", 1, false, -1});
  const RoundPlan pa = *fa.get(), pb = *fb.get(), pc = *fc.get();
  EXPECT_LT(Clock::now() - start, 10s);
  for (const RoundPlan* p : {&pa, &pb, &pc}) {
    EXPECT_EQ(p->round, 0);
    EXPECT_EQ(p->world_size, 4);
    ASSERT_EQ(p->nodes.size(), 3u);
    EXPECT_EQ(p->nodes[0].id, "a");
  }
  EXPECT_EQ(pa.node_rank, 0);
  EXPECT_EQ(pa.rank_offset, 0);
  EXPECT_EQ(std::set<int>({pa.node_rank, pb.node_rank, pc.node_rank}), std::set<int>({0, 1, 2}));
  // b (2 workers) and c (1) follow a in join order, either way round.
  if (pb.node_rank == 1) {
    EXPECT_EQ(pb.rank_offset, 1);
    EXPECT_EQ(pc.rank_offset, 3);
  } else {
    EXPECT_EQ(pc.rank_offset, 1);
    EXPECT_EQ(pb.rank_offset, 2);
  }
  EXPECT_FALSE(a.poll(pa));
}

TEST_F(Rounds, MinNodesCloseAfterTheLastCall) {
  const auto o = options(2, 3, 300ms);
  ElasticRendezvous a(client(), o), b(client(), o);
  const auto start = Clock::now();
  auto fa = join(&a, {"a", 1, true, -1});
  auto fb = join(&b, {"b", 1, false, -1});
  const RoundPlan pa = *fa.get();
  EXPECT_EQ(fb.get()->world_size, 2);
  EXPECT_EQ(pa.nodes.size(), 2u);
  EXPECT_GE(Clock::now() - start, 300ms);
}

TEST_F(Rounds, ALateNodeEndsTheRoundAndTheJobGrowsWithRanksKept) {
  const auto o = options(2, 3, 200ms);
  ElasticRendezvous a(client(), o), b(client(), o), c(client(), o);
  auto fa = join(&a, {"a", 1, true, -1});
  auto fb = join(&b, {"b", 1, false, -1});
  RoundPlan pa = *fa.get(), pb = *fb.get();
  ASSERT_EQ(pa.round, 0);
  EXPECT_FALSE(a.poll(pa));
  auto fc = join(&c, {"c", 1, false, -1});  // round 0 is closed: c waits for round 1
  std::optional<RoundEnd> end;
  for (auto deadline = Clock::now() + 5s; !end && Clock::now() < deadline;) {
    end = b.poll(pb);
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_TRUE(end);
  EXPECT_EQ(end->reason, RoundEnd::Reason::kMembership);
  EXPECT_EQ(end->detail.rfind("a node waits to join", 0), 0u) << end->detail;
  const std::optional<RoundEnd> seen_by_a = a.poll(pa);  // ended for everyone, for the same reason
  ASSERT_TRUE(seen_by_a);
  EXPECT_EQ(seen_by_a->reason, end->reason);
  EXPECT_EQ(seen_by_a->detail, end->detail);
  fa = join(&a, {"a", 1, true, pa.node_rank});
  fb = join(&b, {"b", 1, false, pb.node_rank});
  const RoundPlan qa = *fa.get(), qb = *fb.get(), qc = *fc.get();
  for (const RoundPlan* q : {&qa, &qb, &qc}) {
    EXPECT_EQ(q->round, 1);
    EXPECT_EQ(q->world_size, 3);
  }
  EXPECT_EQ(qa.node_rank, 0);
  EXPECT_EQ(qb.node_rank, pb.node_rank);
  EXPECT_EQ(qc.node_rank, 2);
  EXPECT_FALSE(c.poll(qc));  // full: no one waits, nothing ends it
}

TEST_F(Rounds, AFailureEndsTheRoundWithItsReasonAndTheSurvivorsReform) {
  const auto o = options(2, 3, 200ms);
  ElasticRendezvous a(client(), o), b(client(), o), c(client(), o);
  auto fa = join(&a, {"a", 1, true, -1});
  auto fb = join(&b, {"b", 1, false, -1});
  auto fc = join(&c, {"c", 1, false, -1});
  const RoundPlan pa = *fa.get(), pb = *fb.get(), pc = *fc.get();
  b.end_round(0, {RoundEnd::Reason::kFailure, "node x: exit code 1"});
  b.end_round(0, {RoundEnd::Reason::kMembership, "a later reason loses"});
  const std::optional<RoundEnd> end = a.poll(pa);
  ASSERT_TRUE(end);
  EXPECT_EQ(end->reason, RoundEnd::Reason::kFailure);
  EXPECT_EQ(end->detail, "node x: exit code 1");
  // c's node died with the failure: a and b form round 1 after the last call.
  fa = join(&a, {"a", 1, true, pa.node_rank});
  fb = join(&b, {"b", 1, false, pb.node_rank});
  const RoundPlan qa = *fa.get(), qb = *fb.get();
  EXPECT_EQ(qa.round, 1);
  EXPECT_EQ(qa.world_size, 2);
  EXPECT_EQ(qb.node_rank, 1);
  (void)pc;
}

TEST_F(Rounds, ANodeWaitingWhenTheJobFinishesIsToldSo) {
  const auto o = options(1, 1, 0ms);
  ElasticRendezvous a(client(), o), b(client(), o);
  const RoundPlan pa = *join(&a, {"a", 1, true, -1}).get();
  auto fb = join(&b, {"b", 1, false, -1});  // full: b waits for a later round
  std::this_thread::sleep_for(100ms);
  auto finished = std::async(std::launch::async, [&] { a.finish(pa, {RoundEnd::Reason::kDone, ""}, true); });
  EXPECT_FALSE(fb.get().has_value());
  EXPECT_EQ(b.finished_reason().reason, RoundEnd::Reason::kDone);
  finished.get();  // the host waited for b to read it, and returns
}

TEST_F(Rounds, TooFewNodesTimeOutNamingTheRoundAndTheFix) {
  auto o = options(2, 3);
  o.timeout = 300ms;
  ElasticRendezvous a(client(), o);
  try {
    a.join({"a", 1, true, -1}, [] { return false; });
    FAIL() << "a round of 1 node with MIN 2 did not time out";
  } catch (const TimeoutError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("round 0 has 1 node(s)"), std::string::npos) << what;
    EXPECT_NE(what.find("at least 2"), std::string::npos) << what;
    EXPECT_NE(what.find("--rdzv-endpoint"), std::string::npos) << what;
  }
}

TEST_F(Rounds, AStopRequestEndsTheWait) {
  ElasticRendezvous a(client(), options(2, 3));
  std::atomic<int> asked{0};
  EXPECT_FALSE(a.join({"a", 1, true, -1}, [&] { return ++asked > 3; }).has_value());
}

// The round-end record: what encode writes, decode_round_end reads back, for every reason and for
// details with the separator's characters; anything else is a damaged record, named printably.
TEST(RoundEndRecord, RoundTripsEveryReasonAndRefusesDamagedOnes) {
  for (const RoundEnd& e : {RoundEnd{RoundEnd::Reason::kMembership, "a node waits to join (2 of 3)"},
                            RoundEnd{RoundEnd::Reason::kFailure, "node 1: rank 3: exit code 7\n  message: done: x"},
                            RoundEnd{RoundEnd::Reason::kFailure, ""}, RoundEnd{RoundEnd::Reason::kDone, ""}}) {
    const RoundEnd back = decode_round_end(encode(e));
    EXPECT_EQ(back.reason, e.reason) << encode(e);
    EXPECT_EQ(back.detail, e.detail) << encode(e);
  }
  EXPECT_EQ(encode({RoundEnd::Reason::kFailure, "node 0: x"}), "failure: node 0: x");  // docs/elastic.md's form
  for (const std::string& bad : std::vector<std::string>{"", "Done", "failure", "membership:x", "\x1b[2Jfailure: x"}) {
    try {
      decode_round_end(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("damaged round record"), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\x1b'), std::string::npos) << "raw control byte in the message";
    }
  }
}


}  // namespace
}  // namespace chorus::launch::detail
