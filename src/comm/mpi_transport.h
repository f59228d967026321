// Internal: the MPI transport (docs/mpi.md). One MPI communicator per process group.
//
//   mpi_transport.cc    setup, point-to-point, waiting with deadlines, abort notices, close
//   mpi_collectives.cc  the native collectives (MPI's non-blocking collectives) and the call check
//
// Point-to-point: a transport message (wire::Header + payload) is two MPI messages on kDataTag of
// the group's communicator, the header and then the payload (straight into the receiver's buffer;
// payloads over 1 GiB go as several messages). MPI keeps messages of one pair and tag in order, so
// chorus's rule (messages of a pair match in order, headers are checked) holds unchanged. A rank
// whose sends wait for a peer that has not posted the receive (both ranks send first) reads the
// peer's next messages ahead into memory of its own, as the TCP transport does.
// Failure notices go on kAbortTag; every wait looks for them.
// Threading: one thread at a time per transport (the group's worker); several groups' threads call
// MPI at once, so MPI must give MPI_THREAD_MULTIPLE.
#pragma once

#include <mpi.h>

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "transport.h"

namespace chorus::transport::mpi {

struct MpiOptions {
  std::string group_name;
  int spin_us = -1;  // busy-poll this long before yielding; -1 = 50 us when ranks fit this host's cores
};

class MpiTransport final : public Transport, public NativeCollectives {
 public:
  // Takes ownership of `comm` (freed by close()). Collective over comm: exchanges host names.
  MpiTransport(MPI_Comm comm, MpiOptions options, net::Deadline deadline);
  ~MpiTransport() override { close(); }

  // Transport
  std::string kind() const override { return "mpi"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string peer_name(int peer) const override;
  void begin(const wire::Call& call, net::Deadline deadline) override;
  Ticket send(int peer, const wire::Header& header, const void* data, size_t n) override;
  Ticket recv(int peer, const wire::Call& expect, void* data, size_t n) override;
  void wait(Ticket ticket) override;
  void wait_all() override;
  NativeCollectives* native() override { return this; }
  bool makes_subgroups() const override { return true; }
  std::unique_ptr<Transport> subgroup(const std::vector<int>& ranks, const std::string& group_name) override;
  void set_spin_gate(const std::atomic<int>* gate) override { gate_ = gate; }
  void abort(const std::string& reason, uint8_t error_class) override;
  void close() override;

  // NativeCollectives (mpi_collectives.cc). Reductions of float16 and bfloat16 (no MPI type)
  // return false: the generic algorithms run them over this transport's point-to-point.
  bool allreduce(void* buf, size_t count, DataType dtype, ReduceOp op) override;
  bool broadcast(void* buf, size_t bytes, int root) override;
  bool allgather(const void* in, void* out, size_t bytes) override;
  bool reduce(void* buf, size_t count, DataType dtype, ReduceOp op, int root) override;
  bool allgatherv(const void* in, void* out, const std::vector<size_t>& sizes) override;
  bool gather(const void* in, void* out, size_t bytes, int root) override;
  bool scatter(const void* in, void* out, size_t bytes, int root) override;
  bool reduce_scatter(const void* in, void* out, size_t count, DataType dtype, ReduceOp op) override;
  bool alltoall(const void* in, void* out, size_t bytes) override;
  bool barrier() override;

 private:
  static constexpr int kDataTag = 1;
  static constexpr int kAbortTag = 2;

  // A posted send or receive: its MPI requests (the header's first) and, for a receive, where the
  // message goes and what it must be.
  struct Op {
    Ticket ticket = 0;
    int peer = -1;
    bool is_send = false;
    wire::Header header;         // sent, or received
    bool header_checked = false;
    wire::Call expect;           // receive
    char* data = nullptr;        // receive: n bytes
    size_t n = 0;
    bool from_stash = false;     // receive: its message was read ahead (stash_) before it was posted
    std::vector<MPI_Request> reqs;
  };
  // A message read ahead of its receive: header and payload in memory of its own.
  struct Stashed {
    wire::Header header;
    std::vector<char> payload;
    std::vector<MPI_Request> reqs;  // the payload's, while it arrives
  };

  std::string me() const { return "chorus: rank " + std::to_string(rank_); }
  std::string prefix() const { return me() + ": " + wire::describe(call_); }
  void check(int rc, const std::string& what) const;  // throws PeerError with MPI's error text

  void post_payload(Op& op, char* data, size_t n, bool send);
  bool pump();                  // progresses every posted op; true when something completed
  bool pump_recv(Op& op);       // true when op completed
  void read_ahead(int peer);
  void check_header(const Op& op, const wire::Header& h) const;
  void check_abort_notice();
  // Waits, with the spin policy and the deadline, until done() is true; `what` names the wait in
  // a timeout.
  void wait_until(const std::function<bool()>& done, const std::function<std::string()>& what);
  void wait_request(MPI_Request* req, const char* what);  // a collective's request
  [[noreturn]] void fail_timeout(const std::string& what);
  std::string awaited() const;  // the peers pending ops wait for

  // mpi_collectives.cc
  void check_same_call();
  void run(const char* name, const std::function<int(MPI_Request*)>& start);

  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
  MpiOptions o_;
  int spin_us_ = 0;
  std::vector<std::string> hosts_;  // every rank's host (MPI_Get_processor_name)
  std::vector<int> world_ranks_;    // every rank's rank in MPI_COMM_WORLD
  std::vector<std::deque<Op>> sends_, recvs_;  // per peer, in posting order
  std::vector<std::deque<Stashed>> stash_;     // per peer, in message order
  std::unordered_set<Ticket> pending_;
  Ticket next_ = 1;
  size_t pending_sends_ = 0;
  const std::atomic<int>* gate_ = nullptr;
  wire::Call call_;
  net::Clock::time_point start_ = net::Clock::now();
  net::Deadline deadline_ = net::Deadline::max();
  std::vector<char> sigs_;  // the call check's allgather
  bool aborted_ = false;
  bool closed_ = false;
};

}  // namespace chorus::transport::mpi
