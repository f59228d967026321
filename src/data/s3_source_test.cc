// Datasets in an S3 bucket (S3ByteSource, make_s3_image_folder, CSV over S3) through the
// ParallelLoader, against s3rver on loopback (tests/s3): the same items and pixels as the same
// files on local disk; W=2 ranks read every image exactly once per epoch (counted by the server)
// and the second epoch from a shared cache with no GET; a server answering 503 and one killed
// mid-epoch; an object deleted after the listing.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <set>
#include <thread>

#include "chorus/data/csv_dataset.h"
#include "chorus/data/image.h"
#include "chorus/data/image_tensor.h"
#include "chorus/data/loader.h"
#include "chorus/data/s3_source.h"
#include "chorus/data/sampler.h"
#include "data_test_util.h"
#include "s3_test_server.h"
#include "testing.h"

namespace chorus::data {
namespace {

using namespace s3_testing;

// A small ImageFolder tree: 3 classes x 8 images (PNG and JPEG, gray and RGB, one class nested a
// level deeper), all 12x10 so that batches stack.
struct Tree {
  std::vector<std::pair<std::string, std::vector<uint8_t>>> files;  // key under the root, bytes
  Tree() {
    const std::vector<std::string> dirs = {"ant/", "bee/", "cat/deep/"};
    for (size_t c = 0; c < dirs.size(); ++c) {
      for (int i = 0; i < 8; ++i) {
        Image image;
        image.height = 12;
        image.width = 10;
        image.channels = (i % 2 == 0) ? 3 : 1;
        image.pixels.resize(static_cast<size_t>(image.height * image.width * image.channels));
        for (size_t p = 0; p < image.pixels.size(); ++p) image.pixels[p] = static_cast<uint8_t>(p * 7 + c * 50 + i * 13);
        const bool png = i % 3 != 0;
        files.emplace_back(dirs[c] + std::to_string(i) + (png ? ".png" : ".jpg"),
                           png ? encode_png(image) : encode_jpeg(image, 90));
      }
    }
  }
  void upload(S3Client& client, const std::string& prefix) const {
    for (const auto& [key, bytes] : files) client.put(kBucket, prefix + key, bytes);
  }
  void write(const std::string& root) const {
    for (const auto& [key, bytes] : files) {
      std::filesystem::create_directories(std::filesystem::path(root + "/" + key).parent_path());
      std::ofstream(root + "/" + key, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()),
                                                              static_cast<std::streamsize>(bytes.size()));
    }
  }
};

DecodeFn decoder() {
  return image_decoder(ImagePipeline().random_horizontal_flip().normalise({0.5f, 0.5f, 0.5f}, {0.25f, 0.25f, 0.25f}),
                       ImageMode::kRGB, /*seed=*/7);
}

LoaderOptions loader_options(bool skip_bad = false) {
  LoaderOptions o;
  o.batch_size = 5;
  o.threads = 3;
  o.skip_bad = skip_bad;
  return o;
}

// A loader over the whole dataset on one rank (a shuffling DistributedSampler of 1 replica).
ParallelLoader<DistributedSampler> one_rank_loader(const ImageDataset& dataset, LoaderOptions options,
                                                   bool shuffle = true) {
  DistributedSamplerOptions so;
  so.num_replicas = 1;
  so.rank = 0;
  so.shuffle = shuffle;
  return ParallelLoader(dataset, DistributedSampler(static_cast<int64_t>(dataset.size()), so), options);
}

// Every batch of one pass, as (data, target) pairs.
template <typename Loader>
std::vector<torch::data::Example<>> one_pass(Loader& loader) {
  std::vector<torch::data::Example<>> batches;
  for (auto& batch : loader) batches.push_back(batch);
  return batches;
}

void expect_same_batches(const std::vector<torch::data::Example<>>& a, const std::vector<torch::data::Example<>>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(at::equal(a[i].data, b[i].data)) << "batch " << i;
    EXPECT_TRUE(at::equal(a[i].target, b[i].target)) << "batch " << i;
  }
}

