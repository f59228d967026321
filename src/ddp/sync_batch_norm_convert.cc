// convert_sync_batchnorm: BatchNorm1d/2d/3d in a module tree become SyncBatchNorm. Why a field
// that holds a BatchNorm cannot be converted, and what happens then: sync_batch_norm.h.
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/ddp/sync_batch_norm.h"

namespace chorus::ddp {
namespace {

using torch::nn::Module;

template <typename BatchNorm>
std::shared_ptr<Module> sync_of(const std::shared_ptr<Module>& module, ProcessGroup* group) {
  auto bn = std::dynamic_pointer_cast<BatchNorm>(module);
  if (bn == nullptr) return nullptr;
  auto sync = std::make_shared<SyncBatchNormImpl>(
      SyncBatchNormOptions(bn->options, group),
      SyncBatchNormState{bn->weight, bn->bias, bn->running_mean, bn->running_var, bn->num_batches_tracked});
  sync->train(bn->is_training());
  return sync;
}

// The SyncBatchNorm that replaces module, or nullptr when module is no BatchNorm.
std::shared_ptr<Module> sync_of(const std::shared_ptr<Module>& module, ProcessGroup* group) {
  if (auto s = sync_of<torch::nn::BatchNorm1dImpl>(module, group)) return s;
  if (auto s = sync_of<torch::nn::BatchNorm2dImpl>(module, group)) return s;
  return sync_of<torch::nn::BatchNorm3dImpl>(module, group);
}

bool is_batch_norm(const Module& module) {
  return dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&module) != nullptr;
}

// Sequential keeps its modules as AnyModule, which needs the concrete type.
torch::nn::AnyModule any_module_of(const std::shared_ptr<Module>& module) {
  if (auto m = std::dynamic_pointer_cast<SyncBatchNormImpl>(module)) return torch::nn::AnyModule(m);
  if (auto m = std::dynamic_pointer_cast<torch::nn::BatchNorm1dImpl>(module)) return torch::nn::AnyModule(m);
  if (auto m = std::dynamic_pointer_cast<torch::nn::BatchNorm2dImpl>(module)) return torch::nn::AnyModule(m);
  return torch::nn::AnyModule(std::dynamic_pointer_cast<torch::nn::BatchNorm3dImpl>(module));
}

// One place in the tree that registers a BatchNorm: parent's child `name`.
struct Site {
  Module* parent;
  std::string name;
  std::string path;  // dotted, from the root, for messages
  std::shared_ptr<Module> batch_norm;
  std::shared_ptr<Module> sync;
};

void collect_sites(const std::shared_ptr<Module>& parent, const std::string& prefix, std::set<const Module*>& seen,
                   std::vector<Site>& sites) {
  if (!seen.insert(parent.get()).second) return;  // a subtree registered twice is walked once
  for (const auto& child : parent->named_children()) {
    const std::string path = prefix.empty() ? child.key() : prefix + "." + child.key();
    if (is_batch_norm(*child.value())) {
      sites.push_back({parent.get(), child.key(), path, child.value(), nullptr});
    } else {
      collect_sites(child.value(), path, seen, sites);
    }
  }
}

// Makes parent's child `name` `to` instead of `from`: the registered child, and the container's
// own list that its forward or iteration reads.
void repoint(Module& parent, const std::string& name, const std::shared_ptr<Module>& from,
             const std::shared_ptr<Module>& to) {
  parent.replace_module(name, to);
  if (auto* sequential = dynamic_cast<torch::nn::SequentialImpl*>(&parent)) {
    for (auto& slot : *sequential) {
      if (slot.ptr() == from) slot = any_module_of(to);
    }
  } else if (auto* list = dynamic_cast<torch::nn::ModuleListImpl*>(&parent)) {
    for (auto& slot : *list) {
      if (slot == from) slot = to;
    }
  } else if (auto* dict = dynamic_cast<torch::nn::ModuleDictImpl*>(&parent)) {
    for (auto& item : *dict) {
      if (item.value() == from) item.value() = to;
    }
  }
}

}  // namespace

std::shared_ptr<Module> convert_sync_batchnorm(std::shared_ptr<Module> module, ProcessGroup* group) {
  if (auto sync = sync_of(module, group)) return sync;
  std::vector<Site> sites;
  {
    std::set<const Module*> seen;
    collect_sites(module, "", seen, sites);
  }
  std::map<const Module*, std::shared_ptr<Module>> made;  // one SyncBatchNorm per BatchNorm, however often registered
  std::map<const Module*, long> held;                     // references the sites themselves hold
  for (auto& site : sites) {
    auto& sync = made[site.batch_norm.get()];
    if (sync == nullptr) sync = sync_of(site.batch_norm, group);
    site.sync = sync;
    ++held[site.batch_norm.get()];
  }
  for (const auto& site : sites) repoint(*site.parent, site.name, site.batch_norm, site.sync);

  // The tree no longer refers to any BatchNorm; a reference beyond the sites' own is outside it,
  // typically a field the parent's forward calls.
  std::string stale;
  for (const auto& site : sites) {
    if (site.batch_norm.use_count() > held[site.batch_norm.get()] && stale.find("'" + site.path + "'") == std::string::npos) {
      stale += (stale.empty() ? "'" : ", '") + site.path + "'";
    }
  }
  if (!stale.empty()) {
    for (const auto& site : sites) repoint(*site.parent, site.name, site.sync, site.batch_norm);
    throw UsageError("convert_sync_batchnorm: the BatchNorm at " + stale +
                     " is also held outside the module tree, most likely by a field such as "
                     "`torch::nn::BatchNorm2d bn` that its parent's forward calls; that call would still run "
                     "unsynchronised BatchNorm, so nothing was converted. Fix: declare the field as "
                     "chorus::ddp::SyncBatchNorm (same options; state dicts are compatible), or keep the layer in a "
                     "Sequential, ModuleList or ModuleDict, and hold no other copy of it while converting");
  }
  return module;
}

}  // namespace chorus::ddp
