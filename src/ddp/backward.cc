// DistributedDataParallel's backward (reducer_impl.h): each parameter's gradient goes into its
// bucket as the autograd engine produces it; buckets are launched strictly in bucket order; at the
// end of backward the parameters that got no gradient are settled, what is left is launched, and
// the averages are written into .grad.
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

using detail::Bucket;
using detail::ms_since;

void Reducer::Impl::launch(Bucket& b) {
  b.view.divisor = divisor;
  b.view.joined = shadowing;
  try {
    b.work = hook->run(b.view);
    if (!b.work) throw UsageError("it returned no Work");
  } catch (...) {
    b.work = hook_thread.submit([e = std::current_exception()] { std::rethrow_exception(e); });
  }
  if (!overlap) {  // runs it here, in order; finalize() collects its time and its error
    try {
      b.work->wait();
    } catch (...) {
    }
  }
}

std::exception_ptr Reducer::Impl::wait_buckets(double* comm_ms) {
  std::exception_ptr first;
  for (size_t k = 0; k < buckets.size(); ++k) {
    Bucket& b = buckets[k];
    if (!b.work) continue;
    std::string failed;
    try {
      b.work->wait();
      if (comm_ms != nullptr) *comm_ms += std::chrono::duration<double, std::milli>(b.work->run_time()).count();
    } catch (const Error&) {
      if (!first) first = std::current_exception();
    } catch (const std::exception& e) {
      failed = e.what();
    } catch (...) {
      failed = "an exception that is not a std::exception";
    }
    if (!failed.empty() && !first) {
      first = std::make_exception_ptr(Error(me() + ": the communication hook " + hook->describe() +
                                            " failed on bucket " + std::to_string(k) + " of " +
                                            std::to_string(buckets.size()) + ": " + failed));
    }
    b.work.reset();
  }
  return first;
}

void Reducer::Impl::launch_ready() {
  while (next_launch < buckets.size() && buckets[next_launch].pending == 0) launch(buckets[next_launch++]);
}

void Reducer::Impl::mark_ready(size_t i, bool has_grad) {
  at::Tensor view = slot(i);
  at::Tensor& grad = params[i].mutable_grad();
  if (!has_grad || !grad.defined()) {
    view.zero_();
  } else if (!(opts.gradient_as_bucket_view && grad.data_ptr() == view.data_ptr())) {
    view.copy_(grad.reshape({-1}));
    if (opts.gradient_as_bucket_view) grad = grad_alias(i);
  }
  ready[i] = true;
  buckets[where[i].first].pending--;
}

void Reducer::Impl::on_gradient(size_t i) {
  backward_seen = true;
  used[i] = 1;        // also under no_sync: what accumulates there goes out at the next sync
  if (!sync) return;  // no_sync: gradients accumulate locally
  if (!in_backward) {
    in_backward = true;
    backward_start = Clock::now();
    std::weak_ptr<bool> guard = alive;
    torch::autograd::Engine::get_default_engine().queue_callback([this, guard] {
      if (auto a = guard.lock(); a && *a) finalize();
    });
  }
  if (ready[i]) return;
  mark_ready(i, true);
  launch_ready();
}

void Reducer::Impl::finalize() {
  in_backward = false;
  std::vector<std::string> missing;
  for (size_t i = 0; i < params.size(); ++i) {
    if (ready[i]) continue;
    if (!opts.find_unused_parameters) {
      if (missing.size() < 20) missing.push_back(names[i]);
      mark_ready(i, false);  // zeros still go out, so the other ranks do not wait on this one
    } else {
      // Unused here: contributes what it has (a gradient kept from no_sync steps) or zero.
      mark_ready(i, params[i].grad().defined());
    }
  }
  launch_ready();
  // After every bucket, on every rank: the same collectives in the same order.
  at::Tensor used_anywhere;
  std::shared_ptr<Work> used_work;
  if (opts.find_unused_parameters) {
    used_anywhere = at::empty({static_cast<int64_t>(params.size())}, at::kByte);
    std::copy(used.begin(), used.end(), used_anywhere.data_ptr<uint8_t>());
    if (world > 1) used_work = dist::all_reduce(used_anywhere, ReduceOp::kMax, pg, /*async_op=*/true);
  }
  const auto wait_start = Clock::now();
  double comm_ms = 0;
  std::exception_ptr error = wait_buckets(&comm_ms);
  if (used_work) used_work->wait();
  if (error) {  // ready for the next backward, then the hook's error
    for (auto& b : buckets) b.pending = b.params.size();
    std::fill(ready.begin(), ready.end(), false);
    std::fill(used.begin(), used.end(), 0);
    next_launch = 0;
    std::rethrow_exception(error);
  }
  // Without overlap every allreduce held backward up for its whole run: all of it is exposed.
  stats.comm_wait_ms = overlap ? ms_since(wait_start) : comm_ms;
  stats.comm_ms = comm_ms;
  for (auto& b : buckets) {
    for (size_t k = 0; k < b.params.size(); ++k) {
      const size_t i = b.params[k];
      // No rank used it: .grad stays as it was (with views, a defined .grad already is the slot).
      if (used_anywhere.defined() && used_anywhere.data_ptr<uint8_t>()[i] == 0) continue;
      at::Tensor view = b.flat.narrow(0, b.offsets[k], params[i].numel()).view(params[i].sizes());
      at::Tensor& grad = params[i].mutable_grad();
      if (opts.gradient_as_bucket_view) {
        if (!grad.defined() || grad.data_ptr() != view.data_ptr()) grad = grad_alias(i);
      } else if (grad.defined()) {
        grad.copy_(view);
      } else {
        grad = view.clone();
      }
    }
    b.pending = b.params.size();
  }
  std::fill(ready.begin(), ready.end(), false);
  std::fill(used.begin(), used.end(), 0);
  next_launch = 0;
  stats.backward_ms = ms_since(backward_start);
  if (!missing.empty()) {
    std::ostringstream out;
    out << me() << ": these parameters got no gradient in this backward: ";
    for (size_t k = 0; k < missing.size(); ++k) out << (k ? ", " : "") << missing[k];
    out << ". If parts of the model are legitimately unused on some steps, construct "
        << "DistributedDataParallel with Options::find_unused_parameters = true; otherwise make sure the "
        << "loss depends on every parameter";
    throw UsageError(out.str());
  }
}
}  // namespace chorus::ddp
