// Fuzz target: decode_image (include/chorus/data/image.h), PNG through libpng and JPEG through
// libjpeg-turbo, with each of the three modes (picked by the input's length, so that seed files
// stay plain image files). A damaged file must raise ImageError; a decoded image must hold exactly
// height x width x channels bytes.
#include <cstdint>
#include <cstdlib>

#include "chorus/data/image.h"

namespace data = chorus::data;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  static const data::ImageMode kModes[3] = {data::ImageMode::kKeep, data::ImageMode::kGray, data::ImageMode::kRGB};
  const data::ImageMode mode = kModes[size % 3];
  try {
    const data::Image image = data::decode_image(bytes, size, mode, "fuzz-input");
    if (image.height <= 0 || image.width <= 0 || image.channels < 1 || image.channels > 4 ||
        image.pixels.size() != static_cast<size_t>(image.height * image.width * image.channels)) {
      std::abort();
    }
    if (mode == data::ImageMode::kGray && image.channels != 1) std::abort();
    if (mode == data::ImageMode::kRGB && image.channels != 3) std::abort();
  } catch (const data::ImageError&) {
  }
  return 0;
}
