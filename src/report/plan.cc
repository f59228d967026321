// Planning the page: runs to figures (series of points), figures to gnuplot scripts, runs to the
// table's rows. Pure: no files, no processes.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "chorus/report/report.h"
#include "palette.h"

namespace chorus::report {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Centred moving-mean window for n noisy points: about 1/40 of the run, at most 50 steps.
int smooth_window(size_t n) {
  if (n < 40) return 1;
  return static_cast<int>(std::min<size_t>(50, n / 40)) | 1;  // odd, so the window is centred
}

std::vector<double> moving_mean(const std::vector<double>& y, int window) {
  std::vector<double> out(y.size());
  const long half = window / 2;
  const long n = static_cast<long>(y.size());
  for (long i = 0; i < n; ++i) {
    const long lo = std::max(0L, i - half), hi = std::min(n - 1, i + half);
    double sum = 0;
    for (long k = lo; k <= hi; ++k) sum += y[static_cast<size_t>(k)];
    out[static_cast<size_t>(i)] = sum / static_cast<double>(hi - lo + 1);
  }
  return out;
}

// Bar labels side by side when they fit under their bars (about 7 px a character at 11 px), else
// slanted, steeper when the bars are narrow.
std::string bar_label_rotation(const std::vector<std::string>& labels, const FigureStyle& style) {
  const double slot = 0.8 * style.width / static_cast<double>(std::max<size_t>(1, labels.size()));
  size_t longest = 0;
  for (const auto& l : labels) longest = std::max(longest, l.size());
  if (static_cast<double>(longest) * 7 <= slot) return "";
  return slot >= 60 ? " rotate by 25 right" : " rotate by 60 right";
}

// The indices of y's points to draw, at most about max_points of them: all when they fit; else, per
// bucket of consecutive points, the lowest and highest in index order (`envelope`) or the first,
// and always the last point.
std::vector<size_t> drawn_points(const std::vector<double>& y, size_t max_points, bool envelope) {
  std::vector<size_t> out;
  const size_t n = y.size();
  if (n <= max_points || max_points < 4) {
    for (size_t k = 0; k < n; ++k) out.push_back(k);
    return out;
  }
  const size_t buckets = envelope ? max_points / 2 : max_points - 1;
  const size_t width = (n + buckets - 1) / buckets;
  for (size_t lo = 0; lo < n; lo += width) {
    const size_t hi = std::min(n, lo + width);
    if (!envelope) {
      out.push_back(lo);
      continue;
    }
    size_t min_k = lo, max_k = lo;
    for (size_t k = lo; k < hi; ++k) {
      if (y[k] < y[min_k]) min_k = k;
      if (y[k] > y[max_k]) max_k = k;
    }
    out.push_back(std::min(min_k, max_k));
    if (max_k != min_k) out.push_back(std::max(min_k, max_k));
  }
  if (out.back() != n - 1) out.push_back(n - 1);
  return out;
}

double mean_of(const std::vector<StepRecord>& steps, double StepRecord::*field) {
  double sum = 0;
  size_t n = 0;
  for (const auto& s : steps) {
    const double v = s.*field;
    if (std::isfinite(v)) {
      sum += v;
      ++n;
    }
  }
  return n == 0 ? kNaN : sum / static_cast<double>(n);
}

std::vector<std::pair<std::string, double>> phase_means(const RunRecords& run) {
  const auto& s = run.metrics.steps;
  auto or0 = [](double v) { return std::isfinite(v) ? v : 0.0; };
  const double data = or0(mean_of(s, &StepRecord::data_ms));
  const double forward = or0(mean_of(s, &StepRecord::forward_ms));
  const double backward = or0(mean_of(s, &StepRecord::backward_ms));
  const double wait = or0(mean_of(s, &StepRecord::comm_wait_ms));
  const double optimizer = or0(mean_of(s, &StepRecord::optimizer_ms));
  const double step = or0(mean_of(s, &StepRecord::step_ms));
  const double own_backward = std::max(0.0, backward - wait);
  const double other = std::max(0.0, step - (data + forward + backward + optimizer));
  return {{"data", data},   {"forward", forward},     {"backward", own_backward},
          {"comm wait", wait}, {"optimizer", optimizer}, {"other", other}};
}

// gnuplot single-quoted string: no escapes but '' for a quote.
std::string quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') out += "''";
    else if (c == '\n' || c == '\r') out += ' ';
    else out += c;
  }
  return out + "'";
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}

