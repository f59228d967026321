// Fuzz target: what env:// makes of a launcher's environment (src/comm/cluster_env.h): Slurm host
// lists and tasks-per-node lists, Open MPI's and Slurm's variables, RANK / WORLD_SIZE /
// MASTER_ADDR / MASTER_PORT. The input is "NAME=VALUE" lines; the value of the first line is also
// parsed as a host list and as a tasks-per-node list on its own. Bad values must raise UsageError.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "chorus/comm/error.h"
#include "comm/cluster_env.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  chorus::Environment env;
  std::string first_value;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(start, end - start);
    start = end + 1;
    const size_t eq = line.find('=');
    if (eq == std::string::npos) continue;
    if (env.empty()) first_value = line.substr(eq + 1);
    env[line.substr(0, eq)] = line.substr(eq + 1);
  }
  try {
    // The first hosts only (as env:// takes them): the whole list is checked all the same.
    const auto hosts = chorus::expand_hostlist(first_value, "SLURM_NODELIST", 64);
    if (hosts.empty() || hosts.size() > 64) std::abort();
  } catch (const chorus::UsageError&) {
  }
  try {
    const auto tasks = chorus::expand_tasks_per_node(first_value, "SLURM_TASKS_PER_NODE");
    if (tasks.empty()) std::abort();
  } catch (const chorus::UsageError&) {
  }
  try {
    const chorus::ClusterEnv c = chorus::resolve_cluster_env(env);
    if (c.rank < 0 || c.rank >= c.world_size || c.master_addr.empty() || c.master_port < 1 ||
        c.master_port > 65535) {
      std::abort();
    }
    (void)c.describe();
  } catch (const chorus::UsageError&) {
  }
  return 0;
}
