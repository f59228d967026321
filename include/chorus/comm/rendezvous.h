// Turning an init URL into a store, a rank and a world size, as torch.distributed does.
//
//   env://                    the environment of chorus run / torchrun, srun or mpirun (below)
//   tcp://HOST:PORT?rank=R&world_size=W[&token=T]
//   file:///PATH?rank=R&world_size=W
//
// Explicit rank / world_size arguments (>= 0) override the URL and the environment. With env:// and
// tcp://, rank 0 hosts the TcpStore server unless CHORUS_STORE_EXTERNAL=1 says a launcher already
// hosts it.
//
// env:// takes the ranks from the first of these that is present (docs/launch-env.md):
//   1. RANK / WORLD_SIZE (chorus run, torchrun, spawn): RANK, WORLD_SIZE, MASTER_ADDR and
//      MASTER_PORT are all required.
//   2. Open MPI's mpirun: OMPI_COMM_WORLD_RANK / _SIZE; master 127.0.0.1 when every rank is on
//      one host, else MASTER_ADDR is required.
//   3. Slurm's srun (a job step: SLURM_STEP_ID set): SLURM_PROCID / SLURM_STEP_NUM_TASKS (else
//      SLURM_NTASKS); master = the first host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST).
// MASTER_ADDR and MASTER_PORT, when set, always win. Without MASTER_PORT, mpirun and srun jobs use
// a port derived from the job id: 20000 + FNV-1a-64("slurm:JOB.STEP" or "openmpi:JOBID") mod
// 12768, the same on every rank. Open MPI comes before Slurm because mpirun inside a Slurm
// allocation starts its daemons with srun, so its ranks carry the daemons' SLURM_* variables too.
//
// The job token comes from the URL's token=, else CHORUS_JOB_TOKEN, else, under srun or mpirun
// with rank 0 hosting the store, the job key above (so that another job whose derived port
// collides is refused instead of joining), else "".
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "chorus/comm/store.h"

namespace chorus {

struct RendezvousOptions {
  std::chrono::milliseconds timeout = Store::kDefaultTimeout;
};

struct Rendezvous {
  std::shared_ptr<Store> store;
  int rank = -1;
  int world_size = -1;
  std::string token;
  // The address of this host as seen on the store connection (for publishing listen addresses);
  // "" for stores without a network connection.
  std::string local_address;
};

// Throws UsageError for a malformed URL or missing variables (naming them), TimeoutError when the
// store cannot be reached in time.
Rendezvous rendezvous(const std::string& url, int rank = -1, int world_size = -1,
                      RendezvousOptions options = {});

}  // namespace chorus
