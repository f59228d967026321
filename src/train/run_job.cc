// What a training program's main() calls around the Accelerator, process-wide: run_job (one rank
// of a launched job, or ranks started here with chorus::spawn, with an exception reported on one
// line and recorded for chorus run), set_num_threads and tune_malloc_for_training.
#include <c10/util/Exception.h>
#include <dlfcn.h>
#include <malloc.h>
#include <torch/utils.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>

#include "chorus/comm/rendezvous.h"
#include "chorus/comm/signals.h"
#include "chorus/comm/spawn.h"
#include "chorus/comm/error.h"
#include "chorus/train/run_job.h"

namespace chorus::train {

namespace {
std::string one_line(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  std::string message = c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
  while (!message.empty() && message.back() == '\n') message.pop_back();
  return message;
}

int report(const char* program, const std::string& who, const std::exception& e) {
  const std::string message = one_line(e);
  record_fatal_error(e, message);
  std::fflush(stdout);
  std::fprintf(stderr, "%s: %s: error: %s\n", program, who.c_str(), message.c_str());
  return dynamic_cast<const UsageError*>(&e) != nullptr ? 2 : 1;
}
}  // namespace

void set_num_threads(int threads) {
  if (threads < 1) throw UsageError("set_num_threads: " + std::to_string(threads) + " threads; at least 1");
  torch::set_num_threads(threads);
  using SetThreads = void (*)(int);
  if (auto f = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) f(threads);
}

bool tune_malloc_for_training(const Environment& env) {
  for (const char* name : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"}) {
    if (env.count(name) != 0) return false;
  }
  if (auto it = env.find("CHORUS_MALLOC_TUNING"); it != env.end() && it->second == "0") return false;
  // 32 MiB is the largest mmap threshold glibc accepts (HEAP_MAX_SIZE / 2 on 64-bit); setting it
  // also stops glibc's own adjustment of it.
  const bool mmap_set = ::mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1;
  const bool trim_set = ::mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1;
  return mmap_set && trim_set;
}

bool tune_malloc_for_training() { return tune_malloc_for_training(current_environment()); }

int run_job(const char* program, int nproc, const std::function<void()>& train) {
  if (std::string rank; launched_job(&rank)) {
    // Errors before the process group exists are recorded too (connect_process_group installs
    // the same file again, with the rank it checked).
    if (const std::string file = error_file_from_environment(); !file.empty()) {
      char* end = nullptr;
      const long r = std::strtol(rank.c_str(), &end, 10);
      install_error_file_handler(file.c_str(), end != rank.c_str() && *end == '\0' && r >= 0 && r < (1L << 30) ? static_cast<int>(r) : -1);
    }
    if (nproc > 0) {
      std::fprintf(stderr,
                   "%s: error: this process is rank %s of a job started by a launcher (chorus run, torchrun, srun or "
                   "mpirun), so it cannot start ranks itself; drop --nproc\n",
                   program, rank.c_str());
      return 2;
    }
    try {
      train();
    } catch (const std::exception& e) {
      return report(program, "rank " + rank, e);
    }
    return 0;
  }
  // Start the ranks here. The parent only waits: it must not touch libtorch before forking.
  try {
    spawn(std::max(nproc, 1), [&](int, int) {
      try {
        train();
      } catch (const c10::Error& e) {
        throw std::runtime_error(e.what_without_backtrace());  // spawn reports what(): one line
      }
    });
  } catch (const std::exception& e) {
    return report(program, "job", e);
  }
  return 0;
}

}  // namespace chorus::train
