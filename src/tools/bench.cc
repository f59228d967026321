#include "bench.h"

#include <dirent.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/comm/mpi.h"
#include "chorus/comm/process_group.h"
#include "chorus/comm/rendezvous.h"
#include "chorus/comm/signals.h"
#include "chorus/comm/spawn.h"
#include "chorus/comm/store.h"

namespace chorus::tools {
namespace {

using Clock = std::chrono::steady_clock;

const char* kOps[] = {"allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall"};

std::vector<size_t> parse_sizes(const std::string& text) {
  std::vector<size_t> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) out.push_back(parse_size(item));
  }
  if (out.empty()) throw UsageError("--sizes is empty");
  return out;
}

// Bus bandwidth factor, as nccl-tests defines it: what each rank must move relative to the size.
double bus_factor(const std::string& op, int n) {
  if (op == "allreduce") return 2.0 * (n - 1) / n;
  if (op == "allgather" || op == "reduce_scatter" || op == "alltoall") return static_cast<double>(n - 1) / n;
  return 1.0;
}

struct Stats {
  double p50 = 0, p99 = 0, min = 0, mean = 0;
};

Stats stats(std::vector<double> t) {
  Stats s;
  if (t.empty()) return s;
  std::sort(t.begin(), t.end());
  auto pct = [&](double p) {
    size_t i = static_cast<size_t>(std::ceil(p * static_cast<double>(t.size()))) - 1;
    return t[std::min(i, t.size() - 1)];
  };
  s.p50 = pct(0.5);
  s.p99 = pct(0.99);
  s.min = t.front();
  double sum = 0;
  for (double x : t) sum += x;
  s.mean = sum / static_cast<double>(t.size());
  return s;
}

// One benchmark case on this rank: buffers, fill, run, verify.
class Case {
 public:
  Case(ProcessGroup& pg, const std::string& op, size_t bytes)
      : pg_(pg), op_(op), n_(static_cast<size_t>(pg.size())), r_(static_cast<size_t>(pg.rank())) {
    // Sizes follow nccl-tests: the whole buffer for allreduce/broadcast/reduce; the gathered or
    // scattered total for allgather/reduce_scatter/alltoall.
    count_ = bytes / sizeof(float);
    if (op == "allgather" || op == "reduce_scatter" || op == "alltoall") count_ = count_ / n_;
    size_t in = count_, out = count_;
    if (op == "allgather") out = count_ * n_;
    if (op == "reduce_scatter") in = count_ * n_;
    if (op == "alltoall") in = out = count_ * n_;
    in_.assign(in, 0.0f);
    out_.assign(out, 0.0f);
    fill();
  }

  size_t bytes_moved() const {
    if (op_ == "allgather" || op_ == "reduce_scatter" || op_ == "alltoall") return count_ * n_ * sizeof(float);
    return count_ * sizeof(float);
  }

  void fill() {
    // Small integers: every reduction is exact, so checking is exact.
    for (size_t i = 0; i < in_.size(); ++i) in_[i] = static_cast<float>((r_ + i) % 8);
  }

  void run() {
    const int root = 0;
    if (op_ == "allreduce") pg_.allreduce(in_.data(), count_, DataType::kFloat32)->wait();
    else if (op_ == "broadcast") pg_.broadcast(in_.data(), count_, DataType::kFloat32, root)->wait();
    else if (op_ == "reduce") pg_.reduce(in_.data(), count_, DataType::kFloat32, ReduceOp::kSum, root)->wait();
    else if (op_ == "allgather") pg_.allgather(in_.data(), out_.data(), count_, DataType::kFloat32)->wait();
    else if (op_ == "reduce_scatter") pg_.reduce_scatter(in_.data(), out_.data(), count_, DataType::kFloat32)->wait();
    else if (op_ == "alltoall") pg_.alltoall(in_.data(), out_.data(), count_, DataType::kFloat32)->wait();
  }

  // All ranks of the case's group, before a timed call.
  void barrier() { pg_.barrier()->wait(); }

