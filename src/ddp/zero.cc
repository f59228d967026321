// ZeroRedundancyOptimizer (ZeRO-1): see include/chorus/ddp/zero.h and docs/zero.md.
#include "chorus/ddp/zero.h"

#include <torch/optim.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <numeric>
#include <sstream>
#include <string>
#include <unordered_set>

#include "agreement.h"
#include "chorus/comm/error.h"
#include "chorus/torch/compat.h"
#include "chorus/torch/distributed.h"
#include "chorus/torch/optimizer_bytes.h"

namespace chorus::ddp {

std::vector<int> zero_partition(const std::vector<int64_t>& numels, int world_size) {
  if (world_size < 1) throw UsageError("zero_partition: world_size must be at least 1, not " + std::to_string(world_size));
  std::vector<size_t> order(numels.size());
  std::iota(order.begin(), order.end(), size_t{0});
  // Python's sorted(..., reverse=True) is stable too: equal sizes keep the caller's order.
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return numels[a] > numels[b]; });
  std::vector<int64_t> load(static_cast<size_t>(world_size), 0);
  std::vector<int> owner(numels.size(), 0);
  for (size_t i : order) {
    const auto least = std::min_element(load.begin(), load.end());  // the first of the least loaded
    owner[i] = static_cast<int>(least - load.begin());
    *least += numels[i];
  }
  return owner;
}

namespace {

// libtorch's key for a parameter's entry in Optimizer::state() (its type differs between versions).
auto state_key(const torch::optim::Optimizer& o, const at::Tensor& p) { return compat::optimizer_state_key(o, p); }

std::vector<at::Tensor> all_params(const torch::optim::Optimizer& o) {
  std::vector<at::Tensor> out;
  for (const auto& group : o.param_groups()) out.insert(out.end(), group.params().begin(), group.params().end());
  return out;
}

// A copy that shares no tensor with s (OptimizerParamState::clone() shares them): through its
// serialized form, which every optimizer's state has.
std::unique_ptr<torch::optim::OptimizerParamState> deep_clone(const torch::optim::OptimizerParamState& s) {
  torch::serialize::OutputArchive out;
  s.serialize(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  const std::string b = bytes.str();
  torch::serialize::InputArchive in;
  in.load_from(b.data(), b.size());
  auto copy = s.clone();
  copy->serialize(in);
  return copy;
}

int64_t bytes_of(const at::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0; }

std::string describe(const at::Tensor& t) {
  std::ostringstream out;
  out << t.sizes() << " " << t.scalar_type();
  return out.str();
}

}  // namespace

int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  using namespace torch::optim;
  int64_t total = 0;
  for (const auto& [key, state] : optimizer.state()) {
    if (auto* s = dynamic_cast<const SGDParamState*>(state.get())) {
      total += bytes_of(s->momentum_buffer());
    } else if (auto* a = dynamic_cast<const AdamParamState*>(state.get())) {
      total += bytes_of(a->exp_avg()) + bytes_of(a->exp_avg_sq()) + bytes_of(a->max_exp_avg_sq());
    } else if (auto* w = dynamic_cast<const AdamWParamState*>(state.get())) {
      total += bytes_of(w->exp_avg()) + bytes_of(w->exp_avg_sq()) + bytes_of(w->max_exp_avg_sq());
    } else if (auto* g = dynamic_cast<const AdagradParamState*>(state.get())) {
      total += bytes_of(g->sum());
    } else if (auto* r = dynamic_cast<const RMSpropParamState*>(state.get())) {
      total += bytes_of(r->square_avg()) + bytes_of(r->momentum_buffer()) + bytes_of(r->grad_avg());
    } else {
      torch::serialize::OutputArchive archive;
      state->serialize(archive);
      std::ostringstream out;
      archive.save_to(out);
      total += static_cast<int64_t>(out.str().size());
    }
  }
  return total;
}

struct ZeroRedundancyOptimizer::Impl {
  ZeroOptions opts;
  ProcessGroup* pg = nullptr;
  int rank = 0;
  int world = 1;
  OptimizerFactory factory;
  std::vector<at::Tensor> params;
  std::vector<int> owner;
  std::vector<std::vector<size_t>> shard;           // parameter indices per rank, ascending
  std::unique_ptr<torch::optim::Optimizer> local;
  at::Tensor flat;                                  // parameters_as_bucket_view: every parameter, rank by rank
  std::vector<size_t> rank_elements;                // elements of flat per rank
  size_t my_offset = 0;                             // this rank's first element in flat
  std::unique_ptr<torch::optim::Optimizer> consolidated;

  std::string me() const { return "chorus::ddp::ZeroRedundancyOptimizer: rank " + std::to_string(rank); }

  std::vector<at::Tensor> params_of(int r) const {
    std::vector<at::Tensor> out;
    for (size_t i : shard[static_cast<size_t>(r)]) out.push_back(params[i]);
    return out;
  }

