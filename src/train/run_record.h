// Internal to chorus_train: the run directory's files (docs/run-records.md) and rank 0's progress
// display. No libtorch, no communication: the Accelerator gathers what the aggregate needs.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "chorus/comm/environment.h"

namespace chorus::train {
// Defined in run_record.cc; declared for users in chorus/train/accelerator.h.
bool stdout_rewrites_in_place(const Environment& env, bool stdout_is_terminal);
bool stdout_rewrites_in_place();
}  // namespace chorus::train

namespace chorus::train::detail {

// One optimizer step as one rank measured it (times in milliseconds, time in seconds).
struct StepRow {
  int64_t step = 0;
  int64_t epoch = 0;
  double time = 0;
  double loss = 0;
  double lr = 0;
  double samples = 0;
  double step_ms = 0;
  double data_ms = 0;
  double forward_ms = 0;
  double backward_ms = 0;
  double optimizer_ms = 0;
  double comm_ms = 0;
  double comm_wait_ms = 0;

  static constexpr int kFields = 13;
  void to_doubles(double* out) const;
  static StepRow from_doubles(const double* in);
  std::string to_line() const;  // the step line of metrics files (report::format_step_line)
};

// Rows of the same step from every rank, to the aggregate's row: loss and phases averaged, samples
// summed, step_ms the slowest rank's. Pure.
StepRow aggregate_rows(const std::vector<StepRow>& ranks);

// Drops the lines of a JSON Lines file whose "step" is beyond `step` (a resumed run replays them);
// lines without a step stay. Missing file: nothing to do. Throws std::runtime_error on I/O errors.
void truncate_jsonl_after(const std::string& path, int64_t step);

// The run directory's files of one rank. Disabled: every call does nothing.
class RunRecorder {
 public:
  RunRecorder() = default;
  // Creates dir/metrics and dir/logs. `fresh`: truncate this rank's files (and rank 0's aggregate),
  // else append. Throws std::runtime_error naming the path that cannot be written.
  RunRecorder(std::string dir, int rank, bool fresh);
  void open(bool fresh);
  ~RunRecorder();
  RunRecorder(const RunRecorder&) = delete;
  RunRecorder& operator=(const RunRecorder&) = delete;
  RunRecorder(RunRecorder&& other) noexcept;
  RunRecorder& operator=(RunRecorder&& other) noexcept;

  bool enabled() const { return rank_file_ != nullptr; }
  const std::string& dir() const { return dir_; }

  void step(const StepRow& row);                                  // this rank's file
  void aggregate(const StepRow& row);                             // rank 0's aggregate
  void line(nlohmann::json object, bool to_aggregate);            // a "log" or "event" line
  void aggregate_line(const nlohmann::json& object);              // a line for the aggregate only
  // A resumed run: drops the lines beyond `step` from this rank's files (and the aggregate).
  void rewind(int64_t step);
  void log_line(const std::string& text);                         // logs/rank-<r>.log, time-stamped
  void write_json(const std::string& name, const nlohmann::json& doc);  // atomically, rank 0's files
  void flush();

 private:
  void close();
  void put_aggregate(const nlohmann::json& object);  // the aggregate, and its mirror
  void put_aggregate_text(const std::string& line);

  std::string dir_;
  int rank_ = 0;
  std::FILE* rank_file_ = nullptr;
  std::FILE* aggregate_file_ = nullptr;
  std::FILE* log_file_ = nullptr;
  // Rank 0 under chorus.dask (CHORUS_DASK_METRICS names a file its worker tails): every aggregate
  // line is appended there too, line-buffered, and reaches the client while the job runs.
  std::FILE* mirror_file_ = nullptr;
};


// Rank 0's progress on stdout: a bar rewritten in place (at most 4 times a second) on a terminal,
// else a plain line every `every` steps and at the last.
class Progress {
 public:
  Progress(bool active, bool in_place, int64_t every) : active_(active), in_place_(in_place), every_(every) {}
  // planned: steps in all (0 when unknown); eta_s < 0: unknown.
  void step(int64_t step, int64_t planned, int64_t epoch, int64_t epochs, double loss, double samples_per_s,
            double eta_s);
  // A whole line, after ending the bar.
  void line(const std::string& text);
  // The bar's line ended (before the process exits or prints elsewhere).
  void close();
  bool in_place() const { return in_place_; }

 private:
  bool active_;
  bool in_place_;
  int64_t every_;
  bool open_ = false;
  double loss_sum_ = 0;
  int64_t loss_n_ = 0;
  std::chrono::steady_clock::time_point last_ = {};
};

// "1:02:03" for 3723 seconds.
std::string hms(double seconds);

}  // namespace chorus::train::detail
