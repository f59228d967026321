// A process's environment as a value. The library's decisions that depend on environment
// variables take one (resolve_cluster_env, S3Options::from_env, tune_malloc_for_training,
// stdout_rewrites_in_place), so they are pure functions, unit-tested with a map instead of setenv.
// current_environment() takes the snapshot: with rendezvous and the launcher, the only code that
// reads the process's environment; the entry points without an Environment argument default to it.
#pragma once

#include <map>
#include <string>

namespace chorus {

// Variable name -> value. A variable set to "" is kept: whether it counts as unset is the reader's
// rule (resolve_cluster_env treats it as unset, as an empty RANK= is in a shell).
using Environment = std::map<std::string, std::string>;

// Every variable of this process's environment, as it is now. Not to be called while another
// thread changes the environment (setenv, putenv).
Environment current_environment();

}  // namespace chorus
