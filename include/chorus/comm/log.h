// chorus's diagnostics: the library's notices (a refused connection, a store still out of reach,
// a fallback from shared memory to TCP) as single lines with one prefix,
//
//   chorus[node-3 pid 4242 rank 5] warning: refused a connection from 10.0.0.9:51234: ...
//
// on stderr, or handed to a sink the program sets. Errors are exceptions, not log lines; a line
// here never stops or changes a job.
//
// Thread-safe: any thread may log; the sink is called under a lock, one line at a time, so it
// must not log itself. The level, sink and rank are process-wide (one stderr, one process).
#pragma once

#include <functional>
#include <string>

namespace chorus {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kOff = 4 };

// Lines below `level` are dropped; kOff silences chorus. The default is kInfo; chorus's
// rendezvous (init_process_group) applies CHORUS_LOG_LEVEL when it is set.
void set_log_level(LogLevel level);
LogLevel log_level();
// "debug", "info", "warning", "error" or "off"; UsageError otherwise.
LogLevel parse_log_level(const std::string& name);

// Receives every line that passes the level: the prefix and the message, without a newline.
// nullptr restores the default (stderr).
using LogSink = std::function<void(LogLevel level, const std::string& line)>;
void set_log_sink(LogSink sink);

// The rank shown in the prefix (-1, the default: none); set by rendezvous.
void set_log_rank(int rank);

// Writes `message` (one line) at `level`.
void log(LogLevel level, const std::string& message);

}  // namespace chorus
