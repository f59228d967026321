// Internal to chorus_train: what the Accelerator's sources share. accelerator.cc holds its
// construction, prepare_*, backward, metrics and logging; accelerator_loop.cc the loop's hooks
// (epochs, step boundaries, the per-step records and their aggregate, stop signals, the end of
// training); accelerator_state.cc save_state and load_state; run_job.cc the process-wide helpers
// (run_job, set_num_threads, tune_malloc_for_training). Here: the Accelerator's measurements of the
// step in progress (Timing) and the run directory's writer with rank 0's totals (Records).
#pragma once

#include <chrono>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <vector>

#include "chorus/train/accelerator.h"
#include "run_record.h"

namespace chorus::train {

using Clock = std::chrono::steady_clock;

inline double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}


// The Accelerator's measurements of the step in progress, and of the run.
struct Accelerator::Timing {
  Clock::time_point created = Clock::now();
  Clock::time_point step_start = Clock::now();  // end of the previous step, or start of a pass
  double elapsed_offset = 0;                    // seconds of the run before this process (resumed)
  double data_s = 0, forward_s = 0, backward_s = 0, optimizer_s = 0, comm_ms = 0, comm_wait_ms = 0;
  double loss_sum = 0;
  int64_t loss_n = 0;
  double samples = 0;
  // This rank's totals since this process started training.
  double train_seconds = 0;
  double samples_total = 0;

  void reset_step(Clock::time_point now) {
    step_start = now;
    data_s = forward_s = backward_s = optimizer_s = comm_ms = comm_wait_ms = 0;
    loss_sum = 0;
    loss_n = 0;
    samples = 0;
  }
};

// The run directory's writer and rank 0's progress, with what the aggregate still needs.
struct Accelerator::Records {
  detail::RunRecorder recorder;
  detail::Progress progress{false, false, 1};
  std::vector<detail::StepRow> pending;    // this rank's rows not yet aggregated
  std::vector<nlohmann::json> pending_logs;  // rank 0's log lines, written with the aggregate in step order
  nlohmann::json last_scalars = nlohmann::json::object();
  // Aggregate totals over this process's steps (rank 0).
  int64_t steps = 0;
  double samples = 0, step_ms = 0, data_ms = 0, forward_ms = 0, backward_ms = 0, optimizer_ms = 0, comm_ms = 0,
         comm_wait_ms = 0;
  double last_loss = std::numeric_limits<double>::quiet_NaN();
  double loss_sum = 0;
  double boundary_seconds = 0;  // this rank's time in step boundaries, saves excluded
};

}  // namespace chorus::train
