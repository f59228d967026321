// `chorus data render-fashion-mnist OUT_DIR`: writes Fashion-MNIST as an ImageFolder tree,
// OUT_DIR/{train,test}/<class>/<index>.png|jpg (index zero-padded to five digits, so file order is
// dataset order), and with --csv the same items as CSV datasets. A tiny IDX reader of its own keeps
// the `chorus` tool free of libtorch (examples/fashion_mnist reads IDX into tensors).
#include "render_fashion_mnist.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/data/image.h"
#include "chorus/data/image_transforms.h"
#include "idx_reader.h"

namespace chorus::tools {
namespace {

namespace fs = std::filesystem;

// Directory-safe class names, in label order.
constexpr std::array<const char*, 10> kClasses = {"T-shirt_top", "Trouser", "Pullover", "Dress", "Coat",
                                                  "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle_boot"};

// The multi-label CSV's columns, each a set of classes: a dress is upper and lower body at once.
struct Attribute {
  const char* name;
  std::array<bool, 10> of_class;
};
constexpr std::array<Attribute, 4> kAttributes = {{
    {"upper_body", {true, false, true, true, true, false, true, false, false, false}},
    {"lower_body", {false, true, false, true, false, false, false, false, false, false}},
    {"footwear", {false, false, false, false, false, true, false, true, false, true}},
    {"accessory", {false, false, false, false, false, false, false, false, true, false}},
}};

std::string zero_padded(int64_t i) {
  char digits[24];
  std::snprintf(digits, sizeof(digits), "%05lld", static_cast<long long>(i));
  return digits;
}

struct CsvOut {
  std::ofstream single;
  std::ofstream multi;
};

void open_csv(CsvOut& csv, const std::string& out_dir, const std::string& split) {
  const std::string single = out_dir + "/" + split + ".csv";
  const std::string multi = out_dir + "/" + split + "_multilabel.csv";
  csv.single.open(single);
  csv.multi.open(multi);
  if (!csv.single || !csv.multi) throw Error("cannot create " + single + " or " + multi + ": " + std::strerror(errno));
  csv.single << "path,label\n";
  csv.multi << "path";
  for (const auto& a : kAttributes) csv.multi << "," << a.name;
  csv.multi << ",group\n";
}

// Returns the number of files written.
int64_t render_split(const RenderArgs& args, bool train) {
  const std::string prefix = train ? "train" : "t10k";
  const std::string split = train ? "train" : "test";
  const Idx images = read_idx(args.data_dir, prefix + "-images-idx3-ubyte", 3);
  const Idx labels = read_idx(args.data_dir, prefix + "-labels-idx1-ubyte", 1);
  if (images.shape[0] != labels.shape[0]) {
    throw Error(args.data_dir + ": " + std::to_string(images.shape[0]) + " " + prefix + " images but " +
                std::to_string(labels.shape[0]) + " labels");
  }
  const auto n = static_cast<int64_t>(images.shape[0]);
  std::array<int64_t, 10> per_class{};  // --limit counts items per class, so no class folder is empty
  for (const char* c : kClasses) fs::create_directories(args.out_dir + "/" + split + "/" + c);
  CsvOut csv;
  if (args.csv) open_csv(csv, args.out_dir, split);
  const bool png = args.format != "jpeg";
  const bool jpeg = args.format != "png";
  int64_t written = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t label = labels.data[static_cast<size_t>(i)];
    if (label > 9) throw Error(args.data_dir + ": label " + std::to_string(label) + " at item " + std::to_string(i));
    if (args.limit >= 0 && per_class[label] >= args.limit) continue;
    ++per_class[label];
    data::Image img(28, 28, 1);
    std::memcpy(img.pixels.data(), images.data.data() + i * 28 * 28, 28 * 28);
    if (args.size != 28) img = data::resize(img, args.size, args.size);
    const std::string stem = split + "/" + kClasses[label] + "/" + zero_padded(i);
    for (int k = 0; k < 2; ++k) {
      if (!(k == 0 ? png : jpeg)) continue;
      const std::string rel = stem + (k == 0 ? ".png" : ".jpg");
      data::write_file(args.out_dir + "/" + rel, k == 0 ? data::encode_png(img) : data::encode_jpeg(img, args.quality));
      ++written;
      if (!args.csv) continue;
      csv.single << rel << "," << int{label} << "\n";
      csv.multi << rel;
      for (const auto& a : kAttributes) csv.multi << "," << (a.of_class[label] ? 1 : 0);
      csv.multi << "," << i / 10 << "\n";
    }
  }
  if (args.csv && (!csv.single.flush() || !csv.multi.flush())) throw Error("cannot write the CSV files in " + args.out_dir);
  return written;
}

}  // namespace

