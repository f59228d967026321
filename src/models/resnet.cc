#include "chorus/models/resnet.h"

#include <torch/nn/functional/pooling.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/container/any.h>

#include <sstream>
#include <string>

#include "chorus/comm/error.h"

namespace chorus::models {

FreezableBatchNorm2dImpl::FreezableBatchNorm2dImpl(int64_t num_features) : num_features_(num_features) {
  reset();
}

void FreezableBatchNorm2dImpl::reset() {
  weight = register_parameter("weight", torch::ones({num_features_}));
  bias = register_parameter("bias", torch::zeros({num_features_}));
  running_mean = register_buffer("running_mean", torch::zeros({num_features_}));
  running_var = register_buffer("running_var", torch::ones({num_features_}));
  num_batches_tracked = register_buffer("num_batches_tracked", torch::tensor(int64_t{0}));
}

torch::Tensor FreezableBatchNorm2dImpl::forward(const torch::Tensor& x) {
  if (x.dim() != 4 || x.size(1) != num_features_) {
    std::ostringstream os;
    os << "FreezableBatchNorm2d(" << num_features_ << "): expected input [N, " << num_features_ << ", H, W], got "
       << x.sizes();
    throw UsageError(os.str());
  }
  if (is_training()) {
    torch::NoGradGuard no_grad;
    num_batches_tracked += 1;
  }
  return torch::batch_norm(x, weight, bias, running_mean, running_var, is_training(), /*momentum=*/0.1,
                           /*eps=*/1e-5, /*cudnn_enabled=*/true);
}

void FreezableBatchNorm2dImpl::pretty_print(std::ostream& stream) const {
  stream << "chorus::models::FreezableBatchNorm2d(" << num_features_ << (frozen_ ? ", frozen)" : ")");
}

void FreezableBatchNorm2dImpl::train(bool on) {
  asked_training_ = on;
  torch::nn::Module::train(on && !frozen_);
}

void FreezableBatchNorm2dImpl::set_frozen(bool frozen) {
  frozen_ = frozen;
  torch::nn::Module::train(asked_training_ && !frozen_);
}

namespace {

torch::nn::Conv2d conv(int64_t in, int64_t out, int64_t kernel, int64_t stride) {
  return torch::nn::Conv2d(
      torch::nn::Conv2dOptions(in, out, kernel).stride(stride).padding(kernel / 2).bias(false));
}

}  // namespace

ResidualBlockImpl::ResidualBlockImpl(bool bottleneck, int64_t in_planes, int64_t planes, int64_t stride)
    : bottleneck_(bottleneck) {
  const int64_t out_planes = planes * expansion(bottleneck);
  // Registration order is torchvision's, which fixes the state_dict's key order.
  if (bottleneck) {
    conv1 = register_module("conv1", conv(in_planes, planes, 1, 1));
    bn1 = register_module("bn1", FreezableBatchNorm2d(planes));
    conv2 = register_module("conv2", conv(planes, planes, 3, stride));
    bn2 = register_module("bn2", FreezableBatchNorm2d(planes));
    conv3 = register_module("conv3", conv(planes, out_planes, 1, 1));
    bn3 = register_module("bn3", FreezableBatchNorm2d(out_planes));
  } else {
    conv1 = register_module("conv1", conv(in_planes, planes, 3, stride));
    bn1 = register_module("bn1", FreezableBatchNorm2d(planes));
    conv2 = register_module("conv2", conv(planes, planes, 3, 1));
    bn2 = register_module("bn2", FreezableBatchNorm2d(planes));
  }
  if (stride != 1 || in_planes != out_planes) {
    downsample = register_module(
        "downsample", torch::nn::Sequential(conv(in_planes, out_planes, 1, stride), FreezableBatchNorm2d(out_planes)));
  }
}

// ReLUs in place, as torchvision's (nn.ReLU(inplace=True)): BatchNorm's backward does not need its
// output, and the sum is a fresh tensor.
torch::Tensor ResidualBlockImpl::forward(const torch::Tensor& x) {
  torch::Tensor out = bn1(conv1(x)).relu_();
  if (bottleneck_) {
    out = bn2(conv2(out)).relu_();
    out = bn3(conv3(out));
  } else {
    out = bn2(conv2(out));
  }
  out += downsample ? downsample->forward(x) : x;
  return out.relu_();
}

std::vector<int> resnet_stage_blocks(int depth) {
  switch (depth) {
    case 18: return {2, 2, 2, 2};
    case 34: return {3, 4, 6, 3};
    case 50: return {3, 4, 6, 3};
    case 101: return {3, 4, 23, 3};
    case 152: return {3, 8, 36, 3};
    default:
      throw UsageError("ResNet: depth " + std::to_string(depth) +
                       " is not one of torchvision's (18, 34, 50, 101, 152); set ResNetOptions::depth to one");
  }
}

ResNetImpl::ResNetImpl(const ResNetOptions& options) : options_(options) {
  const std::vector<int> blocks = resnet_stage_blocks(options.depth);
  if (options.in_channels < 1 || options.num_classes < 1) {
    throw UsageError("ResNet: in_channels (" + std::to_string(options.in_channels) + ") and num_classes (" +
                     std::to_string(options.num_classes) + ") must be at least 1");
  }
  const bool bottleneck = options.depth >= 50;
  conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(options.in_channels, 64, 7)
                                                         .stride(2)
                                                         .padding(3)
                                                         .bias(false)));
  bn1 = register_module("bn1", FreezableBatchNorm2d(64));
  int64_t in_planes = 64;
  torch::nn::Sequential* layers[] = {&layer1, &layer2, &layer3, &layer4};
  for (int stage = 0; stage < 4; ++stage) {
    const int64_t planes = int64_t{64} << stage;
    torch::nn::Sequential layer;
    for (int b = 0; b < blocks[stage]; ++b) {
      const int64_t stride = (stage > 0 && b == 0) ? 2 : 1;
      layer->push_back(ResidualBlock(bottleneck, in_planes, planes, stride));
      in_planes = planes * ResidualBlockImpl::expansion(bottleneck);
    }
    *layers[stage] = register_module("layer" + std::to_string(stage + 1), layer);
  }
  num_features_ = in_planes;
  fc = register_module("fc", torch::nn::Linear(num_features_, options.num_classes));

  torch::NoGradGuard no_grad;
  for (const auto& module : modules(/*include_self=*/false)) {
    if (auto* c = module->as<torch::nn::Conv2d>()) {
      torch::nn::init::kaiming_normal_(c->weight, 0.0, torch::kFanOut, torch::kReLU);
    } else if (auto* bn = module->as<FreezableBatchNorm2d>()) {
      bn->weight.fill_(1);
      bn->bias.zero_();
    }
  }
  if (options.zero_init_residual) {
    for (const auto& module : modules(/*include_self=*/false)) {
      if (auto* block = module->as<ResidualBlock>()) (block->bn3 ? block->bn3 : block->bn2)->weight.zero_();
    }
  }
}

torch::Tensor ResNetImpl::forward_features(const torch::Tensor& x) {
  torch::Tensor h = bn1(conv1(x)).relu_();
  h = torch::max_pool2d(h, /*kernel_size=*/3, /*stride=*/2, /*padding=*/1);
  h = layer4->forward(layer3->forward(layer2->forward(layer1->forward(h))));
  return torch::adaptive_avg_pool2d(h, {1, 1}).flatten(1);
}

torch::Tensor ResNetImpl::forward(const torch::Tensor& x) { return fc(forward_features(x)); }

void ResNetImpl::replace_head(int64_t num_classes) {
  if (num_classes < 1) throw UsageError("ResNet::replace_head: num_classes must be at least 1, not " +
                                        std::to_string(num_classes));
  fc = replace_module("fc", torch::nn::Linear(num_features_, num_classes));
  fc->train(is_training());
  options_.num_classes = num_classes;
}

}  // namespace chorus::models
