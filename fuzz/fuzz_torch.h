// Shared by the fuzz targets that link libtorch (checkpoint, pickle).
#pragma once

#include <c10/util/Logging.h>

#include <string>

namespace chorus_fuzz {

// libtorch 1.13's c10::Error collects a backtrace of the throwing thread in its constructor, which
// was most of a libtorch target's time on bad input (about 200 inputs/s). The targets replace the
// fetcher with one that returns nothing: the same errors are thrown along the same paths; only
// their messages lose the backtrace.
inline void cheap_torch_errors() {
  static const bool once = [] {
    c10::SetStackTraceFetcher([] { return std::string(); });
    return true;
  }();
  (void)once;
}

}  // namespace chorus_fuzz
