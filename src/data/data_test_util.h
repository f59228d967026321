// Test helpers for the image-data tests: a temporary directory and a test-only image format
// (binary PGM, "P5"), small enough to write and decode here without an image library.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <random>
#include <thread>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "chorus/data/image_folder.h"

namespace chorus::data::testing {

struct TempDir {
  std::string path;
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "chorus-data-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

inline void write_file(const std::string& path, const std::string& bytes) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream out(path, std::ios::binary);
  out << bytes;
  if (!out) throw std::runtime_error("cannot write " + path);
}

// A width x height binary PGM whose pixel (y, x) is (value + y * width + x) mod 256.
inline std::string pgm(int width, int height, int value) {
  std::string bytes = "P5\n" + std::to_string(width) + " " + std::to_string(height) + "\n255\n";
  for (int i = 0; i < width * height; ++i) bytes += static_cast<char>((value + i) % 256);
  return bytes;
}

// Decodes pgm() output to a 1 x height x width uint8 tensor; throws on anything else.
inline at::Tensor decode_pgm(const std::vector<uint8_t>& bytes) {
  std::istringstream in(std::string(bytes.begin(), bytes.end()));
  std::string magic;
  int width = 0, height = 0, max = 0;
  in >> magic >> width >> height >> max;
  if (!in || magic != "P5" || width <= 0 || height <= 0 || max != 255) {
    throw std::runtime_error("not a binary 8-bit PGM (P5) image");
  }
  in.get();
  const auto offset = static_cast<size_t>(in.tellg());
  if (bytes.size() < offset + static_cast<size_t>(width * height)) {
    throw std::runtime_error("truncated PGM: " + std::to_string(bytes.size() - offset) + " of " +
                             std::to_string(width * height) + " pixel bytes");
  }
  at::Tensor t = at::empty({1, height, width}, at::kByte);
  std::memcpy(t.data_ptr<uint8_t>(), bytes.data() + offset, static_cast<size_t>(width * height));
  return t;
}

// Decoded items alive anywhere (in the loader or not yet freed), counted by their storage's deleter.
struct AliveCounter {
  std::atomic<int64_t> alive{0};
  std::atomic<int64_t> max_alive{0};
  void add() {
    const int64_t now = ++alive;
    int64_t seen = max_alive.load();
    while (now > seen && !max_alive.compare_exchange_weak(seen, now)) {
    }
  }
};

// Items are files "<class>/<i>.num" holding the number i. The decoded item is the float vector
// {i, 1000 + i, epoch}; a file that is not a number fails to decode. Each decode sleeps a random
// 0..max_sleep_us, so that threads finish out of order.
inline DecodeFn number_decoder(std::shared_ptr<AliveCounter> counter, int max_sleep_us) {
  return [counter, max_sleep_us](const std::vector<uint8_t>& bytes, const ItemInfo& item) {
    if (max_sleep_us > 0) {
      thread_local std::mt19937 rng(std::hash<std::thread::id>()(std::this_thread::get_id()));
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % static_cast<unsigned>(max_sleep_us)));
    }
    const std::string text(bytes.begin(), bytes.end());
    if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos) {
      throw std::runtime_error("not a number: '" + text + "'");
    }
    auto* values = new float[3]{static_cast<float>(std::stoi(text)), 1000.0f + std::stoi(text),
                                static_cast<float>(item.epoch)};
    counter->add();
    return at::from_blob(
        values, {3},
        [counter](void* p) {
          delete[] static_cast<float*>(p);
          --counter->alive;
        },
        at::TensorOptions().dtype(at::kFloat));
  };
}

// n items in one class folder "c" (so dataset index i is file c/<i padded>.num).
struct NumberSet {
  TempDir tmp;
  std::shared_ptr<AliveCounter> counter = std::make_shared<AliveCounter>();
  std::string path(size_t i) const {
    char name[32];
    std::snprintf(name, sizeof name, "c/%05zu.num", i);
    return tmp.path + "/" + name;
  }
  explicit NumberSet(size_t n) {
    for (size_t i = 0; i < n; ++i) write_file(path(i), std::to_string(i));
  }
  ImageDataset dataset(int max_sleep_us) const {  // one class folder, .num files
    ImageFolderOptions o;
    o.extensions = {".num"};
    return make_image_folder(std::make_shared<LocalByteSource>(tmp.path), number_decoder(counter, max_sleep_us), o);
  }
};

}  // namespace chorus::data::testing
