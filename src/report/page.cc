// The HTML page: the runs table, the inlined figures and each run's details. Pure.
#include <cmath>
#include <cstdio>
#include <set>
#include <sstream>

#include "chorus/report/report.h"
#include "palette.h"

namespace chorus::report {
namespace {

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string fmt(const char* format, double v) {
  if (!std::isfinite(v)) return "&ndash;";
  char buf[64];
  std::snprintf(buf, sizeof(buf), format, v);
  return buf;
}

std::string duration(double seconds) {
  if (!std::isfinite(seconds)) return "&ndash;";
  char buf[64];
  const long s = std::lround(seconds);
  if (seconds < 60) {
    std::snprintf(buf, sizeof(buf), "%.1f s", seconds);
  } else if (s < 3600) {
    std::snprintf(buf, sizeof(buf), "%ld min %02ld s", s / 60, s % 60);
  } else {
    std::snprintf(buf, sizeof(buf), "%ld h %02ld min", s / 3600, (s % 3600) / 60);
  }
  return buf;
}

const char* kStyle = R"(
  body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
         margin: 0 auto; padding: 16px 24px 40px; max-width: 1320px; color: #222; background: #fff; }
  h1 { font-size: 22px; margin: 8px 0 2px; }
  h2 { font-size: 17px; margin: 28px 0 10px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
  p.meta, p.note { color: #555; font-size: 13px; margin: 4px 0; }
  table { border-collapse: collapse; font-size: 13px; }
  th, td { padding: 5px 10px; border-bottom: 1px solid #e4e4e4; text-align: right; white-space: nowrap; }
  th { background: #f4f4f4; font-weight: 600; }
  td.text, th.text { text-align: left; }
  td.dir { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12px; color: #555;
           white-space: normal; word-break: break-all; max-width: 280px; }
  span.swatch { display: inline-block; width: 10px; height: 10px; margin-right: 6px; border-radius: 2px; }
  .grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 18px; }
  figure { margin: 0; border: 1px solid #e4e4e4; border-radius: 4px; padding: 6px; }
  figure svg { display: block; width: 100%; height: auto; }
  figcaption { font-size: 12px; color: #555; padding: 2px 6px 4px; }
  details { margin: 8px 0; font-size: 13px; }
  summary { cursor: pointer; font-weight: 600; }
  code { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12px; }
)";

std::string caption(const Figure& f) {
  if (f.kind == Figure::Kind::kStackedBars && f.id != "step_breakdown") {
    return "The last value each run logged: with one or two values per run, a value reads better than a "
           "curve.";
  }
  if (f.xlabel == "epochs completed") {
    return "Logged once per epoch, drawn at the number of epochs completed when it was logged.";
  }
  if (f.kind == Figure::Kind::kStackedBars) {
    return "Mean time per optimizer step. backward is its own work; comm wait is the time it then waited "
           "for the gradient allreduces (exposed communication); other is the rest of the step (the "
           "loop's own code). Total above each bar.";
  }
  if (f.id == "throughput_vs_step") return "Samples per second over all workers, each step's slowest worker.";
  if (f.id == "throughput_vs_workers") {
    return "Each world size's samples/s (the runs table's, averaged over its runs), and linear scaling: the "
           "smallest world size's rate times the number of workers.";
  }
  return "";
}

bool is_id_start(const std::string& s, size_t pos) {
  return pos > 0 && (s[pos - 1] == ' ' || s[pos - 1] == '\t' || s[pos - 1] == '\n');
}

}  // namespace

std::string inline_svg(const std::string& svg, const std::string& prefix) {
  size_t start = svg.find("<svg");
  if (start == std::string::npos) start = 0;
  const std::string in = svg.substr(start);
  const std::string p = prefix + "-";
  std::string out;
  out.reserve(in.size() + in.size() / 20);
  for (size_t i = 0; i < in.size();) {
    // id='X' / id="X" (an attribute, so after whitespace), href='#X', url(#X)
    if (in.compare(i, 3, "id=") == 0 && is_id_start(in, i) && i + 3 < in.size() &&
        (in[i + 3] == '"' || in[i + 3] == '\'')) {
      out += in.substr(i, 4) + p;
      i += 4;
    } else if (in.compare(i, 7, "href=\"#") == 0 || in.compare(i, 7, "href='#") == 0) {
      out += in.substr(i, 7) + p;
      i += 7;
    } else if (in.compare(i, 5, "url(#") == 0) {
      out += "url(#" + p;
      i += 5;
    } else {
      out += in[i++];
    }
  }
  return out;
}

std::string render_html(const std::vector<RunRecords>& runs, const std::vector<RunRow>& rows,
                        const std::vector<RenderedFigure>& figures, const std::string& generated_at) {
  std::vector<std::string> keys;  // user scalars, in first-seen order
  std::set<std::string> seen;
  for (const auto& r : runs) {
    for (const auto& rec : r.metrics.scalars) {
      for (const auto& kv : rec.values) {
        if (seen.insert(kv.first).second) keys.push_back(kv.first);
      }
    }
  }
  std::string names;  // each name once
  std::set<std::string> named;
  for (const auto& r : runs) {
    if (named.insert(r.name).second) names += (names.empty() ? "" : ", ") + r.name;
  }

  std::ostringstream h;
  h << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
    << "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
    << "<title>chorus report: " << escape(names) << "</title>\n<style>" << kStyle << "</style>\n</head>\n<body>\n"
    << "<h1>chorus report: " << escape(names) << "</h1>\n"
    << "<p class=\"meta\">" << runs.size() << (runs.size() == 1 ? " run" : " runs") << "; generated "
    << escape(generated_at) << " by <code>chorus report</code> from the run directories' metrics.jsonl "
    << "(docs/run-records.md)</p>\n";

  // The table of runs.
  const RunRow* base = nullptr;
  for (const auto& row : rows) {
    if (base == nullptr || row.world_size < base->world_size) base = &row;
  }
  h << "<h2 id=\"runs\">Runs</h2>\n<table id=\"runs-table\">\n<tr><th class=\"text\">run</th><th>world size</th>"
    << "<th>steps</th><th>samples/s</th><th>speed-up</th><th>final loss</th>";
  for (const auto& k : keys) h << "<th>final " << escape(k) << "</th>";
  h << "<th>wall time</th><th class=\"text\">status</th><th>resumes</th><th class=\"text\">directory</th></tr>\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    const RunRow& row = rows[i];
    h << "<tr><td class=\"text\"><span class=\"swatch\" style=\"background:" << "#" << detail::run_color(i) << "\"></span>"
      << escape(row.label) << "</td><td>" << row.world_size << "</td><td>" << row.steps << "</td><td>"
      << fmt("%.1f", row.samples_per_s) << "</td><td>" << fmt("%.2f&times;", row.speedup) << "</td><td>"
      << fmt("%.4g", row.final_loss) << "</td>";
    for (const auto& k : keys) {
      auto it = row.final_scalars.find(k);
      h << "<td>" << (it == row.final_scalars.end() ? "&ndash;" : fmt("%.4g", it->second)) << "</td>";
    }
    h << "<td>" << duration(row.wall_seconds) << "</td><td class=\"text\">" << escape(row.status) << "</td><td>"
      << row.resumes << "</td><td class=\"text dir\">" << escape(row.dir) << "</td></tr>\n";
  }
  h << "</table>\n";
  if (base != nullptr) {
    h << "<p class=\"note\">samples/s: over the training time (summary.json), else all samples over the sum of "
      << "step times. Speed-up: samples/s over that of " << escape(base->label)
      << ", the smallest world size.</p>\n";
  }

  h << "<h2 id=\"figures\">Figures</h2>\n<div class=\"grid\">\n";
  for (const auto& rf : figures) {
    const Figure& f = rf.figure;
    std::string series;
    for (const auto& s : f.kind == Figure::Kind::kStackedBars ? std::vector<Series>{} : f.series) {
      series += (series.empty() ? "" : "|") + s.label;
    }
    if (f.kind == Figure::Kind::kStackedBars) {
      for (const auto& c : f.categories) series += (series.empty() ? "" : "|") + c;
    }
    h << "<figure id=\"fig-" << escape(f.id) << "\" data-figure=\"" << escape(f.id) << "\" data-series=\""
      << escape(series) << "\">\n"
      << inline_svg(rf.svg, "fig-" + f.id) << "\n";
    const std::string cap = caption(f);
    if (!cap.empty()) h << "<figcaption>" << escape(cap) << "</figcaption>\n";
    h << "</figure>\n";
  }
  h << "</div>\n";

  h << "<h2 id=\"details\">Run details</h2>\n";
  for (size_t i = 0; i < runs.size(); ++i) {
    const RunRecords& r = runs[i];
    h << "<details><summary>" << escape(rows.size() > i ? rows[i].label : r.name) << "</summary>\n<p>"
      << "directory <code>" << escape(r.dir) << "</code>";
    if (!r.host.empty()) h << "; host <code>" << escape(r.host) << "</code>";
    if (!r.started.empty()) h << "; started " << escape(r.started);
    h << "</p>\n";
    if (!r.command.empty()) h << "<p>command <code>" << escape(r.command) << "</code></p>\n";
    if (!r.metrics.events.empty()) {
      h << "<table><tr><th class=\"text\">event</th><th>step</th><th>epoch</th><th>time</th>"
        << "<th class=\"text\">details</th></tr>\n";
      for (const auto& e : r.metrics.events) {
        h << "<tr><td class=\"text\">" << escape(e.event) << "</td><td>" << e.step << "</td><td>" << e.epoch
          << "</td><td>" << duration(e.time) << "</td><td class=\"text\"><code>" << escape(e.detail)
          << "</code></td></tr>\n";
      }
      h << "</table>\n";
    }
    h << "</details>\n";
  }
  h << "</body>\n</html>\n";
  return h.str();
}

}  // namespace chorus::report
