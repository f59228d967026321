// resolve_cluster_env(): the environment of chorus run / torchrun, mpirun or srun becomes a rank, a
// world size and the store's address. Pure: it reads only the map it is given.
#include "cluster_env.h"

#include <algorithm>
#include <charconv>
#include <functional>
#include <initializer_list>
#include <utility>

#include "chorus/comm/error.h"
#include "chorus/comm/hash.h"

namespace chorus {
namespace {

constexpr int kMaxInt = 1 << 30;
constexpr size_t kMaxHosts = size_t{1} << 20;

// The value of `name`, or nullptr when it is unset or empty.
const std::string* lookup(const Environment& env, const std::string& name) {
  auto it = env.find(name);
  return it != env.end() && !it->second.empty() ? &it->second : nullptr;
}

bool has(const Environment& env, const std::string& name) { return lookup(env, name) != nullptr; }

// The first of `names` that is set: {name, value}, or {"", ""} when none is.
std::pair<std::string, std::string> first_set(const Environment& env,
                                              std::initializer_list<const char*> names) {
  for (const char* name : names) {
    if (const std::string* v = lookup(env, name)) return {name, *v};
  }
  return {"", ""};
}

// "A, B or C".
std::string join_or(std::initializer_list<const char*> names) {
  std::string out;
  size_t i = 0;
  for (const char* name : names) {
    if (i > 0) out += (i + 1 == names.size()) ? " or " : ", ";
    out += name;
    ++i;
  }
  return out;
}

int int_var(const std::string& context, const std::string& name, const std::string& text, int lo) {
  int v = 0;
  if (!parse_int(text, lo, kMaxInt, &v)) {
    throw UsageError(context + ": " + name + " must be an integer >= " + std::to_string(lo) +
                     ", got '" + text + "'");
  }
  return v;
}

// An optional integer variable: -1 when unset.
int optional_int(const Environment& env, const std::string& context, const char* name, int lo) {
  const std::string* v = lookup(env, name);
  return v != nullptr ? int_var(context, name, *v, lo) : -1;
}

int port_var(const std::string& context, const std::string& name, const std::string& text) {
  int port = 0;
  if (!parse_int(text, 1, 65535, &port)) {
    throw UsageError(context + ": " + name + " must be a port in [1, 65535], got '" + text + "'");
  }
  return port;
}

// Sets rank / world_size from the caller's arguments, else from the first set variable of each
// list; a missing one is a UsageError built by `missing(what, names)`.
template <typename Missing>
void rank_and_world(const Environment& env, const std::string& context, int rank, int world_size,
                    std::initializer_list<const char*> rank_vars,
                    std::initializer_list<const char*> world_vars, const Missing& missing,
                    ClusterEnv* c) {
  if (world_size >= 0) {
    c->world_size = world_size;
    c->world_size_from = "the world_size argument";
  } else {
    auto [name, text] = first_set(env, world_vars);
    if (name.empty()) missing("world_size", world_vars);
    c->world_size = int_var(context, name, text, 1);
    c->world_size_from = name;
  }
  if (rank >= 0) {
    c->rank = rank;
    c->rank_from = "the rank argument";
  } else {
    auto [name, text] = first_set(env, rank_vars);
    if (name.empty()) missing("rank", rank_vars);
    c->rank = int_var(context, name, text, 0);
    c->rank_from = name;
  }
  // Checked before the master's variables: a rank outside the world is the likelier mistake.
  if (c->world_size < 1) {
    throw UsageError(context + ": world_size must be >= 1, got " + std::to_string(c->world_size) +
                     " (from " + c->world_size_from + ")");
  }
  if (c->rank >= c->world_size) {
    throw UsageError(context + ": rank " + std::to_string(c->rank) + " (from " + c->rank_from +
                     ") is outside [0, " + std::to_string(c->world_size) + ") for world_size " +
                     std::to_string(c->world_size) + " (from " + c->world_size_from + ")");
  }
}

// MASTER_ADDR and MASTER_PORT win over anything a source derives, and CHORUS_STORE_ADDR/PORT over
// those: `chorus run` points MASTER_PORT at a port of PyTorch's env:// store and gives chorus's own
// store there.
void master_overrides(const Environment& env, const std::string& context, ClusterEnv* c) {
  for (const char* name : {"MASTER_ADDR", "CHORUS_STORE_ADDR"}) {
    if (const std::string* addr = lookup(env, name)) {
      c->master_addr = *addr;
      c->master_addr_from = name;
    }
  }
  for (const char* name : {"MASTER_PORT", "CHORUS_STORE_PORT"}) {
    if (const std::string* port = lookup(env, name)) {
      c->master_port = port_var(context, name, *port);
      c->master_port_from = name;
    }
  }
}

// A hint for the "needs WORLD_SIZE / RANK" messages, when a launcher's variables are present but
// are not used.
std::string unused_launcher_hint(const Environment& env) {
  if (has(env, "RANK") || has(env, "WORLD_SIZE")) {
    const char* set = has(env, "RANK") ? "RANK" : "WORLD_SIZE";
    if (has(env, "OMPI_COMM_WORLD_RANK") || has(env, "SLURM_PROCID")) {
      return std::string(" (") + set +
             " is set, so RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are read as chorus run "
             "sets them; unset " + set + " to take the ranks from " +
             (has(env, "OMPI_COMM_WORLD_RANK") ? "mpirun" : "srun") + ")";
    }
    return "";
  }
  if (const std::string* job = lookup(env, "SLURM_JOB_ID")) {
    return " (this process is in Slurm job " + *job +
           " but in no job step: SLURM_STEP_ID is unset, as in an sbatch script itself; start the "
           "ranks with srun)";
  }
  return "";
}

ClusterEnv from_variables(const Environment& env, int rank, int world_size) {
  const std::string context = "env:// rendezvous";
  ClusterEnv c;
  c.source = "env";
  const std::string hint = unused_launcher_hint(env);
  rank_and_world(env, context, rank, world_size, {"RANK"}, {"WORLD_SIZE"},
                 [&](const std::string& what, std::initializer_list<const char*> names) {
                   throw UsageError(context + " needs " + join_or(names) + "; set it, pass " +
                                    what + " explicitly, or use chorus run, srun or mpirun" + hint);
                 },
                 &c);
  c.local_rank = optional_int(env, context, "LOCAL_RANK", 0);
  c.local_world_size = optional_int(env, context, "LOCAL_WORLD_SIZE", 1);
  // A Kubeflow PyTorchJob pod (training operator v1) gets RANK = its own index and WORLD_SIZE =
  // pods x nprocPerNode: a process's rank and world only when nprocPerNode is 1. A launcher in the
  // pod (chorus run, torchrun) sets LOCAL_RANK for its workers; a program started without one
  // would wait for ranks that never come, so say what to do instead.
  const std::string* nproc = lookup(env, "PET_NPROC_PER_NODE");
  if (rank < 0 && nproc != nullptr && *nproc != "1" && lookup(env, "LOCAL_RANK") == nullptr) {
    throw UsageError(context + ": RANK=" + std::to_string(c.rank) + " and WORLD_SIZE=" + std::to_string(c.world_size) +
                     " come with PET_NPROC_PER_NODE=" + *nproc +
                     ", as in a Kubeflow PyTorchJob with nprocPerNode " + *nproc +
                     ": there RANK is the pod's index and WORLD_SIZE counts processes, so one process per pod "
                     "cannot be that rank. Start the program under `chorus run` in each pod (it takes "
                     "PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK and the master address as its defaults), "
                     "or set nprocPerNode to 1");
  }
  master_overrides(env, context, &c);
  if (c.master_addr.empty()) {
    throw UsageError(context + " needs MASTER_ADDR; set it or use chorus run");
  }
  if (c.master_port < 0) {
    throw UsageError(context + " needs MASTER_PORT; set it or use chorus run");
  }
  return c;
}

ClusterEnv from_open_mpi(const Environment& env, int rank, int world_size) {
  const std::string context = "env:// rendezvous under Open MPI (mpirun)";
  ClusterEnv c;
  c.source = "openmpi";
  rank_and_world(env, context, rank, world_size, {"OMPI_COMM_WORLD_RANK"},
                 {"OMPI_COMM_WORLD_SIZE"},
                 [&](const std::string& what, std::initializer_list<const char*> names) {
                   throw UsageError(context + ": " + join_or(names) +
                                    " is not set; mpirun sets it, or pass " + what + " explicitly");
                 },
                 &c);
  c.local_rank = optional_int(env, context, "OMPI_COMM_WORLD_LOCAL_RANK", 0);
  c.local_world_size = optional_int(env, context, "OMPI_COMM_WORLD_LOCAL_SIZE", 1);

  auto [id_var, id] = first_set(env, {"OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "PMIX_ID"});
  if (id_var == "PMIX_ID") {  // "NAMESPACE.RANK": the namespace is the job
    const size_t dot = id.rfind('.');
    if (dot != std::string::npos && dot > 0) id.resize(dot);
  }
  if (!id_var.empty()) c.job_key = "openmpi:" + id;

  master_overrides(env, context, &c);
  if (c.master_addr.empty()) {
    // Open MPI names no host for rank 0; on a single host, loopback reaches it.
    const int size = optional_int(env, context, "OMPI_COMM_WORLD_SIZE", 1);
    const int nodes = optional_int(env, context, "OMPI_MCA_orte_num_nodes", 1);
    if (nodes == 1) {
      c.master_addr = "127.0.0.1";
      c.master_addr_from = "127.0.0.1: one host (OMPI_MCA_orte_num_nodes=1)";
    } else if (c.local_world_size > 0 && size > 0 && c.local_world_size == size) {
      c.master_addr = "127.0.0.1";
      c.master_addr_from =
          "127.0.0.1: every rank on this host (OMPI_COMM_WORLD_LOCAL_SIZE == OMPI_COMM_WORLD_SIZE)";
    } else {
      const std::string layout =
          c.local_world_size > 0 && size > 0
              ? "the job spans several hosts (OMPI_COMM_WORLD_LOCAL_SIZE=" +
                    std::to_string(c.local_world_size) +
                    " < OMPI_COMM_WORLD_SIZE=" + std::to_string(size) + ")"
              : "neither OMPI_COMM_WORLD_LOCAL_SIZE nor OMPI_MCA_orte_num_nodes says the job is on "
                "one host";
      throw UsageError(context + ": " + layout +
                       " and Open MPI does not say which host runs rank 0; set MASTER_ADDR to "
                       "that host, e.g. mpirun -x MASTER_ADDR=<host of rank 0> ...");
    }
  }
  if (c.master_port < 0) {
    if (id_var.empty()) {
      throw UsageError(context +
                       ": none of OMPI_MCA_ess_base_jobid, PMIX_NAMESPACE or PMIX_ID is set to "
                       "derive the store port from; set MASTER_PORT, e.g. mpirun -x "
                       "MASTER_PORT=29500 ...");
    }
    c.master_port = derived_master_port(c.job_key);
    c.master_port_from = "derived from " + id_var + "=" + *lookup(env, id_var);
  }
  return c;
}

ClusterEnv from_slurm(const Environment& env, int rank, int world_size) {
  const std::string context = "env:// rendezvous under Slurm (srun)";
  ClusterEnv c;
  c.source = "slurm";
  rank_and_world(env, context, rank, world_size, {"SLURM_PROCID"},
                 {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"},
                 [&](const std::string& what, std::initializer_list<const char*> names) {
                   throw UsageError(context + ": none of " + join_or(names) +
                                    " is set; srun sets them, or pass " + what + " explicitly");
                 },
                 &c);
  c.local_rank = optional_int(env, context, "SLURM_LOCALID", 0);
  auto [tpn_var, tpn] = first_set(env, {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"});
  if (!tpn_var.empty()) {
    const std::vector<int> per_node = expand_tasks_per_node(tpn, tpn_var);
    const int node = optional_int(env, context, "SLURM_NODEID", 0);
    bool uniform = true;
    for (int n : per_node) uniform = uniform && n == per_node[0];
    if (node >= 0 && static_cast<size_t>(node) < per_node.size()) {
      c.local_world_size = per_node[static_cast<size_t>(node)];
    } else if (uniform) {
      c.local_world_size = per_node[0];
    }
  }
  if (c.local_world_size < 0) {
    c.local_world_size = optional_int(env, context, "SLURM_NTASKS_PER_NODE", 1);
  }

  auto [job_var, job] = first_set(env, {"SLURM_JOB_ID", "SLURM_JOBID"});
  auto [step_var, step] = first_set(env, {"SLURM_STEP_ID", "SLURM_STEPID"});
  if (!job_var.empty()) c.job_key = "slurm:" + job + "." + step;

  master_overrides(env, context, &c);
  if (c.master_addr.empty()) {
    auto [list_var, list] =
        first_set(env, {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"});
    if (list_var.empty()) {
      throw UsageError(context +
                       ": none of SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or SLURM_NODELIST is set "
                       "to take the first host from; set MASTER_ADDR to the host of rank 0");
    }
    c.master_addr = expand_hostlist(list, list_var, 1).front();
    c.master_addr_from = "first host of " + list_var;
  }
  if (c.master_port < 0) {
    if (job_var.empty()) {
      throw UsageError(context +
                       ": neither SLURM_JOB_ID nor SLURM_JOBID is set to derive the store port "
                       "from; set MASTER_PORT");
    }
    c.master_port = derived_master_port(c.job_key);
    c.master_port_from = "derived from " + job_var + "=" + job + " and " + step_var + "=" + step;
  }
  return c;
}

}  // namespace

// Strict decimal integer: the whole text, in [lo, hi].
bool parse_int(const std::string& text, int lo, int hi, int* out) {
  int v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || ptr != text.data() + text.size() || v < lo || v > hi) {
    return false;
  }
  *out = v;
  return true;
}

std::string ClusterEnv::describe() const {
  const char* name = source == "slurm" ? "Slurm" : source == "openmpi" ? "Open MPI" : "environment";
  return "rank " + std::to_string(rank) + " of " + std::to_string(world_size) + " (" + name + ": " +
         rank_from + ", " + world_size_from + "), master " + master_addr + ":" +
         std::to_string(master_port) + " (" + master_addr_from + "; port " + master_port_from +
         ")";
}

ClusterEnv resolve_cluster_env(const Environment& env, int rank, int world_size) {
  ClusterEnv c;
  if (has(env, "RANK") || has(env, "WORLD_SIZE")) {
    c = from_variables(env, rank, world_size);
  } else if (has(env, "OMPI_COMM_WORLD_RANK") || has(env, "OMPI_COMM_WORLD_SIZE")) {
    c = from_open_mpi(env, rank, world_size);
  } else if (has(env, "SLURM_PROCID") && (has(env, "SLURM_STEP_ID") || has(env, "SLURM_STEPID"))) {
    c = from_slurm(env, rank, world_size);
  } else {
    c = from_variables(env, rank, world_size);  // throws naming RANK / WORLD_SIZE unless given
  }
  if (c.local_rank >= 0 && c.local_world_size > 0 && c.local_rank >= c.local_world_size) {
    const char* vars = c.source == "slurm"     ? "SLURM_LOCALID, tasks per node"
                       : c.source == "openmpi" ? "OMPI_COMM_WORLD_LOCAL_RANK, _LOCAL_SIZE"
                                               : "LOCAL_RANK, LOCAL_WORLD_SIZE";
    throw UsageError("env:// rendezvous: local rank " + std::to_string(c.local_rank) +
                     " is outside [0, " + std::to_string(c.local_world_size) +
                     ") for local world size " + std::to_string(c.local_world_size) + " (" + vars +
                     ")");
  }
  return c;
}

namespace {

// One bracket item of a host list: the numbers lo..hi, zero-padded to `width` digits.
struct HostRange {
  int lo, hi;
  size_t width;
};

// A piece of a host name: literal text, or (when `ranges` is not empty) one of a bracket's numbers.
struct HostPart {
  std::string literal;
  std::vector<HostRange> ranges;
  size_t count = 1;  // values this part takes

  // The k-th value of a bracket part, k < count.
  std::string value(size_t k) const {
    for (const HostRange& r : ranges) {
      const size_t n = static_cast<size_t>(r.hi - r.lo) + 1;
      if (k >= n) {
        k -= n;
        continue;
      }
      std::string digits = std::to_string(r.lo + static_cast<int>(k));
      if (digits.size() < r.width) digits.insert(0, r.width - digits.size(), '0');
      return digits;
    }
    return {};
  }
};

// Splits `list` at the commas outside brackets.
std::vector<std::string> split_host_names(const std::string& list, const std::function<UsageError(const std::string&)>& bad) {
  std::vector<std::string> names;
  std::string current;
  int depth = 0;
  for (char ch : list) {
    if (ch == '[') {
      if (++depth > 1) throw bad("nested '['");
    } else if (ch == ']') {
      if (--depth < 0) throw bad("']' without '['");
    }
    if (ch == ',' && depth == 0) {
      names.push_back(current);
      current.clear();
    } else {
      current.push_back(ch);
    }
  }
  if (depth != 0) throw bad("'[' without ']'");
  names.push_back(current);
  return names;
}

// The bracket `body` ("01-03,07") as a part, every item checked.
HostPart parse_bracket(const std::string& body, const std::function<UsageError(const std::string&)>& bad) {
  HostPart part;
  part.count = 0;
  size_t start = 0;
  while (start <= body.size()) {
    size_t end = body.find(',', start);
    if (end == std::string::npos) end = body.size();
    const std::string item = body.substr(start, end - start);
    start = end + 1;
    const size_t dash = item.find('-');
    const std::string lo_text = item.substr(0, dash);
    const std::string hi_text = dash == std::string::npos ? lo_text : item.substr(dash + 1);
    int lo = 0, hi = 0;
    if (!parse_int(lo_text, 0, kMaxInt, &lo) || !parse_int(hi_text, 0, kMaxInt, &hi)) {
      throw bad("'[" + body + "]' holds '" + item + "', not a number or a range N-M");
    }
    if (hi < lo) throw bad("range " + item + " ends below its start");
    part.count += static_cast<size_t>(hi - lo) + 1;
    if (part.count > kMaxHosts) throw bad("more than 1048576 hosts");
    part.ranges.push_back(HostRange{lo, hi, lo_text.size()});
  }
  return part;
}

// One name of a host list ("r[1-2]n[0-1]") as its literal and bracket parts.
std::vector<HostPart> parse_host_name(const std::string& name, const std::function<UsageError(const std::string&)>& bad) {
  if (name.empty()) throw bad("an empty name");
  std::vector<HostPart> parts;
  size_t i = 0;
  while (i < name.size()) {
    if (name[i] != '[') {
      const size_t open = name.find('[', i);
      HostPart literal;
      literal.literal = name.substr(i, open == std::string::npos ? open : open - i);
      parts.push_back(std::move(literal));
      i = open == std::string::npos ? name.size() : open;
      continue;
    }
    const size_t close = name.find(']', i);
    parts.push_back(parse_bracket(name.substr(i + 1, close - i - 1), bad));
    i = close + 1;
  }
  return parts;
}

}  // namespace

// The whole list is parsed and checked (and its hosts counted) before any host is made, so a
// list's errors do not depend on `max_hosts`, and a short list of huge ranges costs no more than
// the hosts asked for.
std::vector<std::string> expand_hostlist(const std::string& list, const std::string& what, size_t max_hosts) {
  const std::function<UsageError(const std::string&)> bad = [&](const std::string& why) {
    return UsageError(what + "='" + list + "' is not a Slurm host list (" + why +
                      "); expected names like node[01-03,07],login");
  };
  std::vector<std::vector<HostPart>> names;
  size_t total = 0;
  for (const std::string& name : split_host_names(list, bad)) {
    names.push_back(parse_host_name(name, bad));
    size_t product = 1;
    for (const HostPart& p : names.back()) {
      if (product * p.count > kMaxHosts) throw bad("more than 1048576 hosts");  // both <= 2^20: no overflow
      product *= p.count;
    }
    total += product;
    if (total > kMaxHosts) throw bad("more than 1048576 hosts");
  }
  std::vector<std::string> hosts;
  hosts.reserve(std::min(total, max_hosts));
  for (const std::vector<HostPart>& parts : names) {
    // The name's hosts in order: an odometer over its bracket parts, the last one turning fastest.
    std::vector<size_t> at(parts.size(), 0);
    for (;;) {
      if (hosts.size() >= max_hosts) return hosts;
      std::string host;
      for (size_t k = 0; k < parts.size(); ++k) host += parts[k].ranges.empty() ? parts[k].literal : parts[k].value(at[k]);
      hosts.push_back(std::move(host));
      size_t k = parts.size();
      while (k > 0 && ++at[k - 1] == parts[k - 1].count) at[--k] = 0;
      if (k == 0) break;
    }
  }
  return hosts;
}

std::vector<int> expand_tasks_per_node(const std::string& text, const std::string& what) {
  auto bad = [&]() -> UsageError {
    return UsageError(what + "='" + text +
                      "' is not a Slurm tasks-per-node list; expected counts like 2(x3),1");
  };
  std::vector<int> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(start, end - start);
    start = end + 1;
    int count = 0, repeat = 1;
    const size_t paren = item.find('(');
    if (paren == std::string::npos) {
      if (!parse_int(item, 0, kMaxInt, &count)) throw bad();
    } else {
      if (item.size() < paren + 4 || item.compare(paren, 2, "(x") != 0 || item.back() != ')' ||
          !parse_int(item.substr(0, paren), 0, kMaxInt, &count) ||
          !parse_int(item.substr(paren + 2, item.size() - paren - 3), 1, kMaxInt, &repeat)) {
        throw bad();
      }
    }
    if (out.size() + static_cast<size_t>(repeat) > kMaxHosts) throw bad();
    out.insert(out.end(), static_cast<size_t>(repeat), count);
  }
  return out;
}

int derived_master_port(const std::string& job_key) {
  return kDerivedPortBase + static_cast<int>(fnv1a64(job_key) % kDerivedPortCount);
}

}  // namespace chorus
