// From images to tensors: the one libtorch step of the image pipeline (target chorus_data).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "chorus/data/image.h"
#include "chorus/data/image_transforms.h"

namespace chorus::data {

// The pixels as a uint8 tensor [H, W, C] (a copy).
at::Tensor image_to_tensor(const Image& image);

// pipeline.apply_into in a new float tensor [C, H, W]: the item's transforms, then ToTensor and
// Normalize. Thread-safe like ImagePipeline::apply_uint8.
at::Tensor apply_to_tensor(const ImagePipeline& pipeline, const Image& image, uint64_t seed, uint64_t epoch,
                           uint64_t index);

}  // namespace chorus::data
