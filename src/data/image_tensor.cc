// Images to tensors (include/chorus/data/image_tensor.h).
#include "chorus/data/image_tensor.h"

#include <ATen/ATen.h>

#include <cstring>

namespace chorus::data {

at::Tensor image_to_tensor(const Image& image) {
  at::Tensor t = at::empty({image.height, image.width, image.channels}, at::kByte);
  std::memcpy(t.data_ptr<uint8_t>(), image.pixels.data(), image.pixels.size());
  return t;
}

at::Tensor apply_to_tensor(const ImagePipeline& pipeline, const Image& image, uint64_t seed, uint64_t epoch,
                           uint64_t index) {
  const Image out = pipeline.apply_uint8(image, seed, epoch, index);
  at::Tensor t = at::empty({out.channels, out.height, out.width}, at::kFloat);
  to_chw_float(out, pipeline.normalise_mean(), pipeline.normalise_std(), t.data_ptr<float>());
  return t;
}

DecodeFn image_decoder(ImagePipeline pipeline, ImageMode mode, uint64_t seed) {
  return [pipeline = std::move(pipeline), mode, seed](const std::vector<uint8_t>& bytes, const ItemInfo& item) {
    const Image image = decode_image(bytes.data(), bytes.size(), mode, item.key);
    return apply_to_tensor(pipeline, image, seed, static_cast<uint64_t>(item.epoch), static_cast<uint64_t>(item.index));
  };
}

}  // namespace chorus::data
