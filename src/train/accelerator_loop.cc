// The Accelerator's side of the training loop: epochs() and the prepared loaders call these hooks.
// Each optimizer step ends at a step boundary, which writes this rank's step record, every 25
// steps gathers the ranks' records into rank 0's aggregate, draws the progress line, checks for a
// stop signal (agreed on by all ranks, one step behind) and saves the state when one is due;
// end_training writes the summary. Stop signals save the state and, by default, end the process.
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "accelerator_internal.h"
#include "chorus/comm/signals.h"

namespace chorus::train {

namespace {

const char* signal_name(int sig) {
  switch (sig) {
    case SIGTERM: return "SIGTERM";
    case SIGUSR1: return "SIGUSR1";
    case SIGUSR2: return "SIGUSR2";
    case SIGINT: return "SIGINT";
    case SIGHUP: return "SIGHUP";
    default: return "a signal";
  }
}
}  // namespace

void Accelerator::ensure_started() {
  if (started_) return;
  started_ = true;
  if (resume_) load_state();
  first_step_ = global_step_;
  nlohmann::json event = {{"type", "event"}, {"event", global_step_ > 0 ? "resume" : "start"},
                          {"step", global_step_}, {"epoch", epoch()}, {"time", elapsed()},
                          {"attempt", restart_count_}};
  records_->recorder.line(event, rank_ == 0);
  records_->recorder.flush();
}

int64_t Accelerator::start_training(int64_t epochs) {
  if (epochs < 0) throw UsageError(who() + ": epochs(" + std::to_string(epochs) + "): the number of epochs is negative");
  ensure_started();
  epochs_ = epochs;
  const int64_t first = loaders_.empty() ? 0 : loaders_.front()->resume_epoch();
  planned_steps_ = 0;
  if (!loaders_.empty()) {
    const auto& l = *loaders_.front();
    const int64_t k = options_.gradient_accumulation_steps;
    const int64_t per_epoch = (l.batches_per_epoch + k - 1) / k;
    const int64_t done_in_epoch = (l.resume_position() + k - 1) / k;
    planned_steps_ = global_step_ + std::max<int64_t>(0, (epochs - first) * per_epoch - done_in_epoch);
  }
  if (options_.max_steps > 0) {
    planned_steps_ = planned_steps_ > 0 ? std::min(planned_steps_, options_.max_steps) : options_.max_steps;
  }
  {
    std::ostringstream line;
    line << "training: " << world_size_ << " rank(s) over " << group_->transport() << ", epochs " << first + 1 << ".."
         << epochs;
    if (planned_steps_ > 0) line << ", " << planned_steps_ - global_step_ << " optimizer step(s)";
    if (options_.records) line << ", records in " << run_dir_;
    notice(line.str());
  }
  timing_->reset_step(Clock::now());
  return first;
}

void Accelerator::begin_epoch(int64_t epoch) {
  for (auto& l : loaders_) {
    if (l->resume_epoch() == epoch) continue;  // already there (resumed mid-epoch, or the next pass)
    l->sampler->set_epoch(epoch);
    l->pass_completed = false;
    l->skip = 0;
  }
}

void Accelerator::end_epoch() {
  settle_step();
  if (options_.checkpoint_each_epoch && saved_step_ != global_step_) save_state();
  if (const int sig = agree_on_signal()) stop(sig);
}

bool Accelerator::training_done(int64_t epoch, int64_t epochs) {
  const bool done = epoch >= epochs || stopped_ || (options_.max_steps > 0 && global_step_ >= options_.max_steps);
  if (done) {
    end_training();
    return true;
  }
  begin_epoch(epoch);
  return false;
}

bool Accelerator::step_boundary() {
  settle_step();
  return stopped_ || (options_.max_steps > 0 && global_step_ >= options_.max_steps);
}

void Accelerator::settle_step() {
  if (global_step_ == settled_step_) return;
  settled_step_ = global_step_;
  finish_step();
}

void Accelerator::finish_step() {
  auto& t = *timing_;
  const auto now = Clock::now();
  struct BoundaryTimer {  // the boundary's own cost (records, progress, aggregate, signal check)
    Clock::time_point start;
    double* total;
    ~BoundaryTimer() { *total += seconds_between(start, Clock::now()); }
  } boundary_timer{now, &records_->boundary_seconds};
  detail::StepRow row;
  row.step = global_step_;
  row.epoch = epoch();
  row.time = elapsed();
  row.loss = t.loss_n > 0 ? t.loss_sum / static_cast<double>(t.loss_n) : std::numeric_limits<double>::quiet_NaN();
  row.lr = optimizers_.empty() || optimizers_.front()->param_groups().empty()
               ? 0.0
               : optimizers_.front()->param_groups().front().options().get_lr();
  row.samples = t.samples;
  row.step_ms = 1e3 * seconds_between(t.step_start, now);
  row.data_ms = 1e3 * t.data_s;
  row.forward_ms = 1e3 * t.forward_s;
  row.backward_ms = 1e3 * t.backward_s;
  row.optimizer_ms = 1e3 * t.optimizer_s;
  row.comm_ms = t.comm_ms;
  row.comm_wait_ms = t.comm_wait_ms;
  t.train_seconds += row.step_ms / 1e3;
  t.samples_total += row.samples;
  t.reset_step(now);

  auto& r = *records_;
  r.recorder.step(row);
  r.pending.push_back(row);
  const int64_t done = global_step_ - first_step_;
  const double samples_per_s = t.train_seconds > 0 ? static_cast<double>(world_size_) * t.samples_total / t.train_seconds : 0;
  const double eta = planned_steps_ > 0 && done > 0
                         ? static_cast<double>(planned_steps_ - global_step_) * t.train_seconds / static_cast<double>(done)
                         : -1;
  r.progress.step(global_step_, planned_steps_, row.epoch, epochs_, row.loss, samples_per_s, eta);
  if (global_step_ % options_.log_every == 0) {  // every rank's log, whatever stdout shows
    char line[160];
    std::snprintf(line, sizeof(line), "step %lld  epoch %lld  loss %.4f  %.0f samples/s (this rank x %d)",
                  static_cast<long long>(global_step_), static_cast<long long>(row.epoch + 1), row.loss,
                  samples_per_s, world_size_);
    r.recorder.log_line(line);
  }
  if (global_step_ % 25 == 0) flush_aggregate();
  if (const int sig = poll_signal()) {
    stop(sig);
  } else if (options_.checkpoint_every > 0 && global_step_ % options_.checkpoint_every == 0) {
    const auto save_start = Clock::now();
    save_state();
    records_->boundary_seconds -= seconds_between(save_start, Clock::now());  // a save is no bookkeeping
  }
}

void Accelerator::flush_aggregate() {
  auto& r = *records_;
  if (!options_.records) return;
  const int64_t n = static_cast<int64_t>(r.pending.size());  // the same on every rank: steps agree
  if (n == 0) return;
  const int64_t f = detail::StepRow::kFields;
  at::Tensor mine = at::empty({n * f}, at::kDouble);
  for (int64_t i = 0; i < n; ++i) r.pending[static_cast<size_t>(i)].to_doubles(mine.data_ptr<double>() + i * f);
  at::Tensor all = at::empty({world_size_ * n * f}, at::kDouble);
  dist::all_gather_into_tensor(all, mine, group_);
  r.pending.clear();
  if (rank_ != 0) {
    r.recorder.flush();
    return;
  }
  const double* data = all.data_ptr<double>();
  size_t next_log = 0;
  for (int64_t i = 0; i < n; ++i) {
    std::vector<detail::StepRow> rows;
    for (int w = 0; w < world_size_; ++w) rows.push_back(detail::StepRow::from_doubles(data + (w * n + i) * f));
    const detail::StepRow agg = detail::aggregate_rows(rows);
    // User scalars logged before this step ended come first, in the order they were logged.
    while (next_log < r.pending_logs.size() && r.pending_logs[next_log]["step"].get<int64_t>() < agg.step) {
      r.recorder.aggregate_line(r.pending_logs[next_log++]);  // in rank 0's own file since log()
    }
    r.recorder.aggregate(agg);
    ++r.steps;
    r.samples += agg.samples;
    r.step_ms += agg.step_ms;
    r.data_ms += agg.data_ms;
    r.forward_ms += agg.forward_ms;
    r.backward_ms += agg.backward_ms;
    r.optimizer_ms += agg.optimizer_ms;
    r.comm_ms += agg.comm_ms;
    r.comm_wait_ms += agg.comm_wait_ms;
    r.last_loss = agg.loss;
    r.loss_sum += agg.loss;
  }
  const int64_t last_step = r.pending_logs.empty() ? 0 : global_step_;  // every row up to it is written now
  while (next_log < r.pending_logs.size() && r.pending_logs[next_log]["step"].get<int64_t>() <= last_step) {
    r.recorder.aggregate_line(r.pending_logs[next_log++]);
  }
  r.pending_logs.erase(r.pending_logs.begin(), r.pending_logs.begin() + static_cast<std::ptrdiff_t>(next_log));
  r.recorder.flush();
}

int Accelerator::finish_signal_check() {
  if (!signal_work_) return 0;
  auto work = std::move(signal_work_);
  work->wait();
  return static_cast<int>(signal_value_.item<int64_t>());
}

int Accelerator::poll_signal() {
  if (world_size_ == 1) return pending_signal();
  // The check started at the previous boundary has long finished (a step ran since), so waiting
  // for it costs nothing; the ranks agree one step after the signal arrived.
  if (const int agreed = finish_signal_check()) return agreed;
  signal_value_ = at::tensor({static_cast<int64_t>(pending_signal())}, at::kLong);
  signal_work_ = dist::all_reduce(signal_value_, ReduceOp::kMax, group_, /*async_op=*/true);
  return 0;
}

int Accelerator::agree_on_signal() {
  int64_t sig = pending_signal();
  if (world_size_ > 1) {
    if (const int agreed = finish_signal_check()) return agreed;
    at::Tensor t = at::tensor({sig}, at::kLong);
    dist::all_reduce(t, ReduceOp::kMax, group_);
    sig = t.item<int64_t>();
  }
  return static_cast<int>(sig);
}

void Accelerator::stop(int sig) {
  stopped_ = true;
  notice(std::string("stopping at step ") + std::to_string(global_step_) + " on " + signal_name(sig) +
         ": saving the state in " + state_dir_);
  save_state();
  end_training();
  if (!options_.exit_on_signal) return;
  notice("state saved; the next run with --resume (or a restart by the launcher) continues from step " +
         std::to_string(global_step_));
  records_->progress.close();
  records_->recorder.flush();
  dist::barrier(group_);  // no rank leaves while another still needs it
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(0);
}

void Accelerator::end_training() {
  if (ended_) return;
  ended_ = true;
  settle_step();
  if (const int sig = finish_signal_check(); sig != 0 && !stopped_) {
    notice(std::string("a ") + signal_name(sig) + " arrived as training ended; the state is saved below");
  }
  if (options_.checkpoint_each_epoch && global_step_ > 0 && saved_step_ != global_step_) save_state();
  flush_aggregate();
  auto& r = *records_;
  for (const auto& line : r.pending_logs) r.recorder.aggregate_line(line);  // logged after the last step
  r.pending_logs.clear();
  const double wall = elapsed();
  nlohmann::json event = {{"type", "event"}, {"event", stopped_ ? "stop" : "finish"}, {"step", global_step_},
                          {"epoch", epoch()}, {"time", wall}};
  if (stopped_) event["signal"] = pending_signal();
  r.recorder.line(event, rank_ == 0);
  // All ranks' samples over rank 0's training time (its steps, evaluations and saves excluded):
  // the ranks step together, so this is the job's rate. (The slowest rank's time per step,
  // summed, would count every step's jitter on either rank as lost time.)
  const double train_s = timing_->train_seconds;
  const double samples_per_s = train_s > 0 ? r.samples / train_s : 0;
  if (rank_ == 0) {
    auto mean = [&](double total) { return r.steps > 0 ? total / static_cast<double>(r.steps) : 0.0; };
    nlohmann::json summary = {
        {"run_name", options_.run_name},
        {"world_size", world_size_},
        {"status", stopped_ ? "stopped" : "finished"},
        {"steps", global_step_},
        {"steps_this_attempt", global_step_ - first_step_},
        {"epochs_completed", loaders_.empty() ? 0 : loaders_.front()->resume_epoch()},
        {"samples", r.samples},
        {"samples_per_s", samples_per_s},
        {"train_seconds", train_s},
        {"wall_seconds", wall},
        {"loss", std::isnan(r.last_loss) ? nlohmann::json(nullptr) : nlohmann::json(r.last_loss)},
        {"last", r.last_scalars},
        // Rank 0's time in step boundaries (records, progress, the aggregate's gather, the signal
        // check; saves excluded) as a share of its training time: the bookkeeping's cost.
        {"boundary_share", timing_->train_seconds > 0 ? r.boundary_seconds / timing_->train_seconds : 0.0},
        {"step_ms_mean",
         {{"step", mean(r.step_ms)},
          {"data", mean(r.data_ms)},
          {"forward", mean(r.forward_ms)},
          {"backward", mean(r.backward_ms)},
          {"optimizer", mean(r.optimizer_ms)},
          {"comm", mean(r.comm_ms)},
          {"comm_wait", mean(r.comm_wait_ms)}}},
    };
    r.recorder.write_json("summary.json", summary);
  }
  if (!stopped_) {
    char line[256];
    std::snprintf(line, sizeof(line), "done: %lld steps, %.0f samples/s, train loss %.4f (mean), %.1f s%s%s",
                  static_cast<long long>(global_step_ - first_step_), samples_per_s,
                  r.steps > 0 ? r.loss_sum / static_cast<double>(r.steps) : 0.0, wall,
                  options_.records ? "; records in " : "", options_.records ? run_dir_.c_str() : "");
    notice(line);
  }
  r.recorder.flush();
}

}  // namespace chorus::train
