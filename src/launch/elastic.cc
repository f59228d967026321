// The rounds of an elastic job in the store (elastic.h; docs/elastic.md). Keys, all under
// "elastic/":
//   open             the round nodes join now (a decimal number; advanced by end_round)
//   r<R>/joined      counter: join index + 1 of each node that joined round R
//   r<R>/node<i>     the i-th joiner's NodeInfo
//   r<R>/closed      the round's size, set once (compare_set)
//   r<R>/waiting     counter: nodes that found round R closed or full and wait for R + 1
//   r<R>/end         why round R ended, set once (compare_set)
//   r<R>/finished    counter: nodes of round R that finished the job
//   finished         "done" or the failure that ended the job, for nodes still waiting
//   left             counter: waiting nodes that read `finished`
#include "elastic.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <thread>

#include "chorus/comm/error.h"

namespace chorus::launch::detail {
namespace {

using Clock = std::chrono::steady_clock;

const std::string kOpen = "elastic/open";
const std::string kFinished = "elastic/finished";
const std::string kLeft = "elastic/left";

std::string round_key(int round, const std::string& what) { return "elastic/r" + std::to_string(round) + "/" + what; }

int parse_count(const std::string& text, const std::string& what) {
  try {
    size_t pos = 0;
    const int v = std::stoi(text, &pos);
    if (pos == text.size() && v >= 0) return v;
  } catch (const std::exception&) {
  }
  throw Error("chorus run: the store's " + what + " holds '" + text + "', not a count; is another job using " +
              "the same --rdzv-endpoint?");
}

}  // namespace

NodeCount parse_node_count(const std::string& text) {
  auto number = [&](const std::string& part) {
    if (part.empty() || part.size() > 6 || part.find_first_not_of("0123456789") != std::string::npos) {
      throw UsageError("chorus run: --nnodes takes N or MIN:MAX (whole numbers, at least 1), got '" + text + "'");
    }
    return std::stoi(part);
  };
  NodeCount c;
  const size_t colon = text.find(':');
  if (colon == std::string::npos) {
    c.min = c.max = number(text);
  } else {
    c.min = number(text.substr(0, colon));
    c.max = number(text.substr(colon + 1));
    c.elastic = true;
  }
  if (c.min < 1) throw UsageError("chorus run: --nnodes needs at least 1 node, got '" + text + "'");
  if (c.max < c.min) {
    throw UsageError("chorus run: --nnodes " + text + ": the most nodes (" + std::to_string(c.max) +
                     ") is below the fewest (" + std::to_string(c.min) + "); write MIN:MAX");
  }
  return c;
}

std::string encode(const NodeInfo& n) {
  std::ostringstream out;
  out << n.nproc << ' ' << (n.store_host ? 1 : 0) << ' ' << n.previous_rank << ' ' << n.id;
  return out.str();
}

NodeInfo decode_node_info(const std::string& text) {
  std::istringstream in(text);
  NodeInfo n;
  int host = 0;
  if (!(in >> n.nproc >> host >> n.previous_rank) || n.nproc < 1 || (host != 0 && host != 1) ||
      n.previous_rank < -1 || in.get() != ' ') {
    throw Error("chorus run: a damaged node record in the store: '" + printable(text) +
                "'; is another job or program using the same --rdzv-endpoint?");
  }
  n.store_host = host == 1;
  std::getline(in, n.id);
  return n;
}

namespace {
constexpr const char* kMembershipWord = "membership: ";
constexpr const char* kFailureWord = "failure: ";
constexpr const char* kDoneWord = "done";
}  // namespace

std::string encode(const RoundEnd& end) {
  switch (end.reason) {
    case RoundEnd::Reason::kMembership: return kMembershipWord + end.detail;
    case RoundEnd::Reason::kFailure: return kFailureWord + end.detail;
    case RoundEnd::Reason::kDone: return kDoneWord;
  }
  return kDoneWord;
}

RoundEnd decode_round_end(const std::string& text) {
  const auto starts = [&](const std::string& word) { return text.compare(0, word.size(), word) == 0; };
  if (text == kDoneWord) return {RoundEnd::Reason::kDone, ""};
  if (starts(kMembershipWord)) return {RoundEnd::Reason::kMembership, text.substr(std::strlen(kMembershipWord))};
  if (starts(kFailureWord)) return {RoundEnd::Reason::kFailure, text.substr(std::strlen(kFailureWord))};
  throw Error("chorus run: a damaged round record in the store: '" + printable(text) +
              "'; is another job or program using the same --rdzv-endpoint?");
}

std::vector<int> assign_node_ranks(const std::vector<NodeInfo>& joined) {
  std::vector<int> order(joined.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  // The store's host, then the last round's nodes by their old rank, then newcomers by join index.
  auto key = [&](int i) {
    const NodeInfo& n = joined[static_cast<size_t>(i)];
    return std::make_tuple(n.store_host ? 0 : 1, n.previous_rank < 0 ? 1 : 0, n.previous_rank, i);
  };
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return key(a) < key(b); });
  std::vector<int> rank(joined.size());
  for (size_t r = 0; r < order.size(); ++r) rank[static_cast<size_t>(order[r])] = static_cast<int>(r);
  return rank;
}

