// write_report: the I/O around the pure steps (read the runs, run gnuplot, write the page).
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "chorus/report/report.h"
#include "program.h"

namespace chorus::report {
namespace {

namespace fs = std::filesystem;

const char* const kInstallHint = "install Debian's gnuplot-nox (apt-get install gnuplot-nox, or scripts/install-deps)";

// Writes `text` to `path` through a temporary file and a rename, so that a reader never sees
// half a page.
void write_file(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) throw Error("chorus report: cannot write " + tmp.string() + ": " + std::strerror(errno));
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) throw Error("chorus report: cannot rename " + tmp.string() + " to " + path.string() + ": " + ec.message());
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

}  // namespace

std::string default_out_dir(const std::vector<std::string>& run_dirs) {
  if (run_dirs.size() == 1) return (fs::path(run_dirs[0]) / "report").lexically_normal().string();
  return "chorus-report";
}

std::string write_report(const ReportOptions& options) {
  if (options.run_dirs.empty()) throw UsageError("chorus report: name at least one run directory");
  std::vector<RunRecords> runs;
  for (const auto& dir : options.run_dirs) runs.push_back(load_run(dir));

  // Before anything is written: gnuplot is there and runs.
  try {
    const auto version = detail::run_program({options.gnuplot, "--version"}, options.gnuplot_timeout);
    if (version.exit_code != 0) {
      throw Error("`" + options.gnuplot + " --version` ended with " + detail::describe_exit(version) + ": " + version.err);
    }
  } catch (const Error& e) {
    throw Error("chorus report: gnuplot, which draws the figures, cannot run: " + std::string(e.what()) + "; " +
                kInstallHint);
  }

  const fs::path out_dir = options.out_dir.empty() ? fs::path(default_out_dir(options.run_dirs)) : fs::path(options.out_dir);
  const fs::path fig_dir = out_dir / "figures";
  std::error_code ec;
  fs::create_directories(fig_dir, ec);
  if (ec) throw Error("chorus report: cannot create " + fig_dir.string() + ": " + ec.message());

  std::vector<RenderedFigure> rendered;
  for (Figure& figure : plan_figures(runs)) {
    const fs::path script = fig_dir / (figure.id + ".gp");
    write_file(script, gnuplot_script(figure, options.style));
    detail::ProgramResult result;
    try {
      result = detail::run_program({options.gnuplot, fs::absolute(script).string()}, options.gnuplot_timeout);
    } catch (const TimeoutError& e) {
      throw TimeoutError("chorus report: gnuplot on " + script.string() + ": " + e.what());
    } catch (const Error& e) {
      throw Error("chorus report: " + std::string(e.what()) + "; " + kInstallHint);
    }
    if (result.exit_code != 0 || result.out.find("<svg") == std::string::npos) {
      throw Error("chorus report: gnuplot failed on " + script.string() + " (" + detail::describe_exit(result) +
                  (result.exit_code == 0 ? ", no SVG on its output" : "") + ")" +
                  (result.err.empty() ? "" : ":\n" + result.err));
    }
    write_file(fig_dir / (figure.id + ".svg"), result.out);
    rendered.push_back({std::move(figure), std::move(result.out)});
  }

  const fs::path index = out_dir / "index.html";
  write_file(index, render_html(runs, summarize_runs(runs), rendered, utc_now()));
  return index.string();
}

}  // namespace chorus::report
