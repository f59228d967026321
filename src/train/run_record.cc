#include "run_record.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <sys/time.h>

#include "chorus/report/report.h"

namespace chorus::train::detail {

namespace fs = std::filesystem;

namespace {
std::FILE* open_file(const std::string& path, bool fresh) {
  std::FILE* f = std::fopen(path.c_str(), fresh ? "w" : "a");
  if (f == nullptr) {
    throw std::runtime_error("cannot open " + path + " for writing: " + std::strerror(errno) +
                             " (choose another AcceleratorOptions::project_dir, or set records = false)");
  }
  std::setvbuf(f, nullptr, _IOFBF, 1 << 16);
  return f;
}

void put_text(std::FILE* f, const std::string& text) {
  if (f == nullptr) return;
  std::fwrite(text.data(), 1, text.size(), f);
  std::fputc('\n', f);
}

void put_line(std::FILE* f, const nlohmann::json& j) {
  put_text(f, j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

std::string rank_name(int rank) { return "rank-" + std::to_string(rank); }
}  // namespace

void StepRow::to_doubles(double* out) const {
  const double v[kFields] = {static_cast<double>(step), static_cast<double>(epoch), time, loss, lr, samples,
                             step_ms, data_ms, forward_ms, backward_ms, optimizer_ms, comm_ms, comm_wait_ms};
  std::copy(v, v + kFields, out);
}

StepRow StepRow::from_doubles(const double* in) {
  StepRow r;
  r.step = static_cast<int64_t>(in[0]);
  r.epoch = static_cast<int64_t>(in[1]);
  r.time = in[2];
  r.loss = in[3];
  r.lr = in[4];
  r.samples = in[5];
  r.step_ms = in[6];
  r.data_ms = in[7];
  r.forward_ms = in[8];
  r.backward_ms = in[9];
  r.optimizer_ms = in[10];
  r.comm_ms = in[11];
  r.comm_wait_ms = in[12];
  return r;
}

// The line is chorus report's definition (report::format_step_line), so writer and reader agree.
std::string StepRow::to_line() const {
  report::StepRecord r;
  r.step = step;
  r.epoch = epoch;
  r.time = time;
  r.loss = loss;
  r.lr = lr;
  r.samples = samples;
  r.step_ms = step_ms;
  r.data_ms = data_ms;
  r.forward_ms = forward_ms;
  r.backward_ms = backward_ms;
  r.optimizer_ms = optimizer_ms;
  r.comm_ms = comm_ms;
  r.comm_wait_ms = comm_wait_ms;
  return report::format_step_line(r);
}

StepRow aggregate_rows(const std::vector<StepRow>& ranks) {
  StepRow out;
  if (ranks.empty()) return out;
  const double n = static_cast<double>(ranks.size());
  out.step = ranks[0].step;
  out.epoch = ranks[0].epoch;
  out.time = ranks[0].time;
  out.lr = ranks[0].lr;
  for (const auto& r : ranks) {
    out.loss += r.loss / n;
    out.samples += r.samples;
    out.step_ms = std::max(out.step_ms, r.step_ms);
    out.data_ms += r.data_ms / n;
    out.forward_ms += r.forward_ms / n;
    out.backward_ms += r.backward_ms / n;
    out.optimizer_ms += r.optimizer_ms / n;
    out.comm_ms += r.comm_ms / n;
    out.comm_wait_ms += r.comm_wait_ms / n;
  }
  return out;
}

void truncate_jsonl_after(const std::string& path, int64_t step) {
  std::ifstream in(path);
  if (!in) return;
  std::string kept, text;
  while (std::getline(in, text)) {
    auto j = nlohmann::json::parse(text, nullptr, false);
    if (!j.is_discarded() && j.is_object() && j.contains("step") && j["step"].is_number() &&
        j["step"].get<double>() > static_cast<double>(step)) {
      continue;
    }
    if (j.is_discarded()) continue;  // a line cut short by a kill
    kept += text;
    kept += '\n';
  }
  in.close();
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << kept;
    if (!out) throw std::runtime_error("cannot write " + tmp + ": " + std::strerror(errno));
  }
  fs::rename(tmp, path);
}

RunRecorder::RunRecorder(std::string dir, int rank, bool fresh) : dir_(std::move(dir)), rank_(rank) {
  std::error_code ec;
  for (const char* sub : {"metrics", "logs"}) {
    fs::create_directories(fs::path(dir_) / sub, ec);
    if (ec) {
      throw std::runtime_error("cannot create " + (fs::path(dir_) / sub).string() + ": " + ec.message() +
                               " (choose another AcceleratorOptions::project_dir, or set records = false)");
    }
  }
  open(fresh);
}

void RunRecorder::open(bool fresh) {
  rank_file_ = open_file(dir_ + "/metrics/" + rank_name(rank_) + ".jsonl", fresh);
  log_file_ = open_file(dir_ + "/logs/" + rank_name(rank_) + ".log", fresh);
  std::setvbuf(log_file_, nullptr, _IOLBF, 1 << 12);
  if (rank_ == 0) aggregate_file_ = open_file(dir_ + "/metrics.jsonl", fresh);
  const char* mirror = std::getenv("CHORUS_DASK_METRICS");
  if (rank_ == 0 && mirror != nullptr && *mirror != '\0') {
    mirror_file_ = std::fopen(mirror, "a");  // a resumed run's lines follow the earlier ones
    if (mirror_file_ != nullptr) std::setvbuf(mirror_file_, nullptr, _IOLBF, 1 << 12);
  }
}

void RunRecorder::put_aggregate(const nlohmann::json& object) {
  put_aggregate_text(object.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

void RunRecorder::put_aggregate_text(const std::string& line) {
  put_text(aggregate_file_, line);
  put_text(mirror_file_, line);
}

void RunRecorder::rewind(int64_t step) {
  if (!enabled()) return;
  close();
  truncate_jsonl_after(dir_ + "/metrics/" + rank_name(rank_) + ".jsonl", step);
  if (rank_ == 0) truncate_jsonl_after(dir_ + "/metrics.jsonl", step);
  open(false);
}

void RunRecorder::aggregate_line(const nlohmann::json& object) { put_aggregate(object); }

RunRecorder::~RunRecorder() { close(); }

RunRecorder::RunRecorder(RunRecorder&& other) noexcept { *this = std::move(other); }

RunRecorder& RunRecorder::operator=(RunRecorder&& other) noexcept {
  if (this == &other) return *this;
  close();
  dir_ = std::move(other.dir_);
  rank_ = other.rank_;
  rank_file_ = std::exchange(other.rank_file_, nullptr);
  aggregate_file_ = std::exchange(other.aggregate_file_, nullptr);
  log_file_ = std::exchange(other.log_file_, nullptr);
  mirror_file_ = std::exchange(other.mirror_file_, nullptr);
  return *this;
}

void RunRecorder::close() {
  for (std::FILE** f : {&rank_file_, &aggregate_file_, &log_file_, &mirror_file_}) {
    if (*f != nullptr) std::fclose(*f);
    *f = nullptr;
  }
}

void RunRecorder::step(const StepRow& row) { put_text(rank_file_, row.to_line()); }

void RunRecorder::aggregate(const StepRow& row) { put_aggregate_text(row.to_line()); }

void RunRecorder::line(nlohmann::json object, bool to_aggregate) {
  put_line(rank_file_, object);
  if (to_aggregate) put_aggregate(object);
}

void RunRecorder::log_line(const std::string& text) {
  if (log_file_ == nullptr) return;
  struct timeval tv {};
  ::gettimeofday(&tv, nullptr);
  struct tm tm {};
  ::gmtime_r(&tv.tv_sec, &tm);
  char stamp[64];
  std::snprintf(stamp, sizeof(stamp), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ ", tm.tm_year + 1900, tm.tm_mon + 1,
                tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(tv.tv_usec / 1000));
  std::fputs(stamp, log_file_);
  std::fputs(text.c_str(), log_file_);
  std::fputc('\n', log_file_);
}

void RunRecorder::write_json(const std::string& name, const nlohmann::json& doc) {
  if (!enabled()) return;
  const std::string path = dir_ + "/" + name;
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << doc.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    if (!out) throw std::runtime_error("cannot write " + tmp + ": " + std::strerror(errno));
  }
  fs::rename(tmp, path);
}

void RunRecorder::flush() {
  for (std::FILE* f : {rank_file_, aggregate_file_, log_file_, mirror_file_}) {
    if (f != nullptr) std::fflush(f);
  }
}


std::string hms(double seconds) {
  const int64_t t = seconds > 0 ? static_cast<int64_t>(seconds + 0.5) : 0;
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%" PRId64 ":%02d:%02d", t / 3600, static_cast<int>(t / 60 % 60),
                static_cast<int>(t % 60));
  return buf;
}

void Progress::step(int64_t step, int64_t planned, int64_t epoch, int64_t epochs, double loss,
                    double samples_per_s, double eta_s) {
  if (!active_) return;
  loss_sum_ += loss;
  ++loss_n_;
  const bool last = planned > 0 && step >= planned;
  const auto now = std::chrono::steady_clock::now();
  if (in_place_) {
    if (!last && now - last_ < std::chrono::milliseconds(250)) return;
  } else if (!last && step % every_ != 0) {
    return;
  }
  last_ = now;
  const double mean_loss = loss_sum_ / static_cast<double>(loss_n_);
  loss_sum_ = 0;
  loss_n_ = 0;
  std::string where = "epoch " + std::to_string(epoch + 1) + (epochs > 0 ? "/" + std::to_string(epochs) : "");
  char tail[160];
  std::snprintf(tail, sizeof(tail), "  loss %.4f  %.0f samples/s  ETA %s", mean_loss, samples_per_s,
                eta_s >= 0 ? hms(eta_s).c_str() : "?");
  if (in_place_) {
    std::string bar;
    if (planned > 0) {
      const int width = 24;
      const int filled = static_cast<int>(static_cast<double>(width) * static_cast<double>(step) /
                                          static_cast<double>(planned));
      bar = " [" + std::string(static_cast<size_t>(std::clamp(filled, 0, width)), '#') +
            std::string(static_cast<size_t>(width - std::clamp(filled, 0, width)), '.') + "]";
    }
    std::printf("\r%s%s step %" PRId64 "%s%s\x1b[K", where.c_str(), bar.c_str(), step,
                planned > 0 ? ("/" + std::to_string(planned)).c_str() : "", tail);
    open_ = true;
  } else {
    std::printf("%s  step %" PRId64 "%s%s\n", where.c_str(), step,
                planned > 0 ? ("/" + std::to_string(planned)).c_str() : "", tail);
  }
  std::fflush(stdout);
}

void Progress::line(const std::string& text) {
  if (!active_) return;
  std::printf("%s%s\n", open_ ? "\n" : "", text.c_str());
  std::fflush(stdout);
  open_ = false;
}

void Progress::close() {
  if (!active_ || !open_) return;
  std::printf("\n");
  std::fflush(stdout);
  open_ = false;
}

}  // namespace chorus::train::detail

namespace chorus::train {

bool stdout_rewrites_in_place(const Environment& env, bool stdout_is_terminal) {
  if (!stdout_is_terminal) return false;
  if (auto term = env.find("TERM"); term != env.end() && term->second == "dumb") return false;
  for (const char* relay : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_STEP_ID", "SLURM_STEPID"}) {
    if (env.count(relay) != 0) return false;
  }
  return true;
}

bool stdout_rewrites_in_place() { return stdout_rewrites_in_place(current_environment(), ::isatty(1) != 0); }

}  // namespace chorus::train
