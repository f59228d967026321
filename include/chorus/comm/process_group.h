// ProcessGroup: a set of ranks that run collectives together.
//
// Contract:
// - Every rank of the group calls the same collectives in the same order with the same dtype,
//   count, op and root. Every message carries the call, so a disagreement raises MismatchError
//   on every rank, stating both calls. (A call in which a rank only sends, such as a broadcast
//   root, learns of a disagreement at its next receive.)
// - Calls return at once with a Work; operations run in issue order on one background thread
//   per group. Buffers passed in must stay valid and untouched until the Work completes.
// - Every operation has a deadline (Options::timeout). On a timeout, a dead or departed peer, or
//   a mismatch, the operation fails with an error naming this rank, the peer and its address,
//   the operation and its sequence number and the time waited; the peers are told, so they fail
//   at once too. The group is then broken: every later call fails fast with the original cause.
// - Thread safety: the issuing methods may be called from any thread; the order in which they
//   are called is the order in which the operations run.
// - Send/recv pairs match in order per pair of ranks; their tags must agree. A run of sends and
//   recvs queued together starts together (see hold_p2p), so neither side's recv blocks its send.
//   recv_any takes the next message with its tag from whichever rank sends first.
// - Destroying the group (or shutdown()) finishes queued work, then says goodbye to the peers.
#pragma once

#include <chrono>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "chorus/comm/store.h"
#include "chorus/comm/types.h"