  // Checks the result of one run() on freshly filled buffers, then refills them.
  bool verify() {
    bool ok = true;
    auto sum_at = [&](size_t i) {
      float s = 0;
      for (size_t r = 0; r < n_; ++r) s += static_cast<float>((r + i) % 8);
      return s;
    };
    if (op_ == "allreduce") {
      for (size_t i = 0; i < count_ && ok; ++i) ok = in_[i] == sum_at(i);
    } else if (op_ == "broadcast") {
      for (size_t i = 0; i < count_ && ok; ++i) ok = in_[i] == static_cast<float>(i % 8);
    } else if (op_ == "reduce") {
      for (size_t i = 0; i < count_ && ok; ++i) ok = in_[i] == (r_ == 0 ? sum_at(i) : static_cast<float>((r_ + i) % 8));
    } else if (op_ == "allgather") {
      for (size_t i = 0; i < out_.size() && ok; ++i) ok = out_[i] == static_cast<float>((i / count_ + i % count_) % 8);
    } else if (op_ == "reduce_scatter") {
      for (size_t i = 0; i < count_ && ok; ++i) ok = out_[i] == sum_at(r_ * count_ + i);
    } else if (op_ == "alltoall") {
      // Block j of out came from rank j's block r_: element (r_ * count + i) of rank j's input.
      for (size_t i = 0; i < out_.size() && ok; ++i) {
        size_t j = i / count_;
        ok = out_[i] == static_cast<float>((j + r_ * count_ + i % count_) % 8);
      }
    }
    return ok;
  }

 private:
  ProcessGroup& pg_;
  std::string op_;
  size_t n_, r_;
  size_t count_;
  std::vector<float> in_, out_;
};

std::string human(size_t bytes) {
  char buf[32];
  if (bytes >= (1u << 20) && bytes % (1u << 20) == 0) std::snprintf(buf, sizeof(buf), "%zuM", bytes >> 20);
  else if (bytes >= 1024 && bytes % 1024 == 0) std::snprintf(buf, sizeof(buf), "%zuK", bytes >> 10);
  else std::snprintf(buf, sizeof(buf), "%zu", bytes);
  return buf;
}

// --allreduce-algorithm: one algorithm, or a comma-separated list to compare in one job.
std::vector<std::string> algorithms(const BenchArgs& a) {
  std::vector<std::string> out;
  std::stringstream in(a.allreduce_algorithm);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(item);
  return out;
}

ProcessGroupOptions group_options(const BenchArgs& a, int rank, int world) {
  ProcessGroupOptions o;
  o.timeout = std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000));
  o.transport = a.transport;
  if (a.hosts > 1) {  // a simulated split: ranks [h*W/K, (h+1)*W/K) form host h
    o.host_id = "bench-host-" + std::to_string(static_cast<long long>(rank) * a.hosts / world);
  }
  o.segment_bytes = a.segment_bytes;
  o.allreduce_algorithm = a.allreduce_algorithm;
  o.link_latency_us = a.link_latency_us;
  o.link_gbit_per_s = a.link_gbit_per_s;
  o.socket_buffer_bytes = a.socket_buffer;
  o.spin_us = a.spin_us;
  return o;
}

// Iteration count: fixed, or calibrated on rank 0 and broadcast so every rank agrees.
int64_t iteration_count(const BenchArgs& a, Case& c, ProcessGroup& pg) {
  int64_t iters = a.iters;
  if (iters <= 0) {
    auto t0 = Clock::now();
    c.run();
    c.run();
    double per = std::chrono::duration<double>(Clock::now() - t0).count() / 2;
    iters = static_cast<int64_t>(std::clamp(a.seconds / std::max(per, 1e-9), 20.0, 100000.0));
    pg.broadcast(&iters, 1, DataType::kInt64, 0)->wait();
  }
  return iters;
}

