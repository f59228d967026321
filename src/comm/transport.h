// Internal: the transport interface the collective algorithms are written against.
//
// A Transport connects one rank to every other rank of its group and moves whole messages
// (wire::Header + payload) between them. Operations are posted (send/recv return a Ticket) and
// progress only inside wait()/wait_all(), which drive every posted send and receive at once, so
// a ring step's send and receive overlap. Messages on one pair arrive in the order they were sent.
//
// Threading: a Transport is used by one thread at a time (the process group's worker thread).
// Errors: wait() throws TimeoutError, PeerError or MismatchError with this rank, the peer and the
// current operation (set by begin()); after a throw the transport is broken and the caller calls
// abort() to tell the peers.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "error_class.h"
#include "message.h"
#include "plan.h"
#include "socket.h"

namespace chorus {
class Store;
}

namespace chorus::algo {
class MeasuredAllreduce;
}

namespace chorus::transport {

using Ticket = uint64_t;

// A buffer that every rank of a group maps (see Transport::allocate_shared). It keeps its own
// mappings: it may outlive the transport that made it.
class SharedRegion {
 public:
  virtual ~SharedRegion() = default;
  virtual void* data() = 0;  // this rank's buffer, page-aligned, zero-filled when made
  virtual size_t size() const = 0;
};

// A posted send or receive, as the transports queue them per peer.
struct SendItem {
  Ticket ticket;
  wire::Header header;
  const char* data;
  size_t n;
  size_t off = 0;  // bytes done, over header + data
};

struct RecvItem {
  Ticket ticket;
  wire::Call expect;
  char* data;
  size_t n;
  bool have_header = false;
  size_t got = 0;  // payload bytes received
};

// Collectives a transport runs itself, faster than the generic algorithms over its send/recv
// (Transport::native()). Each is an operation of its own: the caller has called the transport's
// begin() with the collective's call, and every rank of the group calls the same method with the
// same sizes. A method that returns false did nothing: the caller runs the generic algorithm.
class NativeCollectives {
 public:
  virtual ~NativeCollectives() = default;
  virtual bool allreduce(void* buf, size_t count, DataType dtype, ReduceOp op) = 0;
  virtual bool broadcast(void* buf, size_t bytes, int root) = 0;
  // Every rank contributes `bytes` at `in`; `out` receives rank r's block at r * bytes.
  virtual bool allgather(const void* in, void* out, size_t bytes) { return false; }
  // The rest of ProcessGroup's collectives, with its arguments (sizes in bytes where the call moves
  // bytes without reducing them). Only a transport with a library of collectives underneath (MPI)
  // offers them; the defaults leave them to the generic algorithms.
  virtual bool reduce(void* buf, size_t count, DataType dtype, ReduceOp op, int root) { return false; }
  // Rank r contributes sizes[r] bytes; `out` receives them back to back.
  virtual bool allgatherv(const void* in, void* out, const std::vector<size_t>& sizes) { return false; }
  virtual bool gather(const void* in, void* out, size_t bytes, int root) { return false; }
  virtual bool scatter(const void* in, void* out, size_t bytes, int root) { return false; }
  virtual bool reduce_scatter(const void* in, void* out, size_t count, DataType dtype, ReduceOp op) { return false; }
  virtual bool alltoall(const void* in, void* out, size_t bytes) { return false; }
  virtual bool barrier() { return false; }
  // A buffer of `bytes` that every rank maps, so that allreduce on it (or on the same range of it
  // on every rank) reduces straight out of the peers' buffers and writes the results into them,
  // with no staging copies; for buffers allreduced again and again (DDP's buckets). nullptr when
  // the memory is not there (the caller then uses ordinary memory).
  virtual std::shared_ptr<SharedRegion> allocate_shared(size_t bytes) { return nullptr; }
};

class Transport {
 public:
  virtual ~Transport() = default;

  // "tcp", "shm" or "hybrid": what ProcessGroup::transport() reports.
  virtual std::string kind() const = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "rank 3 (10.0.0.2:41234)": how errors name a peer.
  virtual std::string peer_name(int peer) const = 0;

