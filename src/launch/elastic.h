// Internal to chorus_launch: the rendezvous rounds of an elastic job (`chorus run --nnodes MIN:MAX`).
//
// Every node's agent meets the others in numbered rounds held in the job's store. A round closes
// when MAX nodes have joined, or MIN have and no other joined for `last_call` (so that nodes
// restarting together land in one round); the store's compare_set makes its size one value that
// every agent reads. A node that joins a closed or full round waits for the next one and says so;
// the nodes running the current round see that (poll) and end it when there is room, as they end
// it on a failure, so that the job re-forms with the new member. A round's nodes get their ranks
// from assign_node_ranks (pure): the node hosting the store first, then the nodes of the last round
// in their old order, then newcomers in join order. docs/elastic.md has the protocol.
//
// Ordering: one ElasticRendezvous per agent, used from the agent's thread only; the store is the
// only shared state. Every wait has a deadline, or watches `finished` and a stop callback.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "chorus/comm/store.h"

namespace chorus::launch::detail {

// "N" (a fixed node count) or "MIN:MAX" (elastic). Throws UsageError naming the text otherwise.
struct NodeCount {
  int min = 1;
  int max = 1;
  bool elastic = false;  // given as MIN:MAX (also when MIN == MAX: nodes may then be replaced)
};
NodeCount parse_node_count(const std::string& text);

// One agent as it joins a round.
struct NodeInfo {
  std::string id;          // "host pid 42": for messages
  int nproc = 1;           // workers it starts
  bool store_host = false; // it hosts the store: the job ends with it, so it keeps node rank 0
  int previous_rank = -1;  // its node rank in the last round it ran, -1 for a newcomer
};
std::string encode(const NodeInfo& n);
NodeInfo decode_node_info(const std::string& text);  // throws Error on a damaged record

// Why a round ended (the store's `<round>/end`), or the job (`finished`): a record that only
// elastic.cc encodes and decodes ("membership: ...", "failure: ...", "done"; docs/elastic.md).
struct RoundEnd {
  enum class Reason {
    kMembership,  // a node joins or left: the job re-forms, no restart is used
    kFailure,     // a worker failed somewhere (detail: the root-cause report)
    kDone,        // the job succeeded (finished only)
  };
  Reason reason = Reason::kMembership;
  std::string detail;  // what changed, or the failure report; "" when done
};
std::string encode(const RoundEnd& end);
RoundEnd decode_round_end(const std::string& text);  // throws Error on a damaged record

// The node rank of each of a closed round's nodes, given in join order (pure).
std::vector<int> assign_node_ranks(const std::vector<NodeInfo>& joined);

// What a closed round means for one agent.
struct RoundPlan {
  int round = 0;
  std::vector<NodeInfo> nodes;  // in node-rank order
  int node_rank = 0;            // this agent's
  int world_size = 0;           // the sum of the nodes' nproc
  int rank_offset = 0;          // this node's first global rank
};
// The plan of `me_index` (join index) in a round closed with `joined` nodes (pure).
RoundPlan plan_round(int round, const std::vector<NodeInfo>& joined, int me_index);

struct ElasticOptions {
  int min_nodes = 1;
  int max_nodes = 1;
  std::chrono::milliseconds last_call{5000};  // after MIN joined, how long a round stays open for more
  std::chrono::milliseconds timeout{60000};   // an open round must reach MIN nodes within this
  std::chrono::milliseconds poll{50};
};

class ElasticRendezvous {
 public:
  ElasticRendezvous(std::shared_ptr<Store> store, ElasticOptions options);

  // Joins the open round (or, when it is closed or full, the next one) and returns once it closed
  // with this node in it. nullopt when the job finished (or failed: finished_reason() says) while
  // this node waited, or when should_stop() turned true. Throws TimeoutError when the open round
  // does not reach MIN nodes within the timeout, naming the round, the count and the fix.
  std::optional<RoundPlan> join(NodeInfo me, const std::function<bool()>& should_stop);

  // While `plan`'s round runs: nullopt to go on, else why it ends: another node ended it (its
  // reason), or a node waits to join and the round has room (this call ends the round then).
  std::optional<RoundEnd> poll(const RoundPlan& plan);
  // Ends `round` (the first reason given wins) and opens the next.
  void end_round(int round, const RoundEnd& why);
  RoundEnd end_reason(int round);

  // The job is over: `outcome` kDone or kFailure (the report), for nodes still waiting. The
  // store's host keeps it up until every node of `plan`'s round said so and the waiting nodes read
  // it (within the timeout).
  void finish(const RoundPlan& plan, const RoundEnd& outcome, bool store_host);
  // How the job ended, after join() returned nullopt because it had.
  const RoundEnd& finished_reason() const { return finished_; }

 private:
  int open_round();
  bool wait_to_close(int round, int* size, const std::function<bool()>& should_stop);
  std::vector<NodeInfo> read_nodes(int round, int count);

  std::shared_ptr<Store> store_;
  ElasticOptions options_;
  RoundEnd finished_;
};

}  // namespace chorus::launch::detail
