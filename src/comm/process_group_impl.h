// Internal: the process group's state and its queue of operations, shared by process_group.cc
// (construction, the worker thread that runs the queue, shutdown, subgroups) and
// process_group_ops.cc (the collectives and point-to-point calls that check their arguments and
// enqueue a task). A Work is finished by whichever thread runs its task: the worker, or a waiter
// whose operation is next in line (InlineRunner).
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "algorithms.h"
#include "chorus/comm/error.h"
#include "chorus/comm/process_group.h"
#include "error_class.h"
#include "message.h"
#include "socket.h"
#include "transport.h"

namespace chorus {
namespace detail {

class WorkImpl;

// Runs a queued operation in the calling thread when it is next in line and the worker is idle.
class InlineRunner {
 public:
  virtual ~InlineRunner() = default;
  virtual bool run_inline(const WorkImpl* work) = 0;
  // Lets held point-to-point operations run (ProcessGroup::hold_p2p) when `work` is one of them
  // (a wait on it would never end otherwise); a no-op else.
  virtual void release_held(const WorkImpl* work) = 0;
  // Threads blocked in Work::wait on this group. While there are some, the caller's core is idle
  // and transports may busy-poll; while there are none, the caller computes (DDP's backward) and
  // a polling transport would take the core it needs, so transports sleep instead.
  std::atomic<int> waiters{0};
};

// Counts a thread as blocked in Work::wait for its lifetime.
class WaiterScope {
 public:
  explicit WaiterScope(InlineRunner* runner) : runner_(runner) {
    if (runner_ != nullptr) runner_->waiters.fetch_add(1, std::memory_order_relaxed);
  }
  ~WaiterScope() {
    if (runner_ != nullptr) runner_->waiters.fetch_sub(1, std::memory_order_relaxed);
  }
  WaiterScope(const WaiterScope&) = delete;
  WaiterScope& operator=(const WaiterScope&) = delete;

 private:
  InlineRunner* runner_;
};

class WorkImpl final : public Work {
 public:
  WorkImpl(std::string what, InlineRunner* runner) : what_(std::move(what)), runner_(runner) {}

  bool is_completed() const override { return state_.load(std::memory_order_acquire) != 0; }
  bool is_success() const override { return state_.load(std::memory_order_acquire) == 1; }

  void wait() override {
    if (is_completed()) {
      if (error_) std::rethrow_exception(error_);
      return;
    }
    WaiterScope scope(runner_);
    if (runner_ != nullptr) runner_->release_held(this);  // a held send or recv waited for would never start
    // A waiter whose operation is next in line runs it itself: no hand-off to the worker and
    // back, which is most of a small collective's latency. Issue order is unchanged.
    if (runner_ != nullptr) runner_->run_inline(this);
    if (!is_completed()) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return is_completed(); });
    }
    if (error_) std::rethrow_exception(error_);
  }

  void wait(std::chrono::milliseconds timeout) override {
    // No inline run here: an inline run lasts as long as the operation, which can exceed `timeout`.
    if (!is_completed()) {
      WaiterScope scope(runner_);
      std::unique_lock<std::mutex> lock(mu_);
      if (!cv_.wait_for(lock, timeout, [&] { return is_completed(); })) {
        throw TimeoutError("chorus: " + what_ + ": Work::wait did not see it complete within " +
                           net::format_duration(timeout) + "; it is still running");
      }
    }
    if (error_) std::rethrow_exception(error_);
  }

  std::exception_ptr exception() const override {
    return is_completed() ? error_ : nullptr;
  }
  const std::vector<std::string>& objects() const override { return objects_; }
  std::chrono::nanoseconds run_time() const override { return is_completed() ? run_time_ : std::chrono::nanoseconds(0); }

  void started() { start_ = net::Clock::now(); }

  void finish(std::exception_ptr error) {
    run_time_ = start_ == net::Clock::time_point() ? std::chrono::nanoseconds(0) : net::Clock::now() - start_;
    {
      std::lock_guard<std::mutex> lock(mu_);
      error_ = std::move(error);
      state_.store(error_ ? 2 : 1, std::memory_order_release);
    }
    cv_.notify_all();
  }

  std::vector<std::string> objects_;

  int source() const override { return source_.load(std::memory_order_acquire); }
  void set_source(int rank) { source_.store(rank, std::memory_order_release); }

 private:
  std::atomic<int> source_{-1};
  std::string what_;
  InlineRunner* runner_;  // the group's; a Work that is still queued implies the group is alive
  std::atomic<int> state_{0};  // 0 running, 1 done, 2 failed
  net::Clock::time_point start_{};
  std::chrono::nanoseconds run_time_{0};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::exception_ptr error_;
};

struct Task {
  std::shared_ptr<WorkImpl> work;
  wire::Call call;
  std::function<void(WorkImpl&, const wire::Call&)> run;
  bool local = false;  // ProcessGroup::run_local: no wire call, nothing to begin on the transport
  // Sends and recvs: posts the message on the transport without waiting (run is then unused), so
  // that a run of them can be posted together and waited for at once.
  std::function<transport::Ticket(const wire::Call&)> post;
  bool held = false;  // queued under hold_p2p and not released yet: not started
  int peer = -1;      // a send's destination or a recv's source
};

