// uint8 image transforms and ImagePipeline (docs/image-data.md).
//
// resize() follows Pillow 9's Resample.c step for step (precompute_coeffs, normalize_coeffs_8bpc,
// ImagingResampleHorizontal_8bpc / Vertical_8bpc, and ImagingResampleInner's choice of passes), so
// that its results are PIL's, not merely close to them.
#include "chorus/data/image_transforms.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string>

namespace chorus::data {
namespace {

// Pillow's fixed point for 8-bit resampling: 32 bits minus 8 for the pixel and 2 for headroom.
constexpr int kPrecisionBits = 32 - 8 - 2;

struct Coefficients {
  int ksize = 0;
  std::vector<int> bounds;  // per output pixel: first input pixel, number of input pixels
  std::vector<int32_t> weights;  // per output pixel: ksize fixed-point weights
};

double bilinear_filter(double x) {
  if (x < 0.0) x = -x;
  return x < 1.0 ? 1.0 - x : 0.0;
}

Coefficients precompute_coefficients(int in_size, int out_size) {
  const float in0 = 0.0f;
  const float in1 = static_cast<float>(in_size);
  const double scale = static_cast<double>(in1 - in0) / out_size;
  const double filterscale = scale < 1.0 ? 1.0 : scale;
  const double support = 1.0 * filterscale;  // the bilinear filter's support is 1
  Coefficients c;
  c.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
  c.bounds.resize(static_cast<size_t>(out_size) * 2);
  c.weights.assign(static_cast<size_t>(out_size) * static_cast<size_t>(c.ksize), 0);
  std::vector<double> k(static_cast<size_t>(c.ksize));
  for (int xx = 0; xx < out_size; ++xx) {
    const double center = in0 + (xx + 0.5) * scale;
    const double ss = 1.0 / filterscale;
    int xmin = static_cast<int>(center - support + 0.5);
    if (xmin < 0) xmin = 0;
    int xmax = static_cast<int>(center + support + 0.5);
    if (xmax > in_size) xmax = in_size;
    xmax -= xmin;
    double ww = 0.0;
    for (int x = 0; x < xmax; ++x) {
      const double w = bilinear_filter((x + xmin - center + 0.5) * ss);
      k[static_cast<size_t>(x)] = w;
      ww += w;
    }
    int32_t* out = &c.weights[static_cast<size_t>(xx) * static_cast<size_t>(c.ksize)];
    for (int x = 0; x < xmax; ++x) {
      double v = k[static_cast<size_t>(x)];
      if (ww != 0.0) v /= ww;
      out[x] = v < 0 ? static_cast<int32_t>(-0.5 + v * (1 << kPrecisionBits))
                     : static_cast<int32_t>(0.5 + v * (1 << kPrecisionBits));
    }
    c.bounds[static_cast<size_t>(xx) * 2] = xmin;
    c.bounds[static_cast<size_t>(xx) * 2 + 1] = xmax;
  }
  return c;
}

uint8_t clip8(int32_t in) {
  if (in >= (1 << kPrecisionBits << 8)) return 255;
  if (in <= 0) return 0;
  return static_cast<uint8_t>(in >> kPrecisionBits);
}

// Gives `img` this shape and height * width * channels bytes, keeping its memory when it has
// enough; the bytes are stale: callers write every one.
void reshape(Image& img, int64_t height, int64_t width, int64_t channels) {
  img.height = height;
  img.width = width;
  img.channels = channels;
  img.pixels.resize(static_cast<size_t>(height * width * channels));
}

// Rows [y0, y0 + rows) of `in` resampled along x to out (rows x out_width).
void resample_horizontal(const Image& in, int64_t y0, int64_t rows, int64_t out_width, const Coefficients& k,
                         Image& out) {
  reshape(out, rows, out_width, in.channels);
  const int64_t c = in.channels;
  for (int64_t y = 0; y < rows; ++y) {
    const uint8_t* src = in.row(y0 + y);
    uint8_t* dst = out.row(y);
    for (int64_t xx = 0; xx < out_width; ++xx) {
      const int xmin = k.bounds[static_cast<size_t>(xx) * 2];
      const int xmax = k.bounds[static_cast<size_t>(xx) * 2 + 1];
      const int32_t* w = &k.weights[static_cast<size_t>(xx) * static_cast<size_t>(k.ksize)];
      for (int64_t ch = 0; ch < c; ++ch) {
        int32_t ss = 1 << (kPrecisionBits - 1);
        for (int x = 0; x < xmax; ++x) ss += src[(x + xmin) * c + ch] * w[x];
        dst[xx * c + ch] = clip8(ss);
      }
    }
  }
}

// `in` resampled along y to out_height rows; bounds are relative to in's first row minus y_shift.
void resample_vertical(const Image& in, int64_t out_height, const Coefficients& k, int y_shift, Image& out) {
  reshape(out, out_height, in.width, in.channels);
  const int64_t row_len = in.width * in.channels;
  for (int64_t yy = 0; yy < out_height; ++yy) {
    const int ymin = k.bounds[static_cast<size_t>(yy) * 2] - y_shift;
    const int ymax = k.bounds[static_cast<size_t>(yy) * 2 + 1];
    const int32_t* w = &k.weights[static_cast<size_t>(yy) * static_cast<size_t>(k.ksize)];
    uint8_t* dst = out.row(yy);
    for (int64_t i = 0; i < row_len; ++i) {
      int32_t ss = 1 << (kPrecisionBits - 1);
      for (int y = 0; y < ymax; ++y) ss += in.pixels[static_cast<size_t>((y + ymin) * row_len + i)] * w[y];
      dst[i] = clip8(ss);
    }
  }
}

void check_image(const Image& image, const char* op) {
  if (image.height <= 0 || image.width <= 0 || image.channels <= 0 ||
      image.pixels.size() != static_cast<size_t>(image.height * image.width * image.channels)) {
    throw UsageError(std::string(op) + ": bad image " + std::to_string(image.height) + "x" +
                     std::to_string(image.width) + "x" + std::to_string(image.channels) + " with " +
                     std::to_string(image.pixels.size()) + " bytes");
  }
}

void check_size(int64_t height, int64_t width, const char* op) {
  if (height <= 0 || width <= 0 || height > (int64_t{1} << 20) || width > (int64_t{1} << 20)) {
    throw UsageError(std::string(op) + ": size " + std::to_string(height) + "x" + std::to_string(width) +
                     " must be positive (and at most 2^20 a side)");
  }
}

uint64_t fmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;

}  // namespace

std::pair<int64_t, int64_t> resize_shorter_size(int64_t height, int64_t width, int64_t size) {
  check_size(size, size, "resize");
  const int64_t shorter = std::min(height, width);
  const int64_t longer = std::max(height, width);
  // Python's int(size * long / short): a double quotient, truncated.
  const auto other = static_cast<int64_t>(static_cast<double>(size * longer) / static_cast<double>(shorter));
  return width <= height ? std::make_pair(other, size) : std::make_pair(size, other);
}

namespace {

// resize() into `out`, with `tmp` for the horizontal pass's rows (both may hold memory from before).
void resize_into(const Image& image, int64_t height, int64_t width, Image& out, Image& tmp) {
  check_image(image, "resize");
  check_size(height, width, "resize");
  const bool horizontal = width != image.width;
  const bool vertical = height != image.height;
  if (!horizontal && !vertical) {
    out = image;
    return;
  }
  const Coefficients kx = precompute_coefficients(static_cast<int>(image.width), static_cast<int>(width));
  const Coefficients ky = precompute_coefficients(static_cast<int>(image.height), static_cast<int>(height));
  // Only the rows the vertical pass reads go through the horizontal one, as in Pillow.
  const int y_first = ky.bounds[0];
  const int y_last = ky.bounds[static_cast<size_t>(height) * 2 - 2] + ky.bounds[static_cast<size_t>(height) * 2 - 1];
  if (!horizontal) return resample_vertical(image, height, ky, 0, out);
  if (!vertical) return resample_horizontal(image, y_first, y_last - y_first, width, kx, out);
  resample_horizontal(image, y_first, y_last - y_first, width, kx, tmp);
  resample_vertical(tmp, height, ky, y_first, out);
}

// crop() into `out`, with `fill` outside the image.
void crop_into(const Image& image, int64_t top, int64_t left, int64_t height, int64_t width, uint8_t fill, Image& out) {
  check_size(height, width, "crop");
  reshape(out, height, width, image.channels);
  const bool inside = top >= 0 && left >= 0 && top + height <= image.height && left + width <= image.width;
  if (!inside) std::fill(out.pixels.begin(), out.pixels.end(), fill);
  const int64_t c = image.channels;
  const int64_t x0 = std::max<int64_t>(0, -left);
  const int64_t x1 = std::min(width, image.width - left);
  for (int64_t y = std::max<int64_t>(0, -top); y < std::min(height, image.height - top); ++y) {
    if (x1 <= x0) break;
    std::memcpy(out.row(y) + x0 * c, image.row(top + y) + (left + x0) * c, static_cast<size_t>((x1 - x0) * c));
  }
}

// center_crop's offsets when the image is at least height x width.
std::pair<int64_t, int64_t> center_offsets(const Image& image, int64_t height, int64_t width) {
  // Python's round(): half to even, which nearbyint does in the default rounding mode.
  return {static_cast<int64_t>(std::nearbyint((image.height - height) / 2.0)),
          static_cast<int64_t>(std::nearbyint((image.width - width) / 2.0))};
}

void hflip_in_place(Image& image) {
  const int64_t c = image.channels;
  for (int64_t y = 0; y < image.height; ++y) {
    uint8_t* row = image.row(y);
    for (int64_t x = 0; x < image.width / 2; ++x) {
      std::swap_ranges(row + x * c, row + (x + 1) * c, row + (image.width - 1 - x) * c);
    }
  }
}

// The padding RandomCrop puts around an image of image_height x image_width (left, top, right,
// bottom): `padding`, then with pad_if_needed a short side's whole shortfall on both sides.
// UsageError when the crop is still larger.
std::array<int64_t, 4> random_crop_padding(int64_t image_height, int64_t image_width, int64_t height, int64_t width,
                                           const RandomCropOptions& o) {
  auto [left, top, right, bottom] = o.padding;
  // torchvision pads a short dimension by the whole shortfall on both sides.
  if (o.pad_if_needed && image_width + left + right < width) {
    const int64_t d = width - (image_width + left + right);
    left += d;
    right += d;
  }
  if (o.pad_if_needed && image_height + top + bottom < height) {
    const int64_t d = height - (image_height + top + bottom);
    top += d;
    bottom += d;
  }
  if (image_height + top + bottom < height || image_width + left + right < width) {
    throw UsageError("random_crop: crop " + std::to_string(height) + "x" + std::to_string(width) +
                     " is larger than the (padded) image " + std::to_string(image_height + top + bottom) + "x" +
                     std::to_string(image_width + left + right) + "; resize first, or set pad_if_needed");
  }
  return {left, top, right, bottom};
}

}  // namespace

Image resize(const Image& image, int64_t height, int64_t width) {
  Image out, tmp;
  resize_into(image, height, width, out, tmp);
  return out;
}

Image crop(const Image& image, int64_t top, int64_t left, int64_t height, int64_t width) {
  check_image(image, "crop");
  Image out;
  crop_into(image, top, left, height, width, 0, out);
  return out;
}

Image pad(const Image& image, int64_t left, int64_t top, int64_t right, int64_t bottom, uint8_t fill) {
  check_image(image, "pad");
  if (left < 0 || top < 0 || right < 0 || bottom < 0) throw UsageError("pad: padding must not be negative");
  Image out(image.height + top + bottom, image.width + left + right, image.channels);
  std::fill(out.pixels.begin(), out.pixels.end(), fill);
  const auto row_bytes = static_cast<size_t>(image.width * image.channels);
  for (int64_t y = 0; y < image.height; ++y) std::memcpy(out.row(y + top) + left * image.channels, image.row(y), row_bytes);
  return out;
}

Image center_crop(const Image& image, int64_t height, int64_t width) {
  check_image(image, "center_crop");
  check_size(height, width, "center_crop");
  if (width > image.width || height > image.height) {
    const int64_t dw = std::max<int64_t>(0, width - image.width);
    const int64_t dh = std::max<int64_t>(0, height - image.height);
    Image padded = pad(image, dw / 2, dh / 2, (dw + 1) / 2, (dh + 1) / 2, 0);
    if (padded.width == width && padded.height == height) return padded;
    return center_crop(padded, height, width);
  }
  const auto [top, left] = center_offsets(image, height, width);
  return crop(image, top, left, height, width);
}

Image hflip(const Image& image) {
  check_image(image, "hflip");
  Image out(image.height, image.width, image.channels);
  const int64_t c = image.channels;
  for (int64_t y = 0; y < image.height; ++y) {
    const uint8_t* src = image.row(y);
    uint8_t* dst = out.row(y);
    for (int64_t x = 0; x < image.width; ++x) std::memcpy(dst + x * c, src + (image.width - 1 - x) * c, static_cast<size_t>(c));
  }
  return out;
}

ItemRng::ItemRng(uint64_t seed, uint64_t epoch, uint64_t index, uint64_t stream) {
  uint64_t k = fmix64(seed + kGolden);
  k = fmix64((k ^ epoch) + kGolden);
  k = fmix64((k ^ index) + kGolden);
  key_ = fmix64((k ^ stream) + kGolden);
}

uint64_t ItemRng::next() { return fmix64(key_ + (++counter_) * kGolden); }

int64_t ItemRng::uniform_int(int64_t n) {
  if (n < 1) throw UsageError("ItemRng::uniform_int: n = " + std::to_string(n) + ", must be >= 1");
  // Lemire's multiply-and-reject: unbiased, one draw almost always.
  const auto un = static_cast<uint64_t>(n);
  unsigned __int128 m = static_cast<unsigned __int128>(next()) * un;
  auto low = static_cast<uint64_t>(m);
  if (low < un) {
    const uint64_t threshold = (0 - un) % un;
    while (low < threshold) {
      m = static_cast<unsigned __int128>(next()) * un;
      low = static_cast<uint64_t>(m);
    }
  }
  return static_cast<int64_t>(m >> 64);
}

double ItemRng::uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

Image random_crop_pad(const Image& image, int64_t height, int64_t width, const RandomCropOptions& o) {
  const auto p = random_crop_padding(image.height, image.width, height, width, o);
  if ((p[0] | p[1] | p[2] | p[3]) == 0) return image;
  return pad(image, p[0], p[1], p[2], p[3], o.fill);
}

std::pair<int64_t, int64_t> random_crop_offsets(ItemRng& rng, int64_t image_height, int64_t image_width,
                                                int64_t height, int64_t width) {
  if (image_height == height && image_width == width) return {0, 0};
  const int64_t top = rng.uniform_int(image_height - height + 1);
  const int64_t left = rng.uniform_int(image_width - width + 1);
  return {top, left};
}

bool random_flip_draw(ItemRng& rng, double p) { return rng.uniform() < p; }

struct ImagePipeline::Step {
  enum class Kind { kResizeShorter, kResize, kCenterCrop, kRandomCrop, kRandomFlip } kind;
  int64_t height = 0;  // kResizeShorter: the shorter side
  int64_t width = 0;
  RandomCropOptions crop;
  double p = 0.5;
};

ImagePipeline::ImagePipeline()
    : steps_(std::make_shared<const std::vector<Step>>()),
      mean_std_(std::make_shared<const std::pair<std::vector<float>, std::vector<float>>>()) {}

ImagePipeline& ImagePipeline::add(Step step) {
  auto steps = std::make_shared<std::vector<Step>>(*steps_);  // copies made before stay as they were
  steps->push_back(step);
  steps_ = std::move(steps);
  return *this;
}

ImagePipeline& ImagePipeline::resize(int64_t shorter_side) {
  check_size(shorter_side, shorter_side, "ImagePipeline::resize");
  return add({Step::Kind::kResizeShorter, shorter_side, shorter_side, {}, 0});
}

ImagePipeline& ImagePipeline::resize(int64_t height, int64_t width) {
  check_size(height, width, "ImagePipeline::resize");
  return add({Step::Kind::kResize, height, width, {}, 0});
}

ImagePipeline& ImagePipeline::center_crop(int64_t height, int64_t width) {
  check_size(height, width, "ImagePipeline::center_crop");
  return add({Step::Kind::kCenterCrop, height, width, {}, 0});
}

ImagePipeline& ImagePipeline::random_crop(int64_t height, int64_t width, RandomCropOptions options) {
  check_size(height, width, "ImagePipeline::random_crop");
  for (int64_t p : options.padding) {
    if (p < 0) throw UsageError("ImagePipeline::random_crop: padding must not be negative");
  }
  return add({Step::Kind::kRandomCrop, height, width, options, 0});
}

ImagePipeline& ImagePipeline::random_horizontal_flip(double p) {
  if (!(p >= 0.0 && p <= 1.0)) throw UsageError("ImagePipeline::random_horizontal_flip: p must be in [0, 1]");
  return add({Step::Kind::kRandomFlip, 0, 0, {}, p});
}

ImagePipeline& ImagePipeline::normalise(std::vector<float> mean, std::vector<float> stddev) {
  if (mean.size() != stddev.size() || mean.empty()) {
    throw UsageError("ImagePipeline::normalise: mean and std need the same number of values (one, or one per "
                     "channel); got " + std::to_string(mean.size()) + " and " + std::to_string(stddev.size()));
  }
  for (float s : stddev) {
    if (!(s != 0.0f) || !std::isfinite(s)) throw UsageError("ImagePipeline::normalise: std values must be finite and non-zero");
  }
  mean_std_ = std::make_shared<const std::pair<std::vector<float>, std::vector<float>>>(std::move(mean), std::move(stddev));
  return *this;
}

const Image* ImagePipeline::run_steps(const Image& image, uint64_t seed, uint64_t epoch, uint64_t index,
                                     std::array<Image, 3>& scratch) const {
  check_image(image, "ImagePipeline::apply");
  const Image* cur = &image;
  uint64_t stream = 0;
  for (const Step& s : *steps_) {
    ItemRng rng(seed, epoch, index, stream++);
    Image& out = cur == &scratch[0] ? scratch[1] : scratch[0];  // the step's output, never its input
    switch (s.kind) {
      case Step::Kind::kResizeShorter: {
        const auto [h, w] = resize_shorter_size(cur->height, cur->width, s.height);
        resize_into(*cur, h, w, out, scratch[2]);
        cur = &out;
        break;
      }
      case Step::Kind::kResize:
        resize_into(*cur, s.height, s.width, out, scratch[2]);
        cur = &out;
        break;
      case Step::Kind::kCenterCrop:
        if (s.width > cur->width || s.height > cur->height) {
          out = data::center_crop(*cur, s.height, s.width);  // padded first; rare
        } else {
          const auto [top, left] = center_offsets(*cur, s.height, s.width);
          crop_into(*cur, top, left, s.height, s.width, 0, out);
        }
        cur = &out;
        break;
      case Step::Kind::kRandomCrop: {
        // The crop of the padded image, taken from the image itself with the fill outside it.
        const auto p = random_crop_padding(cur->height, cur->width, s.height, s.width, s.crop);
        const int64_t padded_height = cur->height + p[1] + p[3];
        const int64_t padded_width = cur->width + p[0] + p[2];
        const auto [top, left] = random_crop_offsets(rng, padded_height, padded_width, s.height, s.width);
        if ((p[0] | p[1] | p[2] | p[3]) != 0 || cur->height != s.height || cur->width != s.width) {
          crop_into(*cur, top - p[1], left - p[0], s.height, s.width, s.crop.fill, out);
          cur = &out;
        }
        break;
      }
      case Step::Kind::kRandomFlip:
        if (random_flip_draw(rng, s.p)) {
          if (cur == &image) {
            out = image;
            cur = &out;
          }
          hflip_in_place(const_cast<Image&>(*cur));  // one of the scratch images
        }
        break;
    }
  }
  return cur;
}

Image ImagePipeline::apply_uint8(const Image& image, uint64_t seed, uint64_t epoch, uint64_t index) const {
  std::array<Image, 3> scratch;
  const Image* out = run_steps(image, seed, epoch, index, scratch);
  return out == &image ? image : std::move(const_cast<Image&>(*out));
}

std::array<int64_t, 3> ImagePipeline::output_shape(int64_t height, int64_t width, int64_t channels) const {
  for (const Step& s : *steps_) {
    switch (s.kind) {
      case Step::Kind::kResizeShorter:
        std::tie(height, width) = resize_shorter_size(height, width, s.height);
        break;
      case Step::Kind::kResize:
      case Step::Kind::kCenterCrop:
      case Step::Kind::kRandomCrop:
        height = s.height;
        width = s.width;
        break;
      case Step::Kind::kRandomFlip:
        break;
    }
  }
  return {channels, height, width};
}

std::array<int64_t, 3> ImagePipeline::apply_into(const Image& image, uint64_t seed, uint64_t epoch, uint64_t index,
                                                 float* out) const {
  // The steps' images live in buffers of this thread, kept from one item to the next: allocating
  // and freeing some 200 KB per step made glibc hand the pages back to the kernel and fault them in
  // again, a third of a decode thread's time at 224 px. A buffer grown beyond kKeptBytes (a large
  // photo) is released after the item.
  constexpr size_t kKeptBytes = size_t{16} << 20;
  thread_local std::array<Image, 3> scratch;
  const Image* img = run_steps(image, seed, epoch, index, scratch);
  to_chw_float(*img, mean_std_->first, mean_std_->second, out);
  const std::array<int64_t, 3> shape{img->channels, img->height, img->width};
  for (Image& s : scratch) {
    if (s.pixels.capacity() > kKeptBytes) s = Image();
  }
  return shape;
}

void to_chw_float(const Image& image, const std::vector<float>& mean, const std::vector<float>& stddev, float* out) {
  check_image(image, "to_chw_float");
  const auto c = static_cast<size_t>(image.channels);
  if (mean.size() != stddev.size() || (mean.size() > 1 && mean.size() != c)) {
    throw UsageError("normalise: " + std::to_string(mean.size()) + " mean and " + std::to_string(stddev.size()) +
                     " std values for an image of " + std::to_string(c) + " channels; give one, or one per channel");
  }
  const auto plane = static_cast<size_t>(image.height * image.width);
  for (size_t ch = 0; ch < c; ++ch) {
    const float m = mean.empty() ? 0.0f : mean[mean.size() == 1 ? 0 : ch];
    const float s = stddev.empty() ? 1.0f : stddev[stddev.size() == 1 ? 0 : ch];
    // The same float operations as ToTensor's div(255) and Normalize's sub_(mean).div_(std), done
    // once per pixel value: a uint8 channel takes 256 values, so a table gives every pixel the very
    // same float without two divisions each.
    std::array<float, 256> table;
    for (size_t v = 0; v < table.size(); ++v) table[v] = (static_cast<float>(v) / 255.0f - m) / s;
    const uint8_t* src = image.pixels.data() + ch;
    float* dst = out + ch * plane;
    for (size_t i = 0; i < plane; ++i) dst[i] = table[src[i * c]];
  }
}

}  // namespace chorus::data