class S3SourceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new S3rver();
    S3Client client(server_->options());
    tree_ = new Tree();
    tree_->upload(client, "train/");
    client.put(kBucket, "train2/ant/x.png", tree_->files[0].second);  // a sibling prefix, not part of train/
  }
  static void TearDownTestSuite() {
    delete server_;
    delete tree_;
  }
  void SetUp() override { local_.emplace(); }
  std::string local_root() {
    std::string root = local_->path + "/train";
    if (!std::filesystem::exists(root)) tree_->write(root);
    return root;
  }
  static S3rver* server_;
  static Tree* tree_;
  std::optional<testing::TempDir> local_;
};
S3rver* S3SourceTest::server_ = nullptr;
Tree* S3SourceTest::tree_ = nullptr;

TEST_F(S3SourceTest, ImageFolderOverS3EqualsTheLocalTree) {
  auto s3 = make_s3_image_folder(std::string("s3://") + kBucket + "/train", decoder(), server_->options());
  auto local = make_image_folder(std::make_shared<LocalByteSource>(local_root()), decoder());
  EXPECT_EQ(s3.classes(), (std::vector<std::string>{"ant", "bee", "cat"}));
  EXPECT_EQ(s3.classes(), local.classes());
  ASSERT_EQ(s3.size(), 24u);  // train2/ is not under train/
  for (size_t i = 0; i < s3.size(); ++i) {
    EXPECT_EQ(s3.sample(i).key, local.sample(i).key);
    EXPECT_EQ(s3.sample(i).label, local.sample(i).label);
  }
  EXPECT_EQ(s3.source().describe("ant/1.png"), std::string("s3://") + kBucket + "/train/ant/1.png");
  auto from_s3 = one_rank_loader(s3, loader_options());
  auto from_disk = one_rank_loader(local, loader_options());
  expect_same_batches(one_pass(from_s3), one_pass(from_disk));
}

// The check: a full epoch at W=2 reads every image exactly once across the ranks (counted by
// the server), and the second epoch, whose shuffle gives each rank images the other rank read,
// comes from the ranks' shared cache directory with no GET.
TEST_F(S3SourceTest, TwoRanksReadEveryImageOncePerEpochThenFromTheSharedCache) {
  testing::TempDir cache;
  const std::string root = local_root();
  const S3Options options = [&] {
    S3Options o = server_->options();
    o.cache_dir = cache.path;
    return o;
  }();
  const std::map<std::string, int> before = server_->served_gets();
  const std::string failure = chorus::testing::run_ranks(2, [&](int rank, int world, std::shared_ptr<Store> store) {
    auto client = std::make_shared<S3Client>(options);
    auto s3 = make_image_folder(std::make_shared<S3ByteSource>(client, std::string("s3://") + kBucket + "/train/"),
                                decoder());
    auto local = make_image_folder(std::make_shared<LocalByteSource>(root), decoder());
    DistributedSamplerOptions so;
    so.num_replicas = world;
    so.rank = rank;
    so.seed = 3;
    ParallelLoader from_s3(s3, DistributedSampler(static_cast<int64_t>(s3.size()), so), loader_options());
    ParallelLoader from_disk(local, DistributedSampler(static_cast<int64_t>(local.size()), so), loader_options());
    std::set<int64_t> read_in_epoch0;
    for (int64_t epoch = 0; epoch < 2; ++epoch) {
      from_s3.sampler().set_epoch(epoch);
      from_disk.sampler().set_epoch(epoch);
      const S3Stats start = client->stats();
      expect_same_batches(one_pass(from_s3), one_pass(from_disk));
      const S3Stats end = client->stats();
      const auto mine = from_s3.sampler().indices();
      if (epoch == 0) {
        EXPECT_EQ(end.get_requests - start.get_requests, mine.size()) << "rank " << rank;
        read_in_epoch0.insert(mine.begin(), mine.end());
        // Both ranks have cached their share before either starts epoch 1.
        if (store->add("epoch0-done", 1) == world) store->set("epoch0-all", "1");
        store->wait({"epoch0-all"}, std::chrono::seconds(30));
      } else {
        EXPECT_EQ(end.get_requests - start.get_requests, 0u) << "rank " << rank;
        EXPECT_EQ(end.cache_hits - start.cache_hits, mine.size()) << "rank " << rank;
        const bool reads_the_other_ranks = std::any_of(mine.begin(), mine.end(), [&](int64_t i) {
          return read_in_epoch0.count(i) == 0;
        });
        EXPECT_TRUE(reads_the_other_ranks) << "the shuffle kept rank " << rank << "'s share: the test shows nothing";
      }
    }
    if (::testing::Test::HasFailure()) throw std::runtime_error("rank " + std::to_string(rank) + " failed");
  });
  ASSERT_EQ(failure, "");
  std::map<std::string, int> after = server_->served_gets();
  int images = 0;
  for (const auto& [key, bytes] : tree_->files) {
    const std::string path = std::string("/") + kBucket + "/train/" + key;
    const int earlier = before.count(path) != 0 ? before.at(path) : 0;
    EXPECT_EQ(after[path] - earlier, 1) << path;
    ++images;
  }
  int total = 0;
  for (const auto& [path, n] : after) total += n - (before.count(path) ? before.at(path) : 0);
  EXPECT_EQ(total, images);  // over both epochs: nothing but the 24 first reads
}

