// Where a process of a distributed job learns its rank, the world size and the store's address:
// a pure function of the environment, so that every launcher's variables are unit-tested without
// starting one. rendezvous("env://") is its only caller; docs/launch-env.md has the table.
//
// Sources, first match wins:
//   1. "env"      RANK or WORLD_SIZE is set (chorus run, torchrun, spawn, by hand): RANK,
//                 WORLD_SIZE, MASTER_ADDR and MASTER_PORT are all required.
//   2. "openmpi"  OMPI_COMM_WORLD_RANK or _SIZE is set (a process started by mpirun / prterun).
//   3. "slurm"    SLURM_PROCID and SLURM_STEP_ID (or SLURM_STEPID) are set (a task of an srun job
//                 step; an sbatch script has SLURM_PROCID but no step id, and is no rank).
// Open MPI comes before Slurm because mpirun inside a Slurm allocation starts its daemons with
// srun, so its ranks also carry the daemons' SLURM_PROCID and SLURM_NTASKS; the innermost
// launcher is the one whose numbers are right.
//
// MASTER_ADDR and MASTER_PORT, when set, override whatever a source derives. Otherwise Slurm's
// master is the first host of the step's node list and Open MPI's is 127.0.0.1 when every rank is
// on this host; the port is derived from the job id (derived_master_port).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "chorus/comm/environment.h"

namespace chorus {

struct ClusterEnv {
  std::string source;  // "env", "openmpi" or "slurm"
  int rank = -1;
  int world_size = -1;
  int local_rank = -1;        // -1 when the source does not say
  int local_world_size = -1;  // -1 when the source does not say
  std::string master_addr;
  int master_port = -1;
  // "slurm:JOB.STEP" or "openmpi:JOBID"; "" for "env". The same on every rank of one job, and
  // different for another job: the derived port comes from it. (It is no job token: anyone who
  // sees the job id can derive it; rendezvous requires a secret instead, docs/launch-env.md.)
  std::string job_key;
  // Where each value came from, for messages: "RANK", "SLURM_PROCID", "the rank argument",
  // "first host of SLURM_STEP_NODELIST", "derived from SLURM_JOB_ID=7.SLURM_STEP_ID=0" ...
  std::string rank_from, world_size_from, master_addr_from, master_port_from;

  // One line for messages: "rank 1 of 2 (Slurm: SLURM_PROCID, SLURM_STEP_NUM_TASKS), master
  // node01:23456 (first host of SLURM_STEP_NODELIST; derived from ...)".
  std::string describe() const;
};

// The job's layout from `env` (an empty value counts as unset, as an empty RANK= does in a shell).
// rank / world_size >= 0 come from the caller (rendezvous arguments
// or URL parameters) and win over the environment; then no variable is needed for them.
// Throws UsageError naming the variable that is missing or malformed, and what to set.
ClusterEnv resolve_cluster_env(const Environment& env, int rank = -1, int world_size = -1);

// Slurm's hostlist syntax: comma-separated names, each with bracketed ranges and numbers, e.g.
// "node[01-03,07],login" -> node01 node02 node03 node07 login;
// "r[1-2]n[0-1]" -> r1n0 r1n1 r2n0 r2n1.
// A range keeps the zero padding of its lower bound. `what` names the variable for messages.
// Throws UsageError for unbalanced or nested brackets, empty names or ranges, a range whose end is
// below its start, or more than 1 << 20 hosts. Only the first `max_hosts` hosts are made (the
// whole list is still checked): env:// needs the first host alone.
std::vector<std::string> expand_hostlist(const std::string& list, const std::string& what,
                                         size_t max_hosts = size_t{1} << 20);

// Slurm's tasks-per-node syntax: "2(x3),1" -> 2 2 2 1. Throws UsageError naming `what`.
std::vector<int> expand_tasks_per_node(const std::string& text, const std::string& what);

// The store port for a job without MASTER_PORT: kDerivedPortBase + FNV-1a-64(job_key) mod
// kDerivedPortCount, i.e. in [20000, 32768): below Linux's default ephemeral range (32768-60999),
// so no outgoing connection on the master can already hold it. Every rank computes the same port
// from the same job key; two jobs on one master collide with probability 1 / 12768.
constexpr int kDerivedPortBase = 20000;
constexpr int kDerivedPortCount = 32768 - kDerivedPortBase;

// Strict decimal integer: the whole text, in [lo, hi]; false (and *out untouched) otherwise.
bool parse_int(const std::string& text, int lo, int hi, int* out);
int derived_master_port(const std::string& job_key);

}  // namespace chorus