  // Starts an operation: `call` and `deadline` frame every error until the next begin().
  virtual void begin(const wire::Call& call, net::Deadline deadline) = 0;
  // Posts `header` + n bytes at `data` to `peer`; `data` stays valid until the ticket completes.
  virtual Ticket send(int peer, const wire::Header& header, const void* data, size_t n) = 0;
  // Posts the receive of the next message from `peer`: its header must match `expect` and carry
  // exactly n payload bytes, which land at `data`.
  virtual Ticket recv(int peer, const wire::Call& expect, void* data, size_t n) = 0;
  // Waits until one of `peers` has sent this rank a point-to-point message (a send) with `tag`
  // that no posted receive has taken, and returns that peer without taking the message: the caller
  // then posts its recv. Nothing else may be posted meanwhile. A peer whose next message is another
  // one (a later operation's) is not chosen; a peer that closed its group is passed over; when all
  // of them have, or one dies, or the deadline passes, it throws as wait() does. Transports that
  // cannot look at a message before taking it (MPI's) say so in can_probe() and throw UsageError.
  virtual int probe_any(const std::vector<int>& peers, int64_t tag);
  virtual bool can_probe() const { return false; }  // probe_any works
  // Progresses everything posted until `ticket` has completed.
  virtual void wait(Ticket ticket) = 0;
  // Progresses everything posted until nothing is pending.
  virtual void wait_all() = 0;

  // The transport's own collectives (shared memory, the hybrid's hierarchy), or nullptr (the
  // default): the process group then runs the generic algorithms over send/recv.
  virtual NativeCollectives* native() { return nullptr; }

  // Transports whose groups do not come from a store (MPI's communicators) make their sub-groups
  // themselves: subgroup() is then a collective over this transport, called by every rank with the
  // same `ranks` (members first to last), and returns the sub-group's transport, in which this rank
  // is its index in `ranks`, or nullptr on a non-member. The others connect sub-groups through the
  // store as they connect groups.
  virtual bool makes_subgroups() const { return false; }
  virtual std::unique_ptr<Transport> subgroup(const std::vector<int>& ranks, const std::string& group_name) {
    return nullptr;
  }

  // Busy-polling is allowed only while *gate > 0 (a thread waits for the group's work, so its core
  // is idle); otherwise the transport sleeps as soon as it must wait. nullptr: always allowed.
  virtual void set_spin_gate(const std::atomic<int>* gate) {}

