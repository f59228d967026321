// CHORUS_CHECK(condition, what): an invariant of chorus's own code whose breach would corrupt data
// (write outside a buffer, reduce the wrong bytes, hand out a wrong result). Always on: every use
// sits outside inner loops, so it costs a compare. A failure is a bug in chorus, not a user
// mistake: it throws chorus::Error "chorus internal error at FILE:LINE: CONDITION (WHAT); please
// report it", never aborts the process, and the process group treats it as any other failure.
#pragma once

#include <string>

#include "chorus/comm/error.h"

namespace chorus::detail {
[[noreturn]] void check_failed(const char* file, int line, const char* condition, const std::string& what);
}  // namespace chorus::detail

#define CHORUS_CHECK(condition, what)                                                   \
  do {                                                                                  \
    if (!(condition)) ::chorus::detail::check_failed(__FILE__, __LINE__, #condition, (what)); \
  } while (false)