// This rank's times of `iters` runs of each case (us), cases[k]'s in times[k]; (*correct)[k] says
// whether every checked result of cases[k] was right (with --check every run's, else one run's
// after them). Several cases (algorithms compared in one job) take turns call by call, the first
// of each turn rotating, so that a slow spell of the machine or of the job's placement on its
// cores falls on every case alike.
std::vector<std::vector<double>> time_runs(const BenchArgs& a, const std::vector<Case*>& cases, int64_t iters,
                                           std::vector<bool>* correct) {
  const size_t k = cases.size();
  std::vector<std::vector<double>> times(k);
  for (auto& t : times) t.reserve(static_cast<size_t>(iters));
  correct->assign(k, true);
  for (int64_t i = 0; i < iters; ++i) {
    for (size_t turn = 0; turn < k; ++turn) {
      const size_t j = (static_cast<size_t>(i) + turn) % k;
      Case& c = *cases[j];
      if (a.check) {
        // Outside the timed region. Filling and verifying take each rank its own time (8 ranks on 2
        // cores: tens of ms at 64 MiB), so the ranks start the next call together, from a barrier,
        // as bench/multihost_gloo.py does; else a rank's time includes a late peer's fill.
        c.fill();
        c.barrier();
      }
      auto t0 = Clock::now();
      c.run();
      times[j].push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      if (a.check) (*correct)[j] = c.verify() && (*correct)[j];
    }
  }
  if (!a.check) {  // at least one result of each case is always checked
    for (size_t j = 0; j < k; ++j) {
      cases[j]->fill();
      cases[j]->run();
      (*correct)[j] = cases[j]->verify();
    }
  }
  return times;
}

// The figure of a round is the slowest rank's: max over ranks of each statistic. *all_ok says
// whether every rank's results were right.
Stats slowest_rank(ProcessGroup& pg, const Stats& s, bool correct, bool* all_ok) {
  std::ostringstream mine;
  mine << s.p50 << " " << s.p99 << " " << s.min << " " << s.mean << " " << (correct ? 1 : 0);
  auto w = pg.all_gather_object(mine.str());
  w->wait();
  Stats worst;
  bool ok = true;
  for (const auto& text : w->objects()) {
    std::istringstream in(text);
    Stats t;
    int c_ok = 0;
    in >> t.p50 >> t.p99 >> t.min >> t.mean >> c_ok;
    worst.p50 = std::max(worst.p50, t.p50);
    worst.p99 = std::max(worst.p99, t.p99);
    worst.min = std::max(worst.min, t.min);
    worst.mean = std::max(worst.mean, t.mean);
    ok = ok && c_ok == 1;
  }
  *all_ok = ok;
  return worst;
}

// What setting the group up cost this rank: seconds from the call to a connected group, and the
// file descriptors the process held then (sockets to peers, the store's, shared memory, stdio).
struct SetupCost {
  double seconds = 0;
  double fds = 0;
};

int open_fds() {
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  int n = 0;
  while (readdir(d) != nullptr) ++n;
  closedir(d);
  return n - 3;  // ".", ".." and the directory's own descriptor
}

// Whether allreduce `algo` runs "tuned": asked for, or "auto" replaced by CHORUS_ALLREDUCE_ALGORITHM.
bool tuned(const std::string& algo) {
  const char* env = std::getenv("CHORUS_ALLREDUCE_ALGORITHM");
  return algo == "tuned" || (algo == "auto" && env != nullptr && std::string(env) == "tuned");
}

// The algorithm "tuned" chose for allreduces of `bytes` over the whole group; "" when none did.
std::string tuned_choice(const ProcessGroup& pg, size_t bytes) {
  for (const TunedAllreduce& t : pg.tuned_allreduce()) {
    if (t.ranks == pg.size() && t.min_bytes <= bytes && bytes <= t.max_bytes) return t.chosen;
  }
  return "";
}

