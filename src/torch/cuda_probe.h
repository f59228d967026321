// For tests that need a GPU: why they cannot run here, asked in a child process ("" when a CUDA
// device is usable). Initialising CUDA in the test process itself would break the ranks it forks
// afterwards, so the question goes to a short-lived child.
#pragma once

#include <torch/cuda.h>

#include <string>

#include "testing.h"

namespace chorus::testing {

inline std::string cuda_unavailable_reason() {
  auto probe = run_ranks_independent(1, [](int, int) -> std::string {
    return torch::cuda::is_available() ? "" : "libtorch sees no CUDA device (a CPU-only build, or no GPU here)";
  }, std::chrono::seconds(60));
  if (probe.empty() || !probe[0].exited || probe[0].exit_code != 0) return "the CUDA probe process failed";
  return probe[0].text;
}

}  // namespace chorus::testing
