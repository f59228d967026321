// ResNet-18/34/50 (and 101/152) with torchvision 0.14's architecture and state_dict.
//
//   chorus::models::ResNetOptions options;
//   options.depth = 18;
//   chorus::models::ResNet model(options);
//   chorus::models::load_state_dict(*model, "resnet18.pt");   // torch.save(m.state_dict(), ...)
//   chorus::models::freeze_backbone(*model);                  // include/chorus/models/transfer.h
//   model->replace_head(5);
//
// Contract:
// - The modules, their names and registration order are torchvision's (torchvision/models/resnet.py):
//   conv1, bn1, layer1..layer4 (Sequential of blocks "0", "1", ...; a block's shortcut is
//   "downsample" = Sequential(1x1 conv "0", BatchNorm "1")), fc. So state_dict(*model)
//   (chorus/models/state_dict.h) lists exactly torchvision's keys, in its order, with its shapes;
//   relu, maxpool and avgpool hold no state and are functions here.
// - Initialisation is torchvision's: convolutions kaiming_normal (fan_out, relu), BatchNorm weight 1
//   and bias 0, fc libtorch's Linear default (the same as PyTorch's); zero_init_residual zeroes the
//   last BatchNorm's weight of every block. Deterministic for a given torch::manual_seed.
// - Every BatchNorm is a FreezableBatchNorm2d: frozen (by chorus::models::freeze), it stays in eval
//   mode whatever train() is called on it or on any module above it, until unfrozen.
// - Not thread-safe; one forward at a time per model, like any torch::nn::Module.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <vector>

namespace chorus::models {

// BatchNorm2d whose training mode a freeze pins to eval. train(on) records the mode asked for; the
// module trains only when asked to and not frozen. Unfreezing restores the mode last asked for, so
// the order of freeze/unfreeze and model->train()/eval() calls does not matter. Its state (weight,
// bias, running_mean, running_var, num_batches_tracked, in this order) and its computation are
// torch::nn::BatchNorm2d's with the defaults (eps 1e-5, momentum 0.1, affine, tracked statistics).
// Its own module rather than a subclass: libtorch 1.13 does not export BatchNorm's base class.
class FreezableBatchNorm2dImpl : public torch::nn::Cloneable<FreezableBatchNorm2dImpl> {
 public:
  explicit FreezableBatchNorm2dImpl(int64_t num_features);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);  // [N, num_features, H, W]
  void train(bool on = true) override;
  void set_frozen(bool frozen);
  bool frozen() const { return frozen_; }
  void pretty_print(std::ostream& stream) const override;

  torch::Tensor weight, bias, running_mean, running_var, num_batches_tracked;

 private:
  int64_t num_features_;
  bool frozen_ = false;
  bool asked_training_ = true;  // the mode of the last train()/eval() call; modules start training
};
TORCH_MODULE(FreezableBatchNorm2d);

// torchvision's BasicBlock (ResNet-18/34: two 3x3 convolutions) or Bottleneck (ResNet-50 and up:
// 1x1, 3x3 with the stride, 1x1 to planes * 4), with the shortcut `downsample` when the shape
// changes.
class ResidualBlockImpl : public torch::nn::Module {
 public:
  ResidualBlockImpl(bool bottleneck, int64_t in_planes, int64_t planes, int64_t stride);
  torch::Tensor forward(const torch::Tensor& x);

  static int64_t expansion(bool bottleneck) { return bottleneck ? 4 : 1; }

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};  // conv3: bottleneck only
  FreezableBatchNorm2d bn1{nullptr}, bn2{nullptr}, bn3{nullptr};
  torch::nn::Sequential downsample{nullptr};  // null when the identity is the shortcut

 private:
  bool bottleneck_;
};
TORCH_MODULE(ResidualBlock);

struct ResNetOptions {
  int depth = 18;                    // 18, 34 (BasicBlock), 50, 101, 152 (Bottleneck)
  int64_t in_channels = 3;           // conv1's input channels (torchvision: 3)
  int64_t num_classes = 1000;        // fc's outputs
  bool zero_init_residual = false;   // torchvision's option: each block starts as the identity
};

class ResNetImpl : public torch::nn::Module {
 public:
  explicit ResNetImpl(const ResNetOptions& options = {});

  torch::Tensor forward(const torch::Tensor& x);        // [N, in_channels, H, W] -> [N, num_classes]
  torch::Tensor forward_features(const torch::Tensor& x);  // the pooled features fc reads: [N, features]

  // Replaces fc by a new Linear(features, num_classes), initialised as a fresh one; it keeps its
  // place in the state_dict and trains (requires_grad) whatever the backbone's state.
  void replace_head(int64_t num_classes);
  int64_t num_features() const { return num_features_; }  // fc's input size: 512 or 2048
  const ResNetOptions& options() const { return options_; }

  torch::nn::Conv2d conv1{nullptr};
  FreezableBatchNorm2d bn1{nullptr};
  torch::nn::Sequential layer1{nullptr}, layer2{nullptr}, layer3{nullptr}, layer4{nullptr};
  torch::nn::Linear fc{nullptr};

 private:
  ResNetOptions options_;
  int64_t num_features_ = 0;
};
TORCH_MODULE(ResNet);

// The blocks per stage for a depth, as in torchvision ({2,2,2,2} for 18, {3,4,6,3} for 34 and 50,
// ...). Throws UsageError for another depth, naming the supported ones.
std::vector<int> resnet_stage_blocks(int depth);

}  // namespace chorus::models