  // What is wrong with this rank's list on its own, or "".
  std::string local_problem() const {
    if (params.empty()) return "got no parameters";
    std::unordered_set<const void*> seen;
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      const std::string which = "parameter #" + std::to_string(i);
      if (!p.defined()) return which + " is undefined";
      if (!p.is_cpu() || p.is_sparse()) return which + " is not a dense CPU tensor";
      if (!p.is_contiguous()) return which + " is not contiguous (make it contiguous before building the model's optimizer)";
      if (!seen.insert(p.unsafeGetTensorImpl()).second) {
        return which + " appears earlier in the list too (tied weights: pass each tensor once, e.g. a deduplicated "
                       "list instead of module->parameters())";
      }
      if (opts.parameters_as_bucket_view && p.scalar_type() != params[0].scalar_type()) {
        return which + " is " + std::string(c10::toString(p.scalar_type())) + " but #0 is " +
               c10::toString(params[0].scalar_type()) + ": parameters_as_bucket_view needs one dtype";
      }
    }
    return "";
  }

  // Collective: every rank learns every rank's problems and parameter list; all raise the same error.
  void check_agreement() {
    std::vector<std::string> lines{local_problem()};
    for (const auto& p : params) lines.push_back(describe(p));
    const auto all = gather_lines(*pg, lines);
    std::ostringstream problems;
    for (size_t r = 0; r < all.size(); ++r) {
      if (!all[r].empty() && !all[r][0].empty()) problems << "\n  rank " << r << ": " << all[r][0];
    }
    if (!problems.str().empty()) throw UsageError(me() + ": bad parameter list:" + problems.str());
    std::vector<std::vector<std::string>> described;
    for (const auto& rank_lines : all) described.emplace_back(rank_lines.begin() + 1, rank_lines.end());
    const auto diffs = differences_from_rank0(described);
    if (!diffs.empty()) {
      std::ostringstream out;
      out << me() << ": the ranks hold different parameters (every rank must pass the same list: count, shapes, "
          << "dtypes, in the same order); differences:";
      for (const auto& d : diffs) out << "\n  " << d;
      throw UsageError(out.str());
    }
  }

  std::unique_ptr<torch::optim::Optimizer> make(const std::vector<at::Tensor>& ps) const {
    auto o = factory(ps);
    if (!o) throw UsageError(me() + ": the optimizer factory returned nullptr");
    const auto got = all_params(*o);
    bool same = got.size() == ps.size();
    for (size_t i = 0; same && i < got.size(); ++i) same = got[i].unsafeGetTensorImpl() == ps[i].unsafeGetTensorImpl();
    if (!same) {
      throw UsageError(me() + ": the optimizer factory must build the optimizer over exactly the " +
                       std::to_string(ps.size()) + " tensors it is given, in order (it holds " +
                       std::to_string(got.size()) + ")");
    }
    return o;
  }

  // parameters_as_bucket_view: each parameter's storage becomes its slice of one flat buffer.
  void build_flat() {
    rank_elements.assign(static_cast<size_t>(world), 0);
    for (size_t i = 0; i < params.size(); ++i) rank_elements[static_cast<size_t>(owner[i])] += params[i].numel();
    flat = at::empty({static_cast<int64_t>(std::accumulate(rank_elements.begin(), rank_elements.end(), size_t{0}))},
                     params[0].options().requires_grad(false));
    at::NoGradGuard no_grad;
    int64_t offset = 0;
    for (int r = 0; r < world; ++r) {
      if (r == rank) my_offset = static_cast<size_t>(offset);
      for (size_t i : shard[static_cast<size_t>(r)]) {
        at::Tensor& p = params[i];
        at::Tensor slice = flat.narrow(0, offset, p.numel()).view(p.sizes());
        slice.copy_(p);
        p.set_data(slice);
        offset += p.numel();
      }
    }
  }

  void sync_params() {
    if (world == 1) return;
    if (opts.parameters_as_bucket_view) {
      const size_t esz = flat.element_size();
      char* base = static_cast<char*>(flat.data_ptr());
      pg->allgatherv(base + my_offset * esz, base, rank_elements, dist::to_data_type(flat.scalar_type()))->wait();
      return;
    }
    std::vector<std::shared_ptr<Work>> works;
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].numel() > 0) works.push_back(dist::broadcast(params[i], owner[i], pg, /*async_op=*/true));
    }
    for (auto& w : works) w->wait();
  }
};

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<at::Tensor> params, OptimizerFactory make_optimizer,
                                                 ZeroOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.opts = options;
  m.pg = options.group ? options.group : &dist::default_group();
  m.rank = m.pg->rank();
  m.world = m.pg->size();
  if (!make_optimizer) throw UsageError(m.me() + ": no optimizer factory given");
  m.factory = std::move(make_optimizer);
  m.params = std::move(params);
  m.check_agreement();

  std::vector<int64_t> numels;
  for (const auto& p : m.params) numels.push_back(p.numel());
  m.owner = zero_partition(numels, m.world);
  m.shard.assign(static_cast<size_t>(m.world), {});
  for (size_t i = 0; i < m.params.size(); ++i) m.shard[static_cast<size_t>(m.owner[i])].push_back(i);
  if (options.parameters_as_bucket_view) m.build_flat();
  m.local = m.make(m.params_of(m.rank));
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

