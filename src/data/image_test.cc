// Unit tests of image decoding/encoding, the uint8 transforms, ItemRng and ImagePipeline. Parity with
// PIL and torchvision is image_parity_test's.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "chorus/data/image.h"
#include "chorus/data/image_tensor.h"
#include "chorus/data/image_transforms.h"

namespace chorus::data {
namespace {

Image random_image(int64_t h, int64_t w, int64_t c, uint32_t seed) {
  std::mt19937 gen(seed);
  Image img(h, w, c);
  for (auto& p : img.pixels) p = static_cast<uint8_t>(gen() & 0xff);
  return img;
}

// A smooth image: JPEG keeps it close, so round trips can be checked tightly.
Image gradient_image(int64_t h, int64_t w, int64_t c) {
  Image img(h, w, c);
  for (int64_t y = 0; y < h; ++y)
    for (int64_t x = 0; x < w; ++x)
      for (int64_t k = 0; k < c; ++k) img.at(y, x, k) = static_cast<uint8_t>((x * 3 + y * 2 + k * 40) % 256 / 2 + 40);
  return img;
}

// What decode_image must throw for `bytes`: an ImageError starting with the name and holding `what`.
void expect_decode_error(const std::vector<uint8_t>& bytes, const std::string& what) {
  const std::string name = "dir/bad_file_name.img";
  try {
    decode_image(bytes.data(), bytes.size(), ImageMode::kRGB, name);
    FAIL() << "no error for input of " << bytes.size() << " bytes, expected: " << what;
  } catch (const ImageError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind(name + ": ", 0), 0u) << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "one line: " << msg;
  }
}

TEST(ImageCodec, PngRoundTripsEveryChannelCountExactly) {
  for (int64_t c = 1; c <= 4; ++c) {
    const Image img = random_image(13, 29, c, static_cast<uint32_t>(c));
    const auto png = encode_png(img);
    EXPECT_EQ(sniff_image_format(png.data(), png.size()), ImageFormat::kPng);
    EXPECT_EQ(decode_image(png.data(), png.size(), ImageMode::kKeep, "x.png"), img) << c << " channels";
  }
}

TEST(ImageCodec, ModesConvertAsPil) {
  const Image rgba = random_image(5, 7, 4, 3);
  const auto png = encode_png(rgba);
  const Image rgb = decode_image(png.data(), png.size(), ImageMode::kRGB, "x.png");
  const Image gray = decode_image(png.data(), png.size(), ImageMode::kGray, "x.png");
  ASSERT_EQ(rgb.channels, 3);
  ASSERT_EQ(gray.channels, 1);
  for (int64_t y = 0; y < 5; ++y) {
    for (int64_t x = 0; x < 7; ++x) {
      for (int64_t k = 0; k < 3; ++k) EXPECT_EQ(rgb.at(y, x, k), rgba.at(y, x, k));
      const uint32_t l = (rgba.at(y, x, 0) * 19595u + rgba.at(y, x, 1) * 38470u + rgba.at(y, x, 2) * 7471u + 0x8000u) >> 16;
      EXPECT_EQ(gray.at(y, x, 0), l);
    }
  }
  const Image g = random_image(4, 4, 1, 9);
  const auto gpng = encode_png(g);
  const Image g3 = decode_image(gpng.data(), gpng.size(), ImageMode::kRGB, "g.png");
  for (int64_t i = 0; i < 16; ++i) {
    for (int64_t k = 0; k < 3; ++k) EXPECT_EQ(g3.pixels[static_cast<size_t>(i * 3 + k)], g.pixels[static_cast<size_t>(i)]);
  }
}

TEST(ImageCodec, JpegRoundTripIsClose) {
  for (int64_t c : {1, 3}) {
    const Image img = gradient_image(32, 48, c);
    const auto jpg = encode_jpeg(img, 95);
    EXPECT_EQ(sniff_image_format(jpg.data(), jpg.size()), ImageFormat::kJpeg);
    const Image back = decode_image(jpg.data(), jpg.size(), ImageMode::kKeep, "x.jpg");
    ASSERT_EQ(back.channels, c);
    ASSERT_EQ(back.height, 32);
    ASSERT_EQ(back.width, 48);
    double sum = 0;
    for (size_t i = 0; i < img.pixels.size(); ++i) sum += std::abs(int{img.pixels[i]} - int{back.pixels[i]});
    EXPECT_LT(sum / static_cast<double>(img.pixels.size()), 3.0) << c << " channels";
  }
  EXPECT_THROW(encode_jpeg(random_image(4, 4, 4, 1), 90), ImageError);
  EXPECT_THROW(encode_jpeg(random_image(4, 4, 3, 1), 0), ImageError);
}

TEST(ImageCodec, BadInputIsAClearErrorNamingTheFile) {
  expect_decode_error({}, "empty file");
  std::mt19937 gen(7);
  std::vector<uint8_t> noise(1000);
  for (auto& b : noise) b = static_cast<uint8_t>(gen());
  noise[0] = 0x12;
  expect_decode_error(noise, "not a JPEG or PNG image");
  expect_decode_error({'G', 'I', 'F', '8', '9', 'a', 0, 0}, "a GIF image");

  const auto png = encode_png(random_image(40, 40, 3, 5));
  for (size_t cut : {size_t{8}, size_t{20}, png.size() / 2, png.size() - 20}) {
    expect_decode_error(std::vector<uint8_t>(png.begin(), png.begin() + static_cast<std::ptrdiff_t>(cut)), "PNG");
  }
  auto bad_crc = png;
  bad_crc[40] ^= 0xff;  // inside the IDAT chunk
  expect_decode_error(bad_crc, "corrupt PNG");

  const auto jpg = encode_jpeg(gradient_image(64, 64, 3), 90);
  expect_decode_error(std::vector<uint8_t>(jpg.begin(), jpg.begin() + 3), "JPEG");
  expect_decode_error(std::vector<uint8_t>(jpg.begin(), jpg.begin() + static_cast<std::ptrdiff_t>(jpg.size() / 2)),
                      "JPEG");
  auto early_end = jpg;  // an end-of-image marker inside the entropy-coded data
  early_end[jpg.size() / 2] = 0xff;
  early_end[jpg.size() / 2 + 1] = 0xd9;
  expect_decode_error(early_end, "corrupt or truncated JPEG");
  auto bad_table = jpg;  // a Huffman table (DHT) whose length field is too short
  size_t dht = 2;
  while (dht + 1 < bad_table.size() && !(bad_table[dht] == 0xff && bad_table[dht + 1] == 0xc4)) ++dht;
  ASSERT_LT(dht + 3, bad_table.size());
  bad_table[dht + 2] = 0;
  bad_table[dht + 3] = 3;
  expect_decode_error(bad_table, "corrupt JPEG");

  try {
    read_image("/nonexistent/dir/x.png", ImageMode::kRGB);
    FAIL();
  } catch (const ImageError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/dir/x.png: cannot open"), std::string::npos) << e.what();
  }
}

TEST(ImageCodec, ReadImageReadsAFile) {
  const Image img = random_image(6, 9, 3, 11);
  const std::string path = ::testing::TempDir() + "chorus_image_test_" + std::to_string(::getpid()) + ".png";
  write_file(path, encode_png(img));
  EXPECT_EQ(read_image(path, ImageMode::kKeep), img);
  std::remove(path.c_str());
}

TEST(ImageTransforms, ResizeShorterSizeIsTorchvisions) {
  EXPECT_EQ(resize_shorter_size(375, 500, 256), std::make_pair(int64_t{256}, int64_t{341}));
  EXPECT_EQ(resize_shorter_size(500, 375, 256), std::make_pair(int64_t{341}, int64_t{256}));
  EXPECT_EQ(resize_shorter_size(28, 28, 64), std::make_pair(int64_t{64}, int64_t{64}));
  EXPECT_EQ(resize_shorter_size(3, 7, 2), std::make_pair(int64_t{2}, int64_t{4}));  // int(14 / 3) = 4
}

TEST(ImageTransforms, ResizeKeepsConstantsAndSameSize) {
  Image flat(17, 23, 3);
  std::fill(flat.pixels.begin(), flat.pixels.end(), 77);
  for (auto [h, w] : {std::pair<int64_t, int64_t>{5, 9}, {40, 41}, {17, 5}, {3, 23}}) {
    const Image r = resize(flat, h, w);
    ASSERT_EQ(r.height, h);
    ASSERT_EQ(r.width, w);
    EXPECT_TRUE(std::all_of(r.pixels.begin(), r.pixels.end(), [](uint8_t v) { return v == 77; }));
  }
  const Image img = random_image(9, 8, 2, 4);
  EXPECT_EQ(resize(img, 9, 8), img);
  EXPECT_THROW(resize(img, 0, 8), UsageError);
}

TEST(ImageTransforms, CropPadFlipCenterCrop) {
  const Image img = random_image(6, 7, 3, 2);
  const Image c = crop(img, 1, 2, 3, 4);
  EXPECT_EQ(c.at(0, 0, 1), img.at(1, 2, 1));
  EXPECT_EQ(c.at(2, 3, 2), img.at(3, 5, 2));
  const Image outside = crop(img, -1, 5, 3, 4);  // zeros beyond the image, as PIL
  EXPECT_EQ(outside.at(0, 0, 0), 0);
  EXPECT_EQ(outside.at(1, 0, 0), img.at(0, 5, 0));
  EXPECT_EQ(outside.at(1, 2, 0), 0);
  const Image p = pad(img, 1, 2, 3, 4, 9);
  EXPECT_EQ(p.height, 12);
  EXPECT_EQ(p.width, 11);
  EXPECT_EQ(p.at(0, 0, 0), 9);
  EXPECT_EQ(p.at(2, 1, 0), img.at(0, 0, 0));
  const Image f = hflip(img);
  EXPECT_EQ(f.at(3, 0, 1), img.at(3, 6, 1));
  EXPECT_EQ(hflip(f), img);
  // Python's round is half to even: (7 - 2) / 2 = 2.5 -> 2, (6 - 3) / 2 = 1.5 -> 2.
  const Image cc = center_crop(img, 3, 2);
  EXPECT_EQ(cc.at(0, 0, 0), img.at(2, 2, 0));
  const Image big = center_crop(img, 9, 10);  // pads 1 top, 1 left (floor half), then fits
  EXPECT_EQ(big.height, 9);
  EXPECT_EQ(big.at(0, 0, 0), 0);
  EXPECT_EQ(big.at(1, 1, 0), img.at(0, 0, 0));
}

TEST(ItemRng, CounterBasedAndUniform) {
  ItemRng a(1, 2, 3, 0), b(1, 2, 3, 0), other_stream(1, 2, 3, 1), other_epoch(1, 3, 3, 0);
  const uint64_t first = a.next();
  EXPECT_EQ(first, b.next());
  EXPECT_NE(first, other_stream.next());
  EXPECT_NE(first, other_epoch.next());
  std::vector<int> counts(7, 0);
  ItemRng r(42, 0, 0, 0);
  for (int i = 0; i < 70000; ++i) {
    const int64_t v = r.uniform_int(7);
    ASSERT_GE(v, 0);
    ASSERT_LT(v, 7);
    ++counts[static_cast<size_t>(v)];
  }
  for (int c : counts) EXPECT_NEAR(c, 10000, 500);
  EXPECT_EQ(r.uniform_int(1), 0);
  EXPECT_THROW(r.uniform_int(0), UsageError);
}

ImagePipeline training_pipeline() {
  RandomCropOptions pad4;
  pad4.padding = {4, 4, 4, 4};
  return ImagePipeline().resize(40).random_crop(32, 32, pad4).random_horizontal_flip().normalise({0.5f}, {0.25f});
}

TEST(ImagePipeline, SameItemSameResultInAnyThreadAndOrder) {
  const ImagePipeline p = training_pipeline();
  std::vector<Image> inputs;
  for (uint32_t i = 0; i < 48; ++i) inputs.push_back(random_image(30 + i % 5, 50, 3, i));
  std::vector<Image> serial;
  for (size_t i = 0; i < inputs.size(); ++i) serial.push_back(p.apply_uint8(inputs[i], 7, 1, i));

  std::vector<Image> threaded(inputs.size());
  std::vector<std::thread> threads;
  const ImagePipeline copy = p;  // copies share the steps
  for (size_t t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (size_t k = inputs.size(); k-- > 0;) {  // reverse order, interleaved
        if (k % 4 == t) threaded[k] = copy.apply_uint8(inputs[k], 7, 1, k);
      }
    });
  }
  for (auto& th : threads) th.join();
  int differs_by_epoch = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    EXPECT_EQ(threaded[i], serial[i]) << "item " << i;
    EXPECT_EQ(serial[i].height, 32);
    differs_by_epoch += p.apply_uint8(inputs[i], 7, 2, i) == serial[i] ? 0 : 1;
  }
  EXPECT_GT(differs_by_epoch, 40) << "a new epoch should draw new crops and flips";
}