// The job's groups, one per algorithm of --allreduce-algorithm, and what setting them up cost this
// rank. One algorithm: connect_process_group, as a user's program does. Several, compared in one
// job: one rendezvous and a group each on its store (group names "bench-<algorithm>"), set up as
// connect_process_group sets up its one.
std::vector<std::shared_ptr<ProcessGroup>> connect_timed(const BenchArgs& a, int rank, int world, SetupCost* cost) {
  const auto t0 = Clock::now();
  const std::vector<std::string> algos = algorithms(a);
  ProcessGroupOptions o = group_options(a, std::max(rank, 0), std::max(world, 1));
  o.allreduce_algorithm = algos.front();
  std::vector<std::shared_ptr<ProcessGroup>> groups{connect_process_group("env://", rank, world, o)};
  // Algorithms compared in one job: a group over all ranks for each of the others.
  std::vector<int> all(static_cast<size_t>(groups.front()->size()));
  std::iota(all.begin(), all.end(), 0);
  for (size_t i = 1; i < algos.size(); ++i) {
    o.allreduce_algorithm = algos[i];
    groups.push_back(groups.front()->new_group(all, o));
  }
  cost->seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  cost->fds = open_fds();
  return groups;
}

// Runs every size on this rank: on the job's one group, or on each of its groups (algorithms
// compared in one job) in turns, a record per group.
void rank_main(const BenchArgs& a, std::vector<std::shared_ptr<ProcessGroup>> groups, SetupCost setup = {}) {
  ProcessGroup& pg = *groups.front();
  const int rank = pg.rank(), world = pg.size();
  nlohmann::json records = nlohmann::json::array();
  bool all_correct = true;
  double slowest[2] = {setup.seconds, setup.fds};  // the slowest rank's setup, the most descriptors
  pg.allreduce(slowest, 2, DataType::kFloat64, ReduceOp::kMax)->wait();
  const bool compared = groups.size() > 1;
  if (rank == 0 && !a.quiet) {
    std::printf("# chorus bench %s: world_size %d, transport %s (%s), dtype float32, in place\n", a.op.c_str(),
                world, pg.transport().c_str(), a.transport.c_str());
    if (compared) {
      std::printf("# allreduce algorithms %s compared in one job, call by call in turns\n",
                  a.allreduce_algorithm.c_str());
    }
    std::printf("# setup: slowest rank %.3f s; at most %.0f file descriptors per rank\n", slowest[0], slowest[1]);
    std::printf("# %10s %12s %8s %11s %11s %11s %11s %8s%s\n", "size", "count", "iters", "p50(us)", "p99(us)",
                "algbw(GB/s)", "busbw(GB/s)", "correct", compared ? "  algorithm" : "");
    std::fflush(stdout);
  }
  const std::vector<std::string> algos = algorithms(a);
  for (size_t bytes : parse_sizes(a.sizes)) {
    std::vector<std::unique_ptr<Case>> owned;
    std::vector<Case*> cases;
    for (auto& g : groups) {
      owned.push_back(std::make_unique<Case>(*g, a.op, bytes));
      cases.push_back(owned.back().get());
    }
    for (size_t j = 0; j < cases.size(); ++j) {
      // "tuned" spends a size's first calls on trials: warm up past them, so only its choice is timed.
      const bool trials = a.op == "allreduce" && tuned(algos[j]);
      const int warmup = trials ? std::max(a.warmup, kTunedAllreduceTrials) : a.warmup;
      for (int i = 0; i < warmup; ++i) cases[j]->run();
    }
    const int64_t iters = iteration_count(a, *cases.front(), pg);  // about --seconds per algorithm
    std::vector<bool> correct;
    const std::vector<std::vector<double>> times = time_runs(a, cases, iters, &correct);
    for (size_t j = 0; j < cases.size(); ++j) {
      bool ok = true;
      const Stats worst = slowest_rank(pg, stats(times[j]), correct[j], &ok);
      all_correct = all_correct && ok;
      const double moved = static_cast<double>(cases[j]->bytes_moved());
      const double algbw = worst.p50 > 0 ? moved / (worst.p50 * 1e-6) / 1e9 : 0;
      const double busbw = algbw * bus_factor(a.op, world);
      if (rank != 0) continue;
      if (!a.quiet) {
        std::printf("  %10s %12zu %8lld %11.1f %11.1f %11.3f %11.3f %8s%s%s\n", human(bytes).c_str(),
                    static_cast<size_t>(moved / sizeof(float)), static_cast<long long>(iters), worst.p50, worst.p99,
                    algbw, busbw, ok ? "yes" : "NO", compared ? "  " : "", compared ? algos[j].c_str() : "");
        std::fflush(stdout);
      }
      records.push_back({{"op", a.op},
                         {"transport", groups[j]->transport()},
                         {"transport_requested", a.transport},
                         {"allreduce_algorithm", algos[j]},
                         {"compared_in_one_job", compared},
                         {"tuned_choice", tuned_choice(*groups[j], static_cast<size_t>(moved))},
                         {"setup_s", slowest[0]},
                         {"fds_per_rank", slowest[1]},
                         {"world_size", world},
                         {"bytes", static_cast<size_t>(moved)},
                         {"dtype", "float32"},
                         {"iters", iters},
                         {"p50_us", worst.p50},
                         {"p99_us", worst.p99},
                         {"min_us", worst.min},
                         {"mean_us", worst.mean},
                         {"algbw_gbps", algbw},
                         {"busbw_gbps", busbw},
                         {"correct", ok}});
    }
  }
  // With lazy connections a rank connects to the peers its algorithms use as it first needs them:
  // what it holds once the operations ran.
  double after = open_fds();
  pg.allreduce(&after, 1, DataType::kFloat64, ReduceOp::kMax)->wait();
  if (rank == 0) {
    if (!a.quiet) std::printf("# after the operations: at most %.0f file descriptors per rank\n", after);
    for (auto& r : records) r["fds_after_ops"] = after;
  }
  if (rank == 0 && !a.json.empty()) {
    std::ofstream out(a.json);
    out << records.dump(2) << "\n";
    if (!out) throw Error("cannot write --json file " + a.json);
  }
  if (a.check && !all_correct) {
    throw Error("bench --check: a " + a.op + " result was wrong (see the 'correct' column)");
  }
}

}  // namespace

