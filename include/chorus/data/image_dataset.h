// ImageDataset: a list of samples (key + target), the ByteSource their bytes come from and the
// function that decodes one item's bytes into a tensor. Made by make_image_folder
// (chorus/data/image_folder.h) or make_csv_dataset (chorus/data/csv_dataset.h); loaded in parallel
// by ParallelLoader (chorus/data/loader.h).
//
//   chorus::data::DecodeFn decode = [](const std::vector<uint8_t>& bytes, const chorus::data::ItemInfo& item) {
//     return my_transform(my_decode(bytes), /*seed=*/item.index * 1000003 + item.epoch);
//   };
//   auto train = chorus::data::make_image_folder(source, decode);
//   torch::data::Example<> first = train.get(0);   // {data, target}, on the calling thread
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/data/example.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "chorus/data/byte_source.h"

namespace chorus::data {

// What a decode function knows about the item it decodes: its dataset index and the epoch (for
// augmentations that must differ per epoch yet repeat on a resumed run), and its key (for messages).
struct ItemInfo {
  int64_t index = 0;
  int64_t epoch = 0;
  const std::string& key;
};

// Bytes of one item -> its data tensor (e.g. a C x H x W image after transforms). Called
// concurrently from a loader's decode threads: it must be thread-safe. A failure is an exception
// (any std::exception); the loader reports it with the item's key. Every item of a batch must come
// out with the same shape (they are stacked).
using DecodeFn = std::function<at::Tensor(const std::vector<uint8_t>& bytes, const ItemInfo& item)>;

struct ImageSample {
  std::string key;            // in the dataset's ByteSource
  int64_t label = 0;          // class index, for a single-label dataset
  std::vector<float> labels;  // 0/1 per class, for a multi-label dataset (then `label` is unused)
  std::string group;          // a CSV's group column ("" without one): see grouped_split
};

// Immutable after construction; copies share the samples, the source and the decode function, so
// a copy is cheap and any number of threads may call get() at once (if the source and the decode
// function are thread-safe, as their contracts require).
class ImageDataset {
 public:
  // Throws UsageError for a null source or decode function, or when the samples mix single- and
  // multi-label targets or multi-label targets of different lengths.
  ImageDataset(std::shared_ptr<ByteSource> source, std::vector<ImageSample> samples, DecodeFn decode,
               std::vector<std::string> classes = {});

  size_t size() const;
  const ImageSample& sample(size_t index) const;
  // Class names, by class index (ImageFolder: the folder names; CSV: the label columns of a
  // multi-label dataset; empty for a single-label CSV).
  const std::vector<std::string>& classes() const;
  bool multi_label() const;
  ByteSource& source() const;

  // Item `index`'s target: a 0-dim int64 class index, or a float vector of 0/1 per class.
  at::Tensor target(size_t index) const;
  // Item `index` read and decoded on the calling thread for `epoch`: {data, target}. Throws
  // DataError whose message starts with source().describe(key), then the reader's or decoder's
  // error; UsageError for an index out of range.
  torch::data::Example<> get(size_t index, int64_t epoch = 0) const;

  // The decode function given at construction (ParallelLoader recognises image_decoder's in it).
  const DecodeFn& decode_function() const;
  // Item `index` read on the calling thread and its bytes given to `use`, with the ItemInfo of
  // `epoch`, in place of the decode function: for a loader that decodes items itself (straight
  // into a batch). Whatever `use` or the read throws is named as get() names it.
  void read_item(size_t index, int64_t epoch,
                 const std::function<void(const std::vector<uint8_t>& bytes, const ItemInfo& item)>& use) const;

  // The samples at `indices` (in that order), with the same source, decode function and classes.
  ImageDataset subset(const std::vector<size_t>& indices) const;

 private:
  struct State;
  explicit ImageDataset(std::shared_ptr<const State> state);
  std::shared_ptr<const State> state_;
};

}  // namespace chorus::data
