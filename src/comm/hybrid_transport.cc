// Hybrid transport: several hosts, shared memory within each, TCP between them. See docs/shm.md.
//
// Every rank holds
//   - a TCP full mesh over the whole group: point-to-point messages and every generic algorithm
//     (broadcast, allgather, ... and their mismatch checks) run over it unchanged;
//   - a shared-memory transport over the ranks of its own host (local rank l of L);
//   - a view of the TCP mesh restricted to the ranks with its local index on every host ("rail" l).
// Allreduce is hierarchical, per shared-memory chunk: reduce-scatter within the host (local rank l
// ends up with slice l of the chunk reduced over the host), allreduce of slice l across hosts on
// rail l over TCP (the L rails run at once, each moving 1/L of the bytes), then allgather within
// the host. So the bytes that cross hosts are the minimum, and each host's ranks share that work.
// When hosts hold different numbers of ranks the slices would not line up across hosts: then each
// host's leader (local rank 0) reduces the whole chunk, allreduces it with the other leaders, and
// hands the result to its host.
// Broadcast is hierarchical too: the root sends to one rank per host over TCP, which broadcasts
// within its host over shared memory.

#include <algorithm>
#include <map>
#include <thread>

#include "algorithms.h"
#include "chorus/comm/error.h"
#include "chorus/comm/store.h"
#include "error_class.h"
#include "measured_allreduce.h"
#include "plan.h"
#include "reduce.h"
#include "transport.h"

namespace chorus::transport {

int Transport::probe_any(const std::vector<int>&, int64_t) {
  throw Ranked<UsageError>("chorus: rank " + std::to_string(rank()) + ": the " + kind() +
                   " transport cannot receive from any source (it cannot look at a message before taking it); "
                   "name the sender (recv with src=) or use the tcp, shm or hybrid transport");
}

namespace {

// The ranks `members` of `base` as a group of their own: rank i here is members[i] there.
// Borrows `base`; begin/abort/close belong to the owner of `base`.
class RankMapTransport final : public Transport {
 public:
  RankMapTransport(Transport& base, std::vector<int> members, int index)
      : base_(base), members_(std::move(members)), index_(index) {}

  std::string kind() const override { return base_.kind(); }
  int rank() const override { return index_; }
  int size() const override { return static_cast<int>(members_.size()); }
  std::string peer_name(int peer) const override { return base_.peer_name(map(peer)); }
  void begin(const wire::Call&, net::Deadline) override {}
  Ticket send(int peer, const wire::Header& header, const void* data, size_t n) override {
    return base_.send(map(peer), header, data, n);
  }
  Ticket recv(int peer, const wire::Call& expect, void* data, size_t n) override {
    return base_.recv(map(peer), expect, data, n);
  }
  int probe_any(const std::vector<int>& peers, int64_t tag) override {
    std::vector<int> mapped;
    for (int p : peers) mapped.push_back(map(p));
    const int found = base_.probe_any(mapped, tag);
    return static_cast<int>(std::find(members_.begin(), members_.end(), found) - members_.begin());
  }
  bool can_probe() const override { return base_.can_probe(); }
  void wait(Ticket ticket) override { base_.wait(ticket); }
  void wait_all() override { base_.wait_all(); }
  void abort(const std::string&, uint8_t) override {}
  void close() override {}

 private:
  int map(int peer) const { return members_.at(static_cast<size_t>(peer)); }

  Transport& base_;
  std::vector<int> members_;
  int index_;
};

class HybridTransport final : public Transport, public NativeCollectives {
 public:
  HybridTransport(std::unique_ptr<Transport> tcp, std::unique_ptr<ShmTransportApi> shm, plan::HostPlan plan,
                  const HybridOptions& o)
      : tcp_(std::move(tcp)), shm_(std::move(shm)), even_(plan.even), host_(plan.host), hosts_(std::move(plan.hosts)) {
    if (plan.rail_index >= 0) rail_ = std::make_unique<RankMapTransport>(*tcp_, std::move(plan.rail), plan.rail_index);
    tune_.segment_bytes = std::max<size_t>(o.segment_bytes, 1);
    chunk_bytes_ = shm_chunk_bytes(o.shm);
    tune_.allreduce = o.allreduce;
    tune_.measured = o.measured;
    if (tune_.allreduce == AllreduceAlgorithm::kTuned && !tune_.measured) {
      tune_.measured = std::make_shared<algo::MeasuredAllreduce>(tcp_->rank() == 0);
    }
    tune_.link = o.link;
    hierarchy_ = o.hierarchy;
    local_link_ = plan::default_link_model(TransportKind::kShm);
    for (const auto& h : hosts_) per_host_ = std::max(per_host_, static_cast<int>(h.size()));
  }
  ~HybridTransport() override { close(); }

  std::string kind() const override { return "hybrid"; }
  void set_spin_gate(const std::atomic<int>* gate) override {
    tcp_->set_spin_gate(gate);
    if (shm_) shm_->set_spin_gate(gate);
  }
  int rank() const override { return tcp_->rank(); }
  int size() const override { return tcp_->size(); }
  std::string peer_name(int peer) const override { return tcp_->peer_name(peer); }

  void begin(const wire::Call& call, net::Deadline deadline) override {
    call_ = call;
    tcp_->begin(call, deadline);
    if (shm_) shm_->begin(call, deadline);
  }
  Ticket send(int peer, const wire::Header& header, const void* data, size_t n) override {
    return tcp_->send(peer, header, data, n);
  }
  Ticket recv(int peer, const wire::Call& expect, void* data, size_t n) override {
    return tcp_->recv(peer, expect, data, n);
  }
  int probe_any(const std::vector<int>& peers, int64_t tag) override { return tcp_->probe_any(peers, tag); }
  bool can_probe() const override { return tcp_->can_probe(); }
  void wait(Ticket ticket) override { tcp_->wait(ticket); }
  void wait_all() override { tcp_->wait_all(); }