namespace chorus {

struct ProcessGroupOptions {
  std::chrono::milliseconds timeout{300000};  // per operation; 5 minutes as in PyTorch
  // "tcp": a full mesh of TCP connections. "shm": every rank on this host; point-to-point
  // through shared-memory rings, allreduce, broadcast and allgather straight through shared
  // memory. "hybrid": several hosts; allreduce and broadcast are hierarchical (shared memory in
  // the host, TCP across hosts), everything else over TCP. "auto": shm when every rank shares
  // this host, hybrid when some ranks share a host, else tcp (and tcp when a host's /dev/shm is
  // too small). Hosts are told apart by host_id (docs/shm.md).
  std::string transport = "auto";
  // Which host this rank is on, for shm, hybrid and auto; "" = this machine's identity (boot id,
  // hostname and IPC namespace). Ranks with equal ids must really share /dev/shm: tests set it to
  // split one machine into simulated hosts.
  std::string host_id;
  size_t shm_chunk_bytes = 2 << 20;  // shared-memory allreduce: bytes per chunk (double-buffered)
  size_t shm_small_bytes = 16 << 10; // shared-memory allreduce: one-barrier algorithm up to this size
  std::string token;                           // job token for the connection handshake
  std::string advertise_host;                  // address peers reach this rank by ("" = 127.0.0.1)
  std::string group_name = "default";
  size_t segment_bytes = 1 << 20;              // ring pipeline segment size
  // How allreduce moves data over TCP (and across hosts under hybrid): "auto" picks per call the
  // algorithm with the least predicted time for the call's size and the group's size, from a model
  // of the link (docs/algorithms.md); "ring", "recursive_doubling" or "rabenseifner" force one
  // (recursive doubling still where the buffer has fewer elements than the algorithm cuts it in).
  // "tuned" measures instead: the first calls of each size class (bytes within a power of two)
  // try the model's likely candidates in turn, 6 rounds each (kTunedAllreduceTrials calls at
  // most), then the group agrees on the fastest and keeps it (ProcessGroup::tuned_allreduce says
  // what it chose). Its choice can differ between runs, and sums in another order differ in the
  // last bits: a job that must repeat bit for bit (a resumed run compared with an unbroken one)
  // keeps "auto" or forces one.
  // CHORUS_ALLREDUCE_ALGORITHM in the environment replaces "auto".
  std::string allreduce_algorithm = "auto";
  // The link "auto" plans for: one message's latency and its bandwidth (e.g. 10 for 10 GbE);
  // 0 = CHORUS_LINK_LATENCY_US / CHORUS_LINK_GBIT from the environment where set, else what chorus
  // measured on loopback TCP (plan::default_link_model). It also sets which
  // recursive-doubling and Rabenseifner steps wait for the partner's ready word (blocks of 32
  // latencies and more: docs/algorithms.md), so every rank of a group must be given the same link.
  double link_latency_us = 0;
  double link_gbit_per_s = 0;
  int socket_buffer_bytes = 0;                 // 0 = kernel autotuning
  // TCP connections (tcp, and hybrid's across hosts): "eager" connects every pair of ranks at
  // setup (2(W-1) sockets per rank); "lazy" connects the ring's neighbours at setup and any other
  // pair when a send first needs it, so a rank holds the connections its algorithms use (about
  // 2 log2 W for the collectives); "auto" is lazy from 17 ranks on (docs/algorithms.md,
  // "Connections at scale"). CHORUS_TCP_CONNECTIONS in the environment replaces "auto".
  std::string tcp_connections = "auto";
  // Busy-poll this long before sleeping in poll() while an operation waits for data; cuts small-
  // message latency. -1 = 20 us when the group has no more ranks than this host has cores, else 0
  // (spinning on an oversubscribed host takes the core the peer needs).
  int spin_us = -1;
};

// What allreduce_algorithm "tuned" measured for one size class (ProcessGroup::tuned_allreduce).
struct TunedAllreduce {
  int ranks = 0;  // the group's size, or a hybrid rail's (its hosts) for the part across hosts
  size_t min_bytes = 0;
  size_t max_bytes = 0;  // inclusive
  // Each candidate ("ring", "recursive_doubling", "rabenseifner") and its time in microseconds:
  // the slowest rank's median of its timed trials. Empty when only one algorithm could run.
  std::vector<std::pair<std::string, double>> measured_us;
  std::string chosen;
};

// The handle of one queued operation.
class Work {
 public:
  virtual ~Work() = default;
  virtual bool is_completed() const = 0;
  // True once completed without error.
  virtual bool is_success() const = 0;
  // Blocks until the operation completes and rethrows its error, if any. With a timeout, throws
  // TimeoutError if it is still running then (the operation itself goes on).
  virtual void wait() = 0;
  virtual void wait(std::chrono::milliseconds timeout) = 0;
  virtual std::exception_ptr exception() const = 0;
  // How long the operation ran (from its start on the worker or inline to its end); 0 until done.
  virtual std::chrono::nanoseconds run_time() const = 0;
  // Results of the object collectives (all_gather_object: one per rank; broadcast_object and
  // scatter_object: one; gather_object: one per rank on the root, none elsewhere).
  virtual const std::vector<std::string>& objects() const = 0;
  // The rank a recv_any received from, once it completed; -1 for every other operation.
  virtual int source() const { return -1; }
};

// Memory from ProcessGroup::allocate_buffer.
class Buffer {
 public:
  virtual ~Buffer() = default;
  virtual void* data() = 0;
  virtual size_t size() const = 0;
  // Whether every rank of the group maps this buffer (shared memory), so that allreduce on it
  // reduces in place across ranks instead of copying through staging areas.
  virtual bool shared() const = 0;
};

class ProcessGroup {
 public:
  // Connects to every other rank through `store` (collective: all ranks construct it). The keys
  // it writes there (under "chorus/pg/<group_name>/") are deleted once every rank is set up, so
  // groups come and go without the store growing; a group_name is not reused while a group of
  // that name is still being set up on the same store.
  ProcessGroup(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options = {});
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  // The transport in use: "tcp", "shm" or "hybrid" ("auto" resolved).
  std::string transport() const;
  int rank() const;
  int size() const;
  const ProcessGroupOptions& options() const;
  // allreduce_algorithm "tuned": the size classes whose trials are over, what each candidate
  // measured and which one they run (by ranks, then bytes). Empty for every other algorithm, and
  // for allreduces that never leave shared memory. Any thread; a snapshot.
  std::vector<TunedAllreduce> tuned_allreduce() const;
  // allreduce_algorithm "tuned": keep these decisions (tuned_allreduce() of an earlier run of the
  // job, e.g. from the Accelerator's saved state) instead of measuring their size classes again,
  // so that a resumed run sums with the algorithms the original kept, bit for bit. Every rank passes
  // the same decisions (under hybrid: each rank its own rail's), before the allreduces of those
  // classes; a class already started here keeps what it has, and a decision is used only by a
  // transport of its `ranks`. The first allreduce of every class checks (one small allreduce, on
  // every rank) that all ranks kept the same decision for it, or none: MismatchError on every rank
  // otherwise. No effect for the other algorithms. UsageError for a decision whose byte range is not
  // one of tuned_allreduce()'s size classes or that names no algorithm. Any thread.
  void keep_tuned_allreduce(const std::vector<TunedAllreduce>& decisions);

  std::shared_ptr<Work> allreduce(void* data, size_t count, DataType dtype, ReduceOp op = ReduceOp::kSum);
  std::shared_ptr<Work> broadcast(void* data, size_t count, DataType dtype, int root);
  // The result lands in data on root; other ranks' data is left unchanged.
  std::shared_ptr<Work> reduce(void* data, size_t count, DataType dtype, ReduceOp op, int root);
  // out holds size() * count elements, rank i's block at i * count. in may be out + rank * count.
  std::shared_ptr<Work> allgather(const void* in, void* out, size_t count, DataType dtype);
  // Per-rank counts: rank i contributes counts[i] elements, placed back to back in out.
  std::shared_ptr<Work> allgatherv(const void* in, void* out, const std::vector<size_t>& counts,
                                   DataType dtype);
  // out (size() * count elements) is used on root only.
  std::shared_ptr<Work> gather(const void* in, void* out, size_t count, DataType dtype, int root);
  // in (size() * count elements) is used on root only; each rank receives its count elements.
  std::shared_ptr<Work> scatter(const void* in, void* out, size_t count, DataType dtype, int root);
  // in holds size() * count elements; out receives the reduction of block rank().
  std::shared_ptr<Work> reduce_scatter(const void* in, void* out, size_t count, DataType dtype,
                                       ReduceOp op = ReduceOp::kSum);
  // Block i of in (count elements) goes to rank i; block i of out comes from rank i. No overlap.
  std::shared_ptr<Work> alltoall(const void* in, void* out, size_t count, DataType dtype);
  std::shared_ptr<Work> barrier();
  std::shared_ptr<Work> send(const void* data, size_t count, DataType dtype, int dst, int tag = 0);
  std::shared_ptr<Work> recv(void* data, size_t count, DataType dtype, int src, int tag = 0);
  // Receives the next message with `tag` from whichever other rank sends one first (PyTorch's
  // recv without src); Work::source() then names that rank. It runs alone, after everything issued
  // before it. While it waits, a rank that dies fails it as any operation; one that closed its
  // group is passed over. The MPI transport refuses it (UsageError): it cannot look at a message
  // before taking it.
  std::shared_ptr<Work> recv_any(void* data, size_t count, DataType dtype, int tag = 0);