TEST(ImagePipeline, StepsDrawFromTheirOwnStreams) {
  const Image img = random_image(20, 20, 1, 5);
  RandomCropOptions none;
  const ImagePipeline p = ImagePipeline().random_crop(12, 12, none).random_horizontal_flip(0.5);
  for (uint64_t index = 0; index < 20; ++index) {
    ItemRng crop_rng(3, 0, index, 0), flip_rng(3, 0, index, 1);
    const auto [top, left] = random_crop_offsets(crop_rng, 20, 20, 12, 12);
    Image expected = crop(img, top, left, 12, 12);
    if (random_flip_draw(flip_rng, 0.5)) expected = hflip(expected);
    EXPECT_EQ(p.apply_uint8(img, 3, 0, index), expected);
  }
  const Image no_flip = ImagePipeline().random_horizontal_flip(0.0).apply_uint8(img, 1, 0, 0);
  const Image flip = ImagePipeline().random_horizontal_flip(1.0).apply_uint8(img, 1, 0, 0);
  EXPECT_EQ(no_flip, img);
  EXPECT_EQ(flip, hflip(img));
}

TEST(ImagePipeline, BuildingOnACopyLeavesTheOriginal) {
  ImagePipeline a = ImagePipeline().resize(8, 8);
  ImagePipeline b = a;
  b.center_crop(4);
  const Image img = random_image(10, 10, 3, 1);
  EXPECT_EQ(a.apply_uint8(img, 0, 0, 0).height, 8);
  EXPECT_EQ(b.apply_uint8(img, 0, 0, 0).height, 4);
}