std::string figure_id(const std::string& key) {
  std::string id;
  for (char c : key) id += std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' ? c : '_';
  return id;
}

// A gnuplot colour: '#RRGGBB', or '#AARRGGBB' with AA the transparency (00 opaque).
std::string color(const char* rgb, const char* alpha = "") { return std::string("'#") + alpha + rgb + "'"; }

// One record's value of a series: its step, epoch and time say where it goes on each axis.
struct Point {
  int64_t step;
  double time;
  double value;
  int64_t epoch = 0;
};

// What a figure's x axis is.
enum class XAxis { kStep, kTime, kEpoch };

// On a wall-time axis, a series' line breaks before its first point after each resume: the time
// between is the restart and the redone work, not training.
class ResumeBreaks {
 public:
  ResumeBreaks(const RunRecords& run, bool against_time) {
    if (!against_time) return;
    for (const auto& e : run.metrics.events) {
      if (e.event == "resume") resumed_at_.push_back(e.step);
    }
  }
  // Call before appending the point of `step` to `s`.
  void add(int64_t step, Series* s) {
    for (int64_t r : resumed_at_) {
      if (previous_ >= 0 && previous_ <= r && step > r) s->breaks.push_back(s->x.size());
    }
    previous_ = step;
  }

 private:
  std::vector<int64_t> resumed_at_;
  int64_t previous_ = -1;
};

using Points = std::vector<Point>;
using PointsOf = std::function<Points(const RunRecords&)>;

// Figures against step or wall time, a series per run that has points. The time axis is in
// minutes when the longest run took more than 20 minutes.
class LineFigures {
 public:
  explicit LineFigures(const std::vector<RunRecords>& runs) : runs_(runs), labels_(run_labels(runs)) {
    double max_time = 0;
    for (const auto& r : runs) {
      if (!r.metrics.steps.empty()) max_time = std::max(max_time, r.metrics.steps.back().time);
    }
    minutes_ = max_time > 20 * 60;
  }

  Figure make(const std::string& id, const std::string& title, const std::string& ylabel, Figure::Kind kind,
              bool against_time, const PointsOf& points) const {
    return make(id, title, ylabel, kind, against_time ? XAxis::kTime : XAxis::kStep, points);
  }

  Figure make(const std::string& id, const std::string& title, const std::string& ylabel, Figure::Kind kind, XAxis axis,
              const PointsOf& points) const {
    const bool against_time = axis == XAxis::kTime;
    const double time_scale = minutes_ ? 1.0 / 60 : 1.0;
    Figure f;
    f.id = id;
    f.title = title;
    f.xlabel = against_time ? (minutes_ ? "wall time (min)" : "wall time (s)")
               : axis == XAxis::kEpoch ? "epochs completed"
                                       : "step";
    f.ylabel = ylabel;
    f.kind = kind;
    f.x_from_zero = axis == XAxis::kEpoch;
    int64_t last_epoch = 0;
    for (size_t i = 0; i < runs_.size(); ++i) {
      Series s;
      s.label = labels_[i];
      s.color = static_cast<int>(i);
      ResumeBreaks breaks(runs_[i], against_time);
      for (const Point& p : points(runs_[i])) {
        if (!std::isfinite(p.value)) continue;
        breaks.add(p.step, &s);
        s.x.push_back(against_time ? p.time * time_scale
                      : axis == XAxis::kEpoch ? static_cast<double>(p.epoch + 1)
                                              : static_cast<double>(p.step));
        s.y.push_back(p.value);
        last_epoch = std::max(last_epoch, p.epoch + 1);
      }
      if (kind == Figure::Kind::kLines) s.smooth = smooth_window(s.y.size());
      if (!s.x.empty()) f.series.push_back(std::move(s));
    }
    if (axis == XAxis::kEpoch && last_epoch <= 20) {  // a tic per epoch while they fit
      for (int64_t e = 0; e <= last_epoch; ++e) f.xtics.push_back(static_cast<double>(e));
    }
    return f;
  }

