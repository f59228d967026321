// image_parity_test: decoding and transforms against PIL 9 and torchvision 0.14. The Python side
// (image_parity_test.py) writes source images with PIL; this side decodes them, writes its own
// encoders' files, runs the transforms and writes every result with a manifest line; the script
// recomputes each case with PIL / torchvision and compares (tolerances in the script, measured
// differences in docs/image-data.md). Skips when /usr/bin/python3 cannot import PIL and torchvision.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "chorus/data/image.h"
#include "chorus/data/image_transforms.h"
#include "testing.h"

namespace chorus::data {
namespace {

namespace fs = std::filesystem;

class Cases {
 public:
  explicit Cases(fs::path dir) : dir_(std::move(dir)), manifest_(dir_ / "manifest.txt") {}

  void decode(const std::string& src, const char* mode_name, ImageMode mode) {
    const Image img = read_image((dir_ / src).string(), mode);
    const std::string out = "out/" + std::to_string(n_++) + ".raw";
    write(out, img.pixels.data(), img.pixels.size());
    manifest_ << "decode " << src << " " << mode_name << " " << img.height << " " << img.width << " " << img.channels
              << " " << out << "\n";
  }

  // The input as a lossless PNG the script opens with PIL.
  std::string input(const Image& img) {
    const std::string name = "in/" + std::to_string(n_++) + ".png";
    write_file((dir_ / name).string(), encode_png(img));
    return name;
  }

  void u8(const std::string& in, const Image& out, const std::string& op_args) {
    const std::string raw = "out/" + std::to_string(n_++) + ".raw";
    write(raw, out.pixels.data(), out.pixels.size());
    manifest_ << "u8 " << in << " " << out.height << " " << out.width << " " << out.channels << " " << raw << " "
              << op_args << "\n";
  }

  void f32(const std::string& in, const std::array<int64_t, 3>& shape, const std::vector<float>& out,
           const std::string& op_args) {
    const std::string raw = "out/" + std::to_string(n_++) + ".raw";
    write(raw, out.data(), out.size() * sizeof(float));
    manifest_ << "f32 " << in << " " << shape[0] << " " << shape[1] << " " << shape[2] << " " << raw << " " << op_args
              << "\n";
  }

  void close() { manifest_.close(); }

 private:
  void write(const std::string& name, const void* data, size_t n) {
    std::ofstream f(dir_ / name, std::ios::binary);
    f.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
    ASSERT_TRUE(static_cast<bool>(f)) << name;
  }

