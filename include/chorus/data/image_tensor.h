// From images to tensors: the one libtorch step of the image pipeline (target chorus_data).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "chorus/data/image.h"
#include "chorus/data/image_dataset.h"
#include "chorus/data/image_transforms.h"

namespace chorus::data {

// The pixels as a uint8 tensor [H, W, C] (a copy).
at::Tensor image_to_tensor(const Image& image);

// pipeline.apply_into in a new float tensor [C, H, W]: the item's transforms, then ToTensor and
// Normalize. Thread-safe like ImagePipeline::apply_uint8.
at::Tensor apply_to_tensor(const ImagePipeline& pipeline, const Image& image, uint64_t seed, uint64_t epoch,
                           uint64_t index);

// A DecodeFn (chorus/data/image_dataset.h) for JPEG and PNG files, for make_image_folder and
// make_csv_dataset: decode_image in `mode`, then the pipeline's transforms seeded with (seed, the
// item's epoch, its dataset index), then ToTensor and Normalize: float [C, H, W]. Thread-safe. A
// file that does not decode throws ImageError naming its key (the loader adds the full name).
DecodeFn image_decoder(ImagePipeline pipeline, ImageMode mode = ImageMode::kRGB, uint64_t seed = 0);

}  // namespace chorus::data
