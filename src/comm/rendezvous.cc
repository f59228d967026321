// rendezvous(): an init URL (and, for env://, the environment) becomes a store, a rank and a
// world size. This and the launcher are the only places that read the environment; what env://
// makes of it (chorus run, srun or mpirun) is the pure resolve_cluster_env() in cluster_env.cc.
#include "chorus/comm/rendezvous.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <map>

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "chorus/comm/environment.h"
#include "chorus/comm/error.h"
#include "chorus/comm/log.h"
#include "chorus/comm/spawn.h"
#include "chorus/comm/tcp_store.h"
#include "cluster_env.h"
#include "error_class.h"
#include "rendezvous_url.h"

extern char** environ;  // POSIX; <unistd.h> declares it only with _GNU_SOURCE

namespace chorus {
namespace {

using rendezvous_url::Url;

constexpr const char* kForms =
    "env://, tcp://HOST:PORT?rank=R&world_size=W[&token=T] or file:///PATH?rank=R&world_size=W";

[[noreturn]] void bad_url(const Url& url, const std::string& what) {
  throw UsageError("rendezvous URL '" + url.text + "': " + what);
}

std::string percent_decode(const Url& url, const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      out.push_back(s[i]);
      continue;
    }
    if (i + 2 >= s.size() || !std::isxdigit(static_cast<unsigned char>(s[i + 1])) ||
        !std::isxdigit(static_cast<unsigned char>(s[i + 2]))) {
      bad_url(url, "bad percent escape in '" + s + "'");
    }
    out.push_back(static_cast<char>(std::stoi(s.substr(i + 1, 2), nullptr, 16)));
    i += 2;
  }
  return out;
}

}  // namespace

Url rendezvous_url::parse_url(const std::string& text) {
  Url url;
  url.text = text;
  const size_t sep = text.find("://");
  if (sep == std::string::npos || sep == 0) {
    throw UsageError("malformed rendezvous URL '" + text + "': expected " + kForms);
  }
  url.scheme = text.substr(0, sep);
  std::transform(url.scheme.begin(), url.scheme.end(), url.scheme.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (url.scheme != "env" && url.scheme != "tcp" && url.scheme != "file") {
    throw UsageError("unsupported rendezvous URL scheme '" + url.scheme + "://' in '" + text +
                     "': use " + kForms);
  }
  const std::string rest = text.substr(sep + 3);
  const size_t q = rest.find('?');
  url.body = percent_decode(url, rest.substr(0, q));
  if (q == std::string::npos) return url;
  const std::string query = rest.substr(q + 1);
  size_t start = 0;
  while (start <= query.size()) {
    size_t end = query.find('&', start);
    if (end == std::string::npos) end = query.size();
    const std::string item = query.substr(start, end - start);
    start = end + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    if (eq == std::string::npos) {
      bad_url(url, "parameter '" + item + "' has no value (write name=value)");
    }
    const std::string name = item.substr(0, eq);
    if (name != "rank" && name != "world_size" && name != "token") {
      bad_url(url, "unknown parameter '" + name + "'; known ones are rank, world_size and token");
    }
    if (!url.query.emplace(name, percent_decode(url, item.substr(eq + 1))).second) {
      bad_url(url, "parameter '" + name + "' given twice");
    }
  }
  return url;
}

namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && v[0] != '\0') ? v : nullptr;
}

bool env_flag(const char* name) {
  const char* v = env(name);
  if (v == nullptr) return false;
  std::string s(v);
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s == "1" || s == "true" || s == "yes" || s == "on";
}

}  // namespace

Environment current_environment() {
  Environment out;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const char* entry = *e;
    const char* eq = std::strchr(entry, '=');
    if (eq != nullptr) out.emplace(std::string(entry, eq), std::string(eq + 1));
  }
  return out;
}

// The rank or world size from the explicit argument, else the URL's parameter; -1 when neither
// gives it (env:// then asks the environment).
int rendezvous_url::arg_or_param(const Url& url, int arg, const char* param, int lo) {
  if (arg >= 0) return arg;
  auto it = url.query.find(param);
  if (it == url.query.end()) return -1;
  int v = 0;
  if (!parse_int(it->second, lo, 1 << 30, &v)) {
    bad_url(url, std::string(param) + " must be an integer >= " + std::to_string(lo) + ", got '" +
                     it->second + "'");
  }
  return v;
}

