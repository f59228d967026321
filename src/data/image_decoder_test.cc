// Image files end to end: an ImageFolder tree of PNG and JPEG files read through image_decoder and
// the ParallelLoader gives, item by item, what decoding each file and applying the pipeline by hand
// gives; a corrupt JPEG or a truncated PNG fails its batch with the file's name, or is counted with
// skip_bad.
#include <gtest/gtest.h>
#include <torch/data/samplers/sequential.h>

#include <random>
#include <string>
#include <vector>

#include "chorus/data/byte_source.h"
#include "chorus/data/image_folder.h"
#include "chorus/data/image_tensor.h"
#include "chorus/data/loader.h"
#include "data_test_util.h"

namespace chorus::data {
namespace {

Image random_image(int64_t h, int64_t w, uint32_t seed) {
  std::mt19937 gen(seed);
  Image img;
  img.height = h;
  img.width = w;
  img.channels = 3;
  img.pixels.resize(static_cast<size_t>(h * w * 3));
  for (auto& p : img.pixels) p = static_cast<uint8_t>(gen() & 255);
  return img;
}

void put(const std::string& path, const std::vector<uint8_t>& bytes) {
  testing::write_file(path, std::string(bytes.begin(), bytes.end()));
}

// root/cat/0..4.png and root/dog/0..4.jpg, 10 x 12 RGB.
void write_tree(const std::string& root) {
  for (int i = 0; i < 5; ++i) {
    put(root + "/cat/" + std::to_string(i) + ".png", encode_png(random_image(10, 12, 100 + i)));
    put(root + "/dog/" + std::to_string(i) + ".jpg", encode_jpeg(random_image(10, 12, 200 + i), 92));
  }
}

ImagePipeline pipeline() {
  return ImagePipeline().random_crop(8, 8).random_horizontal_flip().normalise({0.5f, 0.4f, 0.3f}, {0.2f, 0.25f, 0.3f});
}

TEST(ImageDecoder, FolderThroughTheLoaderEqualsDecodingEachFileByHand) {
  testing::TempDir dir;
  write_tree(dir.path);
  auto source = std::make_shared<LocalByteSource>(dir.path);
  ImageDataset dataset = make_image_folder(source, image_decoder(pipeline(), ImageMode::kRGB, 7));
  ASSERT_EQ(dataset.size(), 10);
  LoaderOptions o;
  o.batch_size = 4;
  o.threads = 3;
  ParallelLoader loader(dataset, torch::data::samplers::SequentialSampler(dataset.size()), o);
  int64_t index = 0;
  for (auto& batch : loader) {
    for (int64_t j = 0; j < batch.data.size(0); ++j, ++index) {
      const std::string key = dataset.sample(index).key;
      const Image image = read_image(dir.path + "/" + key, ImageMode::kRGB);
      const at::Tensor expected = apply_to_tensor(pipeline(), image, 7, 0, static_cast<uint64_t>(index));
      EXPECT_TRUE(at::equal(batch.data[j], expected)) << key;
      EXPECT_EQ(batch.target[j].item<int64_t>(), index < 5 ? 0 : 1) << key;
    }
  }
  EXPECT_EQ(index, 10);
}

TEST(ImageDecoder, CorruptFilesNameThemselvesOrAreCounted) {
  testing::TempDir dir;
  write_tree(dir.path);
  std::vector<uint8_t> jpeg = encode_jpeg(random_image(10, 12, 1), 90);
  jpeg.resize(jpeg.size() / 2);  // cut in the middle of the scan
  put(dir.path + "/dog/5.jpg", jpeg);
  std::vector<uint8_t> png = encode_png(random_image(10, 12, 2));
  png.resize(png.size() - 20);  // the image data's end and IEND missing
  put(dir.path + "/cat/5.png", png);
  auto source = std::make_shared<LocalByteSource>(dir.path);
  for (bool skip : {false, true}) {
    ImageDataset dataset = make_image_folder(source, image_decoder(pipeline()));
    LoaderOptions o;
    o.batch_size = 3;
    o.threads = 2;
    o.skip_bad = skip;
    ParallelLoader loader(dataset, torch::data::samplers::SequentialSampler(dataset.size()), o);
    std::vector<std::string> errors;
    int64_t items = 0;
    // A bad batch throws where the loop takes it (begin() or ++); the next ++ goes on after it.
    auto take = [&](auto&& step) {
      for (int tries = 0; tries < 4; ++tries) {
        try {
          return step();
        } catch (const std::exception& e) {
          errors.push_back(e.what());
        }
      }
      throw std::runtime_error("the loader kept failing");
    };
    auto it = take([&] { return loader.begin(); });
    while (it != loader.end()) {
      items += it->data.size(0);
      take([&] { ++it; return 0; });
    }
    if (skip) {
      EXPECT_TRUE(errors.empty());
      EXPECT_EQ(items, 10);
      EXPECT_EQ(loader.stats().bad_items, 2);
    } else {
      EXPECT_EQ(items, 6);  // the two batches holding a bad file fail whole
      ASSERT_EQ(errors.size(), 2u);
      EXPECT_NE(errors[0].find("cat/5.png"), std::string::npos) << errors[0];
      EXPECT_NE(errors[1].find("dog/5.jpg"), std::string::npos) << errors[1];
      for (const auto& e : errors) EXPECT_EQ(e.find('\n'), std::string::npos) << "not one line: " << e;
    }
  }
}

// image_decoder's items go straight into the batch tensor, and the loader writes again into a
// batch tensor the loop has released: batches the loop still holds (or views of them) keep their
// values through later epochs, and every batch equals decoding its items one by one.
TEST(ImageDecoder, BatchTensorsAreReusedOnlyOnceReleased) {
  testing::TempDir dir;
  for (int i = 0; i < 12; ++i) {
    put(dir.path + "/a/" + std::to_string(i) + ".png", encode_png(random_image(10, 12, 300 + i)));
  }
  auto source = std::make_shared<LocalByteSource>(dir.path);
  ImageDataset dataset = make_image_folder(source, image_decoder(pipeline(), ImageMode::kRGB, 3));
  LoaderOptions o;
  o.batch_size = 4;
  o.threads = 2;
  o.prefetch_batches = 1;
  ParallelLoader loader(dataset, torch::data::samplers::SequentialSampler(dataset.size()), o);
  std::vector<std::pair<at::Tensor, at::Tensor>> held;  // (a batch or a view the loop keeps, its values)
  int64_t batches = 0;
  for (int64_t epoch = 0; epoch < 6; ++epoch) {
    int64_t index = 0;
    for (auto& batch : loader) {
      for (int64_t j = 0; j < batch.data.size(0); ++j, ++index) {
        const auto bytes = source->read(dataset.sample(static_cast<size_t>(index)).key);
        const Image image = decode_image(bytes.data(), bytes.size(), ImageMode::kRGB, "x");
        EXPECT_TRUE(at::equal(batch.data[j], apply_to_tensor(pipeline(), image, 3, static_cast<uint64_t>(epoch),
                                                             static_cast<uint64_t>(index))))
            << "epoch " << epoch << " item " << index;
      }
      if (batches == 1) held.emplace_back(batch.data, batch.data.clone());
      if (batches == 4) held.emplace_back(batch.data[2], batch.data[2].clone());  // a view keeps it too
      ++batches;
    }
    EXPECT_EQ(index, 12);
  }
  ASSERT_EQ(held.size(), 2u);
  for (const auto& [tensor, values] : held) EXPECT_TRUE(at::equal(tensor, values));
}

// Through image_decoder, items of different shapes fail their batch as they do when stacked,
// skip_bad or not; batches of one shape go on.
TEST(ImageDecoder, ItemsOfDifferentShapesFailTheirBatch) {
  testing::TempDir dir;
  for (int i = 0; i < 4; ++i) put(dir.path + "/a/" + std::to_string(i) + ".png", encode_png(random_image(10, 12, i)));
  put(dir.path + "/a/4.png", encode_png(random_image(8, 8, 4)));
  put(dir.path + "/a/5.png", encode_png(random_image(8, 8, 5)));
  auto source = std::make_shared<LocalByteSource>(dir.path);
  const auto plain = ImagePipeline().normalise({0.5f}, {0.25f});  // no crop: the files' sizes
  for (bool skip : {false, true}) {
    ImageDataset dataset = make_image_folder(source, image_decoder(plain));
    LoaderOptions o;
    o.batch_size = 2;
    o.threads = 2;
    o.skip_bad = skip;
    // Batches {0, 1}, {2, 4} (two shapes) and {5}.
    std::vector<size_t> order{0, 1, 2, 4, 5};
    ParallelLoader loader(dataset.subset(order), torch::data::samplers::SequentialSampler(order.size()), o);
    auto it = loader.begin();
    ASSERT_TRUE(it != loader.end());
    EXPECT_EQ(it->data.sizes(), (std::vector<int64_t>{2, 3, 10, 12}));
    try {
      ++it;
      FAIL() << "a batch of two shapes was stacked";
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find("different shapes"), std::string::npos) << e.what();
    }
    ++it;
    ASSERT_TRUE(it != loader.end());
    EXPECT_EQ(it->data.sizes(), (std::vector<int64_t>{1, 3, 8, 8}));
  }
}

}  // namespace
}  // namespace chorus::data
