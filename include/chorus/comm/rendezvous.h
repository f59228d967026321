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
// The job token (the secret every connection proves, docs/launch-env.md "Job token") comes from
// the URL's token=, else CHORUS_JOB_TOKEN, else the file CHORUS_JOB_TOKEN_FILE names (it must belong
// to this user and be readable by nobody else). A job of one rank makes up a random one. Otherwise
// there is no default: anything derived from what the ranks can all see (job id, endpoint) could
// be derived by a stranger, so rendezvous throws UsageError saying how to set one. (chorus run on
// one node and chorus::spawn hand their workers a random CHORUS_JOB_TOKEN.) file:// needs none.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "chorus/comm/store.h"

namespace chorus {

struct RendezvousOptions {
  std::chrono::milliseconds timeout = Store::kDefaultTimeout;
  // While the store cannot be reached: a line on stderr this often (0 = none).
  std::chrono::milliseconds progress_interval{5000};
};

struct Rendezvous {
  std::shared_ptr<Store> store;
  int rank = -1;
  int world_size = -1;
  std::string token;
  // The address of this host as seen on the store connection (for publishing listen addresses);
  // "" for stores without a network connection.
  std::string local_address;
  // What a launcher or the user asked of the layers above through the environment; rendezvous is
  // where the library reads CHORUS_* variables, and these pass them on as options.
  std::string error_file;    // CHORUS_ERROR_FILE: where this rank records an uncaught exception
  std::string store_prefix;  // CHORUS_STORE_PREFIX: this attempt's key space in a shared store
  std::string transport;     // CHORUS_TRANSPORT: "tcp", "shm", "hybrid" or "auto" ("": not set)
};

// Throws UsageError for a malformed URL, missing variables or a missing job token (naming them and
// the fix), TimeoutError when the store cannot be reached in time. While it waits for the store it
// prints a line to stderr every 5 s (who, where, how long so far, the deadline); a host name that
// does not resolve fails at once.
Rendezvous rendezvous(const std::string& url, int rank = -1, int world_size = -1,
                      RendezvousOptions options = {});

// The secret in a job token file (trailing whitespace dropped). Throws UsageError naming the file and
// the fix when it is missing, empty, not this user's, or readable by group or others.
std::string read_token_file(const std::string& path);

// How many times a launcher has restarted this job: the largest of CHORUS_RESTART_COUNT (chorus
// run), TORCHELASTIC_RESTART_COUNT (torchrun) and SLURM_RESTART_COUNT (Slurm requeue); 0 when none
// is set. Reads the environment.
int restart_count();

// Whether a launcher started this process as one rank of a job of several: chorus run or torchrun
// (RANK set), mpirun with more than one process (OMPI_COMM_WORLD_RANK), or an srun step of more
// than one task (SLURM_PROCID). An sbatch script (no step id), a one-task mpirun or srun step and
// a plain process are not. When true and `rank` is given, *rank is the rank as the launcher wrote
// it (for messages; init_process_group checks it). Reads the environment.
bool launched_job(std::string* rank = nullptr);

// CHORUS_ERROR_FILE, where chorus run asks each worker to record the exception that ends it
// (install_error_file_handler); "" when unset. rendezvous() reads it into Rendezvous::error_file.
std::string error_file_from_environment();

// Splits "HOST:PORT" or "[IPV6]:PORT" (the port a decimal integer in [1, 65535]) into *host and
// *port. Returns "" on success; otherwise what is wrong ("no port", "no host", ...), for the
// caller's error message, and leaves *host and *port untouched. Pure: no name lookup.
std::string split_host_port(const std::string& text, std::string* host, int* port);

}  // namespace chorus