namespace {

// tcp:// and file:// take the rank and world size from the arguments or the URL only.
int require_arg_or_param(const Url& url, int arg, const char* param, int lo) {
  const int v = rendezvous_url::arg_or_param(url, arg, param, lo);
  if (v < 0) {
    bad_url(url, std::string("no ") + param + "; add ?rank=R&world_size=W to the URL or pass " +
                     param + " explicitly");
  }
  return v;
}

// Rethrows `e` with `context` appended, keeping its type.
[[noreturn]] void rethrow_with(const Error& e, const std::string& context) {
  transport::throw_error(transport::error_class_of(e), e.what() + context);
}

}  // namespace

int restart_count() {
  int count = 0;
  for (const char* name : {"CHORUS_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"}) {
    int v = 0;
    if (const char* text = env(name); text != nullptr && parse_int(text, 0, 1 << 30, &v)) count = std::max(count, v);
  }
  return count;
}

bool launched_job(std::string* rank) {
  auto var = [](const char* name) -> const char* {
    const char* v = std::getenv(name);
    return v != nullptr && v[0] != '\0' ? v : nullptr;
  };
  auto several = [](const char* n) { return n != nullptr && std::strcmp(n, "1") != 0; };
  const char* found = var("RANK");
  if (found == nullptr && several(var("OMPI_COMM_WORLD_SIZE"))) found = var("OMPI_COMM_WORLD_RANK");
  const bool step = var("SLURM_STEP_ID") != nullptr || var("SLURM_STEPID") != nullptr;
  const char* tasks = var("SLURM_STEP_NUM_TASKS") != nullptr ? var("SLURM_STEP_NUM_TASKS") : var("SLURM_NTASKS");
  if (found == nullptr && step && several(tasks)) found = var("SLURM_PROCID");
  if (found != nullptr && rank != nullptr) *rank = found;
  return found != nullptr;
}

std::string error_file_from_environment() {
  const char* v = std::getenv("CHORUS_ERROR_FILE");
  return v != nullptr ? v : "";
}

std::string split_host_port(const std::string& text, std::string* host, int* port) {
  std::string h;
  std::string port_text;
  if (!text.empty() && text[0] == '[') {
    const size_t close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return "expected [IPV6]:PORT, got '" + text + "'";
    }
    h = text.substr(1, close - 1);
    port_text = text.substr(close + 2);
  } else {
    const size_t colon = text.rfind(':');
    if (colon == std::string::npos) return "no port in '" + text + "'";
    h = text.substr(0, colon);
    port_text = text.substr(colon + 1);
  }
  if (h.empty()) return "no host in '" + text + "'";
  int p = 0;
  if (!parse_int(port_text, 1, 65535, &p)) return "port must be an integer in [1, 65535], got '" + port_text + "'";
  *host = h;
  *port = p;
  return "";
}

std::string read_token_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw UsageError("job token file '" + path + "': " + std::strerror(errno) +
                     "; create it with `openssl rand -hex 16 > " + path + " && chmod 600 " + path + "`");
  }
  if (!S_ISREG(st.st_mode)) throw UsageError("job token file '" + path + "' is not a regular file");
  if (st.st_uid != ::geteuid()) {
    throw UsageError("job token file '" + path + "' belongs to uid " + std::to_string(st.st_uid) +
                     ", not to this user (uid " + std::to_string(::geteuid()) + "); use a file of your own");
  }
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    throw UsageError("job token file '" + path + "' can be read by others (mode " + mode +
                     "); a secret must be readable only by you: chmod 600 " + path);
  }
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::string token = text.str();
  while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) token.pop_back();
  if (token.empty()) {
    throw UsageError("job token file '" + path + "' is empty; write a secret into it: openssl rand -hex 16 > " +
                     path);
  }
  return token;
}

