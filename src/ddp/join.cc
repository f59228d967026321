// DistributedDataParallel's join() for uneven inputs (reducer_impl.h), as PyTorch's Join with DDP as
// its joinable: each forward inside a join starts with a round; a rank that has finished answers
// every round, shadows the buffers' broadcast and each synchronised backward's allreduces with
// zeros; at the end the highest of the ranks that finished last broadcasts the model to all.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>

#include <chrono>
#include <sstream>
#include <string>

#include "chorus/comm/check.h"
#include "chorus/comm/error.h"
#include "chorus/comm/log.h"
#include "chorus/torch/distributed.h"
#include "reducer_impl.h"

namespace chorus::ddp {

using detail::JoinRound;

JoinRound Reducer::Impl::join_round(bool flag, bool will_sync) {
  const int64_t mine[2] = {flag ? 1 : 0, will_sync ? 1 : 0};
  std::vector<int64_t> all(2 * static_cast<size_t>(world));
  pg->allgather(mine, all.data(), 2, DataType::kInt64)->wait();
  JoinRound round;
  for (int r = 0; r < world; ++r) {
    if (all[2 * r] == 0) continue;
    round.flagged++;
    round.highest = r;
    round.any_sync = round.any_sync || all[2 * r + 1] != 0;
  }
  return round;
}

void Reducer::Impl::shadow_backward() {
  torch::NoGradGuard no_grad;
  backward_seen = true;
  shadowing = true;
  for (auto& b : buckets) {
    b.flat.zero_();
    launch(b);
  }
  shadowing = false;
  std::shared_ptr<Work> used_work;
  at::Tensor unused;
  if (opts.find_unused_parameters && world > 1) {
    unused = at::zeros({static_cast<int64_t>(params.size())}, at::kByte);
    used_work = dist::all_reduce(unused, ReduceOp::kMax, pg, /*async_op=*/true);
  }
  std::exception_ptr error = wait_buckets(nullptr);
  if (used_work) used_work->wait();
  if (error) std::rethrow_exception(error);
}

void Reducer::Impl::finish_join() {
  bool finished_last = true;
  for (int64_t rounds = 1;; ++rounds) {
    const JoinRound round = join_round(false, false);
    if (round.flagged == 0) break;
    finished_last = false;
    if (join_opts.throw_on_early_termination) {
      throw UnevenInputsError(me() + " ran out of data while " + std::to_string(round.flagged) +
                              " rank(s) still train (join with throw_on_early_termination): every rank stops");
    }
    if (rounds == 1000) {
      log(LogLevel::kWarning, me() + " has shadowed 1000 steps of the ranks still training since its data "
                                     "ran out: inputs this uneven waste that time (balance the shards)");
    }
    divisor = join_opts.divide_by_initial_world_size ? world : round.flagged;
    torch::NoGradGuard no_grad;
    if (opts.broadcast_buffers) broadcast_from(round.highest, buffers);
    if (round.any_sync) shadow_backward();
  }
  const JoinRound last = join_round(finished_last, false);
  CHORUS_CHECK(last.highest >= 0, "join: no rank finished last");
  torch::NoGradGuard no_grad;
  broadcast_from(last.highest, state);
  broadcast_from(last.highest, buffers);
}

void Reducer::join(const std::function<void()>& body, JoinOptions options) {
  Impl& m = *impl_;
  if (m.joining) throw UsageError(m.me() + ": join() is already running on this model (it is not reentrant)");
  struct Reset {
    Impl& m;
    ~Reset() {
      m.joining = false;
      m.divisor = m.world;
    }
  } reset{m};
  m.joining = true;
  m.join_opts = options;
  body();
  m.finish_join();
}

}  // namespace chorus::ddp
