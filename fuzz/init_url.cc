// Fuzz target: the init URL of rendezvous() / init_process_group() (src/comm/rendezvous_url.h):
// scheme, percent escapes, query parameters, rank and world size, tcp://'s host and port. The
// whole input is the URL; a bad one must raise UsageError, nothing else.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "chorus/comm/error.h"
#include "chorus/comm/rendezvous.h"
#include "comm/rendezvous_url.h"

namespace ru = chorus::rendezvous_url;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const ru::Url url = ru::parse_url(text);
    if (url.scheme != "env" && url.scheme != "tcp" && url.scheme != "file") std::abort();
    const int world = ru::arg_or_param(url, -1, "world_size", 1);
    const int rank = ru::arg_or_param(url, -1, "rank", 0);
    if ((world != -1 && world < 1) || rank < -1) std::abort();
    if (url.scheme == "tcp") {
      std::string host;
      int port = 0;
      if (chorus::split_host_port(url.body, &host, &port).empty()) {
        if (host.empty() || port < 1 || port > 65535) std::abort();  // accepted, so it must be usable
      } else if (!host.empty() || port != 0) {
        std::abort();  // refused: the outputs must be untouched
      }
    }
  } catch (const chorus::UsageError&) {
  }
  return 0;
}
