// Internal: the shared-memory transport for ranks on one host (docs/shm.md).
//
// Its parts, each in a file of its own:
//   shm_segment.{h,cc}      the segment: layout, naming, creation, mapping, shared buffers
//   shm_ring.{h,cc}         the single-producer ring and inbox that carry point-to-point messages
//   shm_wait.cc             waiting: spin gate, doorbells (futex), deadlines, liveness, the
//                           agreement and deadlock checks, the barrier
//   shm_collectives.{h,cc}  the native collectives over "areas plus a barrier"
//   shm_transport.cc        setup, point-to-point, abort and close (this class's lifecycle)
//   host_identity.cc        which ranks share a host, and the announcements that tell them
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "shm_collectives.h"
#include "shm_ring.h"
#include "shm_segment.h"
#include "transport.h"

namespace chorus::transport::shm {

class ShmTransport final : public ShmTransportApi, private CollectiveAreas {
 public:
  explicit ShmTransport(const ShmOptions& o) : o_(o), layout_(layout(o, o.size)), collectives_(*this, o.small_bytes) {}
  ~ShmTransport() override { close(); }

  // Creates this rank's segment, maps every peer's, and unlinks the names once all have mapped.
  void setup();

  // Transport
  std::string kind() const override { return "shm"; }
  void set_spin_gate(const std::atomic<int>* gate) override { gate_ = gate; }
  int rank() const override { return o_.rank; }
  int size() const override { return o_.size; }
  std::string peer_name(int peer) const override;
  void begin(const wire::Call& call, net::Deadline deadline) override;
  Ticket send(int peer, const wire::Header& header, const void* data, size_t n) override;
  Ticket recv(int peer, const wire::Call& expect, void* data, size_t n) override;
  int probe_any(const std::vector<int>& peers, int64_t tag) override;
  bool can_probe() const override { return true; }
  void wait(Ticket t) override;
  void wait_all() override;
  ShmCollectives* native() override { return &collectives_; }
  void abort(const std::string& reason, uint8_t error_class) override;
  void close() override;

 private:
  // CollectiveAreas, for collectives_
  int global_rank(int local) const override;
  size_t area_bytes() const override { return layout_.chunk; }
  char* area(int owner, int half) const override { return segs_[static_cast<size_t>(owner)].area(layout_, half); }
  void barrier(const char* what) override;                                   // shm_wait.cc
  void check_agreement() const override;                                     // shm_wait.cc
  void publish_buffer(uint64_t region_plus_one, uint64_t offset) override;
  std::string buffer_name(uint64_t id) const override { return name_ + "-buffer" + std::to_string(id); }

  // Setup
  void map_peers(const SegHeader& mine);
  void wait_until_all_mapped();

  // Naming
  std::string me() const { return "chorus: rank " + std::to_string(global_rank(o_.rank)); }
  std::string prefix() const { return me() + ": " + wire::describe(call_); }
  SegHeader* me_hdr() const { return segs_.empty() ? nullptr : segs_[static_cast<size_t>(o_.rank)].hdr; }
  // This rank's header once setup has mapped it (every operation runs after setup).
  SegHeader& my_hdr() const { return *segs_[static_cast<size_t>(o_.rank)].hdr; }
  SegHeader& hdr(int peer) const { return *segs_[static_cast<size_t>(peer)].hdr; }
  int check_peer(int peer) const;

  // Point-to-point progress (shm_transport.cc)
  bool pump_send(int peer);
  bool pump_recv(int peer);
  bool pump();

  // Waiting (shm_wait.cc)
  void ring(int peer);  // the peer's doorbell
  void ring_all();
  void wait_until(const std::function<bool()>& done, const char* what);
  void sleep_until_rung(const std::function<bool()>& done);
  void check_peers();
  void check_peer_state(int p);
  void check_same_call(int peer, bool strict) const;
  void check_same_buffer(int peer, const Desc& d) const;
  wire::Call current_call(int peer) const;
  bool gone(int peer) const;
  // `peer` waits at a native collective's barrier that this rank has not reached: it cannot send.
  bool waits_at_barrier_ahead(int peer) const;
  bool waiting_on(int peer) const;
  [[noreturn]] void fail_timeout(const char* what);

  ShmOptions o_;
  Layout layout_;
  std::string name_;
  bool named_ = false;
  std::vector<Segment> segs_;
  std::vector<int> pidfds_;
  std::vector<RingSender> senders_;      // per peer: the ring this rank writes to it
  std::vector<RingReceiver> receivers_;  // per peer: the ring it writes to this rank
  std::vector<std::deque<SendItem>> sends_;
  std::vector<std::deque<RecvItem>> recvs_;
  std::vector<char> probing_;  // per peer: probe_any waits for a message from it (set during the probe)
  std::unordered_set<Ticket> pending_;
  Ticket next_ = 1;
  uint64_t stage_ = 0;
  bool in_barrier_ = false;
  const std::atomic<int>* gate_ = nullptr;
  wire::Call call_;
  net::Clock::time_point start_ = net::Clock::now();
  net::Deadline deadline_ = net::Deadline::max();
  bool aborted_ = false;
  bool closed_ = false;
  ShmNativeCollectives collectives_;
};

}  // namespace chorus::transport::shm