Rendezvous rendezvous(const std::string& text, int rank, int world_size,
                      RendezvousOptions options) {
  const Url url = rendezvous_url::parse_url(text);
  Rendezvous rv;
  ClusterEnv cluster;
  if (url.scheme == "env") {
    if (!url.body.empty()) {
      bad_url(url, "env:// takes no address: MASTER_ADDR and MASTER_PORT give it");
    }
    const int world_hint = rendezvous_url::arg_or_param(url, world_size, "world_size", 1);
    const int rank_hint = rendezvous_url::arg_or_param(url, rank, "rank", 0);
    cluster = resolve_cluster_env(current_environment(), rank_hint, world_hint);
    rv.world_size = cluster.world_size;
    rv.rank = cluster.rank;
  } else {
    rv.world_size = require_arg_or_param(url, world_size, "world_size", 1);
    rv.rank = require_arg_or_param(url, rank, "rank", 0);
  }
  if (rv.world_size < 1) {
    throw UsageError("rendezvous '" + text + "': world_size must be >= 1, got " +
                     std::to_string(rv.world_size));
  }
  if (rv.rank >= rv.world_size) {
    throw UsageError("rendezvous '" + text + "': rank " + std::to_string(rv.rank) +
                     " is outside [0, " + std::to_string(rv.world_size) + ") for world_size " +
                     std::to_string(rv.world_size));
  }
  rv.error_file = error_file_from_environment();
  if (const char* v = env("CHORUS_STORE_PREFIX")) rv.store_prefix = v;
  if (const char* v = env("CHORUS_TRANSPORT")) rv.transport = v;  // checked by the process group
  // From here on the library's log lines name this rank; CHORUS_LOG_LEVEL quiets them or asks for more.
  if (const char* level = env("CHORUS_LOG_LEVEL")) set_log_level(parse_log_level(level));
  set_log_rank(rv.rank);
  // Rank 0 hosts the server unless a launcher already does.
  const bool external_store = env_flag("CHORUS_STORE_EXTERNAL");
  auto token = url.query.find("token");
  if (token != url.query.end()) {
    rv.token = token->second;
  } else if (const char* t = env("CHORUS_JOB_TOKEN")) {
    rv.token = t;
  } else if (const char* path = env("CHORUS_JOB_TOKEN_FILE")) {
    rv.token = read_token_file(path);
  } else if (rv.world_size == 1 && !external_store && url.scheme != "file") {
    rv.token = random_token();  // a job of one: nobody else needs to know it
  }
  // Checked once the URL is known to be well formed, so that its mistakes are reported first.
  auto require_token = [&] {
    if (!rv.token.empty() || url.scheme == "file") return;
    // Anything derived from what every rank can see (the job id, the endpoint) can be derived by a
    // stranger too, who would then join the job as a rank. Only a launcher that starts every rank
    // itself can make the secret up; here the user must share one.
    throw UsageError(
        "rendezvous '" + text + "' (rank " + std::to_string(rv.rank) + " of " + std::to_string(rv.world_size) +
        (url.scheme == "env" ? ", " + cluster.source + " environment" : std::string()) +
        "): no job token. Ranks not started by `chorus run` on one node or chorus::spawn (which hand "
        "their workers a random one) need a shared secret, or any process that can reach the store "
        "could join the job: set CHORUS_JOB_TOKEN to the same random value for every rank (e.g. "
        "`export CHORUS_JOB_TOKEN=$(openssl rand -hex 16)` before srun, and `mpirun -x CHORUS_JOB_TOKEN`), "
        "or CHORUS_JOB_TOKEN_FILE to a file only you can read, or add &token=... to a tcp:// URL. See "
        "docs/launch-env.md (\"Job token\").");
  };

  if (url.scheme == "file") {
    if (url.body.empty() || url.body[0] != '/') {
      bad_url(url, "file:// needs an absolute path: file:///PATH?rank=R&world_size=W");
    }
    rv.store = std::make_shared<FileStore>(url.body, options.timeout);
    return rv;
  }

  TcpStoreOptions store;
  if (url.scheme == "env") {
    store.host = cluster.master_addr;
    store.port = cluster.master_port;
  } else {
    if (const std::string bad = split_host_port(url.body, &store.host, &store.port); !bad.empty()) {
      bad_url(url, bad + "; write tcp://HOST:PORT");
    }
  }
  require_token();
  store.is_server = rv.rank == 0 && !external_store;
  store.token = rv.token;
  store.timeout = options.timeout;
  store.who = "rank " + std::to_string(rv.rank);
  store.progress_interval = options.progress_interval;
  std::shared_ptr<TcpStore> tcp;
  try {
    tcp = std::make_shared<TcpStore>(store);
  } catch (const Error& e) {
    // Say where env:// found the address: a wrong MASTER_ADDR, or a derived port that another job
    // holds, is the usual cause of a timeout, a refused hello or a failed listen.
    if (url.scheme != "env") throw;
    rethrow_with(e, " [env:// " + cluster.describe() +
                        (cluster.master_port_from == "MASTER_PORT" || cluster.master_port_from == "CHORUS_STORE_PORT"
                             ? std::string("]")
                             : std::string("; MASTER_PORT overrides the derived port]")));
  }
  rv.local_address = tcp->local_address();
  rv.store = std::move(tcp);
  return rv;
}

}  // namespace chorus