size_t parse_size(const std::string& text) {
  if (text.empty()) throw UsageError("empty size");
  size_t pos = 0;
  unsigned long long v = 0;
  try {
    v = std::stoull(text, &pos);
  } catch (...) {
    throw UsageError("bad size '" + text + "'; use bytes or K/M/G suffixes, e.g. 4K,1M");
  }
  std::string suffix = text.substr(pos);
  if (suffix == "" || suffix == "B") return v;
  if (suffix == "K" || suffix == "k" || suffix == "KiB") return v << 10;
  if (suffix == "M" || suffix == "MiB") return v << 20;
  if (suffix == "G" || suffix == "GiB") return v << 30;
  throw UsageError("bad size suffix in '" + text + "'; use K, M or G (powers of two)");
}

void add_bench_options(CLI::App& app, BenchArgs& a) {
  app.add_option("op", a.op, "collective to measure")
      ->check(CLI::IsMember({"allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall"}));
  app.add_option("-n,--world-size", a.world_size, "number of local ranks to start")->check(CLI::Range(1, 256));
  app.add_option("--transport", a.transport,
                 "transport: tcp, shm, hybrid (shm within a host, tcp across), auto (picks one of those), or mpi "
                 "(Open MPI: run under mpirun -np N, one rank per process)")
      ->check([](const std::string& name) {
        TransportKind kind;
        return parse_transport(name, &kind) ? std::string() : "unknown transport '" + name + "': tcp, shm, hybrid, auto or mpi";
      });
  app.add_option("--hosts", a.hosts, "split the local ranks into this many simulated hosts (for hybrid and auto)")
      ->check(CLI::Range(1, 256));
  app.add_option("--sizes", a.sizes, "comma-separated sizes in bytes (K, M, G suffixes)");
  app.add_option("--iters", a.iters, "timed iterations per size (0 = about --seconds per size)");
  app.add_option("--warmup", a.warmup, "untimed iterations per size")->check(CLI::Range(1, 1000000));
  app.add_option("--seconds", a.seconds, "target time per size when --iters is 0");
  app.add_flag("--check", a.check, "verify every result; exit non-zero on a wrong one");
  app.add_option("--json", a.json, "write the results as a JSON list to this file");
  app.add_option("--timeout", a.timeout_s, "per-operation timeout in seconds");
  app.add_option("--segment-bytes", a.segment_bytes, "ring pipeline segment size");
  app.add_option("--allreduce-algorithm", a.allreduce_algorithm,
                 "auto (chosen per size by the link model), ring, recursive_doubling, rabenseifner or tuned "
                 "(chosen per size by measuring each; warm-up covers its trials); a comma-separated list "
                 "compares them in one job: a group each, timed call by call in turns")
      ->check([](const std::string& list) {
        std::vector<std::string> seen;
        std::stringstream in(list);
        std::string item;
        while (std::getline(in, item, ',')) {
          AllreduceAlgorithm parsed;
          if (!parse_allreduce_algorithm(item, &parsed)) {
            return "unknown allreduce algorithm '" + item + "': auto, ring, recursive_doubling, rabenseifner or tuned";
          }
          if (std::find(seen.begin(), seen.end(), item) != seen.end()) return "'" + item + "' is listed twice";
          seen.push_back(item);
        }
        return seen.empty() ? std::string("empty list") : std::string();
      });
  app.add_option("--link-latency-us", a.link_latency_us, "the link model's latency for auto (0 = measured default)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--link-gbit", a.link_gbit_per_s, "the link model's bandwidth in Gbit/s for auto (0 = measured default)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--socket-buffer", a.socket_buffer, "SO_SNDBUF/SO_RCVBUF bytes (0 = autotuning)");
  app.add_option("--spin-us", a.spin_us, "busy-poll this long before sleeping (-1 = library default)");
  app.add_flag("--quiet", a.quiet, "print nothing (use with --json)");
  app.add_flag("--launched", a.launched,
               "this process is one rank of a job a launcher started (chorus run on every host, e.g. "
               "bench/multihost): rank and world size come from env://; -n is ignored");
  (void)kOps;
}