TEST(ImagePipeline, OutputShapeAndTensor) {
  const ImagePipeline p = ImagePipeline().resize(20).center_crop(16, 18).normalise({0.1f, 0.2f, 0.3f}, {0.5f, 0.6f, 0.7f});
  const Image img = random_image(30, 45, 3, 8);
  const auto shape = p.output_shape(30, 45, 3);
  EXPECT_EQ(shape, (std::array<int64_t, 3>{3, 16, 18}));
  EXPECT_EQ(ImagePipeline().resize(20).output_shape(30, 45, 1), (std::array<int64_t, 3>{1, 20, 30}));
  const at::Tensor t = apply_to_tensor(p, img, 0, 0, 0);
  ASSERT_EQ(t.sizes(), at::IntArrayRef({3, 16, 18}));
  const Image u8 = p.apply_uint8(img, 0, 0, 0);
  const at::Tensor ref = image_to_tensor(u8).permute({2, 0, 1}).to(at::kFloat).div(255)
                             .sub_(at::tensor({0.1f, 0.2f, 0.3f}).view({3, 1, 1}))
                             .div_(at::tensor({0.5f, 0.6f, 0.7f}).view({3, 1, 1}));
  EXPECT_TRUE(at::equal(t, ref)) << "max diff " << (t - ref).abs().max().item<float>();
  std::vector<float> out(3 * 16 * 18);
  EXPECT_EQ(p.apply_into(img, 0, 0, 0, out.data()), shape);
  EXPECT_EQ(std::memcmp(out.data(), t.data_ptr<float>(), out.size() * sizeof(float)), 0);
  EXPECT_THROW(ImagePipeline().normalise({0.1f, 0.2f}, {1.0f, 1.0f}).apply_into(img, 0, 0, 0, out.data()), UsageError);
  EXPECT_THROW(ImagePipeline().normalise({0.1f}, {0.0f}), UsageError);
  EXPECT_THROW(ImagePipeline().random_crop(40, 40).apply_uint8(img, 0, 0, 0), UsageError);
}