void ZeroRedundancyOptimizer::step() { step(nullptr); }

at::Tensor ZeroRedundancyOptimizer::step(const std::function<at::Tensor()>& closure) {
  at::Tensor loss = impl_->local->step(closure);
  impl_->sync_params();
  return loss;
}

void ZeroRedundancyOptimizer::zero_grad(bool set_to_none) {
  for (auto& p : impl_->params) {
    if (!p.grad().defined()) continue;
    if (set_to_none) {
      p.mutable_grad().reset();
    } else {
      p.mutable_grad().detach_();
      p.mutable_grad().zero_();
    }
  }
}

void ZeroRedundancyOptimizer::consolidate_state_dict(int to) {
  Impl& m = *impl_;
  if (to < 0 || to >= m.world) {
    throw UsageError(m.me() + ": consolidate_state_dict(to=" + std::to_string(to) + "): `to` must be a rank of the group (0.." +
                     std::to_string(m.world - 1) + ")");
  }
  m.consolidated.reset();  // the previous copy is stale; free it before gathering the new one
  const std::string mine = dist::optimizer_to_bytes(*m.local);
  int64_t length = static_cast<int64_t>(mine.size());
  std::vector<int64_t> lengths(static_cast<size_t>(m.world), 0);
  m.pg->gather(&length, lengths.data(), 1, DataType::kInt64, to)->wait();
  if (m.rank != to) {
    m.pg->send(mine.data(), mine.size(), DataType::kUInt8, to)->wait();
    return;
  }
  std::vector<std::string> shards(static_cast<size_t>(m.world));
  std::vector<std::shared_ptr<Work>> works;
  for (int r = 0; r < m.world; ++r) {
    if (r == to) continue;
    auto& s = shards[static_cast<size_t>(r)];
    s.resize(static_cast<size_t>(lengths[static_cast<size_t>(r)]));
    works.push_back(m.pg->recv(s.data(), s.size(), DataType::kUInt8, r));
  }
  for (auto& w : works) w->wait();

  // The unsharded optimizer and each shard's optimizer hold the same tensors, so their state
  // entries have the same keys: a shard's entries move over as they are.
  auto full = m.make(m.params);
  for (int r = 0; r < m.world; ++r) {
    if (r == to) {
      for (const auto& [key, state] : m.local->state()) full->state()[key] = deep_clone(*state);
      continue;
    }
    auto part = m.make(m.params_of(r));
    dist::optimizer_from_bytes(shards[static_cast<size_t>(r)], *part);
    for (auto& [key, state] : part->state()) full->state()[key] = std::move(state);
  }
  // Hyper-parameters as the local optimizer has them now (a scheduler may have changed the rate).
  if (full->param_groups().size() == m.local->param_groups().size()) {
    for (size_t g = 0; g < full->param_groups().size(); ++g) {
      full->param_groups()[g].set_options(m.local->param_groups()[g].options().clone());
    }
  }
  m.consolidated = std::move(full);
}

torch::optim::Optimizer& ZeroRedundancyOptimizer::state_dict() {
  Impl& m = *impl_;
  if (!m.consolidated) {
    throw UsageError(m.me() + ": no consolidated optimizer state on this rank; call consolidate_state_dict(" +
                     std::to_string(m.rank) + ") on every rank first");
  }
  return *m.consolidated;
}

void ZeroRedundancyOptimizer::load_state_dict(const torch::optim::Optimizer& unsharded) {
  Impl& m = *impl_;
  const auto theirs = all_params(unsharded);
  if (theirs.size() != m.params.size()) {
    throw UsageError(m.me() + ": load_state_dict: the optimizer given holds " + std::to_string(theirs.size()) +
                     " parameters, this one " + std::to_string(m.params.size()) +
                     " (build it with make_unsharded_optimizer())");
  }
  for (size_t i = 0; i < theirs.size(); ++i) {
    if (theirs[i].sizes() != m.params[i].sizes()) {
      throw UsageError(m.me() + ": load_state_dict: parameter #" + std::to_string(i) + " is " + describe(theirs[i]) +
                       " in the optimizer given, " + describe(m.params[i]) + " here");
    }
  }
  m.local->state().clear();
  for (size_t i : m.shard[static_cast<size_t>(m.rank)]) {
    auto it = unsharded.state().find(state_key(unsharded, theirs[i]));
    if (it != unsharded.state().end()) m.local->state()[state_key(*m.local, m.params[i])] = deep_clone(*it->second);
  }
}

std::unique_ptr<torch::optim::Optimizer> ZeroRedundancyOptimizer::make_unsharded_optimizer() const {
  return impl_->make(impl_->params);
}

torch::optim::Optimizer& ZeroRedundancyOptimizer::local_optimizer() { return *impl_->local; }
const std::vector<at::Tensor>& ZeroRedundancyOptimizer::parameters() const { return impl_->params; }
const std::vector<int>& ZeroRedundancyOptimizer::owners() const { return impl_->owner; }
int64_t ZeroRedundancyOptimizer::local_state_bytes() const { return optimizer_state_bytes(*impl_->local); }

}  // namespace chorus::ddp
