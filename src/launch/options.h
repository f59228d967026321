// Internal to chorus_launch: `chorus run`'s options checked before anything starts (every bad
// value a UsageError naming the option and the fix), and the launcher's scratch directory.
#pragma once

#include <set>
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

// The ranks of a filter's text: comma-separated numbers and ranges, "0", "0,3", "1-3,7". Throws
// UsageError naming `option` for anything else (empty, negative, a range that runs backwards).
std::set<int> parse_rank_list(const std::string& text, const char* option);

// Where one worker's output goes.
enum class Output {
  kTerminal,  // straight to the launcher's terminal (rank 0 with --log-dir: also to its log)
  kPrefixed,  // through the launcher, each line "[rankN]:" on the terminal (and in its log, unprefixed)
  kLogOnly,   // to its --log-dir log alone, or nowhere without --log-dir (not chosen by a filter)
};
// The choice for rank `rank` (local rank `local_rank`) under o's --tee and filters.
Output output_for(const LaunchOptions& o, int rank, int local_rank);

// A fresh /tmp/chorus-run-<pid>-ns<pid namespace>-XXXXXX, after removing those of launchers that
// no longer run. Throws Error when it cannot be made.
std::string make_scratch_dir();

}  // namespace chorus::launch::detail
