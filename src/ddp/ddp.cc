// DistributedDataParallel: the reducer (reducer_impl.h; this file: construction and the public calls,
// backward.cc: the end of backward, join.cc: uneven inputs). See include/chorus/ddp/ddp.h for the contract.
//
// Each parameter's gradient accumulator gets a post hook, which runs once the parameter's .grad is
// up to date in this backward. The hook copies the gradient into its bucket (or, with
// gradient_as_bucket_view, finds it already there) and counts the bucket down; buckets are
// launched strictly in bucket order, so every rank issues the same allreduces in the same order
// whatever order its gradients arrive in. The first hook of a backward queues a callback that the
// autograd engine runs when backward is done: it settles parameters that got no gradient, launches
// what is left, waits, and writes the averages into .grad.
//
// Parity with PyTorch's DDP (1.13), checked by src/ddp/ddp_parity_test.py:
// - Every parameter and buffer is broadcast from rank 0 at construction, frozen ones included.
// - A tensor registered under several names (tied weights) is one parameter: reduced once.
// - With find_unused_parameters, a bitmap of the parameters each rank used since the last
//   synchronised backward is reduced (max) along with the buckets; a parameter no rank used keeps
//   its .grad as it was (undefined stays undefined), so optimizers skip it as PyTorch's do.
// - join() (uneven inputs) follows PyTorch's Join with DDP as its joinable, checked by
//   src/ddp/join_parity_test.py: each forward inside a join starts with a round (one allgather of
//   "still training" and "will synchronise" per rank, where PyTorch runs three allreduces); a rank
//   that has finished answers every round, shadows the buffers' broadcast (from the highest rank
//   still training) and each synchronised backward's bucket allreduces with zeros; at the end the
//   highest of the ranks that finished last broadcasts parameters and buffers to all.
#include "chorus/ddp/ddp.h"

#include <ATen/ATen.h>
#include <c10/util/strides.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <chrono>
#include <map>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "bucket_plan.h"
#include "reducer_impl.h"
#include "chorus/comm/check.h"
#include "chorus/comm/error.h"
#include "chorus/comm/log.h"
#include "chorus/torch/distributed.h"

