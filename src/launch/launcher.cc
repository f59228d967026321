// `chorus run`: the per-node agent. It checks the options, meets the other nodes' agents at the
// rendezvous store (node ranks, process counts, the job token), then runs attempts (attempt.cc):
// start this node's workers (worker.cc), watch them with chorus::Supervisor (exits, error records, a
// failure on another node, forwarded signals), and on a failure stop them, name the root cause and
// restart the group while restarts are left. An elastic job (--nnodes MIN:MAX) meets in rounds
// instead (elastic.cc), and each attempt also ends when the round's membership changes.
#include "chorus/launch/launcher.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "agent.h"
#include "chorus/comm/error.h"
#include "chorus/comm/files.h"
#include "chorus/comm/random.h"
#include "chorus/comm/rendezvous.h"
#include "chorus/comm/tcp_store.h"

namespace chorus::launch::detail {
namespace {

namespace fs = std::filesystem;

// A TCP port that is free on every address of this machine now: the one PyTorch's env:// store
// (rank 0's TCPStore server) listens on in a job that `chorus run` starts, next to chorus's own
// store. The kernel picks it; the window until PyTorch binds it is short.
int free_tcp_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error(std::string("chorus run: socket(): ") + std::strerror(errno));
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok) throw Error(std::string("chorus run: no free TCP port for PyTorch's store: ") + std::strerror(err));
  return ntohs(addr.sin_port);
}

void on_signal(int sig) {
  unsigned char b = static_cast<unsigned char>(sig);
  ssize_t ignored = ::write(g_signal_pipe[1], &b, 1);
  (void)ignored;
}

}  // namespace

int g_signal_pipe[2] = {-1, -1};

int Agent::run() {
  validate();
  rendezvous();
  if (elastic()) return run_elastic();
  for (int attempt = 0;; ++attempt) {
    Failure f = run_attempt(attempt);
    if (stop_signal_ != 0) {
      std::fprintf(stderr, "chorus run: stopped by %s after forwarding it to the workers\n",
                   signal_name(stop_signal_).c_str());
      return 128 + stop_signal_;
    }
    if (!f.happened) {
      finish_ok();
      return 0;
    }
    if (attempt < o_.max_restarts) {
      std::fprintf(stderr, "chorus run: attempt %d failed: %s\nchorus run: restarting the group (%d of %d restarts)\n",
                   attempt + 1, f.report.c_str(), attempt + 1, o_.max_restarts);
      continue;
    }
    std::fprintf(stderr,
                 "chorus run: FAILED (%d of %d restarts used)\n  root cause: %s\n", attempt, o_.max_restarts,
                 f.report.c_str());
    return 1;
  }
}

bool Agent::stop_requested() {
  unsigned char sig = 0;
  while (stop_signal_ == 0 && ::read(g_signal_pipe[0], &sig, 1) == 1) {
    if (sig != SIGUSR1 && sig != SIGUSR2) stop_signal_ = sig;
  }
  return stop_signal_ != 0;
}

