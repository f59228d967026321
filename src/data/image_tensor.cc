// Images to tensors (include/chorus/data/image_tensor.h).
#include "chorus/data/image_tensor.h"

#include <ATen/ATen.h>

#include <cstring>
#include <string>

#include "chorus/comm/error.h"

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

at::Tensor ImageDecoder::operator()(const std::vector<uint8_t>& bytes, const ItemInfo& item) const {
  const Image image = decode_image(bytes.data(), bytes.size(), mode_, item.key);
  return apply_to_tensor(pipeline_, image, seed_, static_cast<uint64_t>(item.epoch), static_cast<uint64_t>(item.index));
}

std::array<int64_t, 3> ImageDecoder::decode_into(const std::vector<uint8_t>& bytes, const ItemInfo& item,
                                                 const Destination& into) const {
  const Image image = decode_image(bytes.data(), bytes.size(), mode_, item.key);
  const auto shape = pipeline_.output_shape(image.height, image.width, image.channels);
  // to_chw_float's check, before any memory is asked for.
  const auto& mean = pipeline_.normalise_mean();
  const auto& stddev = pipeline_.normalise_std();
  if (mean.size() != stddev.size() || (mean.size() > 1 && static_cast<int64_t>(mean.size()) != shape[0])) {
    throw UsageError("normalise: " + std::to_string(mean.size()) + " mean and " + std::to_string(stddev.size()) +
                     " std values for an image of " + std::to_string(shape[0]) +
                     " channels; give one, or one per channel");
  }
  float* out = into(shape);
  if (out != nullptr) {
    pipeline_.apply_into(image, seed_, static_cast<uint64_t>(item.epoch), static_cast<uint64_t>(item.index), out);
  }
  return shape;
}

DecodeFn image_decoder(ImagePipeline pipeline, ImageMode mode, uint64_t seed) {
  return ImageDecoder(std::move(pipeline), mode, seed);
}

}  // namespace chorus::data
