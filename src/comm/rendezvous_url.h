// Internal: the init URL parser of rendezvous() (rendezvous.cc), apart so that fuzz/init_url.cc can
// feed it text. Pure: no environment, no sockets.
#pragma once

#include <map>
#include <string>

namespace chorus::rendezvous_url {

// env://, tcp://HOST:PORT?rank=R&world_size=W[&token=T] or file:///PATH?rank=R&world_size=W.
struct Url {
  std::string text;    // as given, for messages
  std::string scheme;  // "env", "tcp", "file" (lower case)
  std::string body;    // between "://" and "?", percent-decoded
  std::map<std::string, std::string> query;  // rank, world_size, token; values percent-decoded
};

// Throws UsageError naming the URL and what is wrong with it.
Url parse_url(const std::string& text);

// The rank or world size from `arg` when >= 0, else the URL's parameter `param` (an integer in
// [lo, 2^30], else UsageError); -1 when neither gives it.
int arg_or_param(const Url& url, int arg, const char* param, int lo);

// tcp://'s body goes through chorus::split_host_port (chorus/comm/rendezvous.h).

}  // namespace chorus::rendezvous_url
