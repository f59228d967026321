#include "measured_allreduce.h"

#include <chrono>
#include <cstdio>

#include "algorithms.h"
#include "chorus/comm/error.h"
#include "chorus/comm/log.h"
#include "plan.h"

namespace chorus::algo {
namespace {

// "64 KiB" for the log line.
std::string bytes_label(size_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char text[32];
  std::snprintf(text, sizeof(text), v == static_cast<double>(static_cast<long long>(v)) ? "%.0f %s" : "%.1f %s", v,
                units[u]);
  return text;
}

TunedAllreduce describe(int ranks, int size_class, const std::vector<AllreduceAlgorithm>& candidates,
                        const std::vector<double>& agreed_us, AllreduceAlgorithm chosen) {
  TunedAllreduce d;
  d.ranks = ranks;
  const plan::ByteRange range = plan::size_class_bytes(size_class);
  d.min_bytes = range.min_bytes;
  d.max_bytes = range.max_bytes;
  for (size_t i = 0; i < agreed_us.size(); ++i) d.measured_us.emplace_back(to_string(candidates[i]), agreed_us[i]);
  d.chosen = to_string(chosen);
  return d;
}

}  // namespace

void MeasuredAllreduce::run(transport::Transport& t, Scratch& s, const Tuning& tune, const wire::Call& call, void* buf,
                            size_t count, DataType dtype, ReduceOp op) {
  const size_t bytes = count * element_size(dtype);
  const int ranks = t.size();
  const int cls = plan::size_class(bytes);
  AllreduceAlgorithm algorithm;
  plan::Trial trial;
  bool trying = false;
  bool first = false;  // the class's first call here: do all ranks keep the same decision (or none)?
  int kept = -1;       // the kept decision's algorithm, -1 for none
  int index = 0;
  int n_candidates = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto [it, fresh] = classes_.try_emplace({ranks, cls});
    Class& c = it->second;
    first = fresh;
    if (fresh) {
      if (auto k = kept_.find({ranks, cls}); k != kept_.end()) {
        c.candidates = k->second.candidates;
        c.agreed_us = k->second.agreed_us;
        c.chosen = k->second.chosen;
        c.done = true;
        kept = static_cast<int>(c.chosen);
      } else {
        c.candidates = plan::tuning_candidates(bytes, count, ranks, tune.link);
        c.us.resize(c.candidates.size());
        if (plan::tuning_calls(static_cast<int>(c.candidates.size())) == 0) {
          c.done = true;
          c.chosen = c.candidates.front();
        }
      }
    }
    n_candidates = static_cast<int>(c.candidates.size());
    if (c.done) {
      algorithm = c.chosen;
    } else {
      trying = true;
      index = c.calls++;
      trial = plan::tuning_trial(index, n_candidates);
      algorithm = c.candidates[static_cast<size_t>(trial.candidate)];
    }
  }
  if (first) {
    // On every rank, at every class's first call (so that all ranks take the same steps whatever
    // they kept): every rank's kept algorithm, -1 for none, as the largest and (negated) smallest.
    double v[2] = {static_cast<double>(kept), -static_cast<double>(kept)};
    wire::Call agree = call;
    agree.dtype = DataType::kFloat64;
    agree.reduce_op = ReduceOp::kMax;
    agree.count = 2;
    agree.arg = wire::kKeptTunedCheckArg;
    allreduce_recursive_doubling(t, s, tune, agree, v, 2, DataType::kFloat64, ReduceOp::kMax);
    if (v[0] != -v[1]) {
      auto name = [](int a) {
        return a < 0 ? std::string("none") : std::string(to_string(static_cast<AllreduceAlgorithm>(a)));
      };
      const int other = static_cast<int>(v[0]) != kept ? static_cast<int>(v[0]) : static_cast<int>(-v[1]);
      const plan::ByteRange range = plan::size_class_bytes(cls);
      throw MismatchError("chorus: rank " + std::to_string(t.rank()) + ": " + wire::describe(call) +
                          ": allreduce \"tuned\" kept " + name(kept) + " for " + bytes_label(range.min_bytes) +
                          " up to " + bytes_label(range.max_bytes + 1) + " over " + std::to_string(ranks) +
                          " ranks, and another rank kept " + name(other) +
                          "; keep_tuned_allreduce must be given the same decisions on every rank (e.g. all "
                          "ranks load the same saved state), before the allreduces they are for");
    }
  }
  if (trying && trial.timed) {
    // A rank's time runs from its own start. Back to back, an algorithm that ends unevenly
    // (recursive doubling over 6 ranks hands the last two their result one whole-buffer message
    // after the rest are done) makes the early ranks of the next call wait, and that wait would be
    // charged to the next candidate, always the same one: at 6 hosts over 1 Gbit/s, 256 KiB, the
    // ring measured 7.3 ms in its trials and 2.9 ms in fact. From a barrier the slowest rank's time
    // is the algorithm's own.
    wire::Call ready = call;
    ready.arg = wire::kTunedTrialStartArg;
    barrier(t, ready);
  }
  // A later call of the class may have too few elements for the kept algorithm (another dtype):
  // allreduce_by falls back to recursive doubling as a forced algorithm does.
  const auto start = std::chrono::steady_clock::now();
  allreduce_by(algorithm, t, s, tune, call, buf, count, dtype, op);
  if (!trying) return;
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();

