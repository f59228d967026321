// Images as uint8 pixels: decoding (JPEG through libjpeg-turbo's TurboJPEG, PNG through libpng)
// and encoding. No libtorch here (target chorus_image); image_tensor.h turns an Image into a tensor.
//
// Decoding gives what PIL gives for Image.open(f).convert("RGB") / convert("L"): docs/image-data.md
// lists the conversions and the one deliberate difference (16-bit grayscale PNG).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "chorus/comm/error.h"

namespace chorus::data {

// A file could not be decoded or encoded: the message names the file (or the name the caller gave)
// and what is wrong with it ("truncated PNG", "not a JPEG or PNG image", ...).
class ImageError : public Error {
 public:
  using Error::Error;
};

// Pixels in height x width x channels order (HWC), row-major, 8 bits per channel. channels is 1
// (gray), 2 (gray + alpha), 3 (RGB) or 4 (RGBA).
struct Image {
  int64_t height = 0;
  int64_t width = 0;
  int64_t channels = 0;
  std::vector<uint8_t> pixels;  // height * width * channels bytes

  Image() = default;
  Image(int64_t h, int64_t w, int64_t c) : height(h), width(w), channels(c), pixels(static_cast<size_t>(h * w * c)) {}
  uint8_t* row(int64_t y) { return pixels.data() + y * width * channels; }
  const uint8_t* row(int64_t y) const { return pixels.data() + y * width * channels; }
  uint8_t& at(int64_t y, int64_t x, int64_t c) { return pixels[static_cast<size_t>((y * width + x) * channels + c)]; }
  uint8_t at(int64_t y, int64_t x, int64_t c) const {
    return pixels[static_cast<size_t>((y * width + x) * channels + c)];
  }
  bool operator==(const Image& o) const {
    return height == o.height && width == o.width && channels == o.channels && pixels == o.pixels;
  }
};

// What decode_image returns: kRGB and kGray convert as PIL's convert("RGB") / convert("L") do
// (alpha dropped, palette looked up, gray = (19595 R + 38470 G + 7471 B + 2^15) >> 16); kKeep keeps
// the file's own channels (1, 2, 3 or 4): 16-bit samples keep their high byte, a palette becomes
// RGB (RGBA when it has a tRNS chunk), a gray or RGB image's tRNS chunk is ignored.
enum class ImageMode { kKeep, kGray, kRGB };

enum class ImageFormat { kUnknown, kJpeg, kPng };

// The format from the first bytes (JPEG: FF D8 FF; PNG: its 8-byte signature).
ImageFormat sniff_image_format(const void* bytes, size_t n);

// Decodes a JPEG or PNG held in memory. name_for_errors (usually the path) starts every error
// message. Throws ImageError for an empty buffer, bytes of another format, a corrupt or truncated
// file (libjpeg warnings such as "premature end of data" count as errors), CMYK JPEGs, and images
// over kMaxImagePixels. Thread-safe: no state is shared between calls.
Image decode_image(const void* bytes, size_t n, ImageMode mode, const std::string& name_for_errors);

// Reads the file at path and decodes it; errors name the path (and the system error when it
// cannot be read).
Image read_image(const std::string& path, ImageMode mode);

// Bounds what a header may claim before any pixel memory is allocated.
constexpr int64_t kMaxImagePixels = int64_t{1} << 28;

// Encoders (used by `chorus data render-fashion-mnist` and the tests). PNG: lossless, any of the
// four channel counts, compression_level 0-9 (zlib's). JPEG: 1 or 3 channels, quality 1-100,
// 4:2:0 chroma subsampling for RGB (PIL's default). Throw ImageError on bad arguments.
std::vector<uint8_t> encode_png(const Image& image, int compression_level = 6);
std::vector<uint8_t> encode_jpeg(const Image& image, int quality = 90);

// Writes bytes to path (the parent directory must exist); throws ImageError naming path on failure.
void write_file(const std::string& path, const std::vector<uint8_t>& bytes);

}  // namespace chorus::data
