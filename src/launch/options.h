// Internal to chorus_launch: `chorus run`'s options checked before anything starts (every bad
// value a UsageError naming the option and the fix), and the launcher's scratch directory.
#pragma once

#include <string>

#include "chorus/launch/launcher.h"

namespace chorus::launch::detail {

// What the checks resolved.
struct CheckedOptions {
  std::string program_path;  // the program as exec finds it (PATH searched)
  int nproc = 1;             // workers on this node ("auto": one per core)
  std::string master_addr;   // the rendezvous endpoint's host ("" when this node makes the store)
  int master_port = -1;      // and port (-1: none given)
};
CheckedOptions check_options(const LaunchOptions& o);

// A fresh /tmp/chorus-run-<pid>-ns<pid namespace>-XXXXXX, after removing those of launchers that
// no longer run. Throws Error when it cannot be made.
std::string make_scratch_dir();

}  // namespace chorus::launch::detail