RoundPlan plan_round(int round, const std::vector<NodeInfo>& joined, int me_index) {
  const std::vector<int> rank = assign_node_ranks(joined);
  RoundPlan plan;
  plan.round = round;
  plan.nodes.resize(joined.size());
  for (size_t i = 0; i < joined.size(); ++i) plan.nodes[static_cast<size_t>(rank[i])] = joined[i];
  plan.node_rank = rank[static_cast<size_t>(me_index)];
  for (int r = 0; r < static_cast<int>(plan.nodes.size()); ++r) {
    if (r < plan.node_rank) plan.rank_offset += plan.nodes[static_cast<size_t>(r)].nproc;
    plan.world_size += plan.nodes[static_cast<size_t>(r)].nproc;
  }
  return plan;
}

ElasticRendezvous::ElasticRendezvous(std::shared_ptr<Store> store, ElasticOptions options)
    : store_(std::move(store)), options_(options) {
  if (options_.min_nodes < 1 || options_.max_nodes < options_.min_nodes) {
    throw UsageError("chorus run: elastic node counts need 1 <= MIN <= MAX, got " +
                     std::to_string(options_.min_nodes) + ":" + std::to_string(options_.max_nodes));
  }
}

int ElasticRendezvous::open_round() { return parse_count(store_->compare_set(kOpen, "", "0"), kOpen); }

std::optional<RoundPlan> ElasticRendezvous::join(NodeInfo me, const std::function<bool()>& should_stop) {
  for (int round = open_round();; ++round) {
    if (!store_->check({round_key(round, "closed")})) {
      const int index = static_cast<int>(store_->add(round_key(round, "joined"), 1)) - 1;
      store_->set(round_key(round, "node" + std::to_string(index)), encode(me));
      int size = 0;
      if (!wait_to_close(round, &size, should_stop)) return std::nullopt;
      if (index < size) return plan_round(round, read_nodes(round, size), index);
    }
    // Too late for this round, or it is full: the nodes running it see the count and make room.
    store_->add(round_key(round, "waiting"), 1);
  }
}