namespace chorus::ddp {
namespace {

class PostHook final : public torch::autograd::FunctionPostHook {
 public:
  explicit PostHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

std::string describe_tensor(const std::string& name, const at::Tensor& t) {
  std::ostringstream out;
  out << name << " " << t.sizes() << " " << t.scalar_type();
  return out.str();
}

}  // namespace

using detail::Bucket;
using detail::JoinRound;

void Reducer::Impl::check_agreement() {
  std::ostringstream mine;
  for (const auto& line : described) mine << line << "\n";
  auto all = pg->all_gather_object(mine.str());
  all->wait();
  const auto& descs = all->objects();
  std::vector<std::string> bad;
  std::vector<int> bad_ranks;
  auto lines = [](const std::string& s) {
    std::vector<std::string> out;
    std::istringstream in(s);
    for (std::string l; std::getline(in, l);) out.push_back(l);
    return out;
  };
  const auto ref = lines(descs[0]);
  for (size_t r = 1; r < descs.size(); ++r) {
    const auto other = lines(descs[r]);
    bool differs = other.size() != ref.size();
    for (size_t i = 0; i < std::max(ref.size(), other.size()); ++i) {
      const std::string a = i < ref.size() ? ref[i] : "(none)";
      const std::string b = i < other.size() ? other[i] : "(none)";
      if (a != b) {
        differs = true;
        std::string entry = "#" + std::to_string(i) + ": rank 0 has " + a + ", rank " + std::to_string(r) + " has " + b;
        if (bad.size() < 20) bad.push_back(entry);
      }
    }
    if (differs) bad_ranks.push_back(static_cast<int>(r));
  }
  if (!bad.empty()) {
    std::ostringstream out;
    out << me() << ": the ranks hold different parameters (every rank must build the same model before "
        << "wrapping it in DistributedDataParallel); differences:";
    for (const auto& b : bad) out << "\n  " << b;
    throw UsageError(out.str());
  }
}

void Reducer::Impl::broadcast_from(int root, std::vector<at::Tensor>& tensors) {
  if (world == 1 || tensors.empty()) return;
  if (tensors.front().is_cuda()) {
    // On a GPU every collective is staged through host memory: one flat broadcast per dtype
    // (in dtype order, the same on every rank) instead of one per tensor.
    torch::NoGradGuard no_grad;
    std::map<int, std::vector<at::Tensor*>> by_type;
    for (auto& t : tensors) by_type[static_cast<int>(t.scalar_type())].push_back(&t);
    for (auto& [type, group] : by_type) {
      std::vector<at::Tensor> flat_parts;
      for (at::Tensor* t : group) flat_parts.push_back(t->reshape({-1}));
      at::Tensor flat = at::cat(flat_parts);
      dist::broadcast(flat, root, pg);
      int64_t offset = 0;
      for (at::Tensor* t : group) {
        t->copy_(flat.narrow(0, offset, t->numel()).view(t->sizes()));
        offset += t->numel();
      }
    }
    return;
  }
  std::vector<std::shared_ptr<Work>> works;
  for (auto& t : tensors) works.push_back(dist::broadcast(t, root, pg, /*async_op=*/true));
  for (auto& w : works) w->wait();
}

void Reducer::Impl::register_hook(std::shared_ptr<CommHook> h, const std::string& source) {
  std::string problem;
  if (!h) {
    problem = "the hook is null";
  } else if (!hook_source.empty()) {
    problem = "a communication hook is already registered (" + hook_source + "); register one, once";
  } else if (backward_seen) {
    problem = "a backward has already run: register the hook before the first backward";
  }
  auto all = pg->all_gather_object(problem.empty() ? "hook " + h->describe() : "error " + problem);
  all->wait();
  const auto& got = all->objects();
  std::vector<std::string> bad;
  for (size_t r = 0; r < got.size(); ++r) {
    if (got[r].rfind("error ", 0) == 0) bad.push_back("rank " + std::to_string(r) + ": " + got[r].substr(6));
  }
  for (size_t r = 1; bad.empty() && r < got.size(); ++r) {
    if (got[r] != got[0]) {
      bad.push_back("rank 0 registers " + got[0].substr(5) + ", rank " + std::to_string(r) + " registers " +
                    got[r].substr(5) + " (every rank must register the same hook)");
    }
  }
  if (!bad.empty()) {
    std::ostringstream out;
    out << me() << ": register_comm_hook refused on every rank:";
    for (const auto& line : bad) out << "\n  " << line;
    throw UsageError(out.str());
  }
  std::vector<GradBucket> views;
  for (const auto& b : buckets) views.push_back(b.view);
  HookMemory memory;
  h->prepare(views, memory);
  stats.bucket_bytes += memory.bytes;
  stats.shared_bytes += memory.shared_bytes;
  hook = std::move(h);
  hook_source = source;
}

void Reducer::Impl::collect(torch::nn::Module& module) {
  std::unordered_map<const c10::TensorImpl*, std::string> first_name;
  for (auto& item : module.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    auto [it, fresh] = first_name.emplace(p.unsafeGetTensorImpl(), item.key());
    if (!fresh) {
      described.push_back(item.key() + " = " + it->second);
      continue;
    }
    if (!(p.device().is_cpu() || p.device().is_cuda()) || !p.is_contiguous() || p.layout() != at::kStrided) {
      throw UsageError(me() + ": parameter " + item.key() + " must be a dense, contiguous CPU or CUDA tensor; it is " +
                       (p.is_contiguous() ? "" : "non-contiguous ") + "on " + p.device().str());
    }
    if (!state.empty() && p.device() != state.front().device()) {
      throw UsageError(me() + ": parameter " + item.key() + " is on " + p.device().str() + " but the first one is on " +
                       state.front().device().str() + ": move the whole model to one device (module->to(device)) "
                       "before wrapping it");
    }
    described.push_back(describe_tensor(item.key(), p) + (p.requires_grad() ? "" : " frozen"));
    state.push_back(p);
    if (!p.requires_grad()) continue;
    names.push_back(item.key());
    params.push_back(p);
  }
  for (auto& item : module.named_buffers(/*recurse=*/true)) {
    if (!first_name.emplace(item.value().unsafeGetTensorImpl(), item.key()).second) continue;
    buffer_names.push_back(item.key());
    buffers.push_back(item.value());
  }
}

void Reducer::Impl::build_buckets() {
  std::vector<ParamInfo> info;
  for (const auto& p : params) {
    info.push_back({static_cast<size_t>(p.numel()) * p.element_size(), static_cast<int>(p.scalar_type())});
  }
  const auto mb = [](double v) { return static_cast<size_t>(v * 1024 * 1024); };
  assignment = assign_buckets(info, mb(opts.first_bucket_mb), mb(opts.bucket_cap_mb));
  where.resize(params.size());
  ready.assign(params.size(), false);
  used.assign(params.size(), 0);
  for (size_t b = 0; b < assignment.size(); ++b) {
    Bucket bucket;
    int64_t total = 0;
    for (size_t i : assignment[b]) {
      where[i] = {b, bucket.params.size()};
      bucket.params.push_back(i);
      bucket.offsets.push_back(total);
      total += params[i].numel();
    }
    const at::Tensor& first = params[bucket.params[0]];
    if (opts.compression != Compression::kNone || first.is_cuda()) {
      // The compression hook's wire buffers are what travels (CompressHook::prepare). On a GPU the
      // bucket stays on the device; the collective stages it through pinned host memory.
      bucket.flat = at::zeros({total}, first.options().requires_grad(false));
    } else {
      // What travels lives in memory from the group's allocate_buffer (collective: every rank
      // builds the same buckets in the same order): over shared memory the default hook's
      // allreduce works in place across the ranks, with no staging copies.
      std::shared_ptr<Buffer> buf = pg->allocate_buffer(static_cast<size_t>(total) * first.element_size());
      if (buf->shared()) stats.shared_bytes += static_cast<int64_t>(buf->size());
      void* data = buf->data();
      bucket.flat = at::from_blob(data, {total}, [buf](void*) mutable { buf.reset(); },
                                  first.options().requires_grad(false));
    }
    bucket.pending = bucket.params.size();
    stats.gradient_bytes += total * static_cast<int64_t>(first.element_size());
    if (!opts.gradient_as_bucket_view) stats.bucket_bytes += bucket.flat.nbytes();
    GradBucket& view = bucket.view;
    view.index = b;
    view.count = assignment.size();
    view.buffer = bucket.flat;
    view.parameters = bucket.params;
    view.offsets = bucket.offsets;
    for (size_t i : bucket.params) view.shapes.push_back(params[i].sizes().vec());
    view.group = pg;
    view.divisor = world;
    view.thread_ = &hook_thread;
    buckets.push_back(std::move(bucket));
  }
  stats.buckets = static_cast<int>(buckets.size());
}

void Reducer::Impl::view_grads_in_buckets() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor& grad = params[i].mutable_grad();
    if (!grad.defined()) continue;
    at::Tensor alias = grad_alias(i);
    alias.copy_(grad);
    grad = alias;
  }
}

