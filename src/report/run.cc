// Reading run directories: config.json, metrics.jsonl and summary.json to RunRecords.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "chorus/report/report.h"

namespace chorus::report {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A number, or NaN when the key is absent or not a number (the Accelerator may write null for a
// measurement it does not have).
double number_or_nan(const json& o, const char* key) {
  auto it = o.find(key);
  return it != o.end() && it->is_number() ? it->get<double>() : kNaN;
}

// A string, or "" when the key is absent or not a string.
std::string string_or_empty(const json& o, const char* key) {
  auto it = o.find(key);
  return it != o.end() && it->is_string() ? it->get<std::string>() : std::string();
}

std::string where(const std::string& path, size_t line) { return path + ":" + std::to_string(line); }

double required_number(const json& o, const char* key, const std::string& path, size_t line) {
  auto it = o.find(key);
  if (it == o.end() || !it->is_number()) {
    throw UsageError(where(path, line) + ": a \"" + string_or_empty(o, "type") + "\" line needs a numeric \"" +
                     key + "\"" + (it == o.end() ? "" : ", got " + it->dump()));
  }
  return it->get<double>();
}

int64_t required_step(const json& o, const std::string& path, size_t line) {
  const double step = required_number(o, "step", path, line);
  if (step != std::floor(step) || step < 0) {
    throw UsageError(where(path, line) + ": \"step\" must be a whole number >= 0, got " + o["step"].dump());
  }
  return static_cast<int64_t>(step);
}

// The measured fields of a step line, by name: format_step_line writes them and parse_metrics
// reads them, from this one table.
struct StepField {
  const char* name;
  double StepRecord::*member;
};
constexpr StepField kStepFields[] = {
    {"time", &StepRecord::time},           {"loss", &StepRecord::loss},
    {"lr", &StepRecord::lr},               {"samples_per_s", &StepRecord::samples_per_s},
    {"step_ms", &StepRecord::step_ms},     {"data_ms", &StepRecord::data_ms},
    {"forward_ms", &StepRecord::forward_ms}, {"backward_ms", &StepRecord::backward_ms},
    {"optimizer_ms", &StepRecord::optimizer_ms}, {"comm_ms", &StepRecord::comm_ms},
    {"comm_wait_ms", &StepRecord::comm_wait_ms}, {"samples", &StepRecord::samples},
};

int64_t epoch_of(const json& o) {
  const double e = number_or_nan(o, "epoch");
  return std::isnan(e) ? 0 : static_cast<int64_t>(e);
}

// Drops the records of an earlier attempt that the latest one redoes: steps and scalars after
// `step` (inclusive when `inclusive`).
void rewind(Metrics* m, int64_t step, bool inclusive) {
  auto beyond = [&](int64_t s) { return inclusive ? s >= step : s > step; };
  while (!m->steps.empty() && beyond(m->steps.back().step)) m->steps.pop_back();
  while (!m->scalars.empty() && beyond(m->scalars.back().step)) m->scalars.pop_back();
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot read " + path.string() + ": " + std::strerror(errno));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

json parse_document(const std::string& text, const std::string& path) {
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::parse_error& e) {
    throw UsageError(path + ": not valid JSON: " + e.what());
  }
  if (!doc.is_object()) throw UsageError(path + ": expected a JSON object, got " + std::string(doc.type_name()));
  return doc;
}

}  // namespace

std::string format_step_line(const StepRecord& r) {
  const auto value = [](double v) { return std::isnan(v) ? json(nullptr) : json(v); };
  json j = {{"type", "step"}, {"step", r.step}, {"epoch", r.epoch}};
  for (const StepField& f : kStepFields) j[f.name] = value(r.*f.member);
  j["samples"] = std::isnan(r.samples) ? json(nullptr) : json(static_cast<int64_t>(r.samples));
  j["samples_per_s"] = r.step_ms > 0 ? r.samples / (r.step_ms / 1e3) : 0.0;
  j["hidden"] = r.comm_ms > 0 ? std::max(0.0, 1.0 - r.comm_wait_ms / r.comm_ms) : 0.0;
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

Metrics parse_metrics(const std::string& text, const std::string& path) {
  Metrics m;
  size_t line_no = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json o;
    try {
      o = json::parse(line);
    } catch (const json::parse_error& e) {
      // The library's message carries its own "line 1, column N"; ours names the file's line.
      throw UsageError(where(path, line_no) + ": not a JSON object: " + e.what());
    }
    if (!o.is_object()) {
      throw UsageError(where(path, line_no) + ": expected a JSON object, got " + std::string(o.type_name()));
    }
    auto type_it = o.find("type");
    if (type_it == o.end() || !type_it->is_string()) {
      throw UsageError(where(path, line_no) + ": a record needs a string \"type\" (step, log or event)");
    }
    const std::string type = type_it->get<std::string>();
    if (type != "step" && type != "log" && type != "event") continue;  // a later version's record
    const int64_t step = required_step(o, path, line_no);
    const double time = required_number(o, "time", path, line_no);
    if (type == "step") {
      if (!m.steps.empty() && step <= m.steps.back().step) rewind(&m, step, /*inclusive=*/true);
      StepRecord r;
      r.step = step;
      r.epoch = epoch_of(o);
      r.time = time;
      for (const StepField& f : kStepFields) {
        if (f.member != &StepRecord::time) r.*f.member = number_or_nan(o, f.name);
      }
      m.steps.push_back(r);
    } else if (type == "log") {
      ScalarRecord r;
      r.step = step;
      r.epoch = epoch_of(o);
      r.time = time;
      for (const auto& [key, value] : o.items()) {
        if (key == "type" || key == "step" || key == "epoch" || key == "time") continue;
        if (value.is_number()) r.values[key] = value.get<double>();
      }
      if (!r.values.empty()) m.scalars.push_back(std::move(r));
    } else {
      EventRecord r;
      auto ev = o.find("event");
      if (ev == o.end() || !ev->is_string()) {
        throw UsageError(where(path, line_no) + ": an \"event\" line needs a string \"event\"");
      }
      r.event = ev->get<std::string>();
      r.step = step;
      r.epoch = epoch_of(o);
      r.time = time;
      json rest = json::object();
      for (const auto& [key, value] : o.items()) {
        if (key != "type" && key != "event" && key != "step" && key != "epoch" && key != "time") rest[key] = value;
      }
      if (!rest.empty()) r.detail = rest.dump();
      if (r.event == "resume") rewind(&m, step, /*inclusive=*/false);
      m.events.push_back(std::move(r));
    }
  }
  return m;
}

RunRecords parse_run(const std::string& dir, const std::string& config_json, const std::string& metrics_jsonl,
              const std::string& summary_json) {
  const std::string base = dir.empty() || dir.back() == '/' ? dir : dir + "/";
  RunRecords run;
  run.dir = dir;
  const json config = parse_document(config_json, base + "config.json");
  auto ws = config.find("world_size");
  if (ws == config.end() || !ws->is_number_integer() || ws->get<int>() < 1) {
    throw UsageError(base + "config.json: needs \"world_size\", a whole number >= 1" +
                     (ws == config.end() ? "" : ", got " + ws->dump()));
  }
  run.world_size = ws->get<int>();
  run.name = string_or_empty(config, "run_name");
  if (run.name.empty()) {
    fs::path p = fs::path(dir).lexically_normal();
    if (!p.has_filename()) p = p.parent_path();
    run.name = p.filename().string();
    if (run.name.empty() || run.name == ".") run.name = fs::absolute(p).lexically_normal().filename().string();
  }
  run.host = string_or_empty(config, "host");
  run.started = string_or_empty(config, "started");
  if (config.contains("command") && config["command"].is_array()) {
    for (const auto& a : config["command"]) {
      if (a.is_string()) run.command += (run.command.empty() ? "" : " ") + a.get<std::string>();
    }
  }
  run.metrics = parse_metrics(metrics_jsonl, base + "metrics.jsonl");
  if (!summary_json.empty()) {
    const json s = parse_document(summary_json, base + "summary.json");
    Summary summary;
    summary.status = string_or_empty(s, "status");
    const double steps = number_or_nan(s, "steps");
    summary.steps = std::isfinite(steps) ? static_cast<int64_t>(steps) : 0;
    summary.samples_per_s = number_or_nan(s, "samples_per_s");
    summary.train_seconds = number_or_nan(s, "train_seconds");
    summary.wall_seconds = number_or_nan(s, "wall_seconds");
    run.summary = summary;
  }
  return run;
}

RunRecords load_run(const std::string& dir) {
  const fs::path d(dir);
  std::error_code ec;
  if (!fs::is_directory(d, ec)) {
    throw UsageError("chorus report: " + dir + " is not a directory; pass run directories (an " +
                     "Accelerator's project_dir/run_name, e.g. runs/fashion_mnist)");
  }
  for (const char* name : {"config.json", "metrics.jsonl"}) {
    if (!fs::is_regular_file(d / name, ec)) {
      throw UsageError("chorus report: " + dir + " is not a run directory: " + (d / name).string() +
                       " is missing (a run directory holds config.json, metrics.jsonl and, once the run " +
                       "ends, summary.json; docs/run-records.md)");
    }
  }
  const fs::path summary = d / "summary.json";
  return parse_run(dir, read_file(d / "config.json"), read_file(d / "metrics.jsonl"),
                   fs::is_regular_file(summary, ec) ? read_file(summary) : std::string());
}

std::vector<std::string> run_labels(const std::vector<RunRecords>& runs) {
  auto label = [](const std::string& name, int world_size) {
    return name + " (" + std::to_string(world_size) + (world_size == 1 ? " worker)" : " workers)");
  };
  std::map<std::string, int> uses;
  for (const auto& r : runs) ++uses[label(r.name, r.world_size)];
  std::vector<std::string> labels;
  for (const auto& r : runs) {
    const std::string by_name = label(r.name, r.world_size);
    labels.push_back(uses[by_name] > 1 ? label(r.dir, r.world_size) : by_name);
  }
  return labels;
}

}  // namespace chorus::report
