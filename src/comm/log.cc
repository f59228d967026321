#include "chorus/comm/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <mutex>

#include "chorus/comm/error.h"

namespace chorus {
namespace {

struct LogState {
  std::mutex mu;  // guards sink and the prefix, and keeps lines whole
  LogSink sink;
  std::string host;
  int rank = -1;
};

LogState& state() {
  static LogState s;  // constructed on first use, never destroyed before a late log line
  return s;
}

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};

const char* level_name(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kError: return "error";
    default: return "off";
  }
}

}  // namespace

void set_log_level(LogLevel level) { g_level.store(static_cast<int>(level), std::memory_order_relaxed); }
LogLevel log_level() { return static_cast<LogLevel>(g_level.load(std::memory_order_relaxed)); }

LogLevel parse_log_level(const std::string& name) {
  for (LogLevel l : {LogLevel::kDebug, LogLevel::kInfo, LogLevel::kWarning, LogLevel::kError, LogLevel::kOff}) {
    if (name == level_name(l)) return l;
  }
  throw UsageError("log level '" + name + "': expected debug, info, warning, error or off");
}

void set_log_sink(LogSink sink) {
  LogState& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.sink = std::move(sink);
}

void set_log_rank(int rank) {
  LogState& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.rank = rank;
}

void log(LogLevel level, const std::string& message) {
  if (level == LogLevel::kOff || static_cast<int>(level) < g_level.load(std::memory_order_relaxed)) return;
  LogState& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.host.empty()) {
    char name[256] = {};
    s.host = ::gethostname(name, sizeof(name) - 1) == 0 && name[0] != '\0' ? name : "?";
  }
  std::string line = "chorus[" + s.host + " pid " + std::to_string(::getpid());
  if (s.rank >= 0) line += " rank " + std::to_string(s.rank);
  line += "] ";
  line += level_name(level);
  line += ": ";
  line += message;
  if (s.sink) {
    s.sink(level, line);
  } else {
    line += '\n';
    std::fwrite(line.data(), 1, line.size(), stderr);
  }
}

}  // namespace chorus
