// Internal: collective algorithms, written only against transport::Transport.
//
// Every function is called by all ranks of the group with the same `call` (op, seq, dtype, count,
// root) and returns when this rank's part is done. Messages carry the call, so a rank that is in
// a different call raises MismatchError instead of misreading bytes.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "chorus/comm/types.h"
#include "message.h"
#include "plan.h"
#include "transport.h"

namespace chorus::algo {

class MeasuredAllreduce;

// allreduce "auto": the most ranks per core on any machine of the group (plan::ranks_per_core),
// learned at the group's first allreduce and charged to every step (plan::on_shared_cores). Only
// the group's worker touches it.
struct SharedCores {
  bool known = false;
  double ranks_per_core = 1;
  plan::LinkModel link;  // Tuning::link as these shared cores slow it, once known
};

struct Tuning {
  size_t segment_bytes = 1 << 20;  // ring pipeline segment
  // kAuto: plan::choose_allreduce by `link`; kTuned: `measured` tries and picks (never null then).
  AllreduceAlgorithm allreduce = AllreduceAlgorithm::kAuto;
  std::shared_ptr<MeasuredAllreduce> measured;
  plan::BroadcastShape broadcast = plan::BroadcastShape::kAuto;  // kAuto: plan::choose_broadcast by `link`
  plan::LinkModel link = plan::default_link_model(TransportKind::kTcp);
  // kAuto: learned at the first allreduce when set; the link's model as it is when null.
  std::shared_ptr<SharedCores> cores;
};

// Reusable scratch memory, so steady-state calls allocate and page-fault nothing.
class Scratch {
 public:
  char* get(int slot, size_t bytes);

 private:
  std::vector<std::vector<char>> slots_;
};

void allreduce(transport::Transport& t, Scratch& s, const Tuning& tune, const wire::Call& call,
               void* buf, size_t count, DataType dtype, ReduceOp op);
// allreduce "auto", the group's first allreduce: every rank's machine and CPUs, gathered (one
// allgather of 136 bytes a rank, under `call`'s fields with wire::kSharedCoresArg), into
// tune.cores. Every rank of the group must run it at the same call.
void learn_shared_cores(transport::Transport& t, const Tuning& tune, const wire::Call& call);
// allreduce by `algorithm` (plan::choose_allreduce as forced: recursive doubling where it cannot
// split the buffer; kAuto by the model).
void allreduce_by(AllreduceAlgorithm algorithm, transport::Transport& t, Scratch& s, const Tuning& tune,
                  const wire::Call& call, void* buf, size_t count, DataType dtype, ReduceOp op);
void allreduce_recursive_doubling(transport::Transport& t, Scratch& s, const Tuning& tune, const wire::Call& call,
                                  void* buf, size_t count, DataType dtype, ReduceOp op);
void allreduce_ring(transport::Transport& t, Scratch& s, const Tuning& tune, const wire::Call& call,
                    void* buf, size_t count, DataType dtype, ReduceOp op);
// Needs count >= the largest power of two <= the group's size (each of those ranks owns a block).
void allreduce_rabenseifner(transport::Transport& t, Scratch& s, const Tuning& tune, const wire::Call& call,
                            void* buf, size_t count, DataType dtype, ReduceOp op);

void broadcast(transport::Transport& t, const Tuning& tune, const wire::Call& call, void* buf,
               size_t bytes, int root);
// The result lands in buf on root; other ranks' buf is left unchanged.
void reduce(transport::Transport& t, Scratch& s, const wire::Call& call, void* buf, size_t count,
            DataType dtype, ReduceOp op, int root);
// out holds every rank's block at displs (bytes); in is this rank's block of sizes[rank] bytes.
void allgatherv(transport::Transport& t, const wire::Call& call, const void* in, void* out,
                const std::vector<size_t>& sizes);
void gather(transport::Transport& t, const wire::Call& call, const void* in, void* out, size_t bytes,
            int root);
void scatter(transport::Transport& t, const wire::Call& call, const void* in, void* out, size_t bytes,
             int root);
// Blocks of sizes[i] bytes per rank, back to back in root's buffer (out for gatherv, in for
// scatterv). Root reads every entry of sizes; the other ranks read only their own.
void gatherv(transport::Transport& t, const wire::Call& call, const void* in, void* out,
             const std::vector<size_t>& sizes, int root);
void scatterv(transport::Transport& t, const wire::Call& call, const void* in, void* out,
              const std::vector<size_t>& sizes, int root);
// in holds size * count elements; out receives this rank's reduced block of count elements.
void reduce_scatter(transport::Transport& t, Scratch& s, const Tuning& tune, const wire::Call& call,
                    const void* in, void* out, size_t count, DataType dtype, ReduceOp op);
void alltoall(transport::Transport& t, const wire::Call& call, const void* in, void* out, size_t bytes);
void barrier(transport::Transport& t, const wire::Call& call);

}  // namespace chorus::algo