int Agent::run_elastic() {
  ElasticOptions eo;
  eo.min_nodes = o_.nnodes;
  eo.max_nodes = o_.max_nodes;
  eo.last_call = millis(o_.rdzv_last_call_s);
  eo.timeout = millis(o_.rdzv_timeout_s);
  rdzv_ = std::make_unique<ElasticRendezvous>(store_, eo);
  const std::string me = host_name() + " pid " + std::to_string(::getpid());
  int failures = 0;
  int previous_rank = -1;
  for (;;) {
    std::optional<RoundPlan> plan = rdzv_->join({me, nproc_, store_host_, previous_rank}, [&] { return stop_requested(); });
    if (!plan) {
      if (stop_signal_ != 0) {
        std::fprintf(stderr, "chorus run: stopped by %s while waiting to join\n", signal_name(stop_signal_).c_str());
        return 128 + stop_signal_;
      }
      const RoundEnd& outcome = rdzv_->finished_reason();
      if (outcome.reason == RoundEnd::Reason::kDone) {
        std::fprintf(stderr, "chorus run: the job finished while this node (%s) waited to join it\n", me.c_str());
        return 0;
      }
      std::fprintf(stderr, "chorus run: the job failed while this node (%s) waited to join it: %s\n", me.c_str(),
                   outcome.detail.c_str());
      return 1;
    }
    plan_ = *plan;
    node_rank_ = previous_rank = plan_.node_rank;
    world_ = plan_.world_size;
    offset_ = plan_.rank_offset;
    std::fprintf(stderr, "chorus run: round %d: %zu node(s), %d worker(s); this is node %d (ranks %d-%d)\n", plan_.round,
                 plan_.nodes.size(), world_, node_rank_, offset_, offset_ + nproc_ - 1);
    const Failure f = run_attempt(plan_.round);
    if (stop_signal_ != 0) {
      try {
        rdzv_->end_round(plan_.round, {RoundEnd::Reason::kMembership, "node " + std::to_string(node_rank_) + " (" + me +
                                                                        ") was stopped by " + signal_name(stop_signal_)});
      } catch (const Error&) {
      }
      std::fprintf(stderr, "chorus run: stopped by %s after forwarding it to the workers\n",
                   signal_name(stop_signal_).c_str());
      return 128 + stop_signal_;
    }
    if (!f.happened) {
      rdzv_->finish(plan_, {RoundEnd::Reason::kDone, ""}, store_host_);
      return 0;
    }
    if (f.membership) {
      std::fprintf(stderr, "chorus run: round %d ended (membership: %s); re-forming the job\n", plan_.round,
                   f.report.c_str());
      continue;
    }
    if (++failures > o_.max_restarts) {
      std::fprintf(stderr, "chorus run: FAILED (%d of %d restarts used)\n  root cause: %s\n", failures - 1,
                   o_.max_restarts, f.report.c_str());
      try {
        rdzv_->finish(plan_, {RoundEnd::Reason::kFailure, "failed after " + std::to_string(failures - 1) + " restarts: " + f.report},
                      store_host_);
      } catch (const Error&) {
      }
      return 1;
    }
    std::fprintf(stderr, "chorus run: round %d failed: %s\nchorus run: re-forming the job (%d of %d restarts)\n",
                 plan_.round, f.report.c_str(), failures, o_.max_restarts);
  }
}

void Agent::validate() {
  const CheckedOptions checked = check_options(o_);
  program_path_ = checked.program_path;
  nproc_ = checked.nproc;
  master_addr_ = checked.master_addr;
  master_port_ = checked.master_port;
  if (!o_.log_dir.empty()) {
    std::error_code ec;
    fs::create_directories(o_.log_dir, ec);
    if (ec) throw UsageError("chorus run: cannot create --log-dir " + o_.log_dir + ": " + ec.message());
  }
  if ((!o_.ranks_filter.empty() || !o_.local_ranks_filter.empty()) && o_.log_dir.empty()) {
    std::fprintf(stderr, "chorus run: the output of ranks the filter leaves out is discarded; "
                         "add --log-dir DIR to keep every rank's\n");
  }
  scratch_ = make_scratch_dir();
}