TEST_F(S3SourceTest, CsvDatasetOverS3ReadsItsCsvAndImagesFromTheBucket) {
  std::string csv = "path,label\n";
  for (size_t i = 0; i < tree_->files.size(); i += 3) csv += tree_->files[i].first + "," + std::to_string(i % 4) + "\n";
  csv += "ant/missing.png,1\n";
  S3Client(server_->options()).put(kBucket, "train/labels.csv", std::vector<uint8_t>(csv.begin(), csv.end()));
  testing::TempDir cache;
  S3Options o = server_->options();
  o.cache_dir = cache.path;
  auto client = std::make_shared<S3Client>(o);
  auto source = std::make_shared<S3ByteSource>(client, std::string("s3://") + kBucket + "/train");
  auto s3 = make_csv_dataset(source, "labels.csv", decoder());
  testing::write_file(local_root() + "/labels.csv", csv);
  auto local = make_csv_dataset(std::make_shared<LocalByteSource>(local_root()), "labels.csv", decoder());
  ASSERT_EQ(s3.size(), 9u);
  for (size_t i = 0; i < s3.size(); ++i) EXPECT_EQ(s3.sample(i).label, local.sample(i).label);
  auto from_s3 = one_rank_loader(s3, loader_options(true));
  auto from_disk = one_rank_loader(local, loader_options(true));
  for (int epoch = 0; epoch < 2; ++epoch) {
    const S3Stats start = client->stats();
    expect_same_batches(one_pass(from_s3), one_pass(from_disk));
    const S3Stats end = client->stats();
    // The missing image is one GET (404, not retried) each epoch; the 8 others are read once, then cached.
    EXPECT_EQ(end.get_requests - start.get_requests, epoch == 0 ? 9u : 1u) << "epoch " << epoch;
  }
  // The CSV was read, and the prefix listed once for the cache's ETags.
  EXPECT_EQ(client->stats().list_requests, 1u);
  EXPECT_EQ(from_s3.stats().bad_items, 2);
  EXPECT_NE(from_s3.stats().first_bad.find(std::string("s3://") + kBucket + "/train/ant/missing.png: "),
            std::string::npos)
      << from_s3.stats().first_bad;
  EXPECT_NE(from_s3.stats().first_bad.find("NoSuchKey"), std::string::npos) << from_s3.stats().first_bad;
}

TEST_F(S3SourceTest, ObjectDeletedAfterTheListingFailsItsBatchNamingIt) {
  S3Client admin(server_->options());
  tree_->upload(admin, "gone/");
  auto s3 = make_s3_image_folder(std::string("s3://") + kBucket + "/gone/", decoder(), server_->options());
  admin.remove(kBucket, "gone/bee/4.png");
  auto loader = one_rank_loader(s3, loader_options(), /*shuffle=*/false);
  std::string error;
  int good_batches = 0;
  try {
    for (auto& batch : loader) {
      (void)batch;
      ++good_batches;
    }
  } catch (const SourceError& e) {
    ADD_FAILURE() << "a missing object is the item's error, not the storage's: " << e.what();
  } catch (const DataError& e) {
    error = e.what();
  }
  EXPECT_EQ(good_batches, 2);  // batches 0 and 1; item 12 is in batch 2
  EXPECT_NE(error.find(std::string("s3://") + kBucket + "/gone/bee/4.png: "), std::string::npos) << error;
  EXPECT_NE(error.find("HTTP 404"), std::string::npos) << error;
  EXPECT_NE(error.find("dataset index 12"), std::string::npos) << error;  // bee's 5th item, 8 + 4
}