  NativeCollectives* native() override { return this; }

  bool allreduce(void* buf, size_t count, DataType dtype, ReduceOp op) override {
    // Flat: the caller runs one TCP algorithm over every rank (plan::choose_hierarchy; every rank
    // computes the same choice from the same figures).
    if (plan::choose_hierarchy(hierarchy_, count * element_size(dtype), static_cast<int>(hosts_.size()), per_host_,
                               tune_.link, local_link_) == plan::Hierarchy::kFlat) {
      return false;
    }
    // Sums within and across hosts; an average divides by the whole world once, at the end.
    const ReduceOp partial = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
    auto across = [&](void* slice, size_t n) {
      // The rail's messages carry the caller's call unchanged, so hosts that disagree on the
      // count or the op raise MismatchError; payload lengths check the slices.
      algo::allreduce(*rail_, scratch_, tune_, call_, slice, n, dtype, partial);
    };
    if (!shm_ && !even_) {
      // A host of one among bigger ones: its leaders' rail goes chunk by chunk, and so must this.
      const size_t esz = element_size(dtype);
      const size_t chunk = std::max<size_t>(1, chunk_bytes_ / esz);
      for (size_t done = 0; done == 0 || done < count; done += chunk) {
        across(static_cast<char*>(buf) + done * esz, std::min(chunk, count - done));
      }
    } else if (!shm_) {
      across(buf, count);
    } else if (even_) {
      shm_->native()->allreduce_with(buf, count, dtype, partial, across);
    } else {
      shm_->native()->allreduce_through_leader(buf, count, dtype, partial, across);
    }
    if (op == ReduceOp::kAvg) reduce::finish_avg(dtype, buf, count, size());
    return true;
  }

  bool broadcast(void* buf, size_t bytes, int root) override {
    // Across hosts first, over TCP: the root to one rank of every other host (the root itself on
    // its own host, the lowest rank elsewhere); then within each host, over shared memory, from
    // that rank.
    const std::vector<int> heads = plan::broadcast_heads(hosts_, root);
    const std::vector<int>& here = hosts_[static_cast<size_t>(host_)];
    int head_here = 0;  // this host's head, as a local rank
    for (int head : heads) {
      const auto at = std::find(here.begin(), here.end(), head);
      if (at != here.end()) head_here = static_cast<int>(at - here.begin());
    }
    const auto me = std::find(heads.begin(), heads.end(), rank());
    if (me != heads.end()) {
      RankMapTransport across(*tcp_, heads, static_cast<int>(me - heads.begin()));
      algo::broadcast(across, tune_, call_, buf, bytes, 0);
    }
    if (shm_) shm_->native()->broadcast(buf, bytes, head_here);
    return true;
  }

  void abort(const std::string& reason, uint8_t error_class) override {
    if (shm_) shm_->abort(reason, error_class);
    tcp_->abort(reason, error_class);
  }
  void close() override {
    if (shm_) shm_->close();
    tcp_->close();
  }

 private:
  std::unique_ptr<Transport> tcp_;
  std::unique_ptr<ShmTransportApi> shm_;
  std::unique_ptr<RankMapTransport> rail_;
  bool even_;
  int host_;                             // this rank's host, an index into hosts_
  std::vector<std::vector<int>> hosts_;  // every host's ranks, hosts in order of their lowest rank
  size_t chunk_bytes_ = 0;
  algo::Scratch scratch_;
  algo::Tuning tune_;
  plan::Hierarchy hierarchy_ = plan::Hierarchy::kAuto;
  plan::LinkModel local_link_;
  int per_host_ = 1;  // the most ranks any host has
  wire::Call call_;
};

}  // namespace

std::unique_ptr<Transport> make_hybrid_transport(const HybridOptions& options) {
  const TcpOptions& to = options.tcp;
  if (to.store == nullptr) throw UsageError("make_hybrid_transport: a store is required");
  const std::string mine = options.host_id.empty() ? host_identity() : options.host_id;
  std::vector<std::string> ids;
  for (auto& a : exchange_announcements(*to.store, to.key_prefix + "/hybrid", to.rank, to.size, to.token, {mine, ""},
                                        to.deadline)) {
    ids.push_back(a.host);
  }
  plan::HostPlan plan = plan::plan_hosts(ids, to.rank);
  const std::vector<int>& local = plan.hosts[static_cast<size_t>(plan.host)];
  const size_t local_size = local.size();

  auto tcp = make_tcp_transport(to);
  std::unique_ptr<ShmTransportApi> shm;
  if (local_size > 1) {
    ShmOptions so = options.shm;
    so.store = to.store;
    // One shared-memory group per host, named by its lowest rank.
    so.key_prefix = to.key_prefix + "/host" + std::to_string(local.front());
    so.group_name = to.group_name;
    so.rank = plan.local_rank;
    so.size = static_cast<int>(local_size);
    so.token = to.token;
    so.deadline = to.deadline;
    so.host_id = mine;
    so.global_ranks = local;
    if (options.spin_by_local_size) {
      so.spin_us = plan::default_spin_us(TransportKind::kShm, static_cast<int>(local_size), std::thread::hardware_concurrency());
    }
    shm = make_shm_transport(so);
  }
  return std::make_unique<HybridTransport>(std::move(tcp), std::move(shm), std::move(plan), options);
}

}  // namespace chorus::transport