  std::vector<double> medians;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Class& c = classes_.at({ranks, cls});
    if (c.done) return;
    if (trial.timed) c.us[static_cast<size_t>(trial.candidate)].push_back(us);
    if (index + 1 < plan::tuning_calls(n_candidates)) return;
    for (const auto& v : c.us) medians.push_back(plan::median_us(v));
  }
  // The last trial: every rank is here, after the same calls. Agree on the slowest rank's times.
  wire::Call agree = call;
  agree.dtype = DataType::kFloat64;
  agree.reduce_op = ReduceOp::kMax;
  agree.count = medians.size();
  allreduce_recursive_doubling(t, s, tune, agree, medians.data(), medians.size(), DataType::kFloat64, ReduceOp::kMax);
  TunedAllreduce d;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Class& c = classes_.at({ranks, cls});
    c.agreed_us = medians;
    c.chosen = c.candidates[static_cast<size_t>(plan::fastest_candidate(medians))];
    c.done = true;
    d = describe(ranks, cls, c.candidates, c.agreed_us, c.chosen);
  }
  if (announce_) {
    std::string line = "allreduce tuned for " + bytes_label(d.min_bytes) + " up to " + bytes_label(d.max_bytes + 1) +
                       " over " + std::to_string(ranks) + " ranks: " + d.chosen + " (measured:";
    for (size_t i = 0; i < d.measured_us.size(); ++i) {
      char figure[64];
      std::snprintf(figure, sizeof(figure), "%s %s %.0f us", i == 0 ? "" : ",", d.measured_us[i].first.c_str(),
                    d.measured_us[i].second);
      line += figure;
    }
    log(LogLevel::kInfo, line + ")");
  }
}

void MeasuredAllreduce::keep(const std::vector<TunedAllreduce>& decisions) {
  std::map<std::pair<int, int>, Kept> add;
  for (const TunedAllreduce& d : decisions) {
    const int cls = plan::size_class(d.min_bytes);
    const plan::ByteRange range = plan::size_class_bytes(cls);
    const std::string which = "keep_tuned_allreduce: the decision for " + std::to_string(d.min_bytes) + " to " +
                              std::to_string(d.max_bytes) + " bytes over " + std::to_string(d.ranks) + " ranks";
    if (d.ranks < 1 || range.min_bytes != d.min_bytes || range.max_bytes != d.max_bytes) {
      throw UsageError("chorus: " + which + " is not one of tuned_allreduce()'s size classes (bytes from a power of "
                       "two up to the next, at least one rank); pass back what tuned_allreduce() returned");
    }
    Kept k;
    if (!parse_allreduce_algorithm(d.chosen, &k.chosen) || k.chosen == AllreduceAlgorithm::kAuto ||
        k.chosen == AllreduceAlgorithm::kTuned) {
      throw UsageError("chorus: " + which + " keeps '" + d.chosen +
                       "'; it must name an algorithm: ring, recursive_doubling or rabenseifner");
    }
    for (const auto& [name, us] : d.measured_us) {
      AllreduceAlgorithm a;
      if (!parse_allreduce_algorithm(name, &a) || a == AllreduceAlgorithm::kAuto || a == AllreduceAlgorithm::kTuned) {
        throw UsageError("chorus: " + which + " lists a time for '" + name + "', which is not an algorithm");
      }
      k.candidates.push_back(a);
      k.agreed_us.push_back(us);
    }
    if (k.candidates.empty()) k.candidates.push_back(k.chosen);
    add[{d.ranks, cls}] = std::move(k);
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [key, k] : add) kept_[key] = std::move(k);
}

std::vector<TunedAllreduce> MeasuredAllreduce::decided() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<TunedAllreduce> out;
  for (const auto& [key, c] : classes_) {
    if (c.done) out.push_back(describe(key.first, key.second, c.candidates, c.agreed_us, c.chosen));
  }
  return out;
}

}  // namespace chorus::algo