// apply_into keeps its step images from one call to the next on a thread: items of other sizes,
// channels and crops in any order give what apply_uint8 and to_chw_float give.
TEST(ImagePipeline, ApplyIntoEqualsApplyUint8WhateverCameBefore) {
  RandomCropOptions padded;
  padded.padding = {3, 1, 2, 4};
  padded.fill = 7;
  RandomCropOptions needed;
  needed.pad_if_needed = true;
  needed.fill = 200;
  const std::vector<ImagePipeline> pipelines = {
      ImagePipeline().resize(24).center_crop(20).random_horizontal_flip().normalise({0.4f}, {0.3f}),
      ImagePipeline().random_crop(16, 16, padded).random_horizontal_flip().normalise({0.4f}, {0.3f}),
      ImagePipeline().random_crop(40, 36, needed).random_horizontal_flip(1.0).normalise({0.4f}, {0.3f}),
      ImagePipeline().center_crop(50, 10).normalise({0.4f}, {0.3f}),
      ImagePipeline().random_horizontal_flip(1.0).normalise({0.4f}, {0.3f}),
      ImagePipeline().normalise({0.4f}, {0.3f}),
  };
  const std::vector<Image> images = {random_image(30, 45, 3, 1), random_image(17, 19, 1, 2),
                                     random_image(64, 48, 3, 3), random_image(20, 20, 3, 4)};
  int cases = 0;
  for (int round = 0; round < 2; ++round) {
    for (size_t k = 0; k < pipelines.size(); ++k) {
      for (size_t i = 0; i < images.size(); ++i) {
        const auto& p = pipelines[(k + static_cast<size_t>(round)) % pipelines.size()];
        const Image& img = images[(i + k) % images.size()];
        const Image u8 = p.apply_uint8(img, 5, 1, i);
        std::vector<float> expected(u8.pixels.size()), got(u8.pixels.size());
        to_chw_float(u8, p.normalise_mean(), p.normalise_std(), expected.data());
        EXPECT_EQ(p.apply_into(img, 5, 1, i, got.data()), (std::array<int64_t, 3>{u8.channels, u8.height, u8.width}));
        EXPECT_EQ(got, expected) << "pipeline " << k << ", image " << i;
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 48);
}

}  // namespace
}  // namespace chorus::data