 private:
  const std::vector<RunRecords>& runs_;
  std::vector<std::string> labels_;
  bool minutes_ = false;
};

PointsOf step_field(double StepRecord::*field) {
  return [field](const RunRecords& r) {
    Points out;
    for (const auto& st : r.metrics.steps) out.push_back({st.step, st.time, st.*field});
    return out;
  };
}

PointsOf scalar(const std::string& key) {
  return [key](const RunRecords& r) {
    Points out;
    for (const auto& rec : r.metrics.scalars) {
      auto it = rec.values.find(key);
      if (it != rec.values.end()) out.push_back({rec.step, rec.time, it->second, rec.epoch});
    }
    return out;
  };
}

// The user scalars' names, in the order they first appear.
std::vector<std::string> scalar_keys(const std::vector<RunRecords>& runs) {
  std::vector<std::string> keys;
  std::set<std::string> seen;
  for (const auto& r : runs) {
    for (const auto& rec : r.metrics.scalars) {
      for (const auto& kv : rec.values) {
        if (seen.insert(kv.first).second) keys.push_back(kv.first);
      }
    }
  }
  return keys;
}

// How a user scalar was logged: the most values any run has, and whether every run logged it at
// most once per epoch (evaluation results are).
struct ScalarShape {
  size_t max_values = 0;
  bool per_epoch = true;
};
ScalarShape scalar_shape(const std::vector<RunRecords>& runs, const std::string& key) {
  ScalarShape shape;
  for (const auto& r : runs) {
    std::set<int64_t> epochs;
    size_t n = 0;
    for (const auto& rec : r.metrics.scalars) {
      if (rec.values.count(key) == 0) continue;
      ++n;
      if (!epochs.insert(rec.epoch).second) shape.per_epoch = false;
    }
    shape.max_values = std::max(shape.max_values, n);
  }
  return shape;
}

// A scalar with a value or two per run reads as a value, not a curve: each run's last one as a bar
// (the runs side by side), the value printed above it.
Figure last_value_figure(const std::vector<RunRecords>& runs, const std::string& key, const std::string& id) {
  const std::vector<std::string> labels = run_labels(runs);
  Figure bars;
  bars.id = id;
  bars.title = key + ": the last value of each run";
  bars.ylabel = key;
  bars.kind = Figure::Kind::kStackedBars;
  bars.total_format = "%.4g";
  Series s;
  s.label = key;
  for (size_t i = 0; i < runs.size(); ++i) {
    double last = std::numeric_limits<double>::quiet_NaN();
    for (const auto& rec : runs[i].metrics.scalars) {
      auto it = rec.values.find(key);
      if (it != rec.values.end() && std::isfinite(it->second)) last = it->second;
    }
    if (std::isnan(last)) continue;
    bars.categories.push_back(labels[i]);
    s.x.push_back(static_cast<double>(bars.categories.size() - 1));
    s.y.push_back(last);
  }
  if (!s.y.empty()) bars.series.push_back(std::move(s));
  return bars;
}

// Scaling: each world size's samples/s (the mean over its runs) beside linear scaling from the
// smallest one. No series unless the runs have at least two world sizes.
Figure scaling_figure(const std::vector<RunRecords>& runs) {
  std::map<int, std::pair<double, int>> by_world;  // world size -> (sum of samples/s, runs)
  for (const RunRow& row : summarize_runs(runs)) {
    if (row.world_size < 1 || !(row.samples_per_s > 0)) continue;
    by_world[row.world_size].first += row.samples_per_s;
    by_world[row.world_size].second += 1;
  }
  Figure scaling;
  if (by_world.size() < 2) return scaling;
  scaling.id = "throughput_vs_workers";
  scaling.title = "Throughput against workers";
  scaling.xlabel = "workers";
  scaling.ylabel = "samples/s (all workers)";
  scaling.kind = Figure::Kind::kPoints;
  Series measured, linear;
  measured.label = "measured";
  const int base_world = by_world.begin()->first;
  const double base_rate = by_world.begin()->second.first / by_world.begin()->second.second;
  linear.label = "linear scaling from " + std::to_string(base_world) + (base_world == 1 ? " worker" : " workers");
  linear.color = 1;
  for (const auto& [world, rate] : by_world) {
    measured.x.push_back(world);
    measured.y.push_back(rate.first / rate.second);
    linear.x.push_back(world);
    linear.y.push_back(base_rate * world / base_world);
  }
  scaling.y_from_zero = true;
  scaling.xtics = measured.x;
  scaling.series = {std::move(measured), std::move(linear)};
  return scaling;
}

