// From images to tensors: the one libtorch step of the image pipeline (target chorus_data).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

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
// The function it returns holds an ImageDecoder (below), which ParallelLoader recognises.
DecodeFn image_decoder(ImagePipeline pipeline, ImageMode mode = ImageMode::kRGB, uint64_t seed = 0);

// The callable inside image_decoder's DecodeFn. ParallelLoader finds it there
// (DecodeFn::target<ImageDecoder>()) and calls decode_into, so that each item is written straight
// into its batch's tensor: no tensor per item and no stacking copy, the same values. Immutable and
// thread-safe; cheap to copy (the pipeline's steps are shared).
class ImageDecoder {
 public:
  ImageDecoder(ImagePipeline pipeline, ImageMode mode, uint64_t seed)
      : pipeline_(std::move(pipeline)), mode_(mode), seed_(seed) {}

  // The DecodeFn: a new float tensor [C, H, W].
  at::Tensor operator()(const std::vector<uint8_t>& bytes, const ItemInfo& item) const;

  // Where an item goes: given its [C, H, W] shape, a buffer of that many floats, or nullptr for
  // "not here" (decode_into then writes nothing).
  using Destination = std::function<float*(const std::array<int64_t, 3>& shape)>;
  // Decodes the image, works out its output shape (checking the normalisation against its
  // channels), asks `into` for memory once and applies the pipeline there. Returns the shape.
  // Throws as operator() does, before `into` is called for a file that does not decode.
  std::array<int64_t, 3> decode_into(const std::vector<uint8_t>& bytes, const ItemInfo& item,
                                     const Destination& into) const;

 private:
  ImagePipeline pipeline_;
  ImageMode mode_;
  uint64_t seed_;
};

}  // namespace chorus::data
