// Transfer learning: freeze a pretrained backbone, replace the head, train the two at different
// learning rates, unfreeze later.
//
//   chorus::models::load_state_dict(*model, "pretrained.pt");
//   model->replace_head(5);
//   chorus::models::freeze_backbone(*model);
//   torch::optim::SGDOptions head(0.1);
//   torch::optim::SGD optimizer(chorus::models::backbone_and_head_groups(*model, head, 0.01), head);
//   chorus::ddp::DistributedDataParallel ddp(model);  // after freezing: the reducer skips frozen ones
//   ... later: chorus::models::unfreeze_backbone(*model); wrap a new DDP (its buckets are fixed at
//   construction); the same optimizer then also steps the backbone, at its own learning rate.
//
// Contract:
// - freeze(module): every parameter in it stops requiring grad, and every BatchNorm in it stays in
//   eval mode (running statistics neither used from the batch nor updated) whatever train() is
//   called later, on it or on a module above it, until unfreeze(module). A BatchNorm that is not
//   chorus::models::FreezableBatchNorm2d could be put back in training by a later train() without
//   a word, so freeze refuses it: UsageError naming it, and nothing changed.
// - unfreeze(module): parameters require grad again; BatchNorms return to the mode last asked of
//   them (the model's train()/eval() calls, frozen or not, are remembered).
// - Freezing does not touch values. .grad already accumulated on a parameter stays; optimizers skip
//   parameters whose .grad is undefined, so a parameter frozen from the start never moves.
// - Under chorus::ddp, freeze before wrapping: DDP decides at construction which parameters it
//   reduces, checks that every rank froze the same ones, and broadcasts rank 0's values of all of
//   them (frozen or not) and its buffers.
#pragma once

#include <torch/optim/optimizer.h>

#include <vector>

#include "chorus/models/resnet.h"

namespace chorus::models {

void freeze(torch::nn::Module& module);
void unfreeze(torch::nn::Module& module);

// The backbone: every module of the ResNet but fc.
void freeze_backbone(ResNetImpl& model);
void unfreeze_backbone(ResNetImpl& model);

std::vector<torch::Tensor> backbone_parameters(ResNetImpl& model);  // frozen ones too
std::vector<torch::Tensor> head_parameters(ResNetImpl& model);      // fc's

// Two optimizer parameter groups: the head (fc) with `head` options, then the backbone with the
// same options at learning rate backbone_lr. Frozen backbone parameters are included (they have no
// .grad, so optimizers skip them), so unfreezing later needs no new optimizer.
std::vector<torch::optim::OptimizerParamGroup> backbone_and_head_groups(ResNetImpl& model,
                                                                        const torch::optim::OptimizerOptions& head,
                                                                        double backbone_lr);

}  // namespace chorus::models