  // Tells every peer that this rank failed with `reason` (best effort, bounded), then shuts the
  // connections down so peers waiting on this rank fail at once.
  virtual void abort(const std::string& reason, uint8_t error_class) = 0;
  // Says goodbye to every peer and closes: peers that still wait on this rank get a PeerError
  // saying this rank closed its group.
  virtual void close() = 0;
};

struct TcpOptions {
  Store* store = nullptr;       // for exchanging listen addresses (keys under key_prefix)
  std::string key_prefix;       // e.g. "chorus/pg/0"
  std::string group_name;       // checked by both sides of every connection
  int rank = 0;
  int size = 1;
  std::string token;            // job token for the connection handshake
  std::string advertise_host;   // the address peers should connect to ("" = 127.0.0.1)
  net::Deadline deadline;       // for the whole mesh setup
  int socket_buffer_bytes = 0;  // SO_SNDBUF/SO_RCVBUF; 0 = kernel autotuning
  int spin_us = 0;              // busy-poll this long before sleeping in poll()
  // false: the full mesh at setup. true: the ring's neighbours at setup, every other peer when a
  // send to it first needs the connection (docs/algorithms.md, "Connections at scale").
  bool lazy_connections = false;
};

// Listens on a kernel-chosen port, publishes it in the store, and connects to the other ranks
// (all of them, or the ring's neighbours when lazy), with the token handshake and a check that
// both sides agree on group, world size and ranks. Throws HandshakeError/TimeoutError naming the
// peer otherwise.
std::unique_ptr<Transport> make_tcp_transport(const TcpOptions& options);

struct ShmOptions {
  Store* store = nullptr;
  std::string host_id;                // this rank's host ("" = host_identity()); all ranks must agree
  std::vector<int> global_ranks;      // for messages: the whole group's rank of each shm rank
  std::string key_prefix;
  std::string group_name;
  int rank = 0;
  int size = 1;
  std::string token;
  net::Deadline deadline;
  size_t ring_bytes = 256 << 10;      // per ordered pair of ranks, for point-to-point messages
  size_t collective_bytes = 2 << 20;  // per rank, twice (double-buffered): native allreduce's chunk
  size_t small_bytes = 16 << 10;      // native allreduce up to this size: one barrier, all ranks reduce all
  int spin_us = 50;                   // busy-wait this long before sleeping on a futex
};

// Called by a hierarchical allreduce between the reduction of this rank's slice of a chunk within
// the host and its publication to the host's other ranks: it must turn `slice` (count elements)
// into the reduction across hosts. Every rank of the host calls it once per chunk, in order.
using SliceHook = std::function<void(void* slice, size_t count)>;

// The shared-memory transport's collectives, with the hooks the hybrid's hierarchy needs.
class ShmCollectives : public NativeCollectives {
 public:
  // allreduce with `between` run on this rank's reduced slice of every chunk. `op` must not be
  // kAvg when `between` is set (the caller divides by the whole world once at the end).
  virtual void allreduce_with(void* buf, size_t count, DataType dtype, ReduceOp op, const SliceHook& between) = 0;
  // Rank 0 of the host reduces each whole chunk, runs `between` on it, and hands the result to the
  // others: for hosts with different numbers of ranks, where only the leaders talk across hosts.
  virtual void allreduce_through_leader(void* buf, size_t count, DataType dtype, ReduceOp op,
                                        const SliceHook& between) = 0;
};

// A shared-memory transport: its native() is never null and has the hybrid's hooks.
class ShmTransportApi : public Transport {
 public:
  ShmCollectives* native() override = 0;
};

// Ranks on one host: each maps every rank's segment (created in /dev/shm, unlinked as soon as all
// have mapped it, so nothing is left behind even after SIGKILL). Throws UsageError when the ranks
// are not all on this host (host identity = boot id + hostname + IPC namespace, via the store).
std::unique_ptr<ShmTransportApi> make_shm_transport(const ShmOptions& options);

struct HybridOptions {
  TcpOptions tcp;      // every rank, all hosts: point-to-point and the generic algorithms
  ShmOptions shm;      // filled in per host by make_hybrid_transport (rank, size, key prefix)
  std::string host_id; // this rank's host ("" = host_identity())
  bool spin_by_local_size = true;  // shm.spin_us = 50 when this host's ranks fit its cores, else 0
  size_t segment_bytes = 1 << 20;  // for the cross-host allreduce (algo::Tuning)
  AllreduceAlgorithm allreduce = AllreduceAlgorithm::kAuto;  // likewise
  std::shared_ptr<algo::MeasuredAllreduce> measured;         // for kTuned: the group's, or null for the rails' own
  plan::LinkModel link = plan::default_link_model(TransportKind::kTcp);
  // Allreduce through the hosts' shared memory and rails, or one flat TCP algorithm over every
  // rank: kAuto asks plan::choose_hierarchy per call.
  plan::Hierarchy hierarchy = plan::Hierarchy::kAuto;
};

// Several hosts: TCP between all ranks, shared memory within a host, and a hierarchical native
// allreduce (one rail per local rank when every host has as many ranks, else through each host's
// leader). Collective: every rank of the group calls it.
std::unique_ptr<Transport> make_hybrid_transport(const HybridOptions& options);

// What a rank tells the others through the store before they share memory.
struct Announcement {
  std::string host;   // host id
  std::string extra;  // e.g. the name of its shared-memory segment
};

// Publishes this rank's host id and `extra` under key_prefix with its world size and job token
// hash, and collects every rank's (collective). Throws HandshakeError naming the rank whose world
// size or job token differs (a process of another job, or a misconfigured one).
std::vector<Announcement> exchange_announcements(Store& store, const std::string& key_prefix, int rank, int size,
                                                 const std::string& token, const Announcement& mine,
                                                 net::Deadline deadline);

// The native allreduce's chunk (each half of a rank's collective area), in bytes.
size_t shm_chunk_bytes(const ShmOptions& options);
// The bytes of /dev/shm one rank's segment takes in a shared-memory group of `size` ranks.
size_t shm_segment_bytes(const ShmOptions& options, int size);
// Bytes free in /dev/shm (0 when it cannot be read).
uint64_t shm_free_bytes();

// This host's identity for deciding which ranks can share memory.
std::string host_identity();
// This rank's machine (its kernel's boot_id, hashed; the host name where that cannot be read) and
// the CPUs it may run on (sched_getaffinity; the first hardware_concurrency() where that fails),
// for plan::ranks_per_core. Namespaces and containers on one kernel are one machine.
plan::RankCpus this_rank_cpus();

}  // namespace chorus::transport
