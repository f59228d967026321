// The parts of the "chorus" torch.distributed backend (backend.cc) that are not the group itself:
// PyTorch's store as chorus's, the conversions of dtypes and reduce ops with their checks, the
// Works PyTorch sees and the Futures' completion in issue order, and the store and address the
// group's setup uses. Internal to chorus._C.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/comm/process_group.h"
#include "chorus/comm/store.h"

namespace chorus::python::detail {

inline std::string bytes_to_string(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
inline std::vector<uint8_t> string_to_bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }
// PyTorch's store (TCPStore, FileStore, a PrefixStore of either) as chorus's Store.
class TorchStore final : public Store {
 public:
  explicit TorchStore(c10::intrusive_ptr<::c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::string& value) override { store_->set(key, string_to_bytes(value)); }
  std::string get(const std::string& key) override { return bytes_to_string(store_->get(key)); }
  int64_t add(const std::string& key, int64_t delta) override { return store_->add(key, delta); }
  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) override {
    return bytes_to_string(store_->compareSet(key, string_to_bytes(expected), string_to_bytes(desired)));
  }
  // Polls check() instead of calling PyTorch's wait(): chorus waits in short slices (to notice a
  // disagreeing or missing rank early), and a TCPStore wait that times out stays registered on the
  // server, whose later "stop waiting" then answers another request of this client: PyTorch's
  // "Stop_waiting response is expected", or a read that never returns. A check leaves nothing
  // behind.
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto pause = std::chrono::microseconds(200);
    while (!store_->check(keys)) {
      if (std::chrono::steady_clock::now() >= deadline) {
        std::string names;
        for (const auto& k : keys) names += (names.empty() ? "" : ", ") + k;
        throw TimeoutError("chorus backend: waited " + std::to_string(timeout.count()) + " ms for " + names +
                           " in PyTorch's store");
      }
      std::this_thread::sleep_for(std::min<std::chrono::microseconds>(
          pause, std::chrono::duration_cast<std::chrono::microseconds>(deadline - std::chrono::steady_clock::now()) +
                     std::chrono::microseconds(1)));
      pause = std::min(pause * 2, std::chrono::microseconds(10000));
    }
  }
  bool check(const std::vector<std::string>& keys) override { return store_->check(keys); }
  bool delete_key(const std::string& key) override {
    try {
      return store_->deleteKey(key);
    } catch (const std::exception&) {
      return false;  // FileStore in 1.13 cannot delete; the keys then stay (a few bytes per group)
    }
  }
  int64_t num_keys() override { return store_->getNumKeys(); }
  std::string describe() const override { return "PyTorch's store (the one init_process_group made)"; }

 private:
  c10::intrusive_ptr<::c10d::Store> store_;
};
// The dtype chorus moves for `t`; UsageError naming `op` for one it cannot (or, when `reduces`,
// cannot reduce: bool).
DataType data_type(const at::Tensor& t, const char* op, bool reduces);
// PyTorch's reduce op as chorus's; UsageError naming `name` for one chorus does not run itself.
ReduceOp reduce_op(const ::c10d::ReduceOp& op, const char* name);
// BAND, BOR or BXOR: run by gathering every rank's tensor and folding it locally.
bool bitwise(const ::c10d::ReduceOp& op);
// A defined, dense, contiguous CPU tensor, or a UsageError naming `op` and the fix.
void check_tensor(const at::Tensor& t, const char* op);
// The one tensor of a call that takes one (checked as check_tensor does).
const at::Tensor& single(const std::vector<at::Tensor>& tensors, const char* op);

// Under `chorus run` (its store's address and the job token in the environment), chorus's setup
// (addresses, shared-memory names) goes through the launcher's own store, which authenticates every
// client with the token, instead of PyTorch's unauthenticated one. PyTorch's store carries only a
// random name for this group's keys there, drawn by rank 0: a new one for every group and attempt.
// Elsewhere: PyTorch's store, as given. `local_address`: the interface that reaches the launcher's
// store (left as it is elsewhere).
std::shared_ptr<Store> authenticated_store(const std::shared_ptr<Store>& torch_store, int rank,
                                           const std::string& token, std::chrono::milliseconds timeout,
                                           std::string* local_address);

// The address peers reach this rank's TCP transport by: CHORUS_ADVERTISE_HOST when set; else the
// interface that reaches chorus run's store (`toward_store`); else the one that reaches
// MASTER_ADDR (env://); else chorus's default (loopback: one host).
std::string advertise_host(const std::string& toward_store);

class ChorusWork;