int run_bench(const BenchArgs& a) {
  parse_sizes(a.sizes);  // report bad sizes before starting any process
  TransportKind kind = TransportKind::kTcp;
  if (algorithms(a).size() > 1 && (a.op != "allreduce" || (parse_transport(a.transport, &kind) && kind == TransportKind::kMpi))) {
    std::fprintf(stderr, "chorus bench: a list of --allreduce-algorithm values compares allreduce algorithms in "
                         "one job: use it with allreduce, over a transport other than mpi\n");
    return 2;
  }
  if (parse_transport(a.transport, &kind) && kind == TransportKind::kMpi) {
    // mpirun starts the ranks: this process is one of them.
    try {
      auto pg = connect_mpi_process_group(group_options(a, 0, 1));
      if (pg->size() != a.world_size) {
        throw UsageError("--transport mpi: MPI started " + std::to_string(pg->size()) + " ranks but -n is " +
                         std::to_string(a.world_size) + "; run it as mpirun -np " + std::to_string(a.world_size) +
                         " chorus bench ... --transport mpi -n " + std::to_string(a.world_size));
      }
      rank_main(a, {std::move(pg)});
    } catch (const Error& e) {
      std::fprintf(stderr, "chorus bench: %s\n", e.what());
      return 1;
    }
    return 0;
  }
  if (a.launched) {
    try {
      if (a.hosts > 1) throw UsageError("--launched runs on real hosts: drop --hosts");
      SetupCost cost;
      rank_main(a, connect_timed(a, -1, -1, &cost), cost);
    } catch (const Error& e) {
      std::fprintf(stderr, "chorus bench: %s\n", e.what());
      return 1;
    }
    return 0;
  }
  SpawnOptions so;
  so.grace_period = std::chrono::milliseconds(2000);
  try {
    spawn(a.world_size, [&](int rank, int world) {
      SetupCost cost;
      rank_main(a, connect_timed(a, rank, world, &cost), cost);
    }, so);
  } catch (const SpawnError& e) {
    std::fprintf(stderr, "chorus bench: %s\n", e.what());
    return 1;
  }
  return 0;
}

}  // namespace chorus::tools