// Each run's mean step time, stacked by phase (phase_means).
Figure step_breakdown_figure(const std::vector<RunRecords>& runs) {
  const std::vector<std::string> labels = run_labels(runs);
  Figure bars;
  bars.id = "step_breakdown";
  bars.title = "Step time by phase (mean over steps)";
  bars.ylabel = "ms per step";
  bars.kind = Figure::Kind::kStackedBars;
  for (size_t i = 0; i < runs.size(); ++i) {
    if (runs[i].metrics.steps.empty()) continue;
    bars.categories.push_back(labels[i]);
    const auto phases = phase_means(runs[i]);
    if (bars.series.empty()) {
      for (size_t p = 0; p < phases.size(); ++p) {
        Series s;
        s.label = phases[p].first;
        s.color = static_cast<int>(p);
        bars.series.push_back(std::move(s));
      }
    }
    for (size_t p = 0; p < phases.size(); ++p) {
      bars.series[p].x.push_back(static_cast<double>(bars.categories.size() - 1));
      bars.series[p].y.push_back(phases[p].second);
    }
  }
  return bars;
}

// The gnuplot commands every figure starts with: the SVG terminal, the title (saying so when some
// series is smoothed, so that nobody reads the bold line as raw values), the axes and the key.
void write_preamble(std::ostringstream& g, const Figure& f, const FigureStyle& style) {
  const bool any_smooth = f.kind == Figure::Kind::kLines &&
                          std::any_of(f.series.begin(), f.series.end(), [](const Series& s) { return s.smooth > 1; });
  const std::string title = any_smooth ? f.title + " (faint: each step; bold: centred moving mean)" : f.title;
  g << "# " << f.title << ": drawn by chorus report (gnuplot 5, svg terminal)\n"
    << "set terminal svg size " << style.width << "," << style.height << " fixed noenhanced font "
    << quote(style.font) << " background '#ffffff'\n"
    << "set encoding utf8\n"
    << "set title " << quote(title) << " font ',12'\n"
    << "set xlabel " << quote(f.xlabel) << "\n"
    << "set ylabel " << quote(f.ylabel) << "\n"
    << "set border 3 lc rgb '#555555'\n"
    << "set tics nomirror\n"
    << "set grid lt 1 lc rgb '#e6e6e6' lw 1\n"
    << "set key below horizontal noenhanced height 1\n";
}

// A stacked bar per category, its total above it.
void write_stacked_bars(std::ostringstream& g, const Figure& f, const FigureStyle& style) {
  g << "set style data histograms\n"
    << "set style histogram rowstacked\n"
    << "set style fill solid 0.9 border lc rgb '#ffffff'\n"
    << "set boxwidth 0.55 relative\n"
    << "set yrange [0:*]\n"
    << "set xtics scale 0" << bar_label_rotation(f.categories, style) << "\n"
    << "set grid noxtics ytics\n"
    << "set key below horizontal\n"
    << "$bars << EOD\n";
  for (size_t c = 0; c < f.categories.size(); ++c) {
    std::string label = f.categories[c];
    std::replace(label.begin(), label.end(), '"', '\'');
    g << '"' << label << '"';
    double total = 0;
    for (const auto& s : f.series) {
      const double v = c < s.y.size() && std::isfinite(s.y[c]) ? s.y[c] : 0.0;
      total += v;
      g << ' ' << num(v);
    }
    g << ' ' << num(total) << "\n";
  }
  g << "EOD\n"
    << "set offsets 0, 0, graph 0.08, 0\n"
    << "plot ";
  for (size_t p = 0; p < f.series.size(); ++p) {
    g << (p ? ", \\\n     " : "") << "$bars using " << p + 2 << (p == 0 ? ":xtic(1)" : "") << " title "
      << quote(f.series[p].label) << " lc rgb "
      << color(detail::phase_color(static_cast<size_t>(f.series[p].color)));
  }
  const size_t total_col = f.series.size() + 2;
  g << ", \\\n     $bars using 0:" << total_col << ":(sprintf(" << quote(f.total_format) << ", $" << total_col
    << ")) with labels offset 0, 0.8 notitle\n";
}

