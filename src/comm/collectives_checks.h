// Internal test helpers: the collectives conformance suite's checks, on a connected process group.
// Every transport runs the same checks: collectives_test (tcp, shm, hybrid, auto; ranks forked by
// testing::run_ranks) and mpi_collectives_test (mpi, under mpirun). Data are small integers, so
// every reduction is exact and results compare bit for bit. Each check throws std::runtime_error
// naming the call and the first element that differs.
#pragma once

#include <memory>

#include "chorus/comm/process_group.h"

namespace chorus::conformance {

// Every collective, every dtype and op, sizes 0, 1, fewer elements than ranks, unaligned, 4099.
void every_collective(ProcessGroup& pg);
// Allreduce alone: every dtype and op, the sizes above and those around the world size (blocks of
// one element, one block longer than the others), and 65537 elements (many ring segments).
void every_allreduce(ProcessGroup& pg);
// Broadcast alone: from every root, three dtypes, sizes 0 to 100003 elements.
void every_broadcast(ProcessGroup& pg);
// Sizes past the default segment and chunk sizes: allreduce, broadcast, reduce_scatter, allgather.
void large_buffers(ProcessGroup& pg);
// Tagged sends in a ring, large sends posted before the receives on both sides, held batches,
// recvs from any source, object collectives, a sub-group of the even ranks and the parent after it.
void point_to_point_objects_subgroups(ProcessGroup& pg);
// allocate_buffer: allreduce in place, whole and by range, every dtype and op, reused again and
// again; shared() only over shm; the memory outlives the group (which this ends).
void allocated_buffers(std::shared_ptr<ProcessGroup> pg);

}  // namespace chorus::conformance