  fs::path dir_;
  std::ofstream manifest_;
  int n_ = 0;
};

std::string floats(const std::vector<float>& v) {
  std::ostringstream s;
  s.precision(9);
  for (float x : v) s << " " << x;
  return s.str();
}

// CHORUS_IMAGE_PARITY_FILES: more images (colon-separated paths, e.g. real photos) to decode and
// transform, for measuring by hand; the test's own cases do not need them. Copied into dir/src.
std::vector<Image> extra_images(const fs::path& dir) {
  std::vector<Image> extra;
  if (const char* files = std::getenv("CHORUS_IMAGE_PARITY_FILES")) {
    std::istringstream list(files);
    int k = 0;
    for (std::string path; std::getline(list, path, ':');) {
      if (path.empty()) continue;
      const fs::path copy = dir / "src" / ("extra_" + std::to_string(k++) + fs::path(path).extension().string());
      fs::copy_file(path, copy);
      extra.push_back(read_image(copy.string(), ImageMode::kRGB));
    }
  }
  return extra;
}

// Resizes (the shorter side, and both sides: down- and upsampling, odd sizes) and centre crops.
void add_resize_and_crop_cases(Cases& cases, const std::string& in, const Image& img) {
  for (int64_t s : {7, 16, 28, 33, 64, 100, 224}) {
    const auto [h, w] = resize_shorter_size(img.height, img.width, s);
    cases.u8(in, resize(img, h, w), "resize -1 " + std::to_string(s));
  }
  for (auto [h, w] : std::vector<std::pair<int64_t, int64_t>>{{10, 90}, {50, 13}, {img.height, 45}, {31, img.width},
                                                               {img.height * 3, img.width * 2}}) {
    cases.u8(in, resize(img, h, w), "resize " + std::to_string(h) + " " + std::to_string(w));
  }
  for (auto [h, w] : std::vector<std::pair<int64_t, int64_t>>{{10, 10}, {27, 28}, {img.height, img.width - 1},
                                                               {img.height + 3, img.width + 4}, {5, img.width + 1}}) {
    cases.u8(in, center_crop(img, h, w), "center_crop " + std::to_string(h) + " " + std::to_string(w));
  }
}

// Random crops with the pipeline's own draws, replayed in torchvision's RandomCrop.
void add_random_crop_cases(Cases& cases, const std::string& in, const Image& img) {
  struct CropCase {
    int64_t h, w;
    RandomCropOptions o;
  };
  RandomCropOptions plain, padded, needed;
  padded.padding = {4, 2, 1, 3};
  padded.fill = 17;
  needed.pad_if_needed = true;
  for (const CropCase& c : std::vector<CropCase>{{20, 24, plain}, {img.height, img.width, plain},
                                                 {img.height + 2, 30, padded}, {img.height + 5, img.width + 3, needed}}) {
    const ImagePipeline p = ImagePipeline().random_crop(c.h, c.w, c.o).random_horizontal_flip(0.5);
    for (uint64_t index = 0; index < 4; ++index) {
      const Image padded_img = random_crop_pad(img, c.h, c.w, c.o);
      ItemRng crop_rng(11, 2, index, 0), flip_rng(11, 2, index, 1);
      const auto [top, left] = random_crop_offsets(crop_rng, padded_img.height, padded_img.width, c.h, c.w);
      const bool flip = random_flip_draw(flip_rng, 0.5);
      std::ostringstream args;
      args << "random_crop " << c.h << " " << c.w;
      for (int64_t v : c.o.padding) args << " " << v;
      args << " " << int{c.o.pad_if_needed} << " " << int{c.o.fill} << " " << top << " " << left << " " << int{flip};
      cases.u8(in, p.apply_uint8(img, 11, 2, index), args.str());
    }
  }
}

TEST(ImageParity, DecodeAndTransformsMatchPilAndTorchvision) {
  const std::string python = testing::parity_python();
  int status = 0;
  testing::run_capture(python + " -c 'import PIL, torchvision' >/dev/null 2>&1", &status);
  if (status != 0) GTEST_SKIP() << python << " cannot import PIL and torchvision (python3-pil, python3-torchvision)";

  const fs::path dir = fs::path(::testing::TempDir()) / ("chorus_image_parity_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "out");
  fs::create_directories(dir / "in");
  const std::string script = std::string(python) + " " + CHORUS_IMAGE_PARITY_SCRIPT;
  const std::string made = testing::run_capture(script + " make " + dir.string() + " 2>&1", &status);
  ASSERT_EQ(status, 0) << made;

  // Our encoders' files join PIL's.
  const Image photo = read_image((dir / "src/pil_rgb.png").string(), ImageMode::kRGB);
  const Image gray = read_image((dir / "src/pil_gray.png").string(), ImageMode::kGray);
  write_file((dir / "src/ours_rgb.png").string(), encode_png(photo));
  write_file((dir / "src/ours_rgb_q90.jpg").string(), encode_jpeg(photo, 90));
  write_file((dir / "src/ours_gray_q75.jpg").string(), encode_jpeg(gray, 75));

  const std::vector<Image> extra = extra_images(dir);

  Cases cases(dir);
  std::vector<std::string> sources;
  for (const auto& e : fs::directory_iterator(dir / "src")) sources.push_back("src/" + e.path().filename().string());
  std::sort(sources.begin(), sources.end());
  ASSERT_GE(sources.size(), 25u);
  for (const auto& s : sources) {
    cases.decode(s, "keep", ImageMode::kKeep);
    cases.decode(s, "rgb", ImageMode::kRGB);
    cases.decode(s, "gray", ImageMode::kGray);
  }

  // Transforms on RGB and gray inputs of several shapes (down- and upsampling, odd sizes).
  std::vector<Image> inputs = {photo, gray, crop(photo, 3, 5, 40, 61), resize(gray, 28, 28)};
  inputs.insert(inputs.end(), extra.begin(), extra.end());
  for (const Image& img : inputs) {
    const std::string in = cases.input(img);
    add_resize_and_crop_cases(cases, in, img);
    add_random_crop_cases(cases, in, img);
    const std::vector<float> mean = img.channels == 3 ? std::vector<float>{0.485f, 0.456f, 0.406f} : std::vector<float>{0.2860f};
    const std::vector<float> sd = img.channels == 3 ? std::vector<float>{0.229f, 0.224f, 0.225f} : std::vector<float>{0.3530f};
    std::vector<float> out(static_cast<size_t>(img.channels * img.height * img.width));
    to_chw_float(img, mean, sd, out.data());
    cases.f32(in, {img.channels, img.height, img.width}, out, "to_tensor_normalise" + floats(mean) + floats(sd));
    const ImagePipeline eval = ImagePipeline().resize(32).center_crop(24, 30).normalise(mean, sd);
    const auto shape = eval.output_shape(img.height, img.width, img.channels);
    std::vector<float> evaluated(static_cast<size_t>(shape[0] * shape[1] * shape[2]));
    ASSERT_EQ(eval.apply_into(img, 0, 0, 0, evaluated.data()), shape);
    cases.f32(in, shape, evaluated, "compose 32 24 30" + floats(mean) + floats(sd));
  }
  cases.close();

  const std::string report = testing::run_capture(script + " check " + dir.string() + " 2>&1", &status);
  std::printf("%s", report.c_str());
  EXPECT_EQ(status, 0) << "the reference differs (cases kept in " << dir << ")";
  EXPECT_NE(report.find("RESULT ok "), std::string::npos) << report;
  if (status == 0) fs::remove_all(dir);
}

}  // namespace
}  // namespace chorus::data
