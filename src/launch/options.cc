// `chorus run`'s option checks and scratch directories (options.h).
#include "options.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <thread>

#include "chorus/comm/error.h"
#include "chorus/comm/files.h"

namespace chorus::launch::detail {
namespace {

namespace fs = std::filesystem;

// The program as exec will find it, or "" if it cannot be run.
std::string resolve_program(const std::string& prog) {
  if (prog.find('/') != std::string::npos) return ::access(prog.c_str(), X_OK) == 0 ? prog : "";
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    std::string candidate = (dir.empty() ? "." : dir) + "/" + prog;
    struct stat st {};
    if (::stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(candidate.c_str(), X_OK) == 0) {
      return candidate;
    }
  }
  return "";
}

// Bounds of the numeric options: beyond them a value is a typo, and would overflow the
// millisecond arithmetic (a grace period of 1e300 s once meant an immediate SIGKILL).
constexpr int kMaxProcsPerNode = 4096;
constexpr int kMaxRestarts = 1000000;
constexpr double kMaxGraceSeconds = 3600;
constexpr double kMaxRdzvSeconds = 7 * 24 * 3600;

// Throws UsageError unless `value` (seconds) is a finite number in [min, max].
void check_seconds(const char* option, double value, double min, double max) {
  if (std::isfinite(value) && value >= min && value <= max) return;
  std::ostringstream out;
  out << "chorus run: " << option << " must be a number of seconds in [" << min << ", " << max << "], got " << value;
  throw UsageError(out.str());
}

}  // namespace

// Scratch directories are /tmp/chorus-run-<launcher pid>-ns<pid namespace>-XXXXXX. A SIGKILLed
// launcher cannot remove its own, so each launcher removes those of launchers (of this user, in
// its pid namespace, where their pids mean what they say) that are no longer running.
constexpr const char* kScratchPrefix = "chorus-run-";

std::string pid_namespace_tag() {
  struct stat st {};
  return "ns" + std::to_string(::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<unsigned long long>(st.st_ino) : 0ull);
}

void sweep_stale_scratch_dirs() {
  const std::string ns = "-" + pid_namespace_tag() + "-";
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator("/tmp", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(kScratchPrefix, 0) != 0) continue;
    const std::string rest = name.substr(std::strlen(kScratchPrefix));
    char* end = nullptr;
    const long pid = std::strtol(rest.c_str(), &end, 10);
    if (pid <= 0 || end == rest.c_str() || std::string(end).rfind(ns, 0) != 0) continue;  // not one of ours
    struct stat st {};
    if (::lstat(entry.path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::getuid()) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // its launcher still runs
    std::error_code rec;
    remove_tree(entry.path().string(), rec);
  }
}

