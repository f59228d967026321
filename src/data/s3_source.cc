// S3ByteSource: ByteSource over S3Client; open_source and make_s3_image_folder.
#include "chorus/data/s3_source.h"

#include <utility>

namespace chorus::data {
namespace {

// A missing object is the item's problem (skippable); anything else is the storage's.
[[noreturn]] void rethrow_as_data_error(const S3Error& e, const std::string& where) {
  const std::string what = where + ": " + e.what();
  if (e.kind() == S3Error::Kind::kNoSuchKey) throw DataError(what);
  throw SourceError(what);
}

}  // namespace

S3ByteSource::S3ByteSource(const std::string& url, S3Options options)
    : S3ByteSource(std::make_shared<S3Client>(std::move(options)), url) {}

S3ByteSource::S3ByteSource(std::shared_ptr<S3Client> client, const std::string& url) : client_(std::move(client)) {
  if (!client_) throw UsageError("S3ByteSource: the S3Client is null");
  S3Url parsed = parse_s3_url(url);
  bucket_ = std::move(parsed.bucket);
  prefix_ = std::move(parsed.prefix);
  if (!prefix_.empty() && prefix_.back() != '/') prefix_ += '/';
}

std::string S3ByteSource::describe(const std::string& key) const { return "s3://" + bucket_ + "/" + prefix_ + key; }

void S3ByteSource::remember(const std::vector<S3Object>& objects) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const S3Object& o : objects) objects_[o.key] = o;
}

std::vector<std::string> S3ByteSource::list(const std::string& prefix) {
  std::vector<S3Object> objects;
  try {
    objects = client_->list(S3Url{bucket_, prefix_ + prefix});
  } catch (const S3Error& e) {
    // An empty prefix is a wrong path, as a missing local directory is: S3's message says how.
    if (e.kind() == S3Error::Kind::kEmptyListing) throw DataError(describe(prefix) + ": " + e.what());
    rethrow_as_data_error(e, describe(prefix));
  }
  remember(objects);
  if (prefix.empty()) {
    std::lock_guard<std::mutex> lock(mutex_);
    listed_all_ = true;
  }
  std::vector<std::string> keys;
  keys.reserve(objects.size());
  for (const S3Object& o : objects) keys.push_back(o.key.substr(prefix_.size()));
  return keys;
}

std::vector<uint8_t> S3ByteSource::read(const std::string& key) {
  const std::string object_key = prefix_ + key;
  // With a cache, a cached copy is trusted only for the listed ETag and size: list the dataset's
  // prefix once if nothing has listed it (a CSV dataset), rather than serve a stale copy.
  const bool cached = !client_->options().cache_dir.empty();
  if (cached) {
    bool need_listing = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      need_listing = !listed_all_ && objects_.count(object_key) == 0;
    }
    if (need_listing) {
      std::lock_guard<std::mutex> once(listing_mutex_);
      bool still = false;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        still = !listed_all_;
      }
      if (still) list("");
    }
  }
  try {
    if (cached) {
      S3Object object;
      bool known = false;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = objects_.find(object_key);
        if (it != objects_.end()) {
          object = it->second;
          known = true;
        }
      }
      // Not in the listing: added since, or a wrong path; the GET says which.
      if (known) return client_->get(bucket_, object);
    }
    return client_->get(bucket_, object_key);
  } catch (const S3Error& e) {
    rethrow_as_data_error(e, describe(key));
  }
}

std::shared_ptr<ByteSource> open_source(const std::string& location) {
  if (location.rfind("s3://", 0) == 0) return std::make_shared<S3ByteSource>(location, S3Options::from_env());
  return std::make_shared<LocalByteSource>(location);
}

std::shared_ptr<ByteSource> open_source(const std::string& location, const S3Options& s3_options) {
  if (location.rfind("s3://", 0) == 0) return std::make_shared<S3ByteSource>(location, s3_options);
  return std::make_shared<LocalByteSource>(location);
}

ImageDataset make_s3_image_folder(const std::string& url, DecodeFn decode, const S3Options& s3_options,
                                  const ImageFolderOptions& options) {
  return make_image_folder(std::make_shared<S3ByteSource>(url, s3_options), std::move(decode), options);
}

}  // namespace chorus::data
