#include "measured_allreduce.h"

#include <chrono>
#include <cstdio>

#include "algorithms.h"
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
  int index = 0;
  int n_candidates = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto [it, fresh] = classes_.try_emplace({ranks, cls});
    Class& c = it->second;
    if (fresh) {
      c.candidates = plan::tuning_candidates(bytes, count, ranks, tune.link);
      c.us.resize(c.candidates.size());
      if (plan::tuning_calls(static_cast<int>(c.candidates.size())) == 0) {
        c.done = true;
        c.chosen = c.candidates.front();
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

std::vector<TunedAllreduce> MeasuredAllreduce::decided() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<TunedAllreduce> out;
  for (const auto& [key, c] : classes_) {
    if (c.done) out.push_back(describe(key.first, key.second, c.candidates, c.agreed_us, c.chosen));
  }
  return out;
}

}  // namespace chorus::algo
