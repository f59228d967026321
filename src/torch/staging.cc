#include "staging.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "chorus/comm/error.h"

namespace chorus::dist::staging {
namespace {

using Clock = std::chrono::steady_clock;

// Polls `event` until it has completed, sleeping briefly between polls; TimeoutError after `timeout`.
void wait_event(const c10::Event& event, std::chrono::milliseconds timeout, const std::string& what) {
  const auto deadline = Clock::now() + timeout;
  for (int spins = 0; !event.query(); ++spins) {
    if (Clock::now() > deadline) {
      throw TimeoutError(what + " did not finish within " + std::to_string(timeout.count()) +
                         " ms: the GPU is still busy with work queued before it (a long or hung kernel); "
                         "raise the group's timeout if the work is legitimately that long");
    }
    if (spins < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

// The Work of a staged call: every queued step and operation, then the copies back.
class StagedWork final : public Work {
 public:
  StagedWork(std::vector<std::shared_ptr<Work>> works, std::shared_ptr<c10::Event> returned,
             std::chrono::milliseconds timeout, std::string what, std::vector<at::Tensor> keep,
             std::function<void()> done)
      : works_(std::move(works)), returned_(std::move(returned)), timeout_(timeout), what_(std::move(what)),
        keep_(std::move(keep)), done_(std::move(done)) {}

  bool is_completed() const override {
    for (const auto& w : works_) {
      if (!w->is_completed()) return false;
    }
    return exception() != nullptr || returned_ == nullptr || returned_->query();
  }
  bool is_success() const override { return is_completed() && exception() == nullptr; }
  void wait() override { wait_all(nullptr); }
  void wait(std::chrono::milliseconds timeout) override { wait_all(&timeout); }
  std::exception_ptr exception() const override {
    for (const auto& w : works_) {
      if (auto e = w->exception()) return e;
    }
    return nullptr;
  }
  std::chrono::nanoseconds run_time() const override {
    std::chrono::nanoseconds total{0};
    for (const auto& w : works_) total += w->run_time();
    return total;
  }
  const std::vector<std::string>& objects() const override { return none_; }

 private:
  void wait_all(const std::chrono::milliseconds* timeout) {
    for (const auto& w : works_) {
      if (timeout != nullptr) {
        w->wait(*timeout);
      } else {
        w->wait();
      }
    }
    std::call_once(once_, [&] {
      if (returned_) {
        wait_event(*returned_, timeout != nullptr ? *timeout : timeout_, what_ + ": the copy back to the device");
        // Kernels queued later on the waiting thread's stream come after the copy (it is done
        // already; this keeps the order explicit for the device's own bookkeeping).
        c10::impl::VirtualGuardImpl impl(returned_->device_type());
        returned_->block(impl.getStream(returned_->device()));
      }
      if (done_) done_();
      keep_.clear();
    });
  }

  std::vector<std::shared_ptr<Work>> works_;
  std::shared_ptr<c10::Event> returned_;
  std::chrono::milliseconds timeout_;
  std::string what_;
  std::vector<at::Tensor> keep_;
  std::function<void()> done_;
  std::once_flag once_;
  std::vector<std::string> none_;
};

}  // namespace

bool on_device(const at::Tensor& t) { return t.defined() && t.device().is_cuda(); }

std::vector<std::pair<int64_t, int64_t>> pieces(int64_t numel, size_t element_size, size_t chunk_bytes) {
  std::vector<std::pair<int64_t, int64_t>> out;
  const int64_t per = std::max<int64_t>(1, static_cast<int64_t>(chunk_bytes / std::max<size_t>(element_size, 1)));
  for (int64_t off = 0; off < numel; off += per) out.emplace_back(off, std::min(per, numel - off));
  if (out.empty()) out.emplace_back(0, 0);  // an empty tensor is still one (empty) collective
  return out;
}

size_t chunk_bytes() {
  static const size_t bytes = [] {
    const char* v = std::getenv("CHORUS_STAGE_CHUNK_BYTES");
    if (v == nullptr || *v == '\0') return static_cast<size_t>(4) << 20;
    char* end = nullptr;
    const unsigned long long n = std::strtoull(v, &end, 10);
    if (end == v || *end != '\0' || n == 0) {
      throw UsageError(std::string("CHORUS_STAGE_CHUNK_BYTES='") + v + "' is not a positive number of bytes");
    }
    return static_cast<size_t>(n);
  }();
  return bytes;
}

Call::Call(ProcessGroup& pg, c10::Device device, std::string op)
    : pg_(pg),
      device_(device),
      op_("chorus::dist::" + std::move(op) + " (rank " + std::to_string(pg.rank()) + ", " + device.str() + ")"),
      caller_(c10::impl::VirtualGuardImpl(device.type()).getStream(device)),
      to_host_(c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device)),
      to_device_(c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device)) {}

at::Tensor Call::host_like(const at::Tensor& t) const {
  return at::empty({t.numel()}, at::TensorOptions().dtype(t.scalar_type()).device(at::kCPU).pinned_memory(true));
}

std::shared_ptr<c10::Event> Call::copy_to_host(const at::Tensor& dev, const at::Tensor& host) {
  if (!caller_marked_) {
    // The copies start after everything the caller queued so far (the gradients of a bucket).
    c10::Event ready(device_.type());
    ready.record(caller_);
    ready.block(to_host_);
    caller_marked_ = true;
  }
  auto copied = std::make_shared<c10::Event>(device_.type());
  {
    c10::NoGradGuard no_grad;  // the tensors may be parameters; copies are not part of any graph
    c10::StreamGuard guard(to_host_);
    host.copy_(dev.reshape({-1}), /*non_blocking=*/true);
  }
  copied->record(to_host_);
  return copied;
}

void Call::wait_copy(std::shared_ptr<c10::Event> copied) {
  const auto timeout = pg_.options().timeout;
  const std::string what = op_ + ": the copy to host memory";
  works_.push_back(pg_.run_local("stage " + device_.str() + " -> host for " + op_,
                                 [copied, timeout, what] { wait_event(*copied, timeout, what); }));
}

void Call::add(std::shared_ptr<Work> work) { works_.push_back(std::move(work)); }

void Call::copy_to_device(const at::Tensor& host, const at::Tensor& dev) {
  if (!returned_) {
    returned_ = std::make_shared<c10::Event>(device_.type());
    // The copy back lands after everything the caller queued so far: a kernel still writing the
    // destination (the zeros a receive buffer was made of) must not overwrite the result. Marked
    // now, on the caller's thread; the copy itself is queued later, by the step below.
    c10::Event ready(device_.type());
    ready.record(caller_);
    ready.block(to_device_);
  }
  auto returned = returned_;
  auto stream = to_device_;
  at::Tensor h = host;
  at::Tensor d = dev;
  works_.push_back(pg_.run_local("stage host -> " + device_.str() + " for " + op_, [returned, stream, h, d]() mutable {
    c10::NoGradGuard no_grad;  // a parameter (a broadcast's destination) takes the copy in place
    c10::StreamGuard guard(stream);
    d.view({-1}).copy_(h, /*non_blocking=*/true);
    returned->record(stream);
  }));
}

std::shared_ptr<Work> Call::finish(std::vector<at::Tensor> keep, bool async_op, std::function<void()> done) {
  auto w = std::make_shared<StagedWork>(std::move(works_), returned_, pg_.options().timeout, op_, std::move(keep),
                                        std::move(done));
  if (!async_op) w->wait();
  return w;
}

}  // namespace chorus::dist::staging
