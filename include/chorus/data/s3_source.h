// S3ByteSource: a dataset's files in an S3 bucket (Amazon S3 or an S3-compatible server), behind the
// same ByteSource interface as a local directory; and S3ImageFolder, dask-pytorch-ddp's dataset.
//
//   auto decode = chorus::data::image_decoder(pipeline);               // chorus/data/image_tensor.h
//   auto train = chorus::data::make_s3_image_folder("s3://my-bucket/train/", decode);   // AWS_* variables
//   // or, for any location, local or not:
//   auto source = chorus::data::open_source(argv[1]);                 // "s3://b/p/" or "/data/train"
//   auto listed = chorus::data::make_image_folder(source, decode);
//   auto labelled = chorus::data::make_csv_dataset(source, "train.csv", decode, csv_options);
//
// Contract:
// - Keys are relative to the url's prefix: s3://b/data/ and key "cat/1.jpg" read object
//   "data/cat/1.jpg". A prefix without a trailing '/' gets one ("s3://b/data" is the folder data/),
//   so a sibling "data2/..." is never part of the dataset.
// - list(prefix) is one paged ListObjectsV2 (S3Client::list). S3 has no directories: the listing
//   holds objects (and the "dir/" folder markers some tools write), so an ImageFolder over S3 finds
//   its classes from the keys; an empty class folder without a marker is simply not seen.
// - read(key) is one GET (retries and deadline as S3Options says), or none when the client's cache
//   directory holds the object. Cached objects are checked against the listed ETag and size: after
//   list() (an ImageFolder lists first), or, for a dataset that never lists (a CSV), by one listing
//   of the whole prefix before the first cached read. Without a cache directory nothing is listed.
// - Errors: an object that is missing (deleted after it was listed, or a wrong path in a CSV) is a
//   DataError about that item, which LoaderOptions::skip_bad may skip. A failure of the storage
//   itself (endpoint down, timeouts, 5xx after the retries, access denied) is a SourceError: the
//   loader fails the batch even with skip_bad, because every later item would fail the same way.
//   Both name the object (s3://bucket/key) first, then the S3Client's message (endpoint, status,
//   attempts, the likely fix).
// - Thread-safe: the loader's decode threads call read() concurrently; each call is one request
//   on one of the client's pooled connections, so `LoaderOptions::threads` is also the number of
//   GETs in flight.
// - Cache across ranks: ranks on one host that share S3Options::cache_dir share the files, so from
//   the second epoch on a host reads locally every object any of its ranks has read. (Ranks on other
//   hosts keep their own caches: with a shuffling sampler a host meets objects it has not read yet
//   until it has seen the whole dataset.)
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "chorus/data/byte_source.h"
#include "chorus/data/image_folder.h"
#include "chorus/data/s3.h"

namespace chorus::data {

class S3ByteSource : public ByteSource {
 public:
  // A client of its own. Throws UsageError for a url that is not s3://BUCKET[/PREFIX] and S3Error
  // (kNoCredentials) without credentials.
  explicit S3ByteSource(const std::string& url, S3Options options = S3Options::from_env());
  // A shared client (its cache, connections and counters), e.g. for the train and val prefixes.
  S3ByteSource(std::shared_ptr<S3Client> client, const std::string& url);

  std::vector<uint8_t> read(const std::string& key) override;
  std::vector<std::string> list(const std::string& prefix) override;
  std::string describe(const std::string& key) const override;  // s3://bucket/prefix/key

  const std::string& bucket() const { return bucket_; }
  const std::string& prefix() const { return prefix_; }  // "" or ending in '/'
  S3Client& client() const { return *client_; }

 private:
  void remember(const std::vector<S3Object>& objects);
  std::shared_ptr<S3Client> client_;
  std::string bucket_;
  std::string prefix_;
  std::mutex listing_mutex_;  // one listing at a time when read() lists for the cache
  std::mutex mutex_;          // listed_all_, objects_
  bool listed_all_ = false;
  std::unordered_map<std::string, S3Object> objects_;  // by full object key, from listings
};

// A ByteSource for `location`: S3ByteSource for "s3://BUCKET/PREFIX" (S3Options::from_env()),
// LocalByteSource for a directory path. Throws as their constructors do.
std::shared_ptr<ByteSource> open_source(const std::string& location);
std::shared_ptr<ByteSource> open_source(const std::string& location, const S3Options& s3_options);

// dask-pytorch-ddp's S3ImageFolder: make_image_folder over S3ByteSource(url, s3_options).
ImageDataset make_s3_image_folder(const std::string& url, DecodeFn decode,
                                  const S3Options& s3_options = S3Options::from_env(),
                                  const ImageFolderOptions& options = {});

}  // namespace chorus::data