void Agent::rendezvous() {
  token_ = o_.token;
  if (token_.empty()) {
    if (const char* t = std::getenv("CHORUS_JOB_TOKEN")) token_ = t;
  }
  if (token_.empty() && !o_.token_file.empty()) token_ = read_token_file(o_.token_file);
  if (token_.empty()) {
    if (const char* f = std::getenv("CHORUS_JOB_TOKEN_FILE"); f != nullptr && *f != '\0') token_ = read_token_file(f);
  }
  if (token_.empty() && multi_node()) {
    // Anything every node could derive without talking first, a stranger could derive too.
    throw UsageError("chorus run: --nnodes " + nnodes_text() +
                     " needs a job secret shared by every node, or any process that reaches " + master_addr_ + ":" +
                     std::to_string(master_port_) + " could join the job: give every node the same --token-file "
                     "(a file only you can read: openssl rand -hex 16 > ~/.chorus-token && chmod 600 "
                     "~/.chorus-token), --token or CHORUS_JOB_TOKEN");
  }
  if (token_.empty()) token_ = random_token();  // one node: a fresh secret, handed to the workers only
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(o_.rdzv_timeout_s * 1000));
  if (elastic()) {
    // The launcher that can listen on the endpoint's address hosts the store (as torchrun's c10d
    // rendezvous does); the others, and a second launcher on that machine, connect to it.
    TcpStoreServerOptions so;
    so.host = master_addr_;
    so.port = master_port_;
    so.token = token_;
    try {
      server_ = std::make_unique<TcpStoreServer>(so);
      store_host_ = true;
    } catch (const Error& e) {
      host_error_ = e.what();
    }
  } else if (o_.node_rank == 0) {
    TcpStoreServerOptions so;
    so.host = o_.nnodes == 1 && master_addr_.empty() ? "127.0.0.1" : "";
    so.port = master_port_ >= 0 ? master_port_ : 0;
    so.token = token_;
    server_ = std::make_unique<TcpStoreServer>(so);
    if (master_addr_.empty()) master_addr_ = "127.0.0.1";
    master_port_ = server_->port();
  }
  TcpStoreOptions co;
  co.host = master_addr_;
  co.port = master_port_;
  co.token = token_;
  co.timeout = timeout;
  co.who = elastic() ? "chorus run (" + host_name() + ")" : "chorus run (node " + std::to_string(o_.node_rank) + ")";
  try {
    store_ = std::make_shared<TcpStore>(co);
  } catch (const TimeoutError& e) {
    throw TimeoutError("chorus run: " + (elastic() ? std::string("this node") : "node " + std::to_string(o_.node_rank)) +
                       " could not reach the rendezvous endpoint " + master_addr_ + ":" +
                       std::to_string(master_port_) + " within " + std::to_string(o_.rdzv_timeout_s) +
                       " s; is node 0's launcher running and the address reachable? (" + e.what() + ")" +
                       (elastic() ? " This launcher does not host the store itself: " + host_error_ : ""));
  }
  share_torch_port(timeout);
  if (elastic()) return;  // node ranks come from the rounds (run_elastic)
  // Claim the node rank, publish this node's process count, learn everyone's.
  const std::string me = host_name() + " pid " + std::to_string(::getpid());
  std::string claimed = store_->compare_set("launch/node/" + std::to_string(o_.node_rank), "", me);
  if (claimed != me) {
    throw UsageError("chorus run: --node-rank " + std::to_string(o_.node_rank) + " is already taken by " + claimed +
                     "; give every node its own --node-rank");
  }
  store_->set("launch/nproc/" + std::to_string(o_.node_rank), std::to_string(nproc_));
  std::vector<std::string> keys;
  for (int n = 0; n < o_.nnodes; ++n) keys.push_back("launch/nproc/" + std::to_string(n));
  try {
    store_->wait(keys, timeout);
  } catch (const TimeoutError& e) {
    throw TimeoutError("chorus run: not every node joined within " + std::to_string(o_.rdzv_timeout_s) +
                       " s (" + e.what() + "); start one `chorus run` per node with its own --node-rank");
  }
  world_ = 0;
  for (int n = 0; n < o_.nnodes; ++n) {
    int count = std::stoi(store_->get(keys[static_cast<size_t>(n)]));
    if (n < o_.node_rank) offset_ += count;
    world_ += count;
  }
}

void Agent::share_torch_port(std::chrono::milliseconds timeout) {
  const std::string key = "launch/torch_port";
  if (elastic() ? store_host_ : o_.node_rank == 0) {
    store_->compare_set(key, "", std::to_string(free_tcp_port()));
  }
  store_->wait({key}, timeout);
  torch_port_ = std::stoi(store_->get(key));
}

void Agent::finish_ok() {
  if (o_.nnodes == 1) return;
  try {
    store_->add("launch/done", 1);
    if (o_.node_rank == 0) {
      // Keep the store up until every node's workers are done (they report failures through it).
      while (store_->add("launch/done", 0) < o_.nnodes) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  } catch (const Error&) {
    // Node 0 has finished and taken the store down; nothing is left to coordinate.
  }
}

void Agent::wait_for_nodes(int attempt) {
  if (o_.nnodes == 1 || attempt == 0 || elastic()) return;  // an elastic round has met already
  const std::string key = "launch/attempt" + std::to_string(attempt) + "/ready";
  store_->add(key, 1);
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o_.rdzv_timeout_s * 1000));
  while (store_->add(key, 0) < o_.nnodes) {
    if (Clock::now() > deadline) throw TimeoutError("chorus run: nodes did not all come back for the restart");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

Agent::~Agent() {
  if (!scratch_.empty()) {
    std::error_code ec;
    remove_tree(scratch_, ec);
  }
}
}  // namespace chorus::launch::detail

namespace chorus::launch {

void parse_nnodes(const std::string& text, LaunchOptions* options) {
  const detail::NodeCount count = detail::parse_node_count(text);
  options->nnodes = count.min;
  options->max_nodes = count.elastic ? count.max : 0;
}

void parse_endpoint(const std::string& text, std::string* host, int* port) {
  if (const std::string bad = split_host_port(text, host, port); !bad.empty()) {
    throw UsageError("chorus run: bad endpoint '" + text + "': " + bad + "; expected HOST:PORT");
  }
}

int run(const LaunchOptions& options) {
  if (detail::g_signal_pipe[0] < 0 && ::pipe2(detail::g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    throw Error(std::string("chorus run: pipe: ") + std::strerror(errno));
  }
  for (int sig : detail::kForwardedSignals) {
    struct sigaction sa {};
    sa.sa_handler = detail::on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    ::sigaction(sig, &sa, nullptr);
  }
  detail::Agent agent(options);
  return agent.run();
}

}  // namespace chorus::launch
