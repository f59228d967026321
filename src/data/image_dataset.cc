// ImageDataset: samples, their byte source and the decode function.
#include "chorus/data/image_dataset.h"

#include <ATen/ATen.h>

#include <exception>
#include <utility>

namespace chorus::data {

struct ImageDataset::State {
  std::shared_ptr<ByteSource> source;
  std::vector<ImageSample> samples;
  DecodeFn decode;
  std::vector<std::string> classes;
  bool multi_label = false;
};

ImageDataset::ImageDataset(std::shared_ptr<ByteSource> source, std::vector<ImageSample> samples, DecodeFn decode,
                           std::vector<std::string> classes) {
  if (!source) throw UsageError("ImageDataset: the byte source is null");
  if (!decode) throw UsageError("ImageDataset: the decode function is empty");
  auto state = std::make_shared<State>();
  state->multi_label = !samples.empty() && !samples.front().labels.empty();
  for (const auto& s : samples) {
    if (s.labels.empty() == state->multi_label || s.labels.size() != samples.front().labels.size()) {
      throw UsageError("ImageDataset: sample " + s.key +
                       " has a target of another kind than the first sample's: every sample needs a class index, "
                       "or every sample a 0/1 vector of the same length");
    }
  }
  state->source = std::move(source);
  state->samples = std::move(samples);
  state->decode = std::move(decode);
  state->classes = std::move(classes);
  state_ = std::move(state);
}

ImageDataset::ImageDataset(std::shared_ptr<const State> state) : state_(std::move(state)) {}

size_t ImageDataset::size() const { return state_->samples.size(); }

const ImageSample& ImageDataset::sample(size_t index) const {
  if (index >= state_->samples.size()) {
    throw UsageError("ImageDataset: index " + std::to_string(index) + " out of range for " +
                     std::to_string(state_->samples.size()) + " samples");
  }
  return state_->samples[index];
}

const std::vector<std::string>& ImageDataset::classes() const { return state_->classes; }
bool ImageDataset::multi_label() const { return state_->multi_label; }
ByteSource& ImageDataset::source() const { return *state_->source; }

at::Tensor ImageDataset::target(size_t index) const {
  const auto& s = sample(index);
  if (state_->multi_label) {
    return at::tensor(at::ArrayRef<float>(s.labels), at::TensorOptions().dtype(at::kFloat));
  }
  return at::scalar_tensor(s.label, at::TensorOptions().dtype(at::kLong));
}

const DecodeFn& ImageDataset::decode_function() const { return state_->decode; }

void ImageDataset::read_item(size_t index, int64_t epoch,
                             const std::function<void(const std::vector<uint8_t>&, const ItemInfo&)>& use) const {
  const auto& s = sample(index);
  try {
    const std::vector<uint8_t> bytes = state_->source->read(s.key);
    use(bytes, ItemInfo{static_cast<int64_t>(index), epoch, s.key});
  } catch (const SourceError&) {
    throw;  // the storage's failure, not this item's: kept apart for the loader (skip_bad)
  } catch (const std::exception& e) {
    // The source's own errors already start with the file; name it for the decoder's.
    const std::string where = state_->source->describe(s.key);
    const std::string what = e.what();
    throw DataError(what.compare(0, where.size(), where) == 0 ? what : where + ": " + what);
  }
}

torch::data::Example<> ImageDataset::get(size_t index, int64_t epoch) const {
  at::Tensor data;
  read_item(index, epoch, [&](const std::vector<uint8_t>& bytes, const ItemInfo& item) {
    data = state_->decode(bytes, item);
  });
  if (!data.defined()) {
    throw DataError(state_->source->describe(sample(index).key) + ": the decode function returned no tensor");
  }
  return {std::move(data), target(index)};
}

ImageDataset ImageDataset::subset(const std::vector<size_t>& indices) const {
  auto state = std::make_shared<State>(State{state_->source, {}, state_->decode, state_->classes, state_->multi_label});
  state->samples.reserve(indices.size());
  for (size_t i : indices) state->samples.push_back(sample(i));
  return ImageDataset(std::shared_ptr<const State>(std::move(state)));
}

}  // namespace chorus::data