TEST(S3SourceServer, SlowDownAnswersAreRetriedAndEveryImageArrives) {
  S3rver server(/*fail_first=*/2);
  Tree tree;
  {
    S3Client admin(server.options());
    tree.upload(admin, "train/");
  }
  testing::TempDir local;
  tree.write(local.path);
  S3Options o = server.options();
  o.max_attempts = 4;
  auto s3 = make_s3_image_folder(std::string("s3://") + kBucket + "/train/", decoder(), o);
  auto disk = make_image_folder(std::make_shared<LocalByteSource>(local.path), decoder());
  auto from_s3 = one_rank_loader(s3, loader_options());
  auto from_disk = one_rank_loader(disk, loader_options());
  expect_same_batches(one_pass(from_s3), one_pass(from_disk));
  EXPECT_EQ(server.injected_503s(), 2 * 24);  // every image's first two GETs
  EXPECT_EQ(dynamic_cast<S3ByteSource&>(s3.source()).client().stats().get_requests, 3u * 24u);
  for (const auto& [key, bytes] : tree.files) {
    EXPECT_EQ(server.served_gets()[std::string("/") + kBucket + "/train/" + key], 1) << key;
  }
}

// `copies` copies of the Tree (24 images each) under train/0/, train/1/, ... of the server's bucket.
void upload_copies(S3rver& server, int copies) {
  Tree tree;
  S3Client admin(server.options());
  for (int copy = 0; copy < copies; ++copy) tree.upload(admin, "train/" + std::to_string(copy) + "/");
}

// The server dies mid-epoch: the loop gets a SourceError naming the endpoint within the client's
// retry budget, even with skip_bad (the storage's failure is never skipped), and the loader shuts
// down cleanly.
TEST(S3SourceServer, KilledMidEpochFailsTheLoopEvenWithSkipBad) {
  S3rver server;
  upload_copies(server, 4);
  S3Options o = server.options();
  o.max_attempts = 3;
  o.deadline = 3000ms;
  o.request_timeout = 1000ms;
  auto s3 = make_s3_image_folder(std::string("s3://") + kBucket + "/train/", decoder(), o);
  ASSERT_EQ(s3.size(), 96u);
  LoaderOptions lo = loader_options(/*skip_bad=*/true);
  lo.batch_size = 4;
  lo.prefetch_batches = 1;
  const auto start = Clock::now();
  std::string error;
  int batches = 0;
  {
    auto loader = one_rank_loader(s3, lo);
    try {
      for (auto& batch : loader) {
        (void)batch;
        if (++batches == 2) server.child->kill();
      }
    } catch (const SourceError& e) {
      error = e.what();
    }
    EXPECT_EQ(loader.stats().bad_items, 0);
  }
  const auto took = Clock::now() - start;
  EXPECT_GE(batches, 2);
  EXPECT_LT(batches, 24);
  EXPECT_NE(error.find(server.endpoint), std::string::npos) << error;
  EXPECT_NE(error.find(std::string("s3://") + kBucket + "/train/"), std::string::npos) << error;
  EXPECT_NE(error.find("is the server running"), std::string::npos) << error;
  EXPECT_LT(took, 15s);
}