void add_render_options(CLI::App& app, RenderArgs& args) {
  app.add_option("OUT_DIR", args.out_dir, "output directory: OUT_DIR/{train,test}/<class>/<index>.png|jpg")
      ->required();
  app.add_option("--data", args.data_dir, "directory of the IDX files (gzipped or not)")->capture_default_str();
  app.add_option("--size", args.size, "side in pixels: 28 as stored, 64 or 224 upscaled (bilinear, as PIL)")
      ->check(CLI::IsMember({28, 64, 224}))
      ->capture_default_str();
  app.add_option("--format", args.format, "png, jpeg, or both (each item twice, as .png and .jpg)")
      ->check(CLI::IsMember({"png", "jpeg", "both"}))
      ->capture_default_str();
  app.add_option("--limit", args.limit, "the first N items of each class in each split (default: all)")->check(CLI::NonNegativeNumber);
  app.add_flag("--csv", args.csv,
               "also write OUT_DIR/{train,test}.csv (path,label) and {train,test}_multilabel.csv "
               "(path,upper_body,lower_body,footwear,accessory,group; 0/1 columns, group = index / 10)");
  app.add_option("--quality", args.quality, "JPEG quality")->check(CLI::Range(1, 100))->capture_default_str();
}

void add_pairs_options(CLI::App& app, PairsArgs& args) {
  app.add_option("OUT_DIR", args.out_dir, "output directory: OUT_DIR/pairs.csv and OUT_DIR/pairs/<index>.png|jpg")
      ->required();
  app.add_option("--data", args.data_dir, "directory of the IDX files (gzipped or not)")->capture_default_str();
  app.add_option("--count", args.count, "pairs to write (items 2i and 2i+1 of the training split make pair i)")
      ->check(CLI::Range(int64_t{1}, int64_t{30000}))
      ->capture_default_str();
  app.add_option("--size", args.size, "each item's side in pixels (28, 64 or 224); the image is SIZE x 2*SIZE")
      ->check(CLI::IsMember({28, 64, 224}))
      ->capture_default_str();
  app.add_option("--format", args.format, "png or jpeg")->check(CLI::IsMember({"png", "jpeg"}))->capture_default_str();
  app.add_option("--per-group", args.per_group, "consecutive pairs that share a group value (a 'patient')")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--quality", args.quality, "JPEG quality")->check(CLI::Range(1, 100))->capture_default_str();
}

// Pair i: items 2i and 2i+1 of the training split (whose order is already random), left and
// right. Its labels: 1 for each of the two items' classes (one class when both share it).
int run_render_fashion_mnist_pairs(const PairsArgs& args) {
  const Idx images = read_idx(args.data_dir, "train-images-idx3-ubyte", 3);
  const Idx labels = read_idx(args.data_dir, "train-labels-idx1-ubyte", 1);
  const auto available = static_cast<int64_t>(std::min(images.shape[0], labels.shape[0]) / 2);
  if (args.count > available) {
    throw Error(args.data_dir + ": --count " + std::to_string(args.count) + " needs " +
                std::to_string(2 * args.count) + " training items; there are " + std::to_string(2 * available));
  }
  fs::create_directories(args.out_dir + "/pairs");
  const std::string csv_path = args.out_dir + "/pairs.csv";
  std::ofstream csv(csv_path);
  if (!csv) throw Error("cannot create " + csv_path + ": " + std::strerror(errno));
  csv << "path";
  for (const char* c : kClasses) csv << "," << c;
  csv << ",patient\n";
  const int s = args.size;
  for (int64_t i = 0; i < args.count; ++i) {
    data::Image pair(s, 2 * s, 1);
    std::array<bool, 10> present{};
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t item = 2 * i + half;
      const uint8_t label = labels.data[static_cast<size_t>(item)];
      if (label > 9) throw Error(args.data_dir + ": label " + std::to_string(label) + " at item " + std::to_string(item));
      present[label] = true;
      data::Image img(28, 28, 1);
      std::memcpy(img.pixels.data(), images.data.data() + item * 28 * 28, 28 * 28);
      if (s != 28) img = data::resize(img, s, s);
      for (int y = 0; y < s; ++y) {
        std::memcpy(pair.pixels.data() + (static_cast<size_t>(y) * 2 * s + static_cast<size_t>(half * s)),
                    img.pixels.data() + static_cast<size_t>(y) * s, static_cast<size_t>(s));
      }
    }
    const std::string rel = "pairs/" + zero_padded(i) + (args.format == "png" ? ".png" : ".jpg");
    data::write_file(args.out_dir + "/" + rel,
                     args.format == "png" ? data::encode_png(pair) : data::encode_jpeg(pair, args.quality));
    csv << rel;
    for (bool p : present) csv << "," << (p ? 1 : 0);
    csv << ",p" << zero_padded(i / args.per_group) << "\n";
  }
  if (!csv.flush()) throw Error("cannot write " + csv_path);
  std::printf("chorus data render-fashion-mnist-pairs: wrote %lld pairs (%dx%d, %s) and %s\n",
              static_cast<long long>(args.count), s, 2 * s, args.format.c_str(), csv_path.c_str());
  return 0;
}

int run_render_fashion_mnist(const RenderArgs& args) {
  fs::create_directories(args.out_dir);
  const int64_t train = render_split(args, true);
  const int64_t test = render_split(args, false);
  std::printf("chorus data render-fashion-mnist: wrote %lld train and %lld test images (%dx%d, %s) to %s\n",
              static_cast<long long>(train), static_cast<long long>(test), args.size, args.size, args.format.c_str(),
              args.out_dir.c_str());
  return 0;
}

}  // namespace chorus::tools
