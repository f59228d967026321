// DistributedDataParallel: the reducer. See include/chorus/ddp/ddp.h for the contract.
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
#include "hook_thread.h"
#include "chorus/comm/check.h"
#include "chorus/comm/error.h"
#include "chorus/comm/log.h"
#include "chorus/torch/distributed.h"

namespace chorus::ddp {
namespace {

using Clock = std::chrono::steady_clock;

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

// A tensor sharing flat's memory at `offset`, shaped `sizes`, that is not an autograd view:
// optimizers call detach_() on gradients, which views refuse.
at::Tensor alias_of(const at::Tensor& flat, int64_t offset, at::IntArrayRef sizes) {
  at::NoGradGuard no_grad;
  at::Tensor t = at::empty({0}, flat.options());
  t.set_(flat.storage(), flat.storage_offset() + offset, sizes, c10::contiguous_strides(sizes));
  return t;
}

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

struct Bucket {
  std::vector<size_t> params;    // parameter indices, in the order they were assigned
  std::vector<int64_t> offsets;  // element offset of each in flat
  at::Tensor flat;               // the gradients, back to back, in the parameters' dtype
  GradBucket view;               // what the communication hook is given (flat is its buffer)
  size_t pending = 0;            // parameters not yet ready in this backward
  std::shared_ptr<Work> work;
};

// What a join round tells every rank (Reducer::Impl::join_round).
struct JoinRound {
  int flagged = 0;       // ranks whose first value was 1 (still training; at the end: finished last)
  int highest = -1;      // the highest of them
  bool any_sync = false; // some rank still training will synchronise its backward
};

}  // namespace

struct Reducer::Impl {
  Options opts;
  ProcessGroup* pg = nullptr;
  int world = 1;
  std::vector<std::string> names;     // one per distinct parameter that requires a gradient
  std::vector<at::Tensor> params;
  std::vector<std::string> described;  // every distinct parameter, frozen ones too: the agreement check
  std::vector<at::Tensor> state;       // every distinct parameter: broadcast from rank 0 at construction
  std::vector<char> used;              // parameter got a gradient since the last synchronised backward
  std::vector<std::string> buffer_names;
  std::vector<at::Tensor> buffers;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;  // keeps the hooks alive
  std::vector<Bucket> buckets;
  std::vector<std::pair<size_t, size_t>> where;  // parameter -> (bucket, position in bucket)
  std::vector<bool> ready;
  size_t next_launch = 0;
  bool overlap = true;  // bucket allreduces run on the group's worker thread (Options::overlap)
  bool sync = true;
  bool in_backward = false;
  bool joining = false;  // inside join(): every forward starts with a join round
  JoinOptions join_opts;
  int divisor = 1;       // what gradients are divided by: the world size, or the ranks still training
  Clock::time_point backward_start;
  Stats stats;
  std::vector<std::vector<size_t>> assignment;
  std::shared_ptr<bool> alive = std::make_shared<bool>(true);
  std::shared_ptr<CommHook> hook = allreduce_hook();
  std::string hook_source;      // who registered the hook: "" while the default allreduce runs
  bool backward_seen = false;   // a hook may be registered only before the first backward
  bool shadowing = false;       // a join's finished rank runs the hook on zeros
  // Last: destroyed first, so that no hook task outlives the buckets or the hook it uses.
  detail::HookThread hook_thread;

  std::string me() const { return "chorus::ddp: rank " + std::to_string(pg->rank()); }

  at::Tensor slot(size_t i) {
    auto [b, k] = where[i];
    return buckets[b].flat.narrow(0, buckets[b].offsets[k], params[i].numel());
  }
  at::Tensor grad_alias(size_t i) {
    auto [b, k] = where[i];
    return alias_of(buckets[b].flat, buckets[b].offsets[k], params[i].sizes());
  }

  void check_agreement() {
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

  void broadcast_from(int root, std::vector<at::Tensor>& tensors) {
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

  // Hands a complete bucket to the communication hook. What it throws, here or from its Work,
  // is rethrown by wait_buckets() once every bucket has been waited for.
  void launch(Bucket& b) {
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

  // Waits for every launched bucket, in order, adding their run times to *comm_ms. Returns the
  // first error: chorus's own (a timeout, a dead peer) as it is, anything else a hook threw as an
  // Error naming the hook and the bucket.
  std::exception_ptr wait_buckets(double* comm_ms) {
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

  // Collective: see Reducer::register_comm_hook. `source` says who registers it, for the errors.
  void register_hook(std::shared_ptr<CommHook> h, const std::string& source) {
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

  // One allgather of two integers per rank; every rank learns who raised `flag` (still training,
  // or at the end: finished last) and whether any of them will synchronise its backward.
  JoinRound join_round(bool flag, bool will_sync) {
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

  // A finished rank's part in a synchronised backward of the ranks still training: the same
  // allreduces in the same order, of zeros (finalize() without gradients).
  void shadow_backward() {
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

  // The shadowing loop of a rank whose join body returned, then the final model broadcast.
  void finish_join() {
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

  void launch_ready() {
    while (next_launch < buckets.size() && buckets[next_launch].pending == 0) launch(buckets[next_launch++]);
  }

  void mark_ready(size_t i, bool has_grad) {
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

  void on_gradient(size_t i) {
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

  void finalize() {
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

  // The module's distinct parameters and buffers, by identity as PyTorch's DDP dedups them: tied
  // weights registered under two names are one parameter with one .grad, so they are reduced once.
  void collect(torch::nn::Module& module) {
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

  // The buckets of the parameters that require a gradient (assign_buckets), each with its flat
  // gradient tensor and, when compressed, the tensor that travels.
  void build_buckets() {
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

  // Options::gradient_as_bucket_view: a defined .grad becomes a view into its bucket, so backward
  // accumulates straight into the bucket. An undefined one stays undefined until its first
  // gradient (as in PyTorch), so a parameter that is never used is never seen by the optimizer.
  void view_grads_in_buckets() {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor& grad = params[i].mutable_grad();
      if (!grad.defined()) continue;
      at::Tensor alias = grad_alias(i);
      alias.copy_(grad);
      grad = alias;
    }
  }

  // A hook after each parameter's gradient accumulator: on_gradient(i) while this Reducer lives.
  void install_hooks() {
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
};

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

Reducer::NoSync::NoSync(Reducer& r) : r_(r), previous_(r.impl_->sync) { r.impl_->sync = false; }
Reducer::NoSync::~NoSync() { r_.impl_->sync = previous_; }

const Stats& Reducer::stats() const { return impl_->stats; }
ProcessGroup& Reducer::group() { return *impl_->pg; }
const std::vector<std::vector<size_t>>& Reducer::bucket_assignment() const { return impl_->assignment; }
const std::vector<std::string>& Reducer::parameter_names() const { return impl_->names; }

}  // namespace chorus::ddp