// The timing: at batch 64 with 8 threads, a server frozen (SIGSTOP) or killed mid-epoch
// reaches the loop within one item's retry budget (S3Options::deadline) plus a second, not after
// every item of the batch has spent its own (64 / 8 rounds of it: 16 s here).
TEST(S3SourceServer, AFrozenOrKilledServerReachesTheLoopWithinOneItemsBudget) {
  for (const bool freeze : {true, false}) {
    SCOPED_TRACE(freeze ? "frozen" : "killed");
    S3rver server;
    upload_copies(server, 16);
    S3Options o = server.options();
    o.max_attempts = 3;
    o.deadline = 2000ms;
    o.request_timeout = 700ms;
    o.connect_timeout = 700ms;
    auto s3 = make_s3_image_folder(std::string("s3://") + kBucket + "/train/", decoder(), o);
    ASSERT_EQ(s3.size(), 384u);
    LoaderOptions lo;
    lo.batch_size = 64;
    lo.threads = 8;
    lo.prefetch_batches = 2;
    std::string error;
    int batches = 0;
    Clock::time_point fault, caught, closed;
    {
      auto loader = one_rank_loader(s3, lo);
      try {
        for (auto& batch : loader) {
          (void)batch;
          if (++batches == 1) {
            fault = Clock::now();
            if (freeze) {
              server.child->freeze();
            } else {
              server.child->kill();
            }
          }
        }
      } catch (const SourceError& e) {
        caught = Clock::now();
        error = e.what();
      }
    }
    closed = Clock::now();  // the loader's threads have finished the reads they were in
    server.child->kill();
    ASSERT_FALSE(error.empty()) << "the loop ran " << batches << " batches without an error";
    EXPECT_LT(batches, 6);
    const auto to_error = std::chrono::duration<double>(caught - fault).count();
    const auto to_closed = std::chrono::duration<double>(closed - fault).count();
    std::printf("%s server: the error reached the loop %.2f s after the fault (budget %.1f s); loader closed "
                "after %.2f s\n", freeze ? "frozen" : "killed", to_error, o.deadline.count() / 1000.0, to_closed);
    EXPECT_LT(to_error, o.deadline.count() / 1000.0 + 1.0) << error;
    EXPECT_LT(to_closed, 2 * o.deadline.count() / 1000.0 + 1.0);
    EXPECT_NE(error.find(server.endpoint), std::string::npos) << error;
    EXPECT_NE(error.find("ParallelLoader: batch "), std::string::npos) << error;
  }
}

// `chorus data upload DIR s3://...` copies a tree that then reads back as the same dataset.
TEST_F(S3SourceTest, UploadToolCopiesATreeThatReadsBackAsTheSameDataset) {
  const std::string env = "AWS_ACCESS_KEY_ID=S3RVER AWS_SECRET_ACCESS_KEY=S3RVER AWS_ENDPOINT_URL=" +
                          server_->endpoint + " ";
  int status = -1;
  const std::string out = chorus::testing::run_capture(
      env + CHORUS_BIN " data upload " + local_root() + " s3://" + kBucket + "/uploaded --parallel 4 2>&1", &status);
  ASSERT_EQ(status, 0) << out;
  EXPECT_NE(out.find("24 files"), std::string::npos) << out;
  auto s3 = make_s3_image_folder(std::string("s3://") + kBucket + "/uploaded/", decoder(), server_->options());
  auto local = make_image_folder(std::make_shared<LocalByteSource>(local_root()), decoder());
  auto from_s3 = one_rank_loader(s3, loader_options());
  auto from_disk = one_rank_loader(local, loader_options());
  expect_same_batches(one_pass(from_s3), one_pass(from_disk));
  const std::string bad = chorus::testing::run_capture(
      env + CHORUS_BIN " data upload " + local_root() + "/none s3://" + kBucket + "/x 2>&1", &status);
  EXPECT_EQ(WEXITSTATUS(status), 2) << bad;
  EXPECT_NE(bad.find("is not a directory"), std::string::npos) << bad;
}

TEST(S3SourceUnit, OpenSourcePicksByLocation) {
  testing::TempDir dir;
  S3Options o;
  o.access_key_id = o.secret_access_key = "K";
  o.endpoint = "http://127.0.0.1:9";
  auto s3 = open_source("s3://bucket/some/prefix", o);
  EXPECT_EQ(s3->describe("a/b.png"), "s3://bucket/some/prefix/a/b.png");
  EXPECT_EQ(open_source("s3://bucket", o)->describe("k"), "s3://bucket/k");
  auto local = open_source(dir.path, o);
  EXPECT_EQ(local->describe("a/b.png"), dir.path + "/a/b.png");
  EXPECT_THROW(open_source("s3://Bad_Bucket/x", o), UsageError);
  EXPECT_THROW(open_source(dir.path + "/missing", o), DataError);
  S3Options none;
  EXPECT_THROW(open_source("s3://bucket/x", none), S3Error);
}

}  // namespace
}  // namespace chorus::data