bool ElasticRendezvous::wait_to_close(int round, int* size, const std::function<bool()>& should_stop) {
  const std::string closed = round_key(round, "closed");
  const std::string joined = round_key(round, "joined");
  std::optional<Clock::time_point> opened_at;
  Clock::time_point last_join{};
  int64_t seen = -1;
  for (;;) {
    if (store_->check({closed})) {
      *size = parse_count(store_->get(closed), closed);
      return true;
    }
    if (store_->check({kFinished})) {
      finished_ = decode_round_end(store_->get(kFinished));
      store_->add(kLeft, 1);
      return false;
    }
    if (should_stop && should_stop()) return false;
    // Only the open round may close: the next one waits for the running round to end.
    if (parse_count(store_->get(kOpen), kOpen) == round) {
      const auto now = Clock::now();
      if (!opened_at) opened_at = now;
      const int64_t n = store_->add(joined, 0);
      if (n != seen) {
        seen = n;
        last_join = now;
      }
      if (n >= options_.max_nodes || (n >= options_.min_nodes && now - last_join >= options_.last_call)) {
        store_->compare_set(closed, "", std::to_string(std::min<int64_t>(n, options_.max_nodes)));
        continue;
      }
      if (n < options_.min_nodes && now - *opened_at >= options_.timeout) {
        const auto secs = std::chrono::duration_cast<std::chrono::seconds>(options_.timeout).count();
        throw TimeoutError("chorus run: rendezvous round " + std::to_string(round) + " has " + std::to_string(n) +
                           " node(s) after " + std::to_string(secs) + " s (--rdzv-timeout), and --nnodes asks for " +
                           "at least " + std::to_string(options_.min_nodes) + "; start `chorus run` on more nodes " +
                           "with the same --rdzv-endpoint, or lower MIN");
      }
    }
    std::this_thread::sleep_for(options_.poll);
  }
}

std::vector<NodeInfo> ElasticRendezvous::read_nodes(int round, int count) {
  std::vector<std::string> keys;
  for (int i = 0; i < count; ++i) keys.push_back(round_key(round, "node" + std::to_string(i)));
  // Each node writes its record right after taking its index: the wait is short.
  store_->wait(keys, options_.timeout);
  std::vector<NodeInfo> nodes;
  for (const auto& k : keys) nodes.push_back(decode_node_info(store_->get(k)));
  return nodes;
}

std::optional<RoundEnd> ElasticRendezvous::poll(const RoundPlan& plan) {
  if (parse_count(store_->get(kOpen), kOpen) != plan.round) return end_reason(plan.round);
  const int size = static_cast<int>(plan.nodes.size());
  if (size < options_.max_nodes && store_->add(round_key(plan.round, "waiting"), 0) > 0) {
    end_round(plan.round, {RoundEnd::Reason::kMembership, "a node waits to join (the job has " + std::to_string(size) +
                                                              " of at most " + std::to_string(options_.max_nodes) +
                                                              " nodes)"});
    return end_reason(plan.round);
  }
  return std::nullopt;
}

void ElasticRendezvous::end_round(int round, const RoundEnd& why) {
  store_->compare_set(round_key(round, "end"), "", encode(why));
  store_->compare_set(kOpen, std::to_string(round), std::to_string(round + 1));
}

RoundEnd ElasticRendezvous::end_reason(int round) {
  // end_round writes the reason before it opens the next round.
  const std::string key = round_key(round, "end");
  if (!store_->check({key})) return {RoundEnd::Reason::kMembership, "the round ended"};
  return decode_round_end(store_->get(key));
}

void ElasticRendezvous::finish(const RoundPlan& plan, const RoundEnd& outcome, bool store_host) {
  store_->compare_set(kFinished, "", encode(outcome));
  const std::string finished = round_key(plan.round, "finished");
  store_->add(finished, 1);
  if (!store_host) return;
  // Keep the store up for the others: the round's nodes, and those waiting in the next round.
  const auto deadline = Clock::now() + std::min<std::chrono::milliseconds>(options_.timeout, std::chrono::seconds(30));
  while (Clock::now() < deadline) {
    const bool round_done = store_->add(finished, 0) >= static_cast<int64_t>(plan.nodes.size());
    const bool waiters_told = store_->add(kLeft, 0) >= store_->add(round_key(plan.round + 1, "joined"), 0);
    if (round_done && waiters_told) return;
    std::this_thread::sleep_for(options_.poll);
  }
}

}  // namespace chorus::launch::detail