// The drawn points of one series as a data block. A blank line in a data block breaks gnuplot's
// line there: between two drawn points that a break lies between.
void write_block(std::ostringstream& g, const std::string& name, const Series& s, const std::vector<double>& y,
                 const std::vector<size_t>& drawn) {
  g << name << " << EOD\n";
  size_t next_break = 0;
  for (size_t n = 0; n < drawn.size(); ++n) {
    const size_t k = drawn[n];
    if (n > 0) {
      while (next_break < s.breaks.size() && s.breaks[next_break] <= drawn[n - 1]) ++next_break;
      if (next_break < s.breaks.size() && s.breaks[next_break] <= k) g << "\n";
    }
    g << num(s.x[k]) << ' ' << num(y[k]) << "\n";
  }
  g << "EOD\n";
}

// Lines or points per series; a smoothed series is drawn faint as it is and bold as its moving mean.
void write_lines(std::ostringstream& g, const Figure& f, const FigureStyle& style) {
  if (f.y_from_zero) g << "set yrange [0:*]\n";
  if (f.x_from_zero) g << "set xrange [0:*]\n";
  if (!f.xtics.empty()) {
    g << "set xtics (";
    for (size_t i = 0; i < f.xtics.size(); ++i) g << (i ? ", " : "") << num(f.xtics[i]);
    g << ")\nset offsets graph 0.05, graph 0.05, 0, 0\n";
  }
  for (size_t i = 0; i < f.series.size(); ++i) {
    const Series& s = f.series[i];
    write_block(g, "$d" + std::to_string(i), s, s.y, drawn_points(s.y, style.max_points, /*envelope=*/true));
    if (s.smooth > 1) {
      const std::vector<double> mean = moving_mean(s.y, s.smooth);
      write_block(g, "$s" + std::to_string(i), s, mean, drawn_points(mean, style.max_points, /*envelope=*/false));
    }
  }
  g << "plot ";
  for (size_t i = 0; i < f.series.size(); ++i) {
    const Series& s = f.series[i];
    g << (i ? ", \\\n     " : "");
    const bool points = f.kind == Figure::Kind::kPoints || s.x.size() < 3;
    const std::string style_spec = points ? "with linespoints lw 2 pt 7 ps 0.6" : "with lines lw 2";
    const char* rgb = detail::run_color(static_cast<size_t>(s.color));
    if (s.smooth > 1) {
      g << "$d" << i << " using 1:2 with lines lw 1 lc rgb " << color(rgb, "B0") << " notitle, \\\n     "
        << "$s" << i << " using 1:2 " << style_spec << " lc rgb " << color(rgb) << " title " << quote(s.label);
    } else {
      g << "$d" << i << " using 1:2 " << style_spec << " lc rgb " << color(rgb) << " title " << quote(s.label);
    }
  }
  g << "\n";
}

}  // namespace