CheckedOptions check_options(const LaunchOptions& o) {
  CheckedOptions c;
  const bool elastic = o.max_nodes > 0;
  if (o.program.empty()) throw UsageError("chorus run: no program given; usage: chorus run [options] PROGRAM [ARGS...]");
  if (o.program[0].size() > 1 && o.program[0][0] == '-') {
    throw UsageError("chorus run: unknown option '" + o.program[0] + "' (options go before PROGRAM; see chorus run --help)");
  }
  c.program_path = resolve_program(o.program[0]);
  if (c.program_path.empty()) {
    throw UsageError("chorus run: cannot run '" + o.program[0] + "': not found or not executable" +
                     (o.program[0].find('/') == std::string::npos ? " (searched PATH)" : ""));
  }
  if (o.nproc_per_node == "auto") {
    c.nproc = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  } else {
    try {
      size_t pos = 0;
      c.nproc = std::stoi(o.nproc_per_node, &pos);
      if (pos != o.nproc_per_node.size()) throw std::invalid_argument("");
    } catch (...) {
      throw UsageError("chorus run: --nproc-per-node must be a number or 'auto', got '" + o.nproc_per_node + "'");
    }
  }
  if (c.nproc < 1) throw UsageError("chorus run: --nproc-per-node must be at least 1, got " + std::to_string(c.nproc));
  if (o.nnodes < 1) throw UsageError("chorus run: --nnodes must be at least 1");
  if (elastic) {
    if (o.max_nodes < o.nnodes) {
      throw UsageError("chorus run: --nnodes " + std::to_string(o.nnodes) + ":" + std::to_string(o.max_nodes) +
                       ": the most nodes is below the fewest; write MIN:MAX");
    }
    if (o.node_rank != 0) {
      throw UsageError("chorus run: an elastic job (--nnodes MIN:MAX) assigns node ranks in its rendezvous "
                       "rounds; drop --node-rank");
    }
    check_seconds("--rdzv-last-call", o.rdzv_last_call_s, 0, kMaxGraceSeconds);
  }
  if (o.node_rank < 0 || o.node_rank >= o.nnodes) {
    throw UsageError("chorus run: --node-rank " + std::to_string(o.node_rank) + " is outside [0, " +
                     std::to_string(o.nnodes) + ")");
  }
  if (c.nproc > kMaxProcsPerNode) {
    throw UsageError("chorus run: --nproc-per-node " + std::to_string(c.nproc) + " is more than " +
                     std::to_string(kMaxProcsPerNode) + " workers on one node");
  }
  if (o.max_restarts < 0 || o.max_restarts > kMaxRestarts) {
    throw UsageError("chorus run: --max-restarts must be in [0, " + std::to_string(kMaxRestarts) + "], got " +
                     std::to_string(o.max_restarts));
  }
  check_seconds("--grace-period", o.grace_period_s, 0, kMaxGraceSeconds);
  check_seconds("--rdzv-timeout", o.rdzv_timeout_s, 0.001, kMaxRdzvSeconds);
  if (o.master_port != -1 && (o.master_port < 1 || o.master_port > 65535)) {
    throw UsageError("chorus run: --master-port " + std::to_string(o.master_port) +
                     " is not a TCP port; give one in [1, 65535]");
  }
  if (!o.rdzv_endpoint.empty()) {
    parse_endpoint(o.rdzv_endpoint, &c.master_addr, &c.master_port);
  } else if (!o.master_addr.empty() || o.master_port >= 0) {
    if (o.master_addr.empty() || o.master_port < 0) {
      throw UsageError("chorus run: give both --master-addr and --master-port (or --rdzv-endpoint HOST:PORT)");
    }
    c.master_addr = o.master_addr;
    c.master_port = o.master_port;
  } else if (elastic) {
    throw UsageError("chorus run: an elastic job (--nnodes MIN:MAX) needs --rdzv-endpoint HOST:PORT: the "
                     "address of the node that hosts the store (its launcher listens there) and a free port");
  } else if (o.nnodes > 1) {
    throw UsageError("chorus run: --nnodes " + std::to_string(o.nnodes) +
                     " needs --rdzv-endpoint HOST:PORT (node 0's address and a free port)");
  }
  if (!o.ranks_filter.empty() && !o.local_ranks_filter.empty()) {
    throw UsageError("chorus run: give --ranks-filter or --local-ranks-filter, not both");
  }
  if (!o.ranks_filter.empty()) parse_rank_list(o.ranks_filter, "--ranks-filter");
  if (!o.local_ranks_filter.empty()) parse_rank_list(o.local_ranks_filter, "--local-ranks-filter");
  return c;
}

std::set<int> parse_rank_list(const std::string& text, const char* option) {
  auto bad = [&](const std::string& why) {
    return UsageError(std::string("chorus run: ") + option + " '" + text + "': " + why +
                      "; expected ranks and ranges such as 0 or 0,2-3");
  };
  auto number = [&](const std::string& s) {
    if (s.empty() || s.size() > 7 || s.find_first_not_of("0123456789") != std::string::npos) {
      throw bad("'" + s + "' is not a rank");
    }
    return std::stoi(s);
  };
  std::set<int> ranks;
  std::stringstream parts(text);
  for (std::string part; std::getline(parts, part, ',');) {
    const size_t dash = part.find('-');
    const int first = number(part.substr(0, dash));
    const int last = dash == std::string::npos ? first : number(part.substr(dash + 1));
    if (last < first) throw bad("the range " + part + " runs backwards");
    if (last - first > kMaxProcsPerNode * 1024) throw bad("the range " + part + " is too long");
    for (int r = first; r <= last; ++r) ranks.insert(r);
  }
  if (ranks.empty() || text.back() == ',') throw bad("no ranks");
  return ranks;
}

Output output_for(const LaunchOptions& o, int rank, int local_rank) {
  if (!o.ranks_filter.empty()) {
    return parse_rank_list(o.ranks_filter, "--ranks-filter").count(rank) ? Output::kPrefixed : Output::kLogOnly;
  }
  if (!o.local_ranks_filter.empty()) {
    return parse_rank_list(o.local_ranks_filter, "--local-ranks-filter").count(local_rank) ? Output::kPrefixed
                                                                                           : Output::kLogOnly;
  }
  if (o.tee) return Output::kPrefixed;
  return rank == 0 || o.log_dir.empty() ? Output::kTerminal : Output::kLogOnly;
}

std::string make_scratch_dir() {
  sweep_stale_scratch_dirs();
  std::string tmpl =
      std::string("/tmp/") + kScratchPrefix + std::to_string(::getpid()) + "-" + pid_namespace_tag() + "-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) {
    throw Error("chorus run: cannot create a scratch directory " + tmpl + ": " + std::strerror(errno));
  }
  return tmpl;
}

}  // namespace chorus::launch::detail
