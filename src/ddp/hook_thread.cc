#include "hook_thread.h"

#include <ATen/core/grad_mode.h>

#include <chrono>

#include "chorus/comm/error.h"

namespace chorus::ddp::detail {

// A task and its Work: done once fn has run, with its exception if it threw.
struct HookThread::Task final : public Work {
  explicit Task(std::function<void()> f) : fn(std::move(f)) {}

  bool is_completed() const override {
    std::lock_guard<std::mutex> lock(mu);
    return done;
  }
  bool is_success() const override {
    std::lock_guard<std::mutex> lock(mu);
    return done && !error;
  }
  void wait() override {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
    if (error) std::rethrow_exception(error);
  }
  void wait(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, timeout, [&] { return done; })) {
      throw TimeoutError("chorus::ddp: a communication hook's task did not finish within " +
                         std::to_string(timeout.count()) + " ms; it is still running");
    }
    if (error) std::rethrow_exception(error);
  }
  std::exception_ptr exception() const override {
    std::lock_guard<std::mutex> lock(mu);
    return done ? error : nullptr;
  }
  std::chrono::nanoseconds run_time() const override {
    std::lock_guard<std::mutex> lock(mu);
    return done ? ran : std::chrono::nanoseconds(0);
  }
  const std::vector<std::string>& objects() const override { return no_objects; }

  void run() {
    const auto start = std::chrono::steady_clock::now();
    std::exception_ptr caught;
    try {
      at::NoGradGuard no_grad;
      fn();
    } catch (...) {
      caught = std::current_exception();
    }
    fn = nullptr;  // drops what the task captured before anyone waits on it
    std::lock_guard<std::mutex> lock(mu);
    ran = std::chrono::steady_clock::now() - start;
    error = caught;
    done = true;
    cv.notify_all();
  }

  std::function<void()> fn;
  mutable std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
  std::chrono::nanoseconds ran{0};
  std::vector<std::string> no_objects;
};

HookThread::~HookThread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<Work> HookThread::submit(std::function<void()> fn) {
  auto task = std::make_shared<Task>(std::move(fn));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    queue_.push_back(task);
  }
  cv_.notify_all();
  return task;
}

void HookThread::loop() {
  for (;;) {
    std::shared_ptr<Task> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and every queued task has run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task->run();
  }
}

}  // namespace chorus::ddp::detail
