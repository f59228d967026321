// chorus_report: parsing, planning, gnuplot scripts and the page as pure functions; then
// write_report with the real gnuplot (and fake ones that fail or hang) on run directories written
// here.
#include "chorus/report/report.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <algorithm>
#include <regex>
#include <sstream>

namespace chorus::report {
namespace {

namespace fs = std::filesystem;

// metrics.jsonl of `steps` steps of a run at `world` workers: loss falling from 2.3, one
// test_accuracy per `per_epoch` steps, start/finish events.
std::string metrics_text(int steps, int world, int per_epoch = 50) {
  std::ostringstream m;
  m << R"({"type":"event","event":"start","step":0,"epoch":0,"time":0,"attempt":0})" << "\n";
  double time = 0;
  for (int s = 1; s <= steps; ++s) {
    const double step_ms = 40.0 + world * 2;
    time += step_ms / 1000;
    const int epoch = (s - 1) / per_epoch;
    m << R"({"type":"step","step":)" << s << R"(,"epoch":)" << epoch << R"(,"time":)" << time
      << R"(,"loss":)" << 2.3 * std::exp(-s / 100.0) << R"(,"lr":0.01,"samples":)" << 64 * world
      << R"(,"samples_per_s":)" << 64 * world / (step_ms / 1000) << R"(,"step_ms":)" << step_ms
      << R"(,"data_ms":2,"forward_ms":10,"backward_ms":20,"optimizer_ms":3,"comm_ms":6,"comm_wait_ms":)"
      << (world > 1 ? 4 : 0) << R"(,"hidden":0.3})" << "\n";
    if (s % per_epoch == 0) {
      m << R"({"type":"log","step":)" << s << R"(,"epoch":)" << epoch << R"(,"time":)" << time
        << R"(,"test_accuracy":)" << 0.5 + 0.1 * (s / per_epoch) << "}\n";
    }
  }
  m << R"({"type":"event","event":"finish","step":)" << steps << R"(,"epoch":0,"time":)" << time << "}\n";
  return m.str();
}

std::string config_text(const std::string& name, int world) {
  return R"({"run_name":")" + name + R"(","world_size":)" + std::to_string(world) +
         R"(,"attempt":0,"host":"node0","started":"2026-11-23T10:00:00Z","command":["train","--epochs","2"]})";
}

RunRecords make_run(const std::string& name, int world, int steps) {
  return parse_run("runs/" + name + "-" + std::to_string(world), config_text(name, world), metrics_text(steps, world), "");
}

// What a UsageError from `fn` says ("" when none was thrown).
template <typename Fn>
std::string usage_error(Fn fn) {
  try {
    fn();
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

// A scratch directory, removed at the end of the test.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "chorus-report-test-XXXXXX").string();
    path = ::mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

void write(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path) << text;
}

fs::path write_run_dir(const fs::path& root, const std::string& name, int world, int steps) {
  const fs::path dir = root / (name + "-" + std::to_string(world));
  write(dir / "config.json", config_text(name, world));
  write(dir / "metrics.jsonl", metrics_text(steps, world));
  write(dir / "summary.json", R"({"status":"finished","steps":)" + std::to_string(steps) + "}");
  return dir;
}

bool gnuplot_runs() { return std::system("gnuplot --version > /dev/null 2>&1") == 0; }

TEST(ParseMetrics, ReadsStepLogAndEventLines) {
  const Metrics m = parse_metrics(metrics_text(120, 2), "m.jsonl");
  ASSERT_EQ(m.steps.size(), 120u);
  EXPECT_EQ(m.steps.front().step, 1);
  EXPECT_EQ(m.steps.back().step, 120);
  EXPECT_EQ(m.steps[59].epoch, 1);
  EXPECT_DOUBLE_EQ(m.steps[0].samples, 128);
  EXPECT_DOUBLE_EQ(m.steps[0].comm_wait_ms, 4);
  ASSERT_EQ(m.scalars.size(), 2u);  // steps 50 and 100
  EXPECT_EQ(m.scalars[1].step, 100);
  EXPECT_DOUBLE_EQ(m.scalars[1].values.at("test_accuracy"), 0.7);
  ASSERT_EQ(m.events.size(), 2u);
  EXPECT_EQ(m.events[0].event, "start");
  EXPECT_EQ(m.events[0].detail, R"({"attempt":0})");
  EXPECT_EQ(m.events[1].event, "finish");
}

// The step line has one definition: what format_step_line writes (the Accelerator's writer),
// parse_metrics reads back field for field, with samples_per_s and hidden derived.
TEST(StepLine, FormatAndParseRoundTripEveryField) {
  StepRecord r;
  r.step = 7;
  r.epoch = 2;
  r.time = 12.25;
  r.loss = 0.4375;
  r.lr = 0.01;
  r.samples = 128;
  r.step_ms = 64;
  r.data_ms = 1.5;
  r.forward_ms = 10.25;
  r.backward_ms = 30.5;
  r.optimizer_ms = 2.75;
  r.comm_ms = 8;
  r.comm_wait_ms = 2;
  StepRecord with_nan = r;
  with_nan.step = 8;
  with_nan.time = 13;
  with_nan.lr = std::nan("");
  const std::string text = format_step_line(r) + "\n" + format_step_line(with_nan) + "\n";
  EXPECT_EQ(format_step_line(r).find('\n'), std::string::npos);  // one line
  const Metrics m = parse_metrics(text, "metrics.jsonl");
  ASSERT_EQ(m.steps.size(), 2u);
  const StepRecord& b = m.steps[0];
  EXPECT_EQ(b.step, r.step);
  EXPECT_EQ(b.epoch, r.epoch);
  for (auto member : {&StepRecord::time, &StepRecord::loss, &StepRecord::lr, &StepRecord::samples, &StepRecord::step_ms,
                      &StepRecord::data_ms, &StepRecord::forward_ms, &StepRecord::backward_ms,
                      &StepRecord::optimizer_ms, &StepRecord::comm_ms, &StepRecord::comm_wait_ms}) {
    EXPECT_EQ(b.*member, r.*member);
  }
  EXPECT_EQ(b.samples_per_s, 2000.0);  // 128 samples in 64 ms
  EXPECT_NE(format_step_line(r).find("\"hidden\":0.75"), std::string::npos) << format_step_line(r);
  EXPECT_TRUE(std::isnan(m.steps[1].lr));  // written as null, read as absent
  EXPECT_EQ(m.steps[1].loss, r.loss);
}

TEST(ParseMetrics, AbsentKeysAreNaNEmptyLinesAndUnknownTypesSkipped) {
  const Metrics m = parse_metrics(
      "\n{\"type\":\"step\",\"step\":1,\"time\":0.5,\"loss\":null}\n  \n{\"type\":\"histogram\",\"x\":[1]}\n", "m");
  ASSERT_EQ(m.steps.size(), 1u);
  EXPECT_TRUE(std::isnan(m.steps[0].loss));
  EXPECT_TRUE(std::isnan(m.steps[0].data_ms));
  EXPECT_DOUBLE_EQ(m.steps[0].time, 0.5);
}

TEST(ParseMetrics, BadLinesNameFileAndLine) {
  const std::string good = "{\"type\":\"step\",\"step\":1,\"time\":1}\n";
  std::string e = usage_error([&] { parse_metrics(good + good + "{\"type\":\"step\",\"step\":2,", "r/metrics.jsonl"); });
  EXPECT_NE(e.find("r/metrics.jsonl:3: not a JSON object"), std::string::npos) << e;
  e = usage_error([&] { parse_metrics(good + "[1, 2]\n", "f"); });
  EXPECT_NE(e.find("f:2: expected a JSON object, got array"), std::string::npos) << e;
  e = usage_error([&] { parse_metrics("{\"step\":1,\"time\":1}\n", "f"); });
  EXPECT_NE(e.find("f:1: a record needs a string \"type\""), std::string::npos) << e;
  e = usage_error([&] { parse_metrics(good + "\n{\"type\":\"log\",\"step\":3}\n", "f"); });
  EXPECT_NE(e.find("f:3: a \"log\" line needs a numeric \"time\""), std::string::npos) << e;
  e = usage_error([&] { parse_metrics("{\"type\":\"step\",\"step\":1.5,\"time\":1}\n", "f"); });
  EXPECT_NE(e.find("f:1: \"step\" must be a whole number"), std::string::npos) << e;
  e = usage_error([&] { parse_metrics("{\"type\":\"event\",\"step\":1,\"time\":1}\n", "f"); });
  EXPECT_NE(e.find("f:1: an \"event\" line needs a string \"event\""), std::string::npos) << e;
}

// A run that died after step 5 and resumed from its checkpoint at step 3: the redone steps 4 and
// 5 are the second attempt's, and the first attempt's scalar at step 5 is gone.
TEST(ParseMetrics, ResumeKeepsTheLatestAttempt) {
  std::string text;
  auto step = [&](int s, double loss) {
    text += "{\"type\":\"step\",\"step\":" + std::to_string(s) + ",\"time\":" + std::to_string(s) +
            ",\"loss\":" + std::to_string(loss) + "}\n";
  };
  for (int s = 1; s <= 5; ++s) step(s, 10 + s);
  text += "{\"type\":\"log\",\"step\":5,\"time\":5,\"acc\":0.1}\n";
  text += "{\"type\":\"event\",\"event\":\"resume\",\"step\":3,\"time\":6,\"attempt\":1}\n";
  for (int s = 4; s <= 6; ++s) step(s, 20 + s);
  const Metrics m = parse_metrics(text, "m");
  ASSERT_EQ(m.steps.size(), 6u);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(m.steps[static_cast<size_t>(i)].step, i + 1);
  EXPECT_DOUBLE_EQ(m.steps[2].loss, 13);  // kept from the first attempt
  EXPECT_DOUBLE_EQ(m.steps[3].loss, 24);  // redone
  EXPECT_TRUE(m.scalars.empty());
  ASSERT_EQ(m.events.size(), 1u);

  // Without a resume event, a step that goes back does the same.
  text.clear();
  for (int s = 1; s <= 4; ++s) step(s, 10 + s);
  step(3, 33);
  const Metrics m2 = parse_metrics(text, "m");
  ASSERT_EQ(m2.steps.size(), 3u);
  EXPECT_DOUBLE_EQ(m2.steps[2].loss, 33);
}

TEST(ParseRun, ConfigAndSummary) {
  const RunRecords r = parse_run("runs/x/", config_text("mnist", 4), metrics_text(10, 4),
                          R"({"status":"stopped","steps":10,"samples_per_s":123.5,"wall_seconds":7})");
  EXPECT_EQ(r.name, "mnist");
  EXPECT_EQ(r.world_size, 4);
  EXPECT_EQ(r.host, "node0");
  EXPECT_EQ(r.command, "train --epochs 2");
  ASSERT_TRUE(r.summary.has_value());
  EXPECT_EQ(r.summary->status, "stopped");
  EXPECT_DOUBLE_EQ(r.summary->samples_per_s, 123.5);

  // Keys of the wrong type read as absent.
  const RunRecords unnamed = parse_run("runs/exp7", R"({"world_size":1,"run_name":null,"host":3})", "",
                                       R"({"status":null,"steps":"many"})");
  EXPECT_EQ(unnamed.host, "");
  ASSERT_TRUE(unnamed.summary.has_value());
  EXPECT_EQ(unnamed.summary->steps, 0);
  EXPECT_EQ(unnamed.name, "exp7");
  EXPECT_FALSE(parse_run("d", R"({"world_size":1})", "", "").summary.has_value());

  std::string e = usage_error([] { parse_run("d", R"({"run_name":"a"})", "", ""); });
  EXPECT_NE(e.find("d/config.json: needs \"world_size\""), std::string::npos) << e;
  e = usage_error([] { parse_run("d", "{", "", ""); });
  EXPECT_NE(e.find("d/config.json: not valid JSON"), std::string::npos) << e;
  e = usage_error([] { parse_run("d", R"({"world_size":2})", "oops\n", ""); });
  EXPECT_NE(e.find("d/metrics.jsonl:1:"), std::string::npos) << e;
}

TEST(LoadRun, NamesTheMissingFile) {
  TempDir tmp;
  std::string e = usage_error([&] { load_run((tmp.path / "nope").string()); });
  EXPECT_NE(e.find("is not a directory"), std::string::npos) << e;
  write(tmp.path / "r" / "config.json", config_text("a", 1));
  e = usage_error([&] { load_run((tmp.path / "r").string()); });
  EXPECT_NE(e.find((tmp.path / "r" / "metrics.jsonl").string() + " is missing"), std::string::npos) << e;
  write(tmp.path / "r" / "metrics.jsonl", metrics_text(3, 1));
  const RunRecords r = load_run((tmp.path / "r").string());
  EXPECT_EQ(r.metrics.steps.size(), 3u);
  EXPECT_FALSE(r.summary.has_value());
}

TEST(RunLabels, NameAndWorldSizeElseDirectory) {
  const RunRecords a1 = make_run("a", 1, 5), a2 = make_run("a", 2, 5), b1 = make_run("b", 1, 5);
  EXPECT_EQ(run_labels({a1, a2, b1}), (std::vector<std::string>{"a (1 worker)", "a (2 workers)", "b (1 worker)"}));
  RunRecords a1_again = a1;
  a1_again.dir = "other/a";
  EXPECT_EQ(run_labels({a1, a1_again}), (std::vector<std::string>{"runs/a-1 (1 worker)", "other/a (1 worker)"}));
}

TEST(PlanFigures, EveryRunOnEveryFigure) {
  const std::vector<RunRecords> runs = {make_run("job", 1, 300), make_run("job", 2, 150)};
  const std::vector<Figure> figs = plan_figures(runs);
  std::vector<std::string> ids;
  for (const auto& f : figs) ids.push_back(f.id);
  EXPECT_EQ(ids, (std::vector<std::string>{"loss_vs_step", "loss_vs_time", "test_accuracy_vs_epoch",
                                           "test_accuracy_vs_time", "throughput_vs_step", "throughput_vs_workers",
                                           "step_breakdown"}));
  const Figure& loss = figs[0];
  ASSERT_EQ(loss.series.size(), 2u);
  EXPECT_EQ(loss.series[0].label, "job (1 worker)");
  EXPECT_EQ(loss.series[1].label, "job (2 workers)");
  EXPECT_EQ(loss.series[0].x.size(), 300u);
  EXPECT_EQ(loss.series[1].x.size(), 150u);
  EXPECT_GT(loss.series[0].smooth, 1);
  EXPECT_EQ(loss.series[1].color, 1);
  EXPECT_EQ(figs[1].xlabel, "wall time (s)");
  EXPECT_DOUBLE_EQ(figs[1].series[0].x.back(), runs[0].metrics.steps.back().time);
  // test_accuracy is logged once per epoch: against epochs completed, on an axis from 0.
  const Figure& acc = figs[2];
  EXPECT_EQ(acc.kind, Figure::Kind::kPoints);
  EXPECT_EQ(acc.xlabel, "epochs completed");
  EXPECT_TRUE(acc.x_from_zero);
  EXPECT_EQ(acc.series[0].x, (std::vector<double>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(acc.series[1].x, (std::vector<double>{1, 2, 3}));
  EXPECT_EQ(acc.xtics, (std::vector<double>{0, 1, 2, 3, 4, 5, 6}));
  EXPECT_NE(gnuplot_script(acc).find("set xrange [0:*]"), std::string::npos);

  const Figure& bars = figs.back();
  EXPECT_EQ(bars.kind, Figure::Kind::kStackedBars);
  EXPECT_EQ(bars.categories, (std::vector<std::string>{"job (1 worker)", "job (2 workers)"}));
  std::vector<std::string> phases;
  for (const auto& s : bars.series) phases.push_back(s.label);
  EXPECT_EQ(phases, (std::vector<std::string>{"data", "forward", "backward", "comm wait", "optimizer", "other"}));
  // 2 workers: step 44 ms = data 2 + forward 10 + backward 20 (16 own + 4 wait) + optimizer 3 + other 9.
  EXPECT_DOUBLE_EQ(bars.series[2].y[1], 16);
  EXPECT_DOUBLE_EQ(bars.series[3].y[1], 4);
  EXPECT_DOUBLE_EQ(bars.series[5].y[1], 9);
}

TEST(PlanFigures, RunsWithoutAScalarOrStepsAreLeftOutOfItsFigures) {
  RunRecords plain = parse_run("p", config_text("plain", 1), "{\"type\":\"step\",\"step\":1,\"time\":1,\"loss\":1}\n", "");
  RunRecords empty = parse_run("e", config_text("empty", 1), "", "");
  const std::vector<Figure> figs = plan_figures({make_run("job", 2, 100), plain, empty});
  for (const auto& f : figs) {
    for (const auto& s : f.series) EXPECT_NE(s.label, "empty (1 worker)") << f.id;
    if (f.id == "test_accuracy_vs_epoch") {
      EXPECT_EQ(f.series.size(), 1u);
    }
    if (f.id == "loss_vs_step") {
      EXPECT_EQ(f.series.size(), 2u);
    }
  }
  EXPECT_TRUE(plan_figures({empty}).empty());
}

// A one-epoch job's test accuracy is one value: a bar per run with the value above it, not a lone
// dot on a step axis (and, with several runs, against wall time too). A scalar logged every step
// stays against step.
TEST(PlanFigures, AScalarWithOneOrTwoValuesIsABarOfTheLastAndOneLoggedEveryStepStaysOnSteps) {
  const std::vector<RunRecords> runs = {parse_run("a", config_text("one_epoch", 1), metrics_text(40, 1, 40), ""),
                                        parse_run("b", config_text("two_epochs", 2), metrics_text(80, 2, 40), "")};
  const std::vector<Figure> figs = plan_figures(runs);
  const Figure* last = nullptr;
  bool against_time = false;
  for (const auto& f : figs) {
    EXPECT_NE(f.id, "test_accuracy_vs_step");
    EXPECT_NE(f.id, "test_accuracy_vs_epoch");
    if (f.id == "test_accuracy_last") last = &f;
    against_time = against_time || f.id == "test_accuracy_vs_time";  // two runs: when each got there
  }
  EXPECT_TRUE(against_time);
  for (const auto& f : plan_figures({runs[0]})) EXPECT_NE(f.id, "test_accuracy_vs_time");  // one run: the bar alone
  ASSERT_NE(last, nullptr);
  EXPECT_EQ(last->kind, Figure::Kind::kStackedBars);
  EXPECT_EQ(last->categories, (std::vector<std::string>{"one_epoch (1 worker)", "two_epochs (2 workers)"}));
  ASSERT_EQ(last->series.size(), 1u);
  EXPECT_NEAR(last->series[0].y[0], 0.6, 1e-12);  // its one value
  EXPECT_NEAR(last->series[0].y[1], 0.7, 1e-12);  // the last of two
  const std::string g = gnuplot_script(*last);
  EXPECT_NE(g.find("sprintf('%.4g'"), std::string::npos) << g;
  EXPECT_EQ(g.find(" ms'"), std::string::npos) << g;

  std::string every_step;
  for (int s = 1; s <= 5; ++s) {
    every_step += "{\"type\":\"log\",\"step\":" + std::to_string(s) + ",\"epoch\":0,\"time\":" + std::to_string(s) +
                  ",\"grad_norm\":" + std::to_string(s) + "}\n";
  }
  std::vector<std::string> ids;
  for (const auto& f : plan_figures({parse_run("c", config_text("c", 1), every_step, "")})) ids.push_back(f.id);
  EXPECT_EQ(ids, (std::vector<std::string>{"grad_norm_vs_step", "grad_norm_vs_time"}));
}

// The restart and the redone work are not training: on time axes the line breaks at a resume.
TEST(PlanFigures, ResumeBreaksTimeLines) {
  std::string text;
  for (int s = 1; s <= 4; ++s) {
    text += "{\"type\":\"step\",\"step\":" + std::to_string(s) + ",\"time\":" + std::to_string(s) + ",\"loss\":1}\n";
  }
  text += "{\"type\":\"event\",\"event\":\"resume\",\"step\":2,\"time\":10}\n";
  for (int s = 3; s <= 5; ++s) {
    text += "{\"type\":\"step\",\"step\":" + std::to_string(s) + ",\"time\":" + std::to_string(10 + s) + ",\"loss\":1}\n";
  }
  const auto figs = plan_figures({parse_run("r", config_text("r", 1), text, "")});
  ASSERT_EQ(figs[0].id, "loss_vs_step");
  EXPECT_TRUE(figs[0].series[0].breaks.empty());
  ASSERT_EQ(figs[1].id, "loss_vs_time");
  EXPECT_EQ(figs[1].series[0].breaks, std::vector<size_t>{2});
  const std::string g = gnuplot_script(figs[1]);
  EXPECT_NE(g.find("$d0 << EOD\n1 1\n2 1\n\n13 1\n14 1\n15 1\nEOD\n"), std::string::npos) << g;
}

TEST(PlanFigures, LongRunsUseMinutes) {
  RunRecords r = parse_run("r", config_text("long", 1),
                    "{\"type\":\"step\",\"step\":1,\"time\":10,\"loss\":1}\n{\"type\":\"step\",\"step\":2,\"time\":3000,\"loss\":1}\n",
                    "");
  const auto figs = plan_figures({r});
  EXPECT_EQ(figs[1].xlabel, "wall time (min)");
  EXPECT_DOUBLE_EQ(figs[1].series[0].x[1], 50);
}

TEST(GnuplotScript, InlineDataQuotedLabelsAndSmoothing) {
  Figure f;
  f.id = "x";
  f.title = "it's a title";
  f.xlabel = "step";
  f.ylabel = "loss_total";
  Series s;
  s.label = "run's (1 worker)";
  s.x = {1, 2, 3};
  s.y = {0.5, 0.25, 0.125};
  f.series.push_back(s);
  std::string g = gnuplot_script(f);
  EXPECT_NE(g.find("set terminal svg size 620,380 fixed noenhanced"), std::string::npos) << g;
  EXPECT_NE(g.find("set title 'it''s a title' font ',12'\n"), std::string::npos) << g;
  EXPECT_NE(g.find("$d0 << EOD\n1 0.5\n2 0.25\n3 0.125\nEOD\n"), std::string::npos) << g;
  EXPECT_NE(g.find("title 'run''s (1 worker)'"), std::string::npos) << g;
  EXPECT_EQ(g.find("$s0"), std::string::npos) << g;

  f.series[0].smooth = 3;
  g = gnuplot_script(f);
  EXPECT_NE(g.find("$s0 << EOD\n1 0.375\n2 0.291666667\n3 0.1875\nEOD\n"), std::string::npos) << g;
  EXPECT_NE(g.find("moving mean"), std::string::npos) << g;
  EXPECT_NE(g.find("$d0 using 1:2 with lines lw 1 lc rgb '#B01f77b4' notitle"), std::string::npos) << g;

  f.series.clear();
  EXPECT_NE(gnuplot_script(f).find("'no data'"), std::string::npos);
}

// A long run: at most about max_points drawn per line, the spike kept, the line still ending at the
// last step.
TEST(GnuplotScript, LongSeriesAreThinnedKeepingSpikes) {
  Figure f;
  f.id = "x";
  Series s;
  s.label = "long";
  for (int k = 0; k < 10000; ++k) {
    s.x.push_back(k + 1);
    s.y.push_back(k == 5000 ? 99.0 : 1.0 + (k % 7) * 0.01);
  }
  s.smooth = 51;
  s.breaks = {7000};
  f.series.push_back(s);
  FigureStyle style;
  style.max_points = 200;
  const std::string g = gnuplot_script(f, style);
  auto block_lines = [&](const std::string& name) {
    const size_t start = g.find(name + " << EOD\n");
    EXPECT_NE(start, std::string::npos) << name;
    const std::string body = g.substr(start, g.find("EOD\n", start + name.size() + 8) - start);
    return std::count(body.begin(), body.end(), '\n');
  };
  EXPECT_LE(block_lines("$d0"), 200 + 4);
  EXPECT_GE(block_lines("$d0"), 150);
  EXPECT_LE(block_lines("$s0"), 200 + 4);
  EXPECT_NE(g.find("\n5001 99\n"), std::string::npos);   // the spike, raw
  EXPECT_NE(g.find("\n10000 1.03\n"), std::string::npos);  // the last point (9999 % 7 = 3)
  // The break at point 7000 (x 7001) is a blank line in both blocks.
  const size_t d0 = g.find("$d0 << EOD"), s0 = g.find("$s0 << EOD");
  EXPECT_LT(g.find("\n\n", d0), s0);
  EXPECT_NE(g.find("\n\n", s0), std::string::npos);
}

TEST(GnuplotScript, StackedBars) {
  const auto figs = plan_figures({make_run("job", 1, 10), make_run("job", 2, 10)});
  const std::string g = gnuplot_script(figs.back());
  EXPECT_NE(g.find("set style histogram rowstacked"), std::string::npos) << g;
  // label, 6 phases, total
  EXPECT_NE(g.find("\"job (2 workers)\" 2 10 16 4 3 9 44\n"), std::string::npos) << g;
  EXPECT_NE(g.find("$bars using 2:xtic(1) title 'data'"), std::string::npos) << g;
  EXPECT_NE(g.find("$bars using 7 title 'other'"), std::string::npos) << g;
}

TEST(PlanFigures, ThroughputAgainstWorkersWithLinearScaling) {
  RunRecords one = make_run("job", 1, 10), two_a = make_run("job", 2, 10), two_b = make_run("job", 2, 10),
             four = make_run("job", 4, 10);
  one.summary = Summary{"finished", 10, 1000.0, 5, 6};
  two_a.summary = Summary{"finished", 10, 1700.0, 3, 4};
  two_b.summary = Summary{"finished", 10, 1900.0, 3, 4};
  four.summary = Summary{"finished", 10, 3000.0, 3, 4};
  const auto figs = plan_figures({two_a, four, one, two_b});
  auto it = std::find_if(figs.begin(), figs.end(), [](const Figure& f) { return f.id == "throughput_vs_workers"; });
  ASSERT_NE(it, figs.end());
  ASSERT_EQ(it->series.size(), 2u);
  EXPECT_EQ(it->series[0].x, (std::vector<double>{1, 2, 4}));
  EXPECT_EQ(it->series[0].y, (std::vector<double>{1000, 1800, 3000}));  // two runs at W=2: their mean
  EXPECT_EQ(it->series[1].label, "linear scaling from 1 worker");
  EXPECT_EQ(it->series[1].y, (std::vector<double>{1000, 2000, 4000}));
  const std::string script = gnuplot_script(*it);
  EXPECT_NE(script.find("set xtics (1, 2, 4)"), std::string::npos) << script;
  EXPECT_NE(script.find("set yrange [0:*]"), std::string::npos) << script;
  // One world size: no scaling figure.
  for (const auto& f : plan_figures({two_a, two_b})) EXPECT_NE(f.id, "throughput_vs_workers");
}

TEST(SummarizeRuns, SpeedupAgainstTheSmallestWorldSize) {
  RunRecords two = make_run("job", 2, 100);
  RunRecords one = make_run("job", 1, 100);
  one.summary = Summary{"finished", 100, 1000.0, 5, 6};
  two.summary = Summary{"finished", 100, 1800.0, 3, 4};
  const auto rows = summarize_runs({two, one});
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_DOUBLE_EQ(rows[0].speedup, 1.8);
  EXPECT_DOUBLE_EQ(rows[1].speedup, 1.0);
  EXPECT_EQ(rows[0].steps, 100);
  EXPECT_NEAR(rows[0].final_loss, 2.3 * std::exp(-1.0), 1e-5);  // written with 6 digits
  EXPECT_DOUBLE_EQ(rows[0].final_scalars.at("test_accuracy"), 0.7);
  EXPECT_EQ(rows[0].status, "finished");
  EXPECT_DOUBLE_EQ(rows[0].wall_seconds, 4);

  // No summary: samples over the step times, status says so.
  const auto rows2 = summarize_runs({make_run("job", 2, 10)});
  EXPECT_DOUBLE_EQ(rows2[0].samples_per_s, 128 / 0.044);
  EXPECT_EQ(rows2[0].status, "no summary (running or killed)");
}

TEST(InlineSvg, DropsPrologAndPrefixesIds) {
  const std::string svg =
      "<?xml version=\"1.0\"?>\n<!DOCTYPE svg>\n<svg width=\"10\">\n<g id=\"gnuplot_canvas\">"
      "<circle id='gpDot' stroke-width='0.5'/><use xlink:href='#gpDot' fill='url(#grad)'/></g></svg>";
  const std::string out = inline_svg(svg, "fig-a");
  EXPECT_EQ(out,
            "<svg width=\"10\">\n<g id=\"fig-a-gnuplot_canvas\"><circle id='fig-a-gpDot' stroke-width='0.5'/>"
            "<use xlink:href='#fig-a-gpDot' fill='url(#fig-a-grad)'/></g></svg>");
}

TEST(RenderHtml, TableFiguresAndEscaping) {
  std::vector<RunRecords> runs = {make_run("a<b>", 1, 60), make_run("a<b>", 2, 60)};
  runs[1].metrics.events.push_back({"resume", 30, 0, 1.5, R"({"attempt":1})"});
  const auto rows = summarize_runs(runs);
  std::vector<RenderedFigure> figs;
  for (const auto& f : plan_figures(runs)) figs.push_back({f, "<?xml?><svg id='s'><path d='M1,1 L2,2'/></svg>"});
  const std::string html = render_html(runs, rows, figs, "2026-11-23 10:00:00 UTC");
  EXPECT_EQ(html.find("<b>"), std::string::npos);
  EXPECT_NE(html.find("a&lt;b&gt; (2 workers)"), std::string::npos);
  EXPECT_NE(html.find("<th>final test_accuracy</th>"), std::string::npos);
  EXPECT_NE(html.find("<figure id=\"fig-loss_vs_step\" data-figure=\"loss_vs_step\" "
                      "data-series=\"a&lt;b&gt; (1 worker)|a&lt;b&gt; (2 workers)\">"),
            std::string::npos);
  EXPECT_NE(html.find("<svg id='fig-step_breakdown-s'>"), std::string::npos);
  EXPECT_EQ(html.find("<?xml"), std::string::npos);
  EXPECT_NE(html.find("<td class=\"text\">resume</td><td>30</td>"), std::string::npos);
  // Self-contained: nothing to load from elsewhere.
  EXPECT_EQ(html.find("src="), std::string::npos);
  EXPECT_EQ(html.find("<link"), std::string::npos);
}

TEST(DefaultOutDir, WithTheRunForOneElseHere) {
  EXPECT_EQ(default_out_dir({"runs/a/"}), "runs/a/report");
  EXPECT_EQ(default_out_dir({"runs/a", "runs/b"}), "chorus-report");
}

TEST(WriteReport, RealGnuplotDrawsEveryFigure) {
  if (!gnuplot_runs()) GTEST_SKIP() << "gnuplot is not installed (Debian: gnuplot-nox)";
  TempDir tmp;
  ReportOptions o;
  o.run_dirs = {write_run_dir(tmp.path, "job", 1, 200).string(), write_run_dir(tmp.path, "job", 2, 100).string()};
  o.out_dir = (tmp.path / "out").string();
  const std::string index = write_report(o);
  EXPECT_EQ(index, (tmp.path / "out" / "index.html").string());
  std::ifstream in(index);
  const std::string html((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::regex figure("<figure id=\"fig-([a-z_]+)\"");
  std::vector<std::string> ids;
  for (auto it = std::sregex_iterator(html.begin(), html.end(), figure); it != std::sregex_iterator(); ++it) {
    ids.push_back((*it)[1]);
    EXPECT_TRUE(fs::exists(tmp.path / "out" / "figures" / ((*it)[1].str() + ".svg")));
    EXPECT_TRUE(fs::exists(tmp.path / "out" / "figures" / ((*it)[1].str() + ".gp")));
  }
  EXPECT_EQ(ids.size(), 7u);  // with throughput against workers: two world sizes
  EXPECT_EQ(html.find("<?xml"), std::string::npos);
  EXPECT_NE(html.find("id=\"fig-loss_vs_step-gnuplot_canvas\""), std::string::npos);
  EXPECT_NE(html.find("<text>job (2 workers)</text>"), std::string::npos);  // a legend entry
}

TEST(WriteReport, MissingGnuplotNamesThePackageAndWritesNothing) {
  TempDir tmp;
  ReportOptions o;
  o.run_dirs = {write_run_dir(tmp.path, "job", 1, 10).string()};
  o.out_dir = (tmp.path / "out").string();
  o.gnuplot = "/nonexistent/gnuplot";
  try {
    write_report(o);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gnuplot-nox"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("No such file or directory"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(tmp.path / "out"));
}

// One run in `tmp`, drawn by a stand-in gnuplot that answers --version, then runs `body` on the
// script.
ReportOptions with_fake_gnuplot(const TempDir& tmp, const std::string& body) {
  const fs::path p = tmp.path / "fake-gnuplot";
  write(p, "#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'gnuplot 5.4'; exit 0; fi\n" + body + "\n");
  fs::permissions(p, fs::perms::owner_all);
  ReportOptions o;
  o.run_dirs = {write_run_dir(tmp.path, "job", 1, 10).string()};
  o.out_dir = (tmp.path / "out").string();
  o.gnuplot = p.string();
  return o;
}

TEST(WriteReport, GnuplotErrorCarriesItsStderr) {
  TempDir tmp;
  const ReportOptions o = with_fake_gnuplot(tmp, "echo \"$1\" line 7: undefined variable: bogus >&2; exit 1");
  try {
    write_report(o);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("gnuplot failed on " + (tmp.path / "out" / "figures" / "loss_vs_step.gp").string() + " (exit code 1)"),
              std::string::npos)
        << w;
    EXPECT_NE(w.find("line 7: undefined variable: bogus"), std::string::npos) << w;
  }
}

TEST(WriteReport, GnuplotPastItsDeadlineIsKilled) {
  TempDir tmp;
  ReportOptions o = with_fake_gnuplot(tmp, "echo drawing >&2; exec sleep 20");
  o.gnuplot_timeout = std::chrono::milliseconds(300);
  const auto start = std::chrono::steady_clock::now();
  try {
    write_report(o);
    FAIL() << "no error";
  } catch (const TimeoutError& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("did not finish within 300 ms and was killed"), std::string::npos) << w;
    EXPECT_NE(w.find("drawing"), std::string::npos) << w;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
}

}  // namespace
}  // namespace chorus::report
