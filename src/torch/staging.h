// Device tensors (CUDA) through chorus's host collectives: each call copies its inputs into pinned
// host memory on a side stream, runs the ordinary collective on the host copies, and copies the
// results back on a second side stream (docs/gpu.md).
//
// Ordering, without blocking the calling thread:
// - the device-to-host copies wait (on the GPU) for everything already queued on the caller's
//   current stream: an event recorded there is waited on by the copy stream;
// - the collective waits (on the group's worker thread, ProcessGroup::run_local) for its copy's
//   event, so a DDP bucket launched from the backward thread does not hold backward up;
// - the host-to-device copy is queued by the worker once the collective is done; Work::wait()
//   waits for it, so a tensor is final (on the device too) when wait() returns.
// Large in-place collectives (allreduce, broadcast, reduce) run as pieces of pieces() so that
// the copies of one piece overlap the transfer of another. Every wait has the group's deadline.
//
// Internal to chorus_torch; no CUDA headers or libraries: only c10's device-generic streams and
// events, so the same code builds against a CPU-only libtorch (where no tensor is ever on a device).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "chorus/comm/process_group.h"

namespace chorus::dist::staging {

// Whether t lives on a device the staging path serves (CUDA).
bool on_device(const at::Tensor& t);

// [offset, count) pieces of a numel-element tensor, each at most chunk_bytes (at least one element).
// Pure: every rank splits the same count the same way, so the pieces' collectives match.
std::vector<std::pair<int64_t, int64_t>> pieces(int64_t numel, size_t element_size, size_t chunk_bytes);

// Bytes per piece: CHORUS_STAGE_CHUNK_BYTES, else 4 MiB.
size_t chunk_bytes();

// One collective call's staging. Not thread-safe; one per call.
class Call {
 public:
  Call(ProcessGroup& pg, c10::Device device, std::string op);

  // A pinned host tensor with t's dtype and element count, flat.
  at::Tensor host_like(const at::Tensor& t) const;
  // Queues dev -> host on the copy stream (after the caller's queued work). GPU side only: the
  // returned event is what wait_copy() queues a wait for.
  std::shared_ptr<c10::Event> copy_to_host(const at::Tensor& dev, const at::Tensor& host);
  // A step on the group's queue: waits (with the group's deadline) until `copied` has completed.
  void wait_copy(std::shared_ptr<c10::Event> copied);
  // An operation on host tensors, issued by the caller right after the steps it depends on.
  void add(std::shared_ptr<Work> work);
  // A step on the group's queue: queues host -> dev on the return stream.
  void copy_to_device(const at::Tensor& host, const at::Tensor& dev);
  // The Work of the whole call: waits for every step and operation, then for the last copy to the
  // device; then runs `done` (device-side follow-up, e.g. unpacking a gathered flat tensor) in the
  // waiting thread and drops `keep`. Waited on here unless async_op.
  std::shared_ptr<Work> finish(std::vector<at::Tensor> keep, bool async_op, std::function<void()> done = {});

 private:
  ProcessGroup& pg_;
  c10::Device device_;
  std::string op_;
  c10::Stream caller_;
  c10::Stream to_host_;
  c10::Stream to_device_;
  bool caller_marked_ = false;
  std::shared_ptr<c10::Event> returned_;  // recorded after each copy to the device
  std::vector<std::shared_ptr<Work>> works_;
};

}  // namespace chorus::dist::staging
