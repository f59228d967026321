// The reducer's hook thread: runs communication hooks' tasks (GradBucket::run_async) one at a
// time, in submission order, so that the collectives they issue keep the same order on every rank.
// Started on the first task; the destructor lets the queued tasks finish, then joins.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "chorus/comm/process_group.h"

namespace chorus::ddp::detail {

class HookThread {
 public:
  HookThread() = default;
  ~HookThread();
  HookThread(const HookThread&) = delete;
  HookThread& operator=(const HookThread&) = delete;

  // Queues fn; the Work completes when it returns, with what it threw as its error.
  std::shared_ptr<Work> submit(std::function<void()> fn);

 private:
  struct Task;
  void loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Task>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace chorus::ddp::detail
