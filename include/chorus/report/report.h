// chorus::report: turns run directories (docs/run-records.md) into one self-contained HTML page
// with gnuplot's SVG figures inlined: loss and user scalars against steps and wall time,
// throughput, the step-time breakdown and a table of runs (docs/report.md).
//
// The work is split into pure steps, each testable without files or child processes:
//   parse_metrics / parse_run  text -> RunRecords
//   plan_figures               runs -> Figure (series of points, axis labels)
//   gnuplot_script             Figure -> the script gnuplot turns into SVG
//   summarize_runs             runs -> the table's rows
//   render_html                runs, rows, SVGs -> the page
// write_report does the I/O around them: reads the directories, runs gnuplot once per figure (a
// child process with a deadline), writes OUT_DIR/index.html and OUT_DIR/figures/*.{gp,svg}.
//
// Errors: a directory that is not a run directory, or a line of metrics.jsonl that is not a
// record, is a chorus::UsageError naming the file (and `file:line`); gnuplot missing, failing or
// running past its deadline is a chorus::Error naming the package, its stderr or the deadline.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "chorus/comm/error.h"

namespace chorus::report {

// One `type: "step"` line. Keys a line leaves out are NaN.
struct StepRecord {
  int64_t step = 0;
  int64_t epoch = 0;
  double time = 0;  // seconds since the run began
  double loss = 0;
  double lr = 0;
  double samples = 0;
  double samples_per_s = 0;
  double step_ms = 0;
  double data_ms = 0;
  double forward_ms = 0;
  double backward_ms = 0;
  double optimizer_ms = 0;
  double comm_ms = 0;
  double comm_wait_ms = 0;
};

// A step line's text (one JSON object, no newline) for `r`, as the Accelerator writes it to
// metrics.jsonl and parse_metrics reads it: the one definition of the line (docs/run-records.md).
// step, epoch and samples are written as integers; samples_per_s (samples over step_ms) and hidden
// (the share of comm_ms not waited for) are derived, so r.samples_per_s is not read. A NaN field is
// written as null, which parse_metrics reads back as NaN.
std::string format_step_line(const StepRecord& r);

// One `type: "log"` line: the user's scalars.
struct ScalarRecord {
  int64_t step = 0;
  int64_t epoch = 0;
  double time = 0;
  std::map<std::string, double> values;
};

// One `type: "event"` line: start, resume, save, stop or finish.
struct EventRecord {
  std::string event;
  int64_t step = 0;
  int64_t epoch = 0;
  double time = 0;
  std::string detail;  // the event's other keys as compact JSON, e.g. {"attempt":1,"path":"..."}
};

// The records of one metrics.jsonl, as the run's latest attempt left them: a `resume` at step s,
// or a step line that goes back to step s, drops the earlier attempt's records after s (they were
// redone), so every step appears once. Events are all kept, in file order.
struct Metrics {
  std::vector<StepRecord> steps;
  std::vector<ScalarRecord> scalars;
  std::vector<EventRecord> events;
};

// Parses metrics.jsonl's text. `path` only names the file in errors ("path:line: why"). Empty lines
// are skipped and unknown `type`s ignored (later versions may add some); a line that is not a JSON
// object, has no `type`, or a step/log/event line without a numeric `step` and `time` is an error.
Metrics parse_metrics(const std::string& text, const std::string& path);

// summary.json, written when the run finished or stopped.
struct Summary {
  std::string status;  // "finished" or "stopped"
  int64_t steps = 0;
  double samples_per_s = 0;
  double train_seconds = 0;
  double wall_seconds = 0;
};

struct RunRecords {
  std::string dir;         // as given on the command line
  std::string name;        // config.json's run_name, else the directory's last component
  int world_size = 0;      // config.json's
  std::string host;        // config.json's, "" if absent
  std::string started;     // config.json's, "" if absent
  std::string command;     // config.json's argv joined with spaces
  std::optional<Summary> summary;  // absent while a run is going, or after it was killed
  Metrics metrics;
};

// Builds a RunRecords from the files' text; `summary_json` empty = no summary.json. `dir` names the
// files in errors.
RunRecords parse_run(const std::string& dir, const std::string& config_json, const std::string& metrics_jsonl,
              const std::string& summary_json);

// Reads dir/config.json, dir/metrics.jsonl and, if present, dir/summary.json. UsageError naming
// the missing file (and what a run directory holds) when dir is not a run directory.
RunRecords load_run(const std::string& dir);

// "name (2 workers)": the legend and table label of each run, in order. Runs whose labels would be
// the same (same name and world size) are named by their directories instead.
std::vector<std::string> run_labels(const std::vector<RunRecords>& runs);

struct Series {
  std::string label;
  std::vector<double> x, y;
  // A centred moving mean of y over this many points is drawn over the raw points (then drawn
  // faint); 1 = none.
  int smooth = 1;
  int color = 0;  // index into the palette: a run keeps its colour in every figure
  // Indices of points the line does not join to the previous one: on wall-time axes, the first
  // step after a resume (the time between is the restart and the lost work, not training).
  std::vector<size_t> breaks;
};

struct Figure {
  enum class Kind { kLines, kPoints, kStackedBars };
  std::string id;     // file name stem and HTML anchor: "loss_vs_step"
  std::string title;  // "Loss against step"
  std::string xlabel, ylabel;
  Kind kind = Kind::kLines;
  std::vector<Series> series;
  // kStackedBars: one bar per run (categories, the runs' labels), one segment per series (the
  // phases), series[i].y[j] = run j's mean of phase i.
  std::vector<std::string> categories;
  // Line and point figures: the y axis starts at 0; x tics only at these values (none: gnuplot's);
  // the x axis starts at 0.
  bool y_from_zero = false;
  std::vector<double> xtics;
  bool x_from_zero = false;
  // kStackedBars: how the total above each bar is printed (a gnuplot sprintf format).
  std::string total_format = "%.1f ms";
};

// The page's figures, in page order: loss against step and against wall time, each user scalar,
// throughput against step, throughput against workers (when the runs have two or more world sizes:
// each size's mean samples/s, and linear scaling from the smallest), the step-time breakdown. Every
// run with data is one series of a line figure; a figure no run has data for is left out. Wall time
// is in seconds, or minutes when the longest run is over 20 minutes.
//
// A user scalar is drawn by how it was logged: with at most two values in every run (a one- or
// two-epoch job's test accuracy), as a value: a bar per run of its last value ("<key>_last"), and
// with several runs also against wall time, which compares when each got there ("<key>_vs_time");
// logged at most once per epoch in every run (evaluation results), against epochs completed (the
// record's epoch + 1, on an axis from 0) and wall time ("<key>_vs_epoch", "<key>_vs_time");
// otherwise against step and wall time ("<key>_vs_step", "<key>_vs_time").
//
// The breakdown's phases are data, forward, backward's own work (backward_ms - comm_wait_ms: the
// wait happens inside backward()), comm wait, optimizer and other (step_ms minus the rest: the
// loop's own code), each the mean over the run's steps.
std::vector<Figure> plan_figures(const std::vector<RunRecords>& runs);

struct FigureStyle {
  int width = 620;  // SVG size in pixels
  int height = 380;
  std::string font = "sans,11";
  // Points drawn per line at most (a long run's SVG stays small). Past it, each of max_points/2
  // buckets of consecutive points keeps its lowest and highest (spikes stay visible), and a
  // smoothed line keeps one point per bucket.
  size_t max_points = 2000;
};

// The gnuplot script that draws `figure` as SVG on standard output. The data are inline (`$d0 <<
// EOD` blocks), so the script is self-contained; labels are written noenhanced (no '_' subscripts).
std::string gnuplot_script(const Figure& figure, const FigureStyle& style = {});

// One row of the runs table.
struct RunRow {
  std::string label;
  std::string dir;
  int world_size = 0;
  int64_t steps = 0;
  double samples_per_s = 0;  // summary.json's, else all samples over the sum of step times
  double speedup = 0;        // samples_per_s over that of the first run with the smallest world size
  double final_loss = 0;     // NaN when no steps
  std::map<std::string, double> final_scalars;  // the last value of each user scalar
  std::string status;        // summary's status, else "no summary (running or killed)"
  double wall_seconds = 0;   // summary's, else the last record's time
  int resumes = 0;
  std::vector<std::pair<std::string, double>> phase_ms_mean;  // the breakdown's phases, in order
};

std::vector<RunRow> summarize_runs(const std::vector<RunRecords>& runs);

// A figure's SVG as gnuplot wrote it.
struct RenderedFigure {
  Figure figure;
  std::string svg;
};

// The page: self-contained (inline CSS and SVG, no script, nothing loaded from elsewhere). Each
// SVG's XML prolog is dropped and its ids are prefixed with the figure's id, so that the inlined
// figures' ids (gnuplot names them all alike) stay unique in the page.
std::string render_html(const std::vector<RunRecords>& runs, const std::vector<RunRow>& rows,
                        const std::vector<RenderedFigure>& figures, const std::string& generated_at);

// `svg` with the XML prolog and doctype dropped and every id, href="#id" and url(#id) prefixed
// with `prefix` + "-".
std::string inline_svg(const std::string& svg, const std::string& prefix);

struct ReportOptions {
  std::vector<std::string> run_dirs;
  // "" = default_out_dir(run_dirs).
  std::string out_dir;
  std::string gnuplot = "gnuplot";  // program name (searched in PATH) or path
  std::chrono::milliseconds gnuplot_timeout{30000};  // per figure
  FigureStyle style;
};

// RUN_DIR/report for one run (the report lives with its run); ./chorus-report for several.
std::string default_out_dir(const std::vector<std::string>& run_dirs);

// Reads the runs, draws the figures, writes OUT_DIR/index.html (and OUT_DIR/figures/NAME.gp and
// NAME.svg, the scripts and their output, for reuse). Returns index.html's path.
std::string write_report(const ReportOptions& options);

}  // namespace chorus::report