void Reducer::Impl::install_hooks() {
  for (size_t i = 0; i < params.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params[i]);
    std::weak_ptr<bool> guard = alive;
    Impl* self = this;
    acc->add_post_hook(std::make_unique<PostHook>([self, guard, i] {
      if (auto a = guard.lock(); a && *a) self->on_gradient(i);
    }));
    accumulators.push_back(std::move(acc));
  }
}

Reducer::Reducer(torch::nn::Module& module, Options options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.opts = options;
  m.pg = options.group != nullptr ? options.group : &dist::default_group();
  m.world = m.pg->size();
  m.divisor = m.world;
  m.overlap = options.overlap == Options::Overlap::kAlways;
  m.collect(module);
  m.check_agreement();
  {
    // Every parameter, frozen ones too (a backbone loaded on rank 0 only), and every buffer.
    torch::NoGradGuard no_grad;
    m.broadcast_from(0, m.state);
    m.broadcast_from(0, m.buffers);
  }
  m.build_buckets();
  if (options.gradient_as_bucket_view) m.view_grads_in_buckets();
  if (options.compression == Compression::kFloat16) m.register_hook(fp16_compress_hook(), "Options::compression");
  if (options.compression == Compression::kBFloat16) m.register_hook(bf16_compress_hook(), "Options::compression");
  m.install_hooks();
}

void Reducer::register_comm_hook(std::shared_ptr<CommHook> hook) {
  impl_->register_hook(std::move(hook), "by register_comm_hook");
}

Reducer::~Reducer() { *impl_->alive = false; }

void Reducer::prepare_forward() {
  Impl& m = *impl_;
  int buffer_root = 0;
  if (m.joining) {
    const JoinRound round = m.join_round(true, m.sync && at::GradMode::is_enabled());
    if (m.join_opts.throw_on_early_termination && round.flagged < m.world) {
      throw UnevenInputsError(m.me() + ": " + std::to_string(m.world - round.flagged) +
                              " rank(s) ran out of data (join with throw_on_early_termination): every rank stops");
    }
    m.divisor = m.join_opts.divide_by_initial_world_size ? m.world : round.flagged;
    buffer_root = round.highest;  // rank 0 may have finished: its buffers are stale
  }
  if (m.opts.broadcast_buffers && m.world > 1 && !m.buffers.empty()) {
    torch::NoGradGuard no_grad;
    m.broadcast_from(buffer_root, m.buffers);
  }
}

Reducer::NoSync::NoSync(Reducer& r) : r_(r), previous_(r.impl_->sync) { r.impl_->sync = false; }
Reducer::NoSync::~NoSync() { r_.impl_->sync = previous_; }

const Stats& Reducer::stats() const { return impl_->stats; }
ProcessGroup& Reducer::group() { return *impl_->pg; }
const std::vector<std::vector<size_t>>& Reducer::bucket_assignment() const { return impl_->assignment; }
const std::vector<std::string>& Reducer::parameter_names() const { return impl_->names; }

}  // namespace chorus::ddp
