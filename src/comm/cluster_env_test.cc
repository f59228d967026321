// resolve_cluster_env(): each launcher's variables, their precedence, Slurm's host lists and the
// errors for missing or malformed variables. Pure: environments are maps, nothing is started.
#include "chorus/comm/hash.h"
#include "chorus/comm/error.h"
#include "cluster_env.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <set>
#include <string>
#include <vector>

#include "chorus/comm/error.h"

namespace chorus {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// What srun -n 2 sets on the first host of a job step (taken from Slurm 22.05), for rank `procid`.
Environment slurm_step(int procid = 1) {
  return {{"SLURM_JOB_ID", "4242"},
          {"SLURM_JOBID", "4242"},
          {"SLURM_STEP_ID", "0"},
          {"SLURM_STEPID", "0"},
          {"SLURM_PROCID", std::to_string(procid)},
          {"SLURM_LOCALID", std::to_string(procid)},
          {"SLURM_NODEID", "0"},
          {"SLURM_NTASKS", "2"},
          {"SLURM_NPROCS", "2"},
          {"SLURM_STEP_NUM_TASKS", "2"},
          {"SLURM_STEP_TASKS_PER_NODE", "2"},
          {"SLURM_TASKS_PER_NODE", "2"},
          {"SLURM_STEP_NODELIST", "node[07-08]"},
          {"SLURM_JOB_NODELIST", "node[07-08]"},
          {"SLURM_NODELIST", "node[07-08]"}};
}

// What mpirun -np 2 sets on one host (taken from Open MPI 4.1), for rank `rank`.
Environment open_mpi(int rank = 1) {
  return {{"OMPI_COMM_WORLD_RANK", std::to_string(rank)},
          {"OMPI_COMM_WORLD_SIZE", "2"},
          {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(rank)},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
          {"OMPI_COMM_WORLD_NODE_RANK", std::to_string(rank)},
          {"OMPI_MCA_ess_base_jobid", "421068801"},
          {"OMPI_MCA_orte_num_nodes", "1"},
          {"PMIX_NAMESPACE", "421068801"},
          {"PMIX_ID", "421068801." + std::to_string(rank)},
          {"PMIX_RANK", std::to_string(rank)}};
}

// What chorus run / torchrun set.
Environment chorus_run(int rank = 1) {
  return {{"RANK", std::to_string(rank)},   {"WORLD_SIZE", "4"},
          {"LOCAL_RANK", std::to_string(rank)}, {"LOCAL_WORLD_SIZE", "4"},
          {"MASTER_ADDR", "10.0.0.1"},      {"MASTER_PORT", "29500"}};
}

Environment merged(Environment a, const Environment& b) {
  for (const auto& [k, v] : b) a[k] = v;
  return a;
}

// Expects resolve_cluster_env(env, ...) to throw UsageError whose message contains every part.
void expect_usage_error(const Environment& env, std::initializer_list<const char*> parts,
                        int rank = -1, int world_size = -1) {
  try {
    ClusterEnv c = resolve_cluster_env(env, rank, world_size);
    ADD_FAILURE() << "accepted: " << c.describe();
  } catch (const UsageError& e) {
    for (const char* part : parts) EXPECT_THAT(e.what(), HasSubstr(part));
  }
}

void expect_hostlist_error(const std::string& list, const char* part) {
  try {
    auto hosts = expand_hostlist(list, "SLURM_JOB_NODELIST");
    ADD_FAILURE() << "'" << list << "' gave " << hosts.size() << " hosts";
  } catch (const UsageError& e) {
    EXPECT_THAT(e.what(), HasSubstr("SLURM_JOB_NODELIST='" + list + "'"));
    EXPECT_THAT(e.what(), HasSubstr(part)) << "for '" << list << "'";
  }
}

TEST(ClusterEnvTest, ChorusRunVariables) {
  const ClusterEnv c = resolve_cluster_env(chorus_run(3));
  EXPECT_EQ(c.source, "env");
  EXPECT_EQ(c.rank, 3);
  EXPECT_EQ(c.world_size, 4);
  EXPECT_EQ(c.local_rank, 3);
  EXPECT_EQ(c.local_world_size, 4);
  EXPECT_EQ(c.master_addr, "10.0.0.1");
  EXPECT_EQ(c.master_port, 29500);
  EXPECT_EQ(c.job_key, "");
  EXPECT_EQ(c.describe(),
            "rank 3 of 4 (environment: RANK, WORLD_SIZE), master 10.0.0.1:29500 (MASTER_ADDR; port "
            "MASTER_PORT)");
  // LOCAL_RANK and LOCAL_WORLD_SIZE are optional.
  Environment env = chorus_run(0);
  env.erase("LOCAL_RANK");
  env.erase("LOCAL_WORLD_SIZE");
  const ClusterEnv d = resolve_cluster_env(env);
  EXPECT_EQ(d.local_rank, -1);
  EXPECT_EQ(d.local_world_size, -1);
}

// Ray Train starts each rank itself with torchrun's variables and its own NODE_RANK (and no
// launcher): the "env" source. A Ray worker's environment, node 1 of 2 with 2 ranks each.
TEST(ClusterEnvTest, RayTrainWorkerVariables) {
  const Environment env = {{"RANK", "3"},        {"LOCAL_RANK", "1"},        {"WORLD_SIZE", "4"},
                           {"LOCAL_WORLD_SIZE", "2"}, {"NODE_RANK", "1"},  {"MASTER_ADDR", "10.0.0.5"},
                           {"MASTER_PORT", "41233"},  {"RAY_NODE_IP", "10.0.0.6"}};
  const ClusterEnv c = resolve_cluster_env(env);
  EXPECT_EQ(c.source, "env");
  EXPECT_EQ(c.rank, 3);
  EXPECT_EQ(c.world_size, 4);
  EXPECT_EQ(c.local_rank, 1);
  EXPECT_EQ(c.local_world_size, 2);
  EXPECT_EQ(c.master_addr, "10.0.0.5");
  EXPECT_EQ(c.master_port, 41233);
}

// A Kubeflow PyTorchJob pod, training operator v1 (pkg/controller.v1/pytorch/envvar.go): RANK is
// the pod's index, WORLD_SIZE pods x nprocPerNode, PET_NPROC_PER_NODE/PET_NODE_RANK/PET_NNODES.
// With nprocPerNode 1 the program may run alone in the pod; with 2 only under a launcher.
TEST(ClusterEnvTest, KubeflowPyTorchJobV1Pods) {
  Environment worker = {{"MASTER_ADDR", "job-master-0"}, {"MASTER_PORT", "23456"}, {"WORLD_SIZE", "2"},
                        {"RANK", "1"},  {"PET_NPROC_PER_NODE", "1"},  {"PET_NODE_RANK", "1"},
                        {"PET_NNODES", "2"}, {"PYTHONUNBUFFERED", "0"}};
  const ClusterEnv one = resolve_cluster_env(worker);
  EXPECT_EQ(one.source, "env");
  EXPECT_EQ(one.rank, 1);
  EXPECT_EQ(one.world_size, 2);
  EXPECT_EQ(one.master_addr, "job-master-0");
  EXPECT_EQ(one.master_port, 23456);
  worker["WORLD_SIZE"] = "4";
  worker["PET_NPROC_PER_NODE"] = "2";
  expect_usage_error(worker, {"RANK=1 and WORLD_SIZE=4", "PET_NPROC_PER_NODE=2", "PyTorchJob", "chorus run"});
  worker["PET_NPROC_PER_NODE"] = "auto";
  expect_usage_error(worker, {"PET_NPROC_PER_NODE=auto", "chorus run"});
  // Under chorus run in that pod, the worker's own variables (LOCAL_RANK among them) are right.
  Environment under_launcher = worker;
  under_launcher["RANK"] = "3";
  under_launcher["LOCAL_RANK"] = "1";
  under_launcher["LOCAL_WORLD_SIZE"] = "2";
  const ClusterEnv two = resolve_cluster_env(under_launcher);
  EXPECT_EQ(two.rank, 3);
  EXPECT_EQ(two.world_size, 4);
  EXPECT_EQ(two.local_rank, 1);
}

TEST(ClusterEnvTest, ChorusRunNamesEachMissingVariable) {
  expect_usage_error({}, {"needs WORLD_SIZE", "chorus run, srun or mpirun"});
  Environment env = {{"WORLD_SIZE", "2"}};
  expect_usage_error(env, {"needs RANK"});
  env["RANK"] = "1";
  expect_usage_error(env, {"env:// rendezvous needs MASTER_ADDR; set it or use chorus run"});
  env["MASTER_ADDR"] = "127.0.0.1";
  expect_usage_error(env, {"env:// rendezvous needs MASTER_PORT; set it or use chorus run"});
  env["MASTER_PORT"] = "http";
  expect_usage_error(env, {"MASTER_PORT must be a port", "'http'"});
  env["MASTER_PORT"] = "65536";
  expect_usage_error(env, {"MASTER_PORT must be a port in [1, 65535]", "'65536'"});
  env["MASTER_PORT"] = "29500";
  env["RANK"] = "2";
  expect_usage_error(env, {"rank 2 (from RANK)", "[0, 2)", "(from WORLD_SIZE)"});
  env["RANK"] = "-1";
  expect_usage_error(env, {"RANK must be an integer >= 0", "'-1'"});
  env["RANK"] = "1x";
  expect_usage_error(env, {"RANK must be an integer >= 0", "'1x'"});
  env["RANK"] = "1";
  env["WORLD_SIZE"] = "0";
  expect_usage_error(env, {"WORLD_SIZE must be an integer >= 1", "'0'"});
  env["WORLD_SIZE"] = "2";
  env["LOCAL_RANK"] = "one";
  expect_usage_error(env, {"LOCAL_RANK must be an integer", "'one'"});
  env["LOCAL_RANK"] = "2";
  env["LOCAL_WORLD_SIZE"] = "2";
  expect_usage_error(env, {"local rank 2", "[0, 2)", "LOCAL_RANK, LOCAL_WORLD_SIZE"});
  // An empty value counts as unset, as the shell's RANK= does.
  env = chorus_run();
  env["MASTER_ADDR"] = "";
  expect_usage_error(env, {"needs MASTER_ADDR"});
}

TEST(ClusterEnvTest, ArgumentsWinOverTheEnvironment) {
  // No variable is needed for what the caller gives.
  const ClusterEnv c =
      resolve_cluster_env({{"MASTER_ADDR", "h"}, {"MASTER_PORT", "1234"}}, 0, 1);
  EXPECT_EQ(c.rank, 0);
  EXPECT_EQ(c.world_size, 1);
  EXPECT_EQ(c.rank_from, "the rank argument");
  EXPECT_EQ(c.world_size_from, "the world_size argument");
  const ClusterEnv d = resolve_cluster_env(chorus_run(3), 1, 2);
  EXPECT_EQ(d.rank, 1);
  EXPECT_EQ(d.world_size, 2);
  // Under srun, the arguments replace SLURM_PROCID and the task count; the master stays Slurm's.
  const ClusterEnv s = resolve_cluster_env(slurm_step(1), 0, 1);
  EXPECT_EQ(s.source, "slurm");
  EXPECT_EQ(s.rank, 0);
  EXPECT_EQ(s.world_size, 1);
  EXPECT_EQ(s.master_addr, "node07");
  expect_usage_error(chorus_run(), {"rank 5 (from the rank argument)", "[0, 4)"}, 5);
}

TEST(ClusterEnvTest, Slurm) {
  const ClusterEnv c = resolve_cluster_env(slurm_step(1));
  EXPECT_EQ(c.source, "slurm");
  EXPECT_EQ(c.rank, 1);
  EXPECT_EQ(c.world_size, 2);
  EXPECT_EQ(c.local_rank, 1);
  EXPECT_EQ(c.local_world_size, 2);
  EXPECT_EQ(c.master_addr, "node07");
  EXPECT_EQ(c.master_addr_from, "first host of SLURM_STEP_NODELIST");
  EXPECT_EQ(c.job_key, "slurm:4242.0");
  EXPECT_EQ(c.master_port, derived_master_port("slurm:4242.0"));
  EXPECT_EQ(c.master_port_from, "derived from SLURM_JOB_ID=4242 and SLURM_STEP_ID=0");
  // Every rank of the step agrees on the master.
  const ClusterEnv r0 = resolve_cluster_env(slurm_step(0));
  EXPECT_EQ(r0.master_addr, c.master_addr);
  EXPECT_EQ(r0.master_port, c.master_port);
  EXPECT_EQ(r0.job_key, c.job_key);
  // Another step of the same job gets its own port (unless the hash collides; not for these).
  Environment step1 = slurm_step(0);
  step1["SLURM_STEP_ID"] = step1["SLURM_STEPID"] = "1";
  EXPECT_NE(resolve_cluster_env(step1).master_port, c.master_port);
}

TEST(ClusterEnvTest, SlurmFallbacksOfOlderOrPartialEnvironments) {
  // Only the variables every Slurm version sets: SLURM_NTASKS, SLURM_JOB_NODELIST, SLURM_JOBID,
  // SLURM_STEPID, SLURM_TASKS_PER_NODE with repeats.
  Environment env = {{"SLURM_PROCID", "5"},       {"SLURM_STEPID", "3"},
                     {"SLURM_JOBID", "77"},       {"SLURM_NTASKS", "6"},
                     {"SLURM_LOCALID", "1"},      {"SLURM_NODEID", "2"},
                     {"SLURM_TASKS_PER_NODE", "2(x2),3"},
                     {"SLURM_JOB_NODELIST", "gpu-a[009-011],cpu1"}};
  ClusterEnv c = resolve_cluster_env(env);
  EXPECT_EQ(c.rank, 5);
  EXPECT_EQ(c.world_size, 6);
  EXPECT_EQ(c.world_size_from, "SLURM_NTASKS");
  EXPECT_EQ(c.local_world_size, 3);  // node 2's entry of 2,2,3
  EXPECT_EQ(c.master_addr, "gpu-a009");
  EXPECT_EQ(c.master_addr_from, "first host of SLURM_JOB_NODELIST");
  EXPECT_EQ(c.job_key, "slurm:77.3");
  // Without SLURM_NODEID, uneven counts leave the local world size unknown; even ones do not.
  env.erase("SLURM_NODEID");
  EXPECT_EQ(resolve_cluster_env(env).local_world_size, -1);
  env["SLURM_TASKS_PER_NODE"] = "3(x2)";
  EXPECT_EQ(resolve_cluster_env(env).local_world_size, 3);
  // SLURM_NTASKS_PER_NODE (sbatch --ntasks-per-node) is the last resort.
  env.erase("SLURM_TASKS_PER_NODE");
  env["SLURM_NTASKS_PER_NODE"] = "4";
  EXPECT_EQ(resolve_cluster_env(env).local_world_size, 4);
  // SLURM_NODELIST when nothing newer is there.
  env.erase("SLURM_JOB_NODELIST");
  env["SLURM_NODELIST"] = "n[3-4]";
  EXPECT_EQ(resolve_cluster_env(env).master_addr, "n3");
  // The step's own values win over the job's: srun -n 2 inside sbatch -n 6.
  env["SLURM_STEP_NUM_TASKS"] = "2";
  env["SLURM_STEP_NODELIST"] = "n4";
  env["SLURM_PROCID"] = "1";
  c = resolve_cluster_env(env);
  EXPECT_EQ(c.world_size, 2);
  EXPECT_EQ(c.master_addr, "n4");
}

TEST(ClusterEnvTest, SlurmErrorsNameTheVariables) {
  Environment env = slurm_step();
  env.erase("SLURM_STEP_NUM_TASKS");
  env.erase("SLURM_NTASKS");
  env.erase("SLURM_NPROCS");
  expect_usage_error(env, {"Slurm (srun)", "SLURM_STEP_NUM_TASKS, SLURM_NTASKS or SLURM_NPROCS"});
  env = slurm_step();
  env["SLURM_PROCID"] = "x";
  expect_usage_error(env, {"SLURM_PROCID must be an integer >= 0", "'x'"});
  env["SLURM_PROCID"] = "2";
  expect_usage_error(env, {"rank 2 (from SLURM_PROCID)", "[0, 2)", "SLURM_STEP_NUM_TASKS"});
  env = slurm_step();
  for (const char* v : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
    env.erase(v);
  }
  expect_usage_error(env, {"SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or SLURM_NODELIST",
                           "set MASTER_ADDR"});
  env = slurm_step();
  env.erase("SLURM_JOB_ID");
  env.erase("SLURM_JOBID");
  expect_usage_error(env, {"neither SLURM_JOB_ID nor SLURM_JOBID", "set MASTER_PORT"});
  env = slurm_step();
  env["SLURM_STEP_NODELIST"] = "node[1-";
  expect_usage_error(env, {"SLURM_STEP_NODELIST='node[1-'", "not a Slurm host list"});
  env = slurm_step();
  env["SLURM_STEP_TASKS_PER_NODE"] = "2(3)";
  expect_usage_error(env, {"SLURM_STEP_TASKS_PER_NODE='2(3)'", "2(x3),1"});
  env = slurm_step();
  env["SLURM_LOCALID"] = "2";
  expect_usage_error(env, {"local rank 2", "[0, 2)", "SLURM_LOCALID"});
}

TEST(ClusterEnvTest, AnSbatchScriptIsNoRank) {
  // The batch script itself has SLURM_PROCID=0 and the job's SLURM_NTASKS but no step id: taking
  // it for rank 0 of 2 would wait for a rank 1 that never comes.
  Environment env = slurm_step(0);
  env.erase("SLURM_STEP_ID");
  env.erase("SLURM_STEPID");
  expect_usage_error(env, {"needs WORLD_SIZE", "Slurm job 4242", "SLURM_STEP_ID is unset",
                           "start the ranks with srun"});
}

TEST(ClusterEnvTest, OpenMpiOnOneHost) {
  const ClusterEnv c = resolve_cluster_env(open_mpi(1));
  EXPECT_EQ(c.source, "openmpi");
  EXPECT_EQ(c.rank, 1);
  EXPECT_EQ(c.world_size, 2);
  EXPECT_EQ(c.local_rank, 1);
  EXPECT_EQ(c.local_world_size, 2);
  EXPECT_EQ(c.master_addr, "127.0.0.1");
  EXPECT_EQ(c.job_key, "openmpi:421068801");
  EXPECT_EQ(c.master_port, derived_master_port("openmpi:421068801"));
  EXPECT_EQ(c.master_port_from, "derived from OMPI_MCA_ess_base_jobid=421068801");
  // Without orte_num_nodes (Open MPI 5), LOCAL_SIZE == SIZE says one host.
  Environment env = open_mpi(0);
  env.erase("OMPI_MCA_orte_num_nodes");
  EXPECT_EQ(resolve_cluster_env(env).master_addr, "127.0.0.1");
  // PMIx's namespace, else PMIX_ID without its rank, when the ORTE job id is missing.
  env.erase("OMPI_MCA_ess_base_jobid");
  EXPECT_EQ(resolve_cluster_env(env).job_key, "openmpi:421068801");
  env["PMIX_NAMESPACE"] = "prterun-vm-123@1";
  EXPECT_EQ(resolve_cluster_env(env).job_key, "openmpi:prterun-vm-123@1");
  env.erase("PMIX_NAMESPACE");
  env["PMIX_ID"] = "prterun-vm-123@1.0";
  const ClusterEnv p = resolve_cluster_env(env);
  EXPECT_EQ(p.job_key, "openmpi:prterun-vm-123@1");
  EXPECT_EQ(p.master_port_from, "derived from PMIX_ID=prterun-vm-123@1.0");
}

TEST(ClusterEnvTest, OpenMpiErrorsNameTheVariables) {
  Environment env = open_mpi();
  env.erase("OMPI_COMM_WORLD_SIZE");
  expect_usage_error(env, {"Open MPI (mpirun)", "OMPI_COMM_WORLD_SIZE is not set"});
  env = open_mpi();
  env["OMPI_COMM_WORLD_RANK"] = "";
  expect_usage_error(env, {"OMPI_COMM_WORLD_RANK is not set"});
  env = open_mpi();
  env["OMPI_COMM_WORLD_RANK"] = "3";
  expect_usage_error(env, {"rank 3 (from OMPI_COMM_WORLD_RANK)", "[0, 2)"});
  // Several hosts: Open MPI does not say where rank 0 is.
  env = open_mpi();
  env["OMPI_COMM_WORLD_SIZE"] = "4";
  env["OMPI_MCA_orte_num_nodes"] = "2";
  expect_usage_error(env, {"OMPI_COMM_WORLD_LOCAL_SIZE=2 < OMPI_COMM_WORLD_SIZE=4",
                           "set MASTER_ADDR", "mpirun -x MASTER_ADDR="});
  env["MASTER_ADDR"] = "node01";
  EXPECT_EQ(resolve_cluster_env(env).master_addr, "node01");
  env = open_mpi();
  env.erase("OMPI_MCA_orte_num_nodes");
  env.erase("OMPI_COMM_WORLD_LOCAL_SIZE");
  expect_usage_error(env, {"neither OMPI_COMM_WORLD_LOCAL_SIZE nor OMPI_MCA_orte_num_nodes",
                           "set MASTER_ADDR"});
  env = open_mpi();
  for (const char* v : {"OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "PMIX_ID"}) env.erase(v);
  expect_usage_error(env, {"OMPI_MCA_ess_base_jobid, PMIX_NAMESPACE or PMIX_ID", "MASTER_PORT"});
  env["MASTER_PORT"] = "29500";
  const ClusterEnv c = resolve_cluster_env(env);
  EXPECT_EQ(c.master_port, 29500);
  EXPECT_EQ(c.job_key, "");
}

// chorus run: MASTER_PORT is PyTorch's env:// store; chorus's own store is CHORUS_STORE_ADDR/PORT.
TEST(ClusterEnvTest, ChorusStoreAddressWinsOverMaster) {
  const Environment env = {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"},
                           {"CHORUS_STORE_ADDR", "10.0.0.2"}, {"CHORUS_STORE_PORT", "41000"}};
  const ClusterEnv c = resolve_cluster_env(env);
  EXPECT_EQ(c.master_addr, "10.0.0.2");
  EXPECT_EQ(c.master_port, 41000);
  EXPECT_EQ(c.master_addr_from, "CHORUS_STORE_ADDR");
  EXPECT_EQ(c.master_port_from, "CHORUS_STORE_PORT");
  Environment bad = env;
  bad["CHORUS_STORE_PORT"] = "nope";
  EXPECT_THROW(resolve_cluster_env(bad), UsageError);
}

TEST(ClusterEnvTest, MasterAddrAndPortAlwaysOverride) {
  const Environment master = {{"MASTER_ADDR", "head"}, {"MASTER_PORT", "29501"}};
  for (const Environment& base : {slurm_step(), open_mpi()}) {
    const ClusterEnv c = resolve_cluster_env(merged(base, master));
    EXPECT_EQ(c.master_addr, "head");
    EXPECT_EQ(c.master_port, 29501);
    EXPECT_EQ(c.master_addr_from, "MASTER_ADDR");
    EXPECT_EQ(c.master_port_from, "MASTER_PORT");
    EXPECT_NE(c.job_key, "");  // still the job's key
  }
  // Each one alone.
  ClusterEnv c = resolve_cluster_env(merged(slurm_step(), {{"MASTER_PORT", "29502"}}));
  EXPECT_EQ(c.master_addr, "node07");
  EXPECT_EQ(c.master_port, 29502);
  c = resolve_cluster_env(merged(slurm_step(), {{"MASTER_ADDR", "10.1.1.1"}}));
  EXPECT_EQ(c.master_addr, "10.1.1.1");
  EXPECT_EQ(c.master_port, derived_master_port("slurm:4242.0"));
  expect_usage_error(merged(open_mpi(), {{"MASTER_PORT", "0"}}), {"MASTER_PORT must be a port"});
}

TEST(ClusterEnvTest, Precedence) {
  // chorus run (or torchrun) inside an srun step, or inside mpirun: its RANK etc. win.
  const ClusterEnv a = resolve_cluster_env(merged(slurm_step(), chorus_run(2)));
  EXPECT_EQ(a.source, "env");
  EXPECT_EQ(a.rank, 2);
  EXPECT_EQ(a.world_size, 4);
  EXPECT_EQ(resolve_cluster_env(merged(open_mpi(), chorus_run(2))).source, "env");
  // mpirun inside a Slurm allocation starts its daemons with srun: its ranks carry the daemons'
  // SLURM_PROCID and task count, and Open MPI's numbers are the right ones.
  Environment daemons = slurm_step(0);
  daemons["SLURM_STEP_NUM_TASKS"] = daemons["SLURM_NTASKS"] = "1";
  const ClusterEnv b = resolve_cluster_env(merged(daemons, open_mpi(1)));
  EXPECT_EQ(b.source, "openmpi");
  EXPECT_EQ(b.rank, 1);
  EXPECT_EQ(b.world_size, 2);
  // A half-set RANK / WORLD_SIZE is an error naming the other, not a silent mix with srun's.
  expect_usage_error(merged(slurm_step(), {{"WORLD_SIZE", "2"}}),
                     {"needs RANK", "WORLD_SIZE is set", "unset WORLD_SIZE", "srun"});
  expect_usage_error(merged(open_mpi(), {{"RANK", "0"}}),
                     {"needs WORLD_SIZE", "RANK is set", "mpirun"});
}

TEST(ClusterEnvTest, DerivedPortIsStableAndInRange) {
  // FNV-1a 64 of the job key: fixed values, so that a user can compute the port outside chorus.
  EXPECT_EQ(fnv1a64(""), 14695981039346656037ull);
  EXPECT_EQ(fnv1a64("a"), 12638187200555641996ull);
  EXPECT_EQ(derived_master_port("slurm:4242.0"),
            20000 + static_cast<int>(fnv1a64("slurm:4242.0") % 12768));
  std::set<int> ports;
  for (int job = 0; job < 2000; ++job) {
    const int p = derived_master_port("slurm:" + std::to_string(job) + ".0");
    EXPECT_GE(p, 20000);
    EXPECT_LT(p, 32768);
    ports.insert(p);
  }
  EXPECT_GT(ports.size(), 1800u);  // spread out: about 1850 distinct expected for 2000 in 12768
}

TEST(ClusterEnvTest, Hostlists) {
  EXPECT_THAT(expand_hostlist("localhost", "V"), ElementsAre("localhost"));
  EXPECT_THAT(expand_hostlist("node[01-03,07],other", "V"),
              ElementsAre("node01", "node02", "node03", "node07", "other"));
  EXPECT_THAT(expand_hostlist("n[8-10]", "V"), ElementsAre("n8", "n9", "n10"));
  EXPECT_THAT(expand_hostlist("n[098-100]", "V"), ElementsAre("n098", "n099", "n100"));
  EXPECT_THAT(expand_hostlist("gpu-[1,3]-ib", "V"), ElementsAre("gpu-1-ib", "gpu-3-ib"));
  EXPECT_THAT(expand_hostlist("r[1-2]n[0-1]", "V"), ElementsAre("r1n0", "r1n1", "r2n0", "r2n1"));
  EXPECT_THAT(expand_hostlist("a[5],b[2-3],c", "V"), ElementsAre("a5", "b2", "b3", "c"));
  EXPECT_THAT(expand_hostlist("node-10.cluster.local", "V"), ElementsAre("node-10.cluster.local"));
  EXPECT_EQ(expand_hostlist("big[0000-9999]", "V").size(), 10000u);
  expect_hostlist_error("", "an empty name");
  expect_hostlist_error("a,,b", "an empty name");
  expect_hostlist_error("a,", "an empty name");
  expect_hostlist_error("node[1-3", "'[' without ']'");
  expect_hostlist_error("node1-3]", "']' without '['");
  expect_hostlist_error("node[1[2]]", "nested '['");
  expect_hostlist_error("node[]", "not a number or a range");
  expect_hostlist_error("node[a-b]", "not a number or a range");
  expect_hostlist_error("node[1-]", "not a number or a range");
  expect_hostlist_error("node[1,,2]", "not a number or a range");
  expect_hostlist_error("node[5-3]", "range 5-3 ends below its start");
  expect_hostlist_error("n[0-1048576]", "more than 1048576 hosts");
  expect_hostlist_error("a[0-1023]b[0-1024]", "more than 1048576 hosts");
}

TEST(ClusterEnvTest, HostlistsMakeOnlyTheHostsAskedFor) {
  EXPECT_THAT(expand_hostlist("r[1-2]n[0-1],x", "V", 3), ElementsAre("r1n0", "r1n1", "r2n0"));
  EXPECT_THAT(expand_hostlist("a[5],b[2-3],c", "V", 1), ElementsAre("a5"));
  EXPECT_THAT(expand_hostlist("n[7-9]", "V", 10), ElementsAre("n7", "n8", "n9"));
  // A million hosts in 13 bytes: env:// takes the first without making the others.
  const auto started = std::chrono::steady_clock::now();
  for (int i = 0; i < 1000; ++i) ASSERT_THAT(expand_hostlist("n[0-1048575]", "V", 1), ElementsAre("n0"));
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(2)) << "1000 first hosts of 2^20";
  EXPECT_EQ(expand_hostlist("n[0-1048575]", "V").size(), size_t{1} << 20);
  // The rest of the list is checked all the same.
  EXPECT_THROW(expand_hostlist("a,b[3-1]", "V", 1), UsageError);
  EXPECT_THROW(expand_hostlist("a,n[0-1048576]", "V", 1), UsageError);
  EXPECT_THROW(expand_hostlist("a,", "V", 1), UsageError);
  Environment env = {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_ID", "7"},
                     {"SLURM_STEP_ID", "0"}, {"SLURM_JOB_NODELIST", "n[0-1048575]"}};
  EXPECT_EQ(resolve_cluster_env(env).master_addr, "n0");
}

TEST(ClusterEnvTest, TasksPerNode) {
  EXPECT_THAT(expand_tasks_per_node("2", "V"), ElementsAre(2));
  EXPECT_THAT(expand_tasks_per_node("2(x3),1", "V"), ElementsAre(2, 2, 2, 1));
  EXPECT_THAT(expand_tasks_per_node("1,4(x2)", "V"), ElementsAre(1, 4, 4));
  for (const char* bad : {"", "x", "2(x)", "2(3)", "2(x0)", "2(x3", "(x3)", "2,,1", "-1"}) {
    EXPECT_THROW(expand_tasks_per_node(bad, "SLURM_TASKS_PER_NODE"), UsageError) << bad;
  }
}

}  // namespace
}  // namespace chorus
