// chorus::dist::nccl: NCCL communicators set up through chorus, for CUDA tensors on one GPU per rank.
//
//   chorus::dist::init_process_group("nccl");      // chorus's group (CPU) + an NCCL communicator
//   chorus::dist::all_reduce(grad_on_gpu);          // NCCL, on the current CUDA stream
//
// chorus's own backends take CUDA tensors too (staged through pinned host memory; several ranks may
// share a GPU). NCCL moves them GPU to GPU and needs one GPU per rank. It is built only with
// -DCHORUS_WITH_NCCL=ON against a CUDA libtorch; otherwise create() and init_process_group("nccl")
// throw UsageError saying so (built_with_nccl() tells beforehand). docs/gpu.md has the details.
//
// A Communicator:
// - Setup (create) is collective over `size` ranks. Rank 0 draws NCCL's unique id and shares it
//   (through the process group, or under `key` in a store); every rank then joins with
//   ncclCommInitRankConfig in NCCL's non-blocking mode, and waits for the setup with the deadline
//   (`timeout`). A rank that never joins makes the others' create() throw TimeoutError naming the
//   ranks that did not join (store form) and the likely fix; NCCL's own refusal (two ranks on one
//   GPU, for instance) is an Error with NCCL's message, on every rank that sees it. Either way the
//   half-made communicator is aborted (ncclCommAbort), so nothing is left waiting.
// - Operations are queued on the calling thread's current CUDA stream of the communicator's device,
//   in call order; every rank must call the same operations in the same order (NCCL's rule). The
//   calling thread's current device is left as it was. The returned Work completes when the GPU
//   has finished the operation. wait() (or the call itself, without async_op) blocks the host
//   until then while polling NCCL for asynchronous errors (a peer that died, a network failure).
//   An error, or `timeout` passing since the operation was issued, aborts the communicator and
//   throws (PeerError / TimeoutError), so a dead peer is an error, not a hang. wait(limit) with a
//   shorter limit only ends that wait (TimeoutError); the operation goes on. Unlike
//   torch.distributed's nccl backend, which returns once the operation is queued, a call without
//   async_op returns when the result is final on the device.
// - After abort() (or an error that aborted it), every later operation throws PeerError with the
//   first cause, and so does waiting on an operation the abort cut short (one that had not
//   finished when it came): its tensors hold no valid result. Abort may be called from any
//   thread, also while another thread waits.
// - Thread-safe: calls are serialised internally. Destroying the communicator waits for its
//   pending operations (with the deadline), finalises it (at most 10 s: NCCL needs the peers
//   quiescent too) and destroys it, or aborts it when any of that fails. Tensors stay valid while
//   NCCL uses them, also when a Work is dropped unwaited (the caching allocator is told the stream).
// Tensors must be dense, contiguous CUDA tensors on the communicator's device, with the dtypes of
// chorus::dist (bool for broadcast and gathers only).
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>

#include "chorus/comm/process_group.h"
#include "chorus/comm/store.h"
#include "chorus/torch/distributed.h"

namespace chorus::dist::nccl {

// Whether this chorus was built with NCCL (-DCHORUS_WITH_NCCL=ON).
bool built_with_nccl();
// NCCL's version as "2.28.9" (of the library loaded at run time); "" without NCCL.
std::string version();

struct CommunicatorOptions {
  // The CUDA device of this rank; -1: LOCAL_RANK modulo the visible devices when LOCAL_RANK is set
  // (as chorus run and torchrun set it), else the current device.
  int device = -1;
  std::chrono::milliseconds timeout{300000};  // setup, each wait and teardown
};

class Communicator {
 public:
  // Collective over the group's ranks; the unique id travels by the group's broadcast (its deadline).
  static std::shared_ptr<Communicator> create(ProcessGroup& group, CommunicatorOptions options = {});
  // Collective over `size` ranks that share `store`; keys under `key` (one setup per key).
  static std::shared_ptr<Communicator> create(Store& store, const std::string& key, int rank, int size,
                                              CommunicatorOptions options = {});
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const;
  int size() const;
  int device() const;
  // "" while usable; otherwise why it was aborted.
  std::string broken() const;
  // ncclCommAbort: pending operations are dropped; later calls throw PeerError naming `why`.
  void abort(const std::string& why);

  WorkPtr all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::kSum, bool async_op = false);
  WorkPtr broadcast(const at::Tensor& tensor, int root, bool async_op = false);
  // The result lands in tensor on root; other ranks' tensors are left unchanged.
  WorkPtr reduce(const at::Tensor& tensor, int root, ReduceOp op = ReduceOp::kSum, bool async_op = false);
  // output holds size() blocks of input's size, rank i's at block i.
  WorkPtr all_gather_into_tensor(const at::Tensor& output, const at::Tensor& input, bool async_op = false);
  // input holds size() blocks of output's size; output = the reduction of block rank().
  WorkPtr reduce_scatter_tensor(const at::Tensor& output, const at::Tensor& input, ReduceOp op = ReduceOp::kSum,
                                bool async_op = false);

  struct Impl;

 private:
  explicit Communicator(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;  // shared with the Works still pending
};

// The communicator init_process_group("nccl") made for the default group; nullptr for any other
// backend or group.
std::shared_ptr<Communicator> default_communicator();

}  // namespace chorus::dist::nccl
