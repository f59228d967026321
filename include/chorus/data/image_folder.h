// ImageFolder: root/<class>/**/<file> trees, listed exactly as torchvision 0.14's
// datasets.ImageFolder lists them.
//
//   auto source = std::make_shared<chorus::data::LocalByteSource>("/data/train");
//   auto train = chorus::data::make_image_folder(source, decode);   // decode: chorus/data/image_dataset.h
//   train.classes();            // sorted folder names; sample(i).label indexes them
//
// The listing (torchvision's find_classes + make_dataset with IMG_EXTENSIONS):
// - classes: the names of the directories directly under the root, sorted; class_to_idx maps each
//   to its position. Files directly under the root are ignored. No directory: DataError.
// - samples, class by class in that order: every file at any depth under the class directory whose
//   name ends, ignoring ASCII case, with one of the extensions; ordered by its directory's path,
//   then by file name (torchvision sorts os.walk's (root, dirs, files) tuples, i.e. by the full
//   directory path string, and then the file names). Strings compare by bytes, which for UTF-8 is
//   Python's code-point order. Other files are ignored.
// - a class directory holding no such file: DataError naming every such class folder and the
//   extensions (torchvision raises FileNotFoundError "Found no valid file for the classes ...").
// The listing is a pure function of the source's keys (ByteSource::list("")), so the same tree on
// local disk or in an object store lists the same.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "chorus/data/byte_source.h"
#include "chorus/data/image_dataset.h"

namespace chorus::data {

// torchvision's IMG_EXTENSIONS: .jpg .jpeg .png .ppm .bmp .pgm .tif .tiff .webp
const std::vector<std::string>& image_extensions();

struct ImageFolderOptions {
  std::vector<std::string> extensions = image_extensions();  // lower case, with the dot
  // Only these class folders, in this order (class index = position), e.g. half the classes for
  // pretraining and the other half for transfer. Empty: every folder, sorted (torchvision's). A
  // name with no folder is a DataError listing the folders found; a name twice, a UsageError.
  std::vector<std::string> classes;
};

struct ImageFolderListing {
  std::vector<std::string> classes;
  std::map<std::string, int64_t> class_to_idx;
  std::vector<std::pair<std::string, int64_t>> samples;  // (key, class index)
};

// Pure. `keys` as ByteSource::list("") returns them (directories end with '/'); `where` names the
// root in error messages.
ImageFolderListing list_image_folder(const std::vector<std::string>& keys, const std::string& where,
                                     const ImageFolderOptions& options = {});
// source.list("") listed as above, with source.describe("") as `where`.
ImageFolderListing list_image_folder(ByteSource& source, const ImageFolderOptions& options = {});

// The dataset of list_image_folder(*source, options): label = class index, classes = folder names.
ImageDataset make_image_folder(std::shared_ptr<ByteSource> source, DecodeFn decode,
                               const ImageFolderOptions& options = {});

}  // namespace chorus::data
