#include "chorus/models/transfer.h"

#include <torch/nn/modules/batchnorm.h>

#include <string>

#include "chorus/comm/error.h"

namespace chorus::models {
namespace {

// The module's FreezableBatchNorm2d's; UsageError naming any other BatchNorm, before any change.
std::vector<FreezableBatchNorm2dImpl*> freezable_norms(torch::nn::Module& module, const char* operation) {
  std::vector<FreezableBatchNorm2dImpl*> out;
  std::string others;
  auto visit = [&](torch::nn::Module& m, const std::string& name) {
    if (auto* bn = m.as<FreezableBatchNorm2dImpl>()) {
      out.push_back(bn);
    } else if (m.as<torch::nn::BatchNorm1dImpl>() || m.as<torch::nn::BatchNorm2dImpl>() ||
               m.as<torch::nn::BatchNorm3dImpl>()) {
      others += (others.empty() ? "" : ", ") + name;
    }
  };
  visit(module, "the module itself");
  for (const auto& item : module.named_modules("", /*include_self=*/false)) visit(*item.value(), item.key());
  if (!others.empty()) {
    throw UsageError(std::string(operation) + ": " + others +
                     " is a torch::nn BatchNorm, which a later train() would put back in training mode; use "
                     "chorus::models::FreezableBatchNorm2d (the same state) so the freeze holds");
  }
  return out;
}

void set_frozen(torch::nn::Module& module, bool frozen, const char* operation) {
  auto norms = freezable_norms(module, operation);
  for (auto& p : module.parameters()) {
    if (p.defined()) p.set_requires_grad(!frozen);
  }
  for (auto* bn : norms) bn->set_frozen(frozen);
}

template <typename Fn>
void for_backbone(ResNetImpl& model, Fn fn) {
  for (const auto& child : model.named_children()) {
    if (child.key() != "fc") fn(*child.value());
  }
}

}  // namespace

void freeze(torch::nn::Module& module) { set_frozen(module, true, "freeze"); }
void unfreeze(torch::nn::Module& module) { set_frozen(module, false, "unfreeze"); }

void freeze_backbone(ResNetImpl& model) {
  for_backbone(model, [](torch::nn::Module& m) { freeze(m); });
}

void unfreeze_backbone(ResNetImpl& model) {
  for_backbone(model, [](torch::nn::Module& m) { unfreeze(m); });
}

std::vector<torch::Tensor> backbone_parameters(ResNetImpl& model) {
  std::vector<torch::Tensor> out;
  for_backbone(model, [&](torch::nn::Module& m) {
    for (auto& p : m.parameters()) out.push_back(p);
  });
  return out;
}

std::vector<torch::Tensor> head_parameters(ResNetImpl& model) { return model.fc->parameters(); }

std::vector<torch::optim::OptimizerParamGroup> backbone_and_head_groups(ResNetImpl& model,
                                                                        const torch::optim::OptimizerOptions& head,
                                                                        double backbone_lr) {
  auto backbone_options = head.clone();
  backbone_options->set_lr(backbone_lr);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(head_parameters(model), head.clone());
  groups.emplace_back(backbone_parameters(model), std::move(backbone_options));
  return groups;
}

}  // namespace chorus::models
