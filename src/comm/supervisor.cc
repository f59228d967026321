#include "chorus/comm/supervisor.h"

#include <algorithm>

namespace chorus {

int root_cause(const std::vector<ExitReport>& exits) {
  int best = -1, best_score = -1;
  double best_time = 0.0;
  for (size_t i = 0; i < exits.size(); ++i) {
    const ExitReport& e = exits[i];
    if (!e.failed()) continue;
    int score;
    double time = static_cast<double>(i);  // without a record: the order seen
    if (e.recorded) {
      score = e.relayed ? 1 : 4;
      time = e.recorded_at;
    } else {
      score = e.signal != 0 ? 3 : 2;
    }
    if (score > best_score || (score == best_score && time < best_time)) {
      best = static_cast<int>(i);
      best_score = score;
      best_time = time;
    }
  }
  return best;
}

Supervisor::Supervisor(Options options, Clock::time_point start)
    : options_(options),
      deadline_(options.timeout.count() > 0 ? start + options.timeout : Clock::time_point::max()) {}

void Supervisor::on_exit(const ExitReport& report, Clock::time_point now) {
  exits_.push_back(report);
  if (report.failed() && !decided_ && !timed_out_ && !stopping_ && decide_at_ == Clock::time_point::max()) {
    decide_at_ = now + options_.failure_window;
  }
}

void Supervisor::on_record(const ExitReport& report, Clock::time_point now) {
  for (const ExitReport& e : exits_) {
    if (e.rank == report.rank) return;  // reaped already: its exit report has the record
  }
  for (const ExitReport& r : records_) {
    if (r.rank == report.rank) return;
  }
  ExitReport r = report;
  r.recorded = true;
  if (!r.failed()) r.exit_code = 1;  // it is failing
  records_.push_back(r);
  if (!decided_ && !timed_out_ && !stopping_ && decide_at_ == Clock::time_point::max()) {
    decide_at_ = now + options_.failure_window;
  }
}

void Supervisor::on_stop(Clock::time_point now) {
  if (stopping_) return;
  stopping_ = true;
  kill_at_ = std::min(kill_at_, now + options_.grace_period);
}

void Supervisor::on_remote_failure(Clock::time_point now) {
  if (decided_ || timed_out_ || stopping_) return;
  decided_ = true;
  root_ = -1;
  terminate_due_ = true;
  kill_at_ = now + options_.grace_period;
}

Supervisor::Send Supervisor::step(Clock::time_point now, size_t running) {
  const bool undecided = !decided_ && !timed_out_ && !stopping_;
  if (undecided && decide_at_ != Clock::time_point::max() && (now >= decide_at_ || running == 0)) {
    decided_ = true;
    // The exits, then the records of processes still running (those reaped are in exits_).
    std::vector<ExitReport> all = exits_;
    for (const ExitReport& r : records_) {
      bool reaped = false;
      for (const ExitReport& e : exits_) reaped = reaped || e.rank == r.rank;
      if (!reaped) all.push_back(r);
    }
    const int cause = root_cause(all);
    root_ = cause < 0 ? -1 : all[static_cast<size_t>(cause)].rank;
    terminate_due_ = true;
    kill_at_ = now + options_.grace_period;
  } else if (undecided && running > 0 && now >= deadline_) {
    timed_out_ = true;
    terminate_due_ = true;
    kill_at_ = now + options_.grace_period;
  }
  if (terminate_due_) {
    terminate_due_ = false;
    return running > 0 ? Send::kTerminate : Send::kNothing;
  }
  if (!killed_ && now >= kill_at_) {
    killed_ = true;
    return running > 0 ? Send::kKill : Send::kNothing;
  }
  return Send::kNothing;
}

Supervisor::Clock::time_point Supervisor::next_wakeup() const {
  if (terminate_due_) return Clock::time_point::min();
  Clock::time_point next = killed_ ? Clock::time_point::max() : kill_at_;
  if (!decided_ && !timed_out_ && !stopping_) next = std::min({next, decide_at_, deadline_});
  return next;
}

}  // namespace chorus