  // Point-to-point batches. Sends and recvs normally run one at a time in issue order, so two
  // ranks that each post a recv before their send (PyTorch's batch_isend_irecv lists) would wait
  // on each other until the deadline. After hold_p2p(), sends and recvs are queued but not started;
  // release_p2p() lets the run of them go as one step: every send and recv of the run posted at
  // once and progressed together (matching stays in order per pair of ranks). The next collective,
  // a Work::wait on a held operation, and shutdown release the hold too, so nothing waits forever.
  // Sends and recvs queued back to back without a hold are batched the same way when the worker
  // finds them queued together.
  void hold_p2p();
  void release_p2p();

  // A buffer of at least `bytes`, zero-filled and 64-byte aligned, for data this group allreduces
  // again and again (DDP's gradient buckets). Over shared memory every rank maps every rank's
  // buffer: an allreduce of the whole buffer, or of the same range of it on every rank, reduces
  // straight out of the peers' copies and writes the results into them, with no staging copies
  // (about half the memory traffic). Elsewhere, or when /dev/shm cannot hold it, it is ordinary
  // memory and works the same. Collective: every rank calls it with the same bytes, in the same
  // order as its other collectives; it blocks until done. The memory may outlive the group.
  std::shared_ptr<Buffer> allocate_buffer(size_t bytes);

  // Object collectives on byte strings of any length (empty too, and different on every rank);
  // results in Work::objects(). Each exchanges the lengths first, then the bytes.
  // all_gather_object: every rank gets one object per rank, in rank order.
  std::shared_ptr<Work> all_gather_object(std::string object);
  // broadcast_object: every rank gets root's object (the others' `object` is not read).
  std::shared_ptr<Work> broadcast_object(std::string object, int root);
  // gather_object: root gets one object per rank, in rank order; the others get none.
  std::shared_ptr<Work> gather_object(std::string object, int root);
  // scatter_object: on root, `objects` holds one object per rank; rank i gets objects[i] (one
  // object). The other ranks' `objects` is not read.
  std::shared_ptr<Work> scatter_object(std::vector<std::string> objects, int root);

  // A step of this rank alone, without communication: `fn` runs on the group's worker in issue
  // order, after the operations issued before it and before those issued after it. For work that
  // an operation depends on but the issuing thread should not wait for, such as a device-to-host
  // copy that the next collective reads (chorus::dist stages CUDA tensors so). Other ranks issue no
  // matching call. If fn throws, the group breaks as when an operation fails: the Work carries the
  // error, the peers are told (their pending operations fail at once) and every later call fails
  // with it. `what` names the step in errors ("stage cuda:0 -> host").
  std::shared_ptr<Work> run_local(std::string what, std::function<void()> fn);

  // A sub-group of the listed ranks of this group (every rank of this group calls it with the same
  // list, in the same order relative to other new_group calls). Returns nullptr on non-members.
  std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks);
  // The same with options of its own (another allreduce_algorithm, link model, timeout, ...), as
  // torch.distributed.new_group's timeout and pg_options. What ties it to this group's job is this
  // group's: transport, host_id, token and advertise_host are copied from it (those fields of
  // `options` are not read) and group_name is this group's with "/<n>" appended.
  std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks, ProcessGroupOptions options);

  // Waits for queued work, says goodbye to the peers and stops the worker. Idempotent.
  void shutdown();

 private:
  struct Impl;
  ProcessGroup() = default;  // for Impl::adopt
  // Builds its group over a transport of its own, without a store (chorus/comm/mpi.h).
  friend std::shared_ptr<ProcessGroup> connect_mpi_process_group(ProcessGroupOptions options);
  std::unique_ptr<Impl> impl_;
};

// Rendezvous (see rendezvous.h) + ProcessGroup: the usual way to start. What rendezvous read from
// the environment applies here: CHORUS_ERROR_FILE (uncaught exceptions recorded for chorus run),
// CHORUS_STORE_PREFIX (the attempt's keys) and CHORUS_TRANSPORT (when options.transport is "auto").
std::shared_ptr<ProcessGroup> connect_process_group(const std::string& init_method = "env://",
                                                    int rank = -1, int world_size = -1,
                                                    ProcessGroupOptions options = {});

}  // namespace chorus