// The Futures of one group, completed in issue order (the order chorus runs the operations in):
// by the group's completion thread, or by a thread blocked in Work.wait on the operation at the
// front, which then completes it itself (chorus's own Work::wait runs a next-in-line operation in
// the waiting thread), saving the hand-offs between threads that a small synchronous call would
// otherwise pay. Shared by the group and its Works, so that neither outlives it.
class Completions {
 public:
  struct Pending {
    c10::intrusive_ptr<ChorusWork> work;
    std::vector<std::shared_ptr<Work>> inner;
    std::vector<at::Tensor> keep;
    std::function<void()> finish;
    bool p2p = false;  // a send or recv: may be held (hold())
  };

  // Point-to-point batches (chorus::ProcessGroup::hold_p2p): sends and recvs issued after hold()
  // wait in the group's queue, and this thread does not wait on them either, until release():
  // on a wait, poll or future of any of this group's Works, on its next collective, or at stop.
  // Then the run of them starts together, so ranks that each post their recvs first (PyTorch's
  // batch_isend_irecv) do not wait on each other.
  void hold(chorus::ProcessGroup* pg) {
    std::lock_guard<std::mutex> lock(mu_);
    held_ = true;
    held_group_ = pg;
    pg->hold_p2p();
  }
  void release() {
    if (!held_.load(std::memory_order_acquire)) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!held_) return;
      held_ = false;
      if (held_group_ != nullptr) held_group_->release_p2p();
    }
    cv_.notify_all();
  }

  void push(std::shared_ptr<Pending> p) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.push_back(std::move(p));
    }
    cv_.notify_one();
  }

  // Completes the operation of `work` in this thread if it is at the front; false if it is not.
  bool run_if_front(const ChorusWork* work) {
    std::shared_ptr<Pending> p;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (pending_.empty() || pending_.front()->work.get() != work) return false;
      p = std::move(pending_.front());
      pending_.pop_front();
    }
    complete(*p);
    return true;
  }

  // The completion thread: waits for the front operation without claiming it, then completes it
  // unless a waiter did meanwhile.
  void loop() {
    for (;;) {
      std::shared_ptr<Pending> p;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || (!pending_.empty() && !(held_ && pending_.front()->p2p)); });
        if (pending_.empty()) return;
        p = pending_.front();
      }
      try {
        for (auto& w : p->inner) w->wait();
      } catch (...) {
        // complete() meets the same error again and reports it
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (pending_.empty() || pending_.front() != p) continue;  // a waiter completed it
        pending_.pop_front();
      }
      complete(*p);
    }
  }

  void stop() {
    release();
    {
      std::lock_guard<std::mutex> lock(mu_);
      held_group_ = nullptr;  // Works may outlive the group; hold() is not called after stop
      stopping_ = true;
    }
    cv_.notify_all();
  }

 private:
  static void complete(Pending& p);

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Pending>> pending_;
  bool stopping_ = false;
  std::atomic<bool> held_{false};
  chorus::ProcessGroup* held_group_ = nullptr;  // the group hold() was called for (set again by each call)
};

// The Work PyTorch sees: done when its Future is. The Future completes, in issue order, with the
// output tensors or with chorus's error (Completions).
class ChorusWork final : public ::c10d::Work {
 public:
  ChorusWork(::c10d::OpType type, std::vector<at::Tensor> outputs, std::shared_ptr<Completions> completions)
      : ::c10d::Work(-1, type),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))),
        completions_(std::move(completions)) {}

  bool isCompleted() override {
    completions_->release();  // a poll loop on a held send would otherwise spin forever
    return future_->completed();
  }
  bool isSuccess() const override { return future_->completed() && !future_->hasError(); }
  std::exception_ptr exception() const override { return future_->hasError() ? future_->exception_ptr() : nullptr; }
  std::vector<at::Tensor> result() override { return outputs_; }
  bool wait(std::chrono::milliseconds timeout) override {
    completions_->release();
    if (timeout == kNoTimeout) {
      if (!future_->completed()) completions_->run_if_front(this);
      future_->wait();
    } else {
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      while (!future_->completed()) {
        if (std::chrono::steady_clock::now() > deadline) {
          throw std::runtime_error("chorus backend: Work.wait timed out after " + std::to_string(timeout.count()) +
                                   " ms (the operation goes on; its own deadline is the group's timeout)");
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
    if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
    return true;
  }
  void synchronize() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    completions_->release();
    return future_;
  }

  // recvAnysource: the rank it received from, once done (dist.recv without src returns it).
  int sourceRank() const override {
    if (!source_of_) return ::c10d::Work::sourceRank();  // throws: not a recv from any source
    if (!future_->completed() || future_->hasError()) {
      throw std::runtime_error("chorus backend: the source of a recv from any source is known once it completed");
    }
    return source_of_->source();
  }
  void set_source_of(std::shared_ptr<chorus::Work> recv_any) { source_of_ = std::move(recv_any); }

  void complete(std::exception_ptr error) {
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
  }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::shared_ptr<Completions> completions_;
  std::shared_ptr<chorus::Work> source_of_;
};

}  // namespace chorus::python::detail
