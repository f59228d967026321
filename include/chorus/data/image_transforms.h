// Transforms on uint8 images, torchvision 0.14 style, and ImagePipeline, their Compose. No libtorch
// here (target chorus_image); image_tensor.h adds the step that makes a tensor.
//
// Parity with torchvision 0.14 on PIL images (image_parity_test): resize is PIL's BILINEAR resize
// (with its antialiasing support when downsampling) in PIL's own fixed-point arithmetic; crop,
// center crop, padding, flip and normalise give the same values as torchvision. docs/image-data.md
// has the measured differences.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "chorus/data/image.h"

namespace chorus::data {

// torchvision's output size for Resize(size) with an int: the shorter side becomes `size`, the
// longer int(size * long / short). Returns {height, width}.
std::pair<int64_t, int64_t> resize_shorter_size(int64_t height, int64_t width, int64_t size);

// PIL's Image.resize((width, height), BILINEAR): separable, triangle filter widened by the scale
// when downsampling, 22-bit fixed-point coefficients. Each channel on its own (PIL premultiplies
// alpha for LA/RGBA first; this does not). Same size: a copy.
Image resize(const Image& image, int64_t height, int64_t width);

// PIL's Image.crop((left, top, left + width, top + height)): areas outside the image are zeros.
Image crop(const Image& image, int64_t top, int64_t left, int64_t height, int64_t width);

// torchvision's F.pad with padding_mode "constant".
Image pad(const Image& image, int64_t left, int64_t top, int64_t right, int64_t bottom, uint8_t fill = 0);

// torchvision's F.center_crop: pads with zeros when the image is smaller, then crops at
// round((H - height) / 2), round((W - width) / 2) with Python's round (half to even).
Image center_crop(const Image& image, int64_t height, int64_t width);

// Mirrors left-right (F.hflip).
Image hflip(const Image& image);

// Random numbers for one item of one epoch, counter-based: the n-th draw of stream s is
// splitmix64 of a key hashed from (seed, epoch, index, s) plus n. The same arguments give the same
// numbers in any thread and in any order of items; nothing is shared, so it is free to copy.
class ItemRng {
 public:
  ItemRng(uint64_t seed, uint64_t epoch, uint64_t index, uint64_t stream);
  uint64_t next();
  // Uniform in [0, n), n >= 1, without modulo bias.
  int64_t uniform_int(int64_t n);
  // Uniform in [0, 1), 53 random bits.
  double uniform();

 private:
  uint64_t key_;
  uint64_t counter_ = 0;
};

// RandomCrop's options, torchvision's names: padding (left, top, right, bottom) applied first,
// then pad_if_needed pads both sides of a short dimension by (size - dimension) (torchvision's
// behaviour), with `fill`.
struct RandomCropOptions {
  std::array<int64_t, 4> padding{0, 0, 0, 0};
  bool pad_if_needed = false;
  uint8_t fill = 0;
};

// The pieces of a random crop, exposed so tests and tools can reproduce a pipeline's choices.
// random_crop_pad: the image RandomCrop draws from (padding, pad_if_needed); throws UsageError
// when it is still smaller than height x width. random_crop_offsets: {top, left} drawn as
// top = uniform_int(H - height + 1), then left = uniform_int(W - width + 1); {0, 0} without a draw
// when the sizes are equal (as torchvision).
Image random_crop_pad(const Image& image, int64_t height, int64_t width, const RandomCropOptions& options);
std::pair<int64_t, int64_t> random_crop_offsets(ItemRng& rng, int64_t image_height, int64_t image_width,
                                                int64_t height, int64_t width);
// True when a random horizontal flip with probability p flips: rng.uniform() < p.
bool random_flip_draw(ItemRng& rng, double p);

// A Compose of the transforms above, ending (when asked for a float output) in ToTensor (x / 255)
// and Normalize(mean, std). Built step by step:
//
//   auto p = ImagePipeline().resize(256).center_crop(224).normalise({0.485f, 0.456f, 0.406f},
//                                                                  {0.229f, 0.224f, 0.225f});
//
// Copies share the steps (a shared_ptr to an immutable list), so a copy is cheap; apply is const
// and touches no shared state, so any number of threads may apply one pipeline at once. Step k's
// random draws come from ItemRng(seed, epoch, index, k): an item's result depends only on
// (seed, epoch, index), never on the thread, the order of items, or the other steps' draws.
class ImagePipeline {
 public:
  ImagePipeline();

  ImagePipeline& resize(int64_t shorter_side);  // Resize(int)
  ImagePipeline& resize(int64_t height, int64_t width);  // Resize((h, w))
  ImagePipeline& center_crop(int64_t height, int64_t width);
  ImagePipeline& center_crop(int64_t size) { return center_crop(size, size); }
  ImagePipeline& random_crop(int64_t height, int64_t width, RandomCropOptions options = {});
  ImagePipeline& random_horizontal_flip(double p = 0.5);
  // Per-channel mean and std for the float output; one value each applies to every channel.
  ImagePipeline& normalise(std::vector<float> mean, std::vector<float> stddev);
  const std::vector<float>& normalise_mean() const { return mean_std_->first; }
  const std::vector<float>& normalise_std() const { return mean_std_->second; }

  // The uint8 steps only.
  Image apply_uint8(const Image& image, uint64_t seed, uint64_t epoch, uint64_t index) const;

  // Every step, then (x / 255 - mean) / std in float, written as [C, H, W] to out, which must hold
  // output_shape(...)'s product of floats (a slice of a batch tensor, say). Returns the shape.
  std::array<int64_t, 3> apply_into(const Image& image, uint64_t seed, uint64_t epoch, uint64_t index,
                                    float* out) const;

  // The [C, H, W] shape apply_into writes for an input of this size, without decoding anything.
  std::array<int64_t, 3> output_shape(int64_t height, int64_t width, int64_t channels) const;

 private:
  struct Step;  // one transform and its arguments (image_transforms.cc)
  // The uint8 steps on `image`; returns `image` itself when no step changed it, else one of
  // scratch[0] and scratch[1], between which the steps alternate (scratch[2]: a resize's middle
  // pass). The scratch images may hold memory from earlier calls.
  const Image* run_steps(const Image& image, uint64_t seed, uint64_t epoch, uint64_t index,
                         std::array<Image, 3>& scratch) const;
  std::shared_ptr<const std::vector<Step>> steps_;
  std::shared_ptr<const std::pair<std::vector<float>, std::vector<float>>> mean_std_;
  ImagePipeline& add(Step step);
};

// (x / 255 - mean[c]) / stddev[c] in float, HWC uint8 in, CHW float out: torchvision's ToTensor then
// Normalize, operation for operation. mean/stddev of size 1 apply to every channel; empty: 0 and 1.
void to_chw_float(const Image& image, const std::vector<float>& mean, const std::vector<float>& stddev, float* out);

}  // namespace chorus::data
