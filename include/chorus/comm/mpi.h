// The MPI backend: a process group whose ranks, messages and collectives are Open MPI's
// (docs/mpi.md). Start the ranks with mpirun; rank and size are MPI_COMM_WORLD's, and there is no
// rendezvous and no store.
//
//   auto pg = chorus::connect_mpi_process_group();   // under mpirun -np 4 prog
//   pg->allreduce(data, n, chorus::DataType::kFloat32)->wait();
//
// Contract: that of ProcessGroup (chorus/comm/process_group.h), with these differences:
// - Every operation has the deadline of options.timeout and fails with TimeoutError naming this
//   rank, the operation and the peers awaited. A rank that dies is not seen as such: mpirun ends the
//   whole job when one of its processes dies (its own policy, before chorus can say anything).
// - A rank that fails tells the others (they fail at once with its error), as over TCP; a rank
//   that closes its group does not say goodbye: a peer still waiting on it times out.
// - Collectives check first that every rank is in the same call (one small allgather of the call):
//   a mismatch is a MismatchError on every rank, naming the rank that differs and both calls.
// - Sub-groups (new_group) are MPI communicators split off the group's (MPI_Comm_split), in order
//   with the group's other operations; no deadline covers the split itself.
// - allocate_buffer gives ordinary memory (shared() is false).
// MPI is initialised by the first call (MPI_THREAD_MULTIPLE: the groups' worker threads call MPI at
// once) unless the program did it, and finalised at exit when chorus initialised it.
#pragma once

#include <memory>

#include "chorus/comm/process_group.h"

namespace chorus {

// Whether this build of chorus has the MPI backend (CHORUS_WITH_MPI, on when CMake found MPI).
bool mpi_available();

// The group of every process of MPI_COMM_WORLD. options.timeout, group_name and spin_us apply;
// the transport is "mpi" whatever options.transport says. Collective: every process calls it.
// Throws UsageError in a build without MPI (saying how to get one), and when the MPI library cannot
// give MPI_THREAD_MULTIPLE.
std::shared_ptr<ProcessGroup> connect_mpi_process_group(ProcessGroupOptions options = {});

}  // namespace chorus