// The algorithms' tuning from the options: the allreduce algorithm (CHORUS_ALLREDUCE_ALGORITHM
// replaces "auto") and the link model of `kind`. Throws UsageError naming a bad algorithm name.
algo::Tuning tuning_for(const ProcessGroupOptions& options, TransportKind kind);

}  // namespace detail

struct ProcessGroup::Impl final : detail::InlineRunner {
  std::shared_ptr<Store> store;
  int rank;
  int size;
  ProcessGroupOptions opts;
  std::unique_ptr<transport::Transport> transport;
  transport::NativeCollectives* native = nullptr;  // transport's own collectives, if it has any
  algo::Scratch scratch;
  algo::Tuning tune;
  std::shared_ptr<algo::MeasuredAllreduce> measured;  // allreduce "tuned": its trials and choices

  std::mutex mu;  // guards the queue, the sequence counters and stopping
  std::condition_variable cv;
  std::deque<detail::Task> queue;
  bool stopping = false;
  bool running = false;  // an operation is executing (on the worker or inline)
  bool holding = false;  // hold_p2p: sends and recvs enqueued now are held
  std::atomic<bool> any_held{false};  // some queued task is held (read without mu by release_held)
  uint64_t seq = 0;
  std::vector<uint64_t> send_seq, recv_seq;
  int next_group_id = 0;
  std::thread worker;
  std::mutex shutdown_mu;

  std::atomic<bool> broken{false};
  std::string broken_msg;  // written by the worker before broken is set
  uint8_t broken_class = transport::kErrOther;

  std::string me() const { return "chorus: rank " + std::to_string(rank); }
  // The error of an operation `what` not run because the group broke earlier (broken_msg).
  std::exception_ptr not_run(const std::string& what) const;
  // An operation failed with e: the group is broken from now on, and the peers are told.
  void break_group(const std::exception& e);

  void check_root(int root, const char* op) const {
    if (root < 0 || root >= size) {
      throw transport::Ranked<UsageError>(me() + ": " + op + ": root " + std::to_string(root) + " is not a rank of this group of size " +
                       std::to_string(size));
    }
  }
  void check_buffer(const void* p, size_t count, const char* op) const {
    if (p == nullptr && count > 0) throw transport::Ranked<UsageError>(me() + ": " + op + ": null buffer for " + std::to_string(count) + " elements");
  }

  // The group over `t`, an already connected transport (MPI's, which needs no store): rank, size
  // and kind come from it. store may be null when t makes its own sub-groups.
  static std::shared_ptr<ProcessGroup> adopt(std::unique_ptr<transport::Transport> t, std::shared_ptr<Store> store,
                                             ProcessGroupOptions options);
  // Sets the state every group starts with, once `transport` is connected, and starts the worker.
  void start(ProcessGroup* pg, std::unique_ptr<transport::Transport> t);

  std::shared_ptr<Work> enqueue(wire::OpType op, DataType dtype, ReduceOp rop, uint64_t count, int64_t arg,
                                std::function<void(detail::WorkImpl&, const wire::Call&)> run, int p2p_peer = -1,
                                std::function<transport::Ticket(const wire::Call&)> post = nullptr);
  // A send or recv: queued like an operation, with `post` in place of run (Task::post).
  std::shared_ptr<Work> enqueue_p2p(wire::OpType op, DataType dtype, uint64_t count, int64_t tag, int peer,
                                    std::function<transport::Ticket(const wire::Call&)> post);
  // ProcessGroup::recv_any: an operation of its own (run, not post) whose sequence number is taken
  // when its source is known (take_recv_seq).
  std::shared_ptr<Work> enqueue_recv_any(DataType dtype, uint64_t count, int64_t tag,
                                         std::function<void(detail::WorkImpl&, const wire::Call&)> run);
  // The sequence number of a recv from `src` that runs now although it was issued without one:
  // the recvs from src queued after it, numbered as if it were not there, move up by one.
  uint64_t take_recv_seq(int src);
  // A run_local step: queued like an operation, without a sequence number or a wire call.
  std::shared_ptr<Work> enqueue_local(std::string what, std::function<void()> fn);
  // The tasks to run next, under mu: the front one, with the run of sends and recvs behind it
  // when it is one (released ones only); empty when the front is held or the queue empty.
  std::vector<detail::Task> take_next();
  bool front_runnable() const { return !queue.empty() && !queue.front().held; }
  // Clears every task's hold, under mu.
  void release_locked();
  void execute(detail::Task& task);
  // A run of sends and recvs: all posted, then all waited for; one failure fails them all.
  void execute_p2p(std::vector<detail::Task>& run);
  void execute_all(std::vector<detail::Task>& tasks);
  bool run_inline(const detail::WorkImpl* work) override;
  void release_held(const detail::WorkImpl* work) override;
  // The worker thread: runs the queued operations in order until shutdown.
  void loop();
};

}  // namespace chorus