std::vector<Figure> plan_figures(const std::vector<RunRecords>& runs) {
  const LineFigures line(runs);
  std::vector<Figure> figures;
  auto add = [&](Figure f) {
    if (!f.series.empty()) figures.push_back(std::move(f));
  };
  const auto lines = Figure::Kind::kLines;
  add(line.make("loss_vs_step", "Loss against step", "loss", lines, false, step_field(&StepRecord::loss)));
  add(line.make("loss_vs_time", "Loss against wall time", "loss", lines, true, step_field(&StepRecord::loss)));

  std::set<std::string> ids = {"loss_vs_step", "loss_vs_time", "throughput_vs_step", "step_breakdown"};
  for (const auto& key : scalar_keys(runs)) {
    std::string stem = figure_id(key);
    while (ids.count(stem + "_vs_step")) stem += "_";
    ids.insert(stem + "_vs_step");
    const ScalarShape shape = scalar_shape(runs, key);
    const auto points = Figure::Kind::kPoints;
    if (shape.max_values <= 2) {
      add(last_value_figure(runs, key, stem + "_last"));
      // Several runs: when each got there still compares them (the scaling curves' figure).
      if (runs.size() > 1) {
        add(line.make(stem + "_vs_time", key + " against wall time", key, points, XAxis::kTime, scalar(key)));
      }
      continue;
    }
    if (shape.per_epoch) {
      add(line.make(stem + "_vs_epoch", key + " against epochs completed", key, points, XAxis::kEpoch, scalar(key)));
    } else {
      add(line.make(stem + "_vs_step", key + " against step", key, points, XAxis::kStep, scalar(key)));
    }
    add(line.make(stem + "_vs_time", key + " against wall time", key, points, XAxis::kTime, scalar(key)));
  }

  add(line.make("throughput_vs_step", "Throughput against step", "samples/s (all workers)", lines, false,
                step_field(&StepRecord::samples_per_s)));
  add(scaling_figure(runs));
  add(step_breakdown_figure(runs));
  return figures;
}

std::string gnuplot_script(const Figure& f, const FigureStyle& style) {
  std::ostringstream g;
  write_preamble(g, f, style);
  if (f.series.empty()) {
    g << "set xrange [0:1]\nset yrange [0:1]\nunset tics\n"
      << "set label 'no data' at graph 0.5, 0.5 center\nplot -1 notitle\n";
  } else if (f.kind == Figure::Kind::kStackedBars) {
    write_stacked_bars(g, f, style);
  } else {
    write_lines(g, f, style);
  }
  return g.str();
}

std::vector<RunRow> summarize_runs(const std::vector<RunRecords>& runs) {
  const std::vector<std::string> labels = run_labels(runs);
  std::vector<RunRow> rows;
  for (size_t i = 0; i < runs.size(); ++i) {
    const RunRecords& r = runs[i];
    const auto& steps = r.metrics.steps;
    RunRow row;
    row.label = labels[i];
    row.dir = r.dir;
    row.world_size = r.world_size;
    row.steps = steps.empty() ? 0 : steps.back().step;
    if (r.summary && std::isfinite(r.summary->samples_per_s) && r.summary->samples_per_s > 0) {
      row.samples_per_s = r.summary->samples_per_s;
    } else {
      double samples = 0, ms = 0;
      for (const auto& s : steps) {
        if (std::isfinite(s.samples) && std::isfinite(s.step_ms)) {
          samples += s.samples;
          ms += s.step_ms;
        }
      }
      row.samples_per_s = ms > 0 ? samples / (ms / 1000) : 0;
    }
    row.final_loss = steps.empty() ? kNaN : steps.back().loss;
    for (const auto& rec : r.metrics.scalars) {
      for (const auto& kv : rec.values) row.final_scalars[kv.first] = kv.second;
    }
    row.status = r.summary && !r.summary->status.empty() ? r.summary->status : "no summary (running or killed)";
    double last_time = steps.empty() ? 0 : steps.back().time;
    for (const auto& e : r.metrics.events) last_time = std::max(last_time, e.time);
    row.wall_seconds = r.summary && std::isfinite(r.summary->wall_seconds) ? r.summary->wall_seconds : last_time;
    for (const auto& e : r.metrics.events) row.resumes += e.event == "resume";
    row.phase_ms_mean = phase_means(r);
    rows.push_back(std::move(row));
  }
  // Speed-up against the first run of the smallest world size.
  const RunRow* base = nullptr;
  for (const auto& row : rows) {
    if (base == nullptr || row.world_size < base->world_size) base = &row;
  }
  const double base_rate = base ? base->samples_per_s : 0;
  for (auto& row : rows) row.speedup = base_rate > 0 ? row.samples_per_s / base_rate : kNaN;
  return rows;
}

}  // namespace chorus::report
