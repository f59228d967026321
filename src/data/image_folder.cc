// ImageFolder listing: torchvision 0.14's find_classes + make_dataset over a source's keys.
#include "chorus/data/image_folder.h"

#include <algorithm>
#include <set>
#include <utility>

namespace chorus::data {
namespace {

// has_file_allowed_extension: Python lower-cases the whole name; for these ASCII extensions only
// ASCII letters can match, so ASCII lower-casing decides the same.
bool has_extension(const std::string& name, const std::vector<std::string>& extensions) {
  std::string lower = name;
  for (auto& c : lower) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  for (const auto& ext : extensions) {
    if (lower.size() >= ext.size() && lower.compare(lower.size() - ext.size(), ext.size(), ext) == 0) return true;
  }
  return false;
}

std::string join(const std::vector<std::string>& items, const std::string& separator) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? separator : "") + items[i];
  return out;
}

}  // namespace

const std::vector<std::string>& image_extensions() {
  static const std::vector<std::string> extensions = {".jpg", ".jpeg", ".png",  ".ppm", ".bmp",
                                                      ".pgm", ".tif",  ".tiff", ".webp"};
  return extensions;
}

ImageFolderListing list_image_folder(const std::vector<std::string>& keys, const std::string& where,
                                     const ImageFolderOptions& options) {
  ImageFolderListing out;
  // find_classes: the directories directly under the root (a key "a/..." implies directory a).
  std::set<std::string> classes;
  for (const auto& key : keys) {
    const auto slash = key.find('/');
    if (slash != std::string::npos && slash > 0) classes.insert(key.substr(0, slash));
  }
  if (classes.empty()) throw DataError("ImageFolder: couldn't find any class folder in " + where);
  const std::string root = !where.empty() && where.back() == '/' ? where : where + "/";
  if (options.classes.empty()) {
    out.classes.assign(classes.begin(), classes.end());
  } else {
    std::vector<std::string> missing;
    std::set<std::string> chosen;
    for (const auto& name : options.classes) {
      if (!chosen.insert(name).second) throw UsageError("ImageFolder: class '" + name + "' is chosen twice");
      if (classes.count(name) == 0) missing.push_back(name);
    }
    if (!missing.empty()) {
      throw DataError("ImageFolder: no class folder " + join(missing, ", ") + " in " + where + " (it has " +
                      join(std::vector<std::string>(classes.begin(), classes.end()), ", ") + ")");
    }
    out.classes = options.classes;
  }
  for (size_t i = 0; i < out.classes.size(); ++i) out.class_to_idx[out.classes[i]] = static_cast<int64_t>(i);

  // make_dataset: per class, files ordered by (directory path, file name), as sorted(os.walk()).
  std::vector<std::vector<std::pair<std::string, std::string>>> files(out.classes.size());
  for (const auto& key : keys) {
    if (key.empty() || key.back() == '/') continue;  // a directory
    const auto first = key.find('/');
    if (first == std::string::npos || first == 0) continue;  // a file directly under the root
    const auto last = key.rfind('/');
    if (!has_extension(key.substr(last + 1), options.extensions)) continue;
    const auto cls = out.class_to_idx.find(key.substr(0, first));
    if (cls == out.class_to_idx.end()) continue;  // a class left out by ImageFolderOptions::classes
    files[static_cast<size_t>(cls->second)].emplace_back(key.substr(0, last), key.substr(last + 1));
  }
  std::vector<std::string> empty;
  for (size_t c = 0; c < files.size(); ++c) {
    auto& list = files[c];
    if (list.empty()) empty.push_back(root + out.classes[c]);
    std::sort(list.begin(), list.end());
    for (auto& [dir, name] : list) out.samples.emplace_back(dir + "/" + name, static_cast<int64_t>(c));
  }
  if (!empty.empty()) {
    throw DataError("ImageFolder: found no valid file for the classes " + join(empty, ", ") +
                    " (torchvision raises the same). Supported extensions are: " + join(options.extensions, ", ") +
                    ". Add images to these folders or remove them");
  }
  return out;
}

ImageFolderListing list_image_folder(ByteSource& source, const ImageFolderOptions& options) {
  return list_image_folder(source.list(""), source.describe(""), options);
}

ImageDataset make_image_folder(std::shared_ptr<ByteSource> source, DecodeFn decode, const ImageFolderOptions& options) {
  if (!source) throw UsageError("make_image_folder: the byte source is null");
  auto listing = list_image_folder(*source, options);
  std::vector<ImageSample> samples;
  samples.reserve(listing.samples.size());
  for (auto& [key, label] : listing.samples) samples.push_back(ImageSample{std::move(key), label, {}, {}});
  return ImageDataset(std::move(source), std::move(samples), std::move(decode), std::move(listing.classes));
}

}  // namespace chorus::data
