// Internal to chorus_report: the colours the figures and the page's table share, so that a run's
// swatch in the table is its line's colour in every figure.
#pragma once

#include <cstddef>
#include <string>

namespace chorus::report::detail {

// Tableau's ten colours (hex RGB, no '#'): distinct on screen and in grey print. Run i gets
// run_color(i).
inline const char* run_color(size_t index) {
  static const char* const kColors[] = {"1f77b4", "ff7f0e", "2ca02c", "d62728", "9467bd",
                                        "8c564b", "e377c2", "7f7f7f", "bcbd22", "17becf"};
  return kColors[index % (sizeof(kColors) / sizeof(kColors[0]))];
}

// The step-time breakdown's phases, in plan order: data, forward, backward, comm wait, optimizer,
// other.
inline const char* phase_color(size_t index) {
  static const char* const kColors[] = {"9467bd", "1f77b4", "2ca02c", "d62728", "ff7f0e", "b0b0b0"};
  return kColors[index % (sizeof(kColors) / sizeof(kColors[0]))];
}

}  // namespace chorus::report::detail
