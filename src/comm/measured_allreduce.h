// Internal: allreduce_algorithm "tuned", the algorithm chosen per size class by measuring it
// (docs/algorithms.md, "Measured choice"). The schedule is plan.h's (tuning_candidates,
// tuning_trial, fastest_candidate); this class keeps each class's trials and runs them.
#pragma once

#include <cstddef>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "chorus/comm/process_group.h"
#include "chorus/comm/types.h"
#include "message.h"
#include "transport.h"

namespace chorus::algo {

class Scratch;
struct Tuning;

// One group's measured choices, keyed by (ranks, size class): the same object serves a group's
// flat allreduces and its hybrid rails, whose transports differ in size. Every rank of a transport
// makes the same calls in the same order, so every rank runs the same trial at the same call and
// reaches the agreement (one small allreduce of float64 times, max) at the same point; a rank
// configured otherwise meets it as a MismatchError. run() is called on the group's one worker
// thread; decided() may be called from any thread.
class MeasuredAllreduce {
 public:
  // announce: log each decision (at info level; the group's rank 0 does, the others stay quiet).
  explicit MeasuredAllreduce(bool announce) : announce_(announce) {}

  // One allreduce of `count` elements at buf over t: the class's trial while it has trials left
  // (followed by the agreement after its last), its chosen algorithm after.
  void run(transport::Transport& t, Scratch& s, const Tuning& tune, const wire::Call& call, void* buf,
           size_t count, DataType dtype, ReduceOp op);
  // The classes decided so far, by ranks then bytes.
  std::vector<TunedAllreduce> decided() const;
  // Decisions to use in place of trials for classes not started yet (ProcessGroup::
  // keep_tuned_allreduce); validated first, UsageError naming the bad one. Any thread.
  void keep(const std::vector<TunedAllreduce>& decisions);

 private:
  struct Class {
    std::vector<AllreduceAlgorithm> candidates;
    int calls = 0;                       // calls of this class so far
    std::vector<std::vector<double>> us;  // per candidate: this rank's timed rounds
    bool done = false;
    AllreduceAlgorithm chosen = AllreduceAlgorithm::kRecursiveDoubling;
    std::vector<double> agreed_us;  // per candidate: the slowest rank's median
  };
  // A decision kept from an earlier run, waiting for its class's first call.
  struct Kept {
    AllreduceAlgorithm chosen = AllreduceAlgorithm::kRing;
    std::vector<AllreduceAlgorithm> candidates;  // what was measured, for decided()
    std::vector<double> agreed_us;
  };
  const bool announce_;
  mutable std::mutex mu_;  // guards classes_ and kept_ (run inserts and updates, decided reads)
  std::map<std::pair<int, int>, Class> classes_;
  std::map<std::pair<int, int>, Kept> kept_;
};

}  // namespace chorus::algo
