// chorus::dist: torch.distributed's API on at::Tensor, for the libtorch C++ frontend.
//
//   chorus::dist::init_process_group();               // env:// (as set by chorus run or spawn)
//   chorus::dist::all_reduce(grad);                    // in place, sum
//   chorus::dist::all_reduce(grad, chorus::ReduceOp::kAvg);
//
// Tensors must be defined, dense, contiguous and on the CPU or a CUDA device; anything else raises
// UsageError saying how to fix it (.contiguous(), .cpu()). Supported dtypes: float32, float64,
// float16, bfloat16, int8, uint8, int32, int64 (bool too for the non-reducing collectives).
//
// CUDA tensors (docs/gpu.md) go through pinned host memory: copied out on a side stream after the
// work already queued on the caller's current stream, reduced or moved by the same host
// collectives, copied back; wait() (or the call, without async_op) returns once the result is on
// the device. The calling thread does not wait for the GPU: the group's worker does. All tensors of
// one call must be on one device. Allreduce, broadcast and reduce of large tensors run as pieces of
// CHORUS_STAGE_CHUNK_BYTES (4 MiB) so that copies overlap the transfer: every rank must then pass
// a tensor on the same kind of device (a CPU rank against a CUDA rank is a MismatchError). At world
// size 1 allreduce, broadcast and reduce of a CUDA tensor return at once.
//
// Every collective takes an optional group (nullptr = the default group) and async_op. With
// async_op=false (the default) it returns once done; with async_op=true it returns a Work to
// wait on, and the tensors must not be touched until then. Errors, timeouts and the rules of
// ordering are those of chorus::ProcessGroup (see chorus/comm/process_group.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "chorus/comm/process_group.h"

namespace chorus::dist {

struct InitOptions {
  std::chrono::milliseconds timeout{300000};
  ProcessGroupOptions group;  // tuning and the transport; timeout above wins
};

// backend: "chorus" (the transport options.group.transport names, "auto" by default: shared memory
// within a host, TCP between hosts; CHORUS_TRANSPORT in the environment overrides it), "gloo" (an
// alias of "chorus", so code written for torch.distributed's CPU backend runs unchanged), one
// transport forced: "tcp", "shm" or "hybrid", or "mpi": Open MPI under mpirun, as torch.distributed's
// mpi backend (rank and world size are MPI_COMM_WORLD's, init_method is not used, rank/world_size
// other than -1 must agree with MPI; chorus/comm/mpi.h and docs/mpi.md; a build without MPI throws
// UsageError saying how to get it), or "nccl": chorus's group as with "chorus", plus an NCCL
// communicator (chorus/torch/nccl.h) that then carries allreduce, broadcast, reduce, the allgathers
// and reduce_scatter_tensor of CUDA tensors on the default group, one GPU per rank (a build without
// -DCHORUS_WITH_NCCL=ON throws UsageError saying so; the other collectives are staged as above).
// init_method: env://, tcp://, file:// (see chorus/comm/rendezvous.h). rank / world_size < 0 come
// from the URL or the environment.
void init_process_group(const std::string& backend = "chorus", const std::string& init_method = "env://",
                        int rank = -1, int world_size = -1, InitOptions options = {});
// The transport a backend name forces ("" for "chorus" and "gloo": the group's own choice).
// Throws UsageError for any other name, saying which names exist. Pure; no communication.
std::string transport_for_backend(const std::string& backend);
bool is_initialized();
// Says goodbye to the peers and drops the default group. Also runs at exit.
void destroy_process_group();
int get_rank(ProcessGroup* group = nullptr);
int get_world_size(ProcessGroup* group = nullptr);
ProcessGroup& default_group();  // throws UsageError before init_process_group
namespace detail {
inline ProcessGroup& group_or_default(ProcessGroup* group) { return group != nullptr ? *group : default_group(); }
}  // namespace detail
std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks);

// Maps a tensor dtype to the collectives' DataType; throws UsageError for others.
DataType to_data_type(c10::ScalarType type);

using WorkPtr = std::shared_ptr<Work>;

// A Work that completes with `inner`, then runs `finish` once, in the first thread that waits or
// finds it complete with is_completed() (e.g. copying a result out of a staging tensor), and keeps
// `keep` alive until then. is_completed() is true only once `finish` has run.
WorkPtr then(WorkPtr inner, std::function<void()> finish, std::vector<at::Tensor> keep = {});

WorkPtr all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::kSum, ProcessGroup* group = nullptr,
                   bool async_op = false);
WorkPtr broadcast(const at::Tensor& tensor, int src, ProcessGroup* group = nullptr, bool async_op = false);
// The result lands in tensor on dst; other ranks' tensors are left unchanged.
WorkPtr reduce(const at::Tensor& tensor, int dst, ReduceOp op = ReduceOp::kSum, ProcessGroup* group = nullptr,
               bool async_op = false);
// tensor_list gets one tensor per rank, each shaped like tensor.
WorkPtr all_gather(std::vector<at::Tensor>& tensor_list, const at::Tensor& tensor, ProcessGroup* group = nullptr,
                   bool async_op = false);
// output holds world_size blocks of input's size, concatenated along dim 0.
WorkPtr all_gather_into_tensor(const at::Tensor& output, const at::Tensor& input, ProcessGroup* group = nullptr,
                               bool async_op = false);
// gather_list (on dst only) gets one tensor per rank.
WorkPtr gather(const at::Tensor& tensor, std::vector<at::Tensor>* gather_list, int dst,
               ProcessGroup* group = nullptr, bool async_op = false);
// scatter_list (on src only) holds one tensor per rank; each rank's goes into tensor.
WorkPtr scatter(const at::Tensor& tensor, const std::vector<at::Tensor>* scatter_list, int src,
                ProcessGroup* group = nullptr, bool async_op = false);
// output = reduction over ranks of input_list[rank].
WorkPtr reduce_scatter(const at::Tensor& output, const std::vector<at::Tensor>& input_list,
                       ReduceOp op = ReduceOp::kSum, ProcessGroup* group = nullptr, bool async_op = false);
// input holds world_size blocks of output's size; output = reduction of block rank.
WorkPtr reduce_scatter_tensor(const at::Tensor& output, const at::Tensor& input, ReduceOp op = ReduceOp::kSum,
                              ProcessGroup* group = nullptr, bool async_op = false);
// Equal splits: block i of input goes to rank i, block i of output comes from rank i.
WorkPtr all_to_all_single(const at::Tensor& output, const at::Tensor& input, ProcessGroup* group = nullptr,
                          bool async_op = false);
WorkPtr barrier(ProcessGroup* group = nullptr, bool async_op = false);
WorkPtr send(const at::Tensor& tensor, int dst, int tag = 0, ProcessGroup* group = nullptr);
WorkPtr recv(const at::Tensor& tensor, int src, int tag = 0, ProcessGroup* group = nullptr);
WorkPtr isend(const at::Tensor& tensor, int dst, int tag = 0, ProcessGroup* group = nullptr);
WorkPtr irecv(const at::Tensor& tensor, int src, int tag = 0, ProcessGroup* group = nullptr);

// Objects as byte strings (serialise them yourself, e.g. with torch::pickle_save). For C++ values
// and tensors, and PyTorch's gather_object, scatter_object_list and broadcast_object_list, see
// chorus/torch/objects.h.
std::vector<std::string> all_gather_object(const std::string& object, ProcessGroup* group = nullptr);
std::string broadcast_object(const std::string& object, int src, ProcessGroup* group = nullptr);

}  // namespace chorus::dist
