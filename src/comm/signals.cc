#include "chorus/comm/signals.h"

#include <fcntl.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <cxxabi.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <string>
#include <typeinfo>

#include "chorus/comm/error.h"
#include "chorus/comm/log.h"

namespace chorus {
namespace {

std::atomic<int> g_pending{0};

void record(int sig) { g_pending.store(sig, std::memory_order_relaxed); }

std::string g_error_file;
int g_rank = -1;  // written as the record's rank (-1: null)
std::terminate_handler g_previous = nullptr;

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out;
}

std::atomic<bool> g_recorded{false};

// The exception's type as the source spells it ("chorus::PeerError"), not the mangled name.
std::string type_name(const std::exception& e) {
  const char* mangled = typeid(e).name();
  int status = 0;
  char* plain = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string out = status == 0 && plain != nullptr ? plain : mangled;
  std::free(plain);
  return out;
}

// Writes the record atomically (temporary file, then rename), so the launcher reads all or none.
void write_record(const std::string& message, const std::string& type, bool relayed) {
  if (g_error_file.empty() || g_recorded.exchange(true)) return;
  timespec now {};
  ::clock_gettime(CLOCK_REALTIME, &now);
  const std::string tmp = g_error_file + ".tmp";
  if (FILE* f = std::fopen(tmp.c_str(), "w")) {
    const std::string rank = g_rank >= 0 ? std::to_string(g_rank) : "null";
    std::fprintf(f,
                 "{\"message\": \"%s\", \"type\": \"%s\", \"relayed\": %s, \"rank\": %s, \"pid\": %d, "
                 "\"time\": %lld.%06ld}\n",
                 json_escape(message).c_str(), json_escape(type).c_str(), relayed ? "true" : "false",
                 rank.c_str(), static_cast<int>(::getpid()),
                 static_cast<long long>(now.tv_sec), now.tv_nsec / 1000);
    std::fclose(f);
    std::rename(tmp.c_str(), g_error_file.c_str());
  }
}

[[noreturn]] void on_terminate() {
  std::string message = "std::terminate called without an active exception";
  if (std::exception_ptr e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      record_fatal_error(ex);
      message = ex.what();
    } catch (...) {
      message = "an exception not derived from std::exception";
      write_record(message, "unknown", false);
    }
  } else {
    write_record(message, "none", false);
  }
  chorus::log(LogLevel::kError, "uncaught exception: " + message);
  if (g_previous != nullptr && g_previous != on_terminate) g_previous();
  std::abort();
}

}  // namespace

void watch_signals() { watch_signals({SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2}); }

void watch_signals(std::initializer_list<int> signals) {
  for (int sig : signals) {
    struct sigaction sa {};
    sa.sa_handler = record;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    ::sigaction(sig, &sa, nullptr);
  }
}

int pending_signal() { return g_pending.load(std::memory_order_relaxed); }
void clear_pending_signal() { g_pending.store(0, std::memory_order_relaxed); }

void install_error_file_handler(const char* path, int rank) {
  g_error_file = path;
  g_rank = rank;
  std::terminate_handler prev = std::set_terminate(on_terminate);
  if (prev != on_terminate) g_previous = prev;
}

void record_fatal_error(const std::exception& error, const std::string& message) {
  write_record(message.empty() ? error.what() : message, type_name(error),
               dynamic_cast<const PeerError*>(&error) != nullptr);
}

}  // namespace chorus
