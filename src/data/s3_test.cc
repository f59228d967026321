// S3Client tests. S3Unit.*: the pure parts, no server. S3Server*: a real S3-compatible server
// (s3rver from npm, tests/s3) on loopback; the retry tests use tests/s3/flaky_server.py, a stand-in
// that answers 503, and a socket that never answers.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <gtest/gtest.h>
#include <random>
#include <sstream>
#include <thread>

#include "chorus/data/s3.h"
#include "s3_internal.h"
#include "s3_test_server.h"

namespace chorus::data {
namespace {

using namespace s3_testing;
namespace fs = std::filesystem;

template <typename F>
S3Error expect_s3_error(F&& f) {
  try {
    f();
  } catch (const S3Error& e) {
    return e;
  }
  ADD_FAILURE() << "no S3Error thrown";
  return S3Error(S3Error::Kind::kProtocol, 0, "", "none");
}

// ---------------------------------------------------------------------------------------------
// Unit tests: no server.

TEST(S3Unit, ParsesUrls) {
  S3Url u = parse_s3_url("s3://my-bucket/train/images/");
  EXPECT_EQ(u.bucket, "my-bucket");
  EXPECT_EQ(u.prefix, "train/images/");
  EXPECT_EQ(parse_s3_url("s3://data.set").prefix, "");
  EXPECT_EQ(parse_s3_url("s3://abc/").prefix, "");
  EXPECT_THROW(parse_s3_url("http://bucket/x"), UsageError);
  EXPECT_THROW(parse_s3_url("s3://"), UsageError);
  EXPECT_THROW(parse_s3_url("s3://Upper/x"), UsageError);
}

TEST(S3Unit, OptionsFromStandardVariables) {
  ::setenv("AWS_ACCESS_KEY_ID", "AK", 1);
  ::setenv("AWS_SECRET_ACCESS_KEY", "SK", 1);
  ::setenv("AWS_SESSION_TOKEN", "TOKEN", 1);
  ::setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000", 1);
  ::unsetenv("AWS_REGION");
  ::unsetenv("AWS_DEFAULT_REGION");
  S3Options o = S3Options::from_env();
  EXPECT_EQ(o.access_key_id, "AK");
  EXPECT_EQ(o.secret_access_key, "SK");
  EXPECT_EQ(o.session_token, "TOKEN");
  EXPECT_EQ(o.endpoint, "http://127.0.0.1:9000");
  EXPECT_EQ(o.region, "us-east-1");
  ::setenv("AWS_REGION", "eu-west-3", 1);
  EXPECT_EQ(S3Options::from_env().region, "eu-west-3");
  for (const char* v : {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
                        "AWS_REGION"}) {
    ::unsetenv(v);
  }
}

// The same decisions from an Environment value, without touching the process's environment:
// AWS_REGION wins over AWS_DEFAULT_REGION, an empty one counts as unset, us-east-1 without either.
TEST(S3Unit, OptionsFromAnEnvironmentValue) {
  const Environment env = {{"AWS_ACCESS_KEY_ID", "AK"},
                           {"AWS_SECRET_ACCESS_KEY", "SK"},
                           {"AWS_SESSION_TOKEN", "TOKEN"},
                           {"AWS_ENDPOINT_URL", "http://127.0.0.1:9000"},
                           {"AWS_REGION", "eu-west-3"},
                           {"AWS_DEFAULT_REGION", "ap-south-1"}};
  const S3Options o = S3Options::from_env(env);
  EXPECT_EQ(o.access_key_id, "AK");
  EXPECT_EQ(o.secret_access_key, "SK");
  EXPECT_EQ(o.session_token, "TOKEN");
  EXPECT_EQ(o.endpoint, "http://127.0.0.1:9000");
  EXPECT_EQ(o.region, "eu-west-3");
  EXPECT_EQ(S3Options::from_env({{"AWS_DEFAULT_REGION", "ap-south-1"}}).region, "ap-south-1");
  EXPECT_EQ(S3Options::from_env({{"AWS_REGION", ""}, {"AWS_DEFAULT_REGION", "ap-south-1"}}).region, "ap-south-1");
  const S3Options none = S3Options::from_env(Environment{});
  EXPECT_EQ(none.region, "us-east-1");
  EXPECT_EQ(none.access_key_id, "");
  EXPECT_EQ(none.endpoint, "");
}

TEST(S3Unit, NoCredentialsIsAClearError) {
  S3Options o;
  o.endpoint = "http://127.0.0.1:1";
  S3Error e = expect_s3_error([&] { S3Client c(o); });
  EXPECT_EQ(e.kind(), S3Error::Kind::kNoCredentials);
  EXPECT_NE(std::string(e.what()).find("AWS_ACCESS_KEY_ID"), std::string::npos) << e.what();
  o.access_key_id = "AK";
  o.secret_access_key = "SK";
  o.endpoint = "127.0.0.1:9000";
  EXPECT_THROW(S3Client c(o), UsageError);
}

TEST(S3Unit, UriEncoding) {
  using s3_detail::uri_encode;
  EXPECT_EQ(uri_encode("a b/c+d~e_f.g-h", true), "a%20b/c%2Bd~e_f.g-h");
  EXPECT_EQ(uri_encode("a/b=c&", false), "a%2Fb%3Dc%26");
  EXPECT_EQ(uri_encode("\xc3\xbc", false), "%C3%BC");
  EXPECT_EQ(s3_detail::url_decode("a+b%2Bc%2fd%"), "a b+c/d%");
  // x-amz-content-sha256 values (the test server checks signatures, not that a body matches its hash).
  EXPECT_EQ(s3_detail::sha256_hex(nullptr, 0), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(s3_detail::sha256_hex("abc", 3), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(s3_detail::list_query("x/", 3, "tok/+="),
            "continuation-token=tok%2F%2B%3D&encoding-type=url&list-type=2&max-keys=3&prefix=x%2F");
}

TEST(S3Unit, ParsesListPagesWithEntities) {
  std::string xml = R"(<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>b</Name><Prefix>p/</Prefix>
<Contents><Key>p/a&amp;b&lt;c&gt;&#x41;&#66;.jpg</Key><Size>12</Size><ETag>&quot;abc&quot;</ETag></Contents>
<Contents><Key>p/&#xFC;.png</Key><Size>0</Size><ETag>"d41d"</ETag></Contents>
<IsTruncated>true</IsTruncated><NextContinuationToken>t+/=</NextContinuationToken></ListBucketResult>)";
  s3_detail::ListPage page = s3_detail::parse_list_page(xml);
  ASSERT_EQ(page.objects.size(), 2u);
  EXPECT_EQ(page.objects[0].key, "p/a&b<c>AB.jpg");
  EXPECT_EQ(page.objects[0].size, 12u);
  EXPECT_EQ(page.objects[0].etag, "abc");
  EXPECT_EQ(page.objects[1].key, "p/\xc3\xbc.png");
  EXPECT_EQ(page.objects[1].etag, "d41d");
  EXPECT_TRUE(page.is_truncated);
  EXPECT_EQ(page.next_continuation_token, "t+/=");

  // encoding-type=url honoured by the server: keys come percent-encoded ('+' = space).
  s3_detail::ListPage encoded = s3_detail::parse_list_page(
      "<ListBucketResult><EncodingType>url</EncodingType><Contents><Key>a+b%2Bc%01</Key><Size>1</Size></Contents>"
      "<IsTruncated>false</IsTruncated></ListBucketResult>");
  ASSERT_EQ(encoded.objects.size(), 1u);
  EXPECT_EQ(encoded.objects[0].key, std::string("a b+c\x01"));
  EXPECT_FALSE(encoded.is_truncated);

  S3Error bad = expect_s3_error([] { s3_detail::parse_list_page("<ListBucketResult><Contents>"); });
  EXPECT_EQ(bad.kind(), S3Error::Kind::kProtocol);
  S3Error no_token = expect_s3_error(
      [] { s3_detail::parse_list_page("<ListBucketResult><IsTruncated>true</IsTruncated></ListBucketResult>"); });
  EXPECT_EQ(no_token.kind(), S3Error::Kind::kProtocol);
  EXPECT_THROW(s3_detail::parse_list_page("<html>nope</html>"), S3Error);
}

TEST(S3Unit, ParsesErrorDocuments) {
  auto e = s3_detail::parse_error_body(
      "<?xml version=\"1.0\"?><Error><Code>NoSuchKey</Code><Message>gone &amp; away</Message></Error>");
  EXPECT_EQ(e.code, "NoSuchKey");
  EXPECT_EQ(e.message, "gone & away");
  EXPECT_EQ(s3_detail::parse_error_body("not xml").code, "");
}

TEST(S3Unit, DiskCacheEvictsLeastRecentlyUsedBytes) {
  std::string dir = temp_dir();
  {
    s3_detail::DiskCache cache(dir, 100);
    cache.put("a", std::vector<std::uint8_t>(40, 'a'));
    cache.put("b", std::vector<std::uint8_t>(40, 'b'));
    ASSERT_TRUE(cache.get("a", 40).has_value());  // a is now the most recent
    cache.put("c", std::vector<std::uint8_t>(40, 'c'));  // 120 > 100: b goes
    EXPECT_FALSE(cache.get("b", -1).has_value());
    EXPECT_EQ(*cache.get("a", -1), std::vector<std::uint8_t>(40, 'a'));
    EXPECT_EQ(cache.get("c", 40)->size(), 40u);
    EXPECT_EQ(cache.bytes(), 80u);
    EXPECT_FALSE(cache.get("c", 41).has_value());  // wrong size: dropped
    EXPECT_FALSE(fs::exists(dir + "/c"));
    cache.put("huge", std::vector<std::uint8_t>(101, 'h'));  // larger than the bound: not kept
    EXPECT_FALSE(cache.get("huge", -1).has_value());
    cache.put("d", std::vector<std::uint8_t>(10, 'd'));
  }
  // Only final names on disk: writes went through temporary files and renames.
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"a", "d"}));
  {
    // A new cache adopts the files, oldest use first, and enforces a smaller bound on them.
    std::this_thread::sleep_for(20ms);
    s3_detail::DiskCache cache(dir, 100);
    EXPECT_EQ(cache.bytes(), 50u);
    ASSERT_TRUE(cache.get("a", 40).has_value());  // a used after d
    s3_detail::DiskCache smaller(dir, 45);        // d is the least recently used: evicted
    EXPECT_EQ(smaller.bytes(), 40u);
    EXPECT_FALSE(fs::exists(dir + "/d"));
  }
  fs::remove_all(dir);
}

// ---------------------------------------------------------------------------------------------
// Against s3rver.

class S3ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new S3rver();
    S3Client c(server_->options());
    // Keys that need URI encoding in the path and entity decoding in the listing.
    keys_ = {"train/cat 1.jpg",  "train/a&b<c>.bin", "train/plus+sign=1.bin", "train/\xc3\xbcnicode.png",
             "train/sub/deep/x.bin", "train/empty.bin", "train/q'uote.bin", "train/p%41ct.bin",
             "train/z0.bin", "train/z1.bin"};
    std::sort(keys_.begin(), keys_.end());
    for (std::size_t i = 0; i < keys_.size(); ++i) {
      c.put(kBucket, keys_[i], fixture_bytes(keys_[i] == "train/empty.bin" ? 0 : 1000 + 997 * i, unsigned(i)));
    }
    c.put(kBucket, "val/other.bin", bytes_of("not in train/"));
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  static std::vector<std::uint8_t> expected(const std::string& key) {
    auto i = static_cast<std::size_t>(std::find(keys_.begin(), keys_.end(), key) - keys_.begin());
    return fixture_bytes(key == "train/empty.bin" ? 0 : 1000 + 997 * i, unsigned(i));
  }
  static S3rver* server_;
  static std::vector<std::string> keys_;
};
S3rver* S3ServerTest::server_ = nullptr;
std::vector<std::string> S3ServerTest::keys_;

TEST_F(S3ServerTest, ListsEveryPageAndReadsEveryObject) {
  S3Options o = server_->options();
  o.max_keys = 3;
  o.parallel_requests = 4;
  S3Client c(o);
  std::vector<S3Object> objects = c.list(parse_s3_url(std::string("s3://") + kBucket + "/train/"));
  std::vector<std::string> listed;
  for (const S3Object& ob : objects) listed.push_back(ob.key);
  EXPECT_EQ(listed, keys_);
  EXPECT_EQ(c.stats().list_requests, (keys_.size() + 2) / 3);  // 3 per page
  for (const S3Object& ob : objects) {
    EXPECT_EQ(ob.size, expected(ob.key).size()) << ob.key;
    EXPECT_FALSE(ob.etag.empty());
    EXPECT_EQ(ob.etag.find('"'), std::string::npos);
  }
  int gets_before = server_->object_gets();
  auto bytes = c.get_many(kBucket, objects);
  ASSERT_EQ(bytes.size(), objects.size());
  for (std::size_t i = 0; i < objects.size(); ++i) EXPECT_EQ(bytes[i], expected(objects[i].key)) << objects[i].key;
  EXPECT_EQ(c.stats().get_requests, objects.size());
  EXPECT_EQ(server_->object_gets() - gets_before, static_cast<int>(objects.size()));
  EXPECT_EQ(c.get(kBucket, "val/other.bin"), bytes_of("not in train/"));
}

TEST_F(S3ServerTest, CacheServesLaterEpochsWithoutGets) {
  std::string cache_dir = temp_dir();
  S3Options o = server_->options();
  o.cache_dir = cache_dir;
  std::vector<S3Object> objects;
  {
    S3Client c(o);
    objects = c.list(parse_s3_url(std::string("s3://") + kBucket + "/train/"));
    c.get_many(kBucket, objects);
    EXPECT_EQ(c.stats().get_requests, objects.size());
    EXPECT_EQ(c.stats().cache_hits, 0u);
  }
  int gets_before = server_->object_gets();
  for (int epoch = 0; epoch < 2; ++epoch) {
    S3Client c(o);  // a new client (a new process, next run) finds the files
    auto bytes = c.get_many(kBucket, objects);
    for (std::size_t i = 0; i < objects.size(); ++i) EXPECT_EQ(bytes[i], expected(objects[i].key));
    EXPECT_EQ(c.stats().get_requests, 0u);
    EXPECT_EQ(c.stats().cache_hits, objects.size());
  }
  EXPECT_EQ(server_->object_gets(), gets_before);  // counted on the server's side too
  fs::remove_all(cache_dir);
}

TEST_F(S3ServerTest, MissingBucketNamesIt) {
  S3Client c(server_->options());
  S3Error e = expect_s3_error([&] { c.list(parse_s3_url("s3://no-such-bucket/train/")); });
  EXPECT_EQ(e.kind(), S3Error::Kind::kNoSuchBucket) << e.what();
  EXPECT_EQ(e.code(), "NoSuchBucket");
  EXPECT_EQ(e.http_status(), 404);
  std::string what = e.what();
  EXPECT_NE(what.find("no-such-bucket"), std::string::npos) << what;
  EXPECT_NE(what.find(server_->endpoint), std::string::npos) << what;
}

TEST_F(S3ServerTest, EmptyPrefixSaysSo) {
  S3Client c(server_->options());
  S3Error e = expect_s3_error([&] { c.list(parse_s3_url(std::string("s3://") + kBucket + "/Train/")); });
  EXPECT_EQ(e.kind(), S3Error::Kind::kEmptyListing) << e.what();
  EXPECT_NE(std::string(e.what()).find("no objects under prefix 'Train/'"), std::string::npos) << e.what();
}

TEST_F(S3ServerTest, UnknownAccessKeyIsDenied) {
  S3Options o = server_->options();
  o.access_key_id = "NOT-A-KEY";
  S3Client c(o);
  S3Error e = expect_s3_error([&] { c.list(parse_s3_url(std::string("s3://") + kBucket + "/train/")); });
  EXPECT_EQ(e.kind(), S3Error::Kind::kAccessDenied) << e.what();
  EXPECT_EQ(e.http_status(), 403);
  EXPECT_EQ(e.code(), "InvalidAccessKeyId");
  EXPECT_NE(std::string(e.what()).find("check AWS_ACCESS_KEY_ID"), std::string::npos) << e.what();
  EXPECT_EQ(c.stats().list_requests, 1u);  // a 403 is not retried
}

// The server (s3rver_run.js) verifies SigV4 signatures itself, since s3rver does not.
TEST_F(S3ServerTest, WrongSecretIsDenied) {
  S3Options o = server_->options();
  o.secret_access_key = "not-the-secret";
  S3Client c(o);
  S3Error e = expect_s3_error([&] { c.get(kBucket, "val/other.bin"); });
  EXPECT_EQ(e.kind(), S3Error::Kind::kAccessDenied) << e.what();
  EXPECT_EQ(e.code(), "SignatureDoesNotMatch");
  EXPECT_NE(std::string(e.what()).find("check AWS_SECRET_ACCESS_KEY"), std::string::npos) << e.what();
  EXPECT_EQ(c.stats().get_requests, 1u);
}

TEST_F(S3ServerTest, SessionTokenIsSentAndSigned) {
  S3Options o = server_->options();
  o.session_token = "FwoGZXIvYXdzE+token/with=chars";
  S3Client c(o);
  // The server refuses any x-amz-* header left out of the signature.
  EXPECT_EQ(c.get(kBucket, "val/other.bin"), bytes_of("not in train/"));
  EXPECT_EQ(c.list(parse_s3_url(std::string("s3://") + kBucket + "/val/")).size(), 1u);
}

TEST_F(S3ServerTest, ObjectDeletedBetweenListAndGetNamesTheKey) {
  S3Client c(server_->options());
  for (int i = 0; i < 6; ++i) c.put(kBucket, "gone/" + std::to_string(i), bytes_of("x" + std::to_string(i)));
  auto objects = c.list(parse_s3_url(std::string("s3://") + kBucket + "/gone/"));
  ASSERT_EQ(objects.size(), 6u);
  c.remove(kBucket, "gone/3");
  S3Error e = expect_s3_error([&] { c.get_many(kBucket, objects); });
  EXPECT_EQ(e.kind(), S3Error::Kind::kNoSuchKey) << e.what();
  EXPECT_EQ(e.http_status(), 404);
  EXPECT_NE(std::string(e.what()).find("s3://chorus-test/gone/3"), std::string::npos) << e.what();
  for (int i = 0; i < 6; ++i) {
    if (i != 3) c.remove(kBucket, "gone/" + std::to_string(i));
  }
}

TEST(S3ServerDown, ClosedPortNamesTheEndpoint) {
  S3Options o;
  o.access_key_id = o.secret_access_key = "S3RVER";
  o.endpoint = "http://127.0.0.1:" + std::to_string(closed_port());
  o.max_attempts = 3;
  o.backoff_base = 20ms;
  o.deadline = 3000ms;
  S3Client c(o);
  auto start = Clock::now();
  S3Error e = expect_s3_error([&] { c.list(parse_s3_url("s3://bucket/x/")); });
  EXPECT_LT(Clock::now() - start, o.deadline);
  EXPECT_EQ(e.kind(), S3Error::Kind::kUnreachable) << e.what();
  EXPECT_NE(std::string(e.what()).find(o.endpoint), std::string::npos) << e.what();
  EXPECT_NE(std::string(e.what()).find("after 3 attempts"), std::string::npos) << e.what();
  EXPECT_EQ(c.stats().list_requests, 3u);
}

TEST(S3ServerKilled, MidTransferFailsWithinTheDeadline) {
  S3rver server;
  S3Options o = server.options();
  o.parallel_requests = 2;
  o.max_attempts = 3;
  o.deadline = 4000ms;
  o.request_timeout = 2000ms;
  {
    S3Client c(o);
    for (int i = 0; i < 16; ++i) c.put(kBucket, "big/" + std::to_string(i), fixture_bytes(4 << 20, unsigned(i)));
  }
  S3Client c(o);
  auto objects = c.list(parse_s3_url(std::string("s3://") + kBucket + "/big/"));
  ASSERT_EQ(objects.size(), 16u);
  std::thread killer([&] {
    auto until = Clock::now() + 10s;
    while (server.object_gets() == 0 && Clock::now() < until) std::this_thread::sleep_for(1ms);
    server.child->kill();
  });
  auto start = Clock::now();
  S3Error e = expect_s3_error([&] { c.get_many(kBucket, objects); });
  auto took = Clock::now() - start;
  killer.join();
  EXPECT_TRUE(e.kind() == S3Error::Kind::kUnreachable || e.kind() == S3Error::Kind::kTimeout) << e.what();
  EXPECT_NE(std::string(e.what()).find(server.endpoint), std::string::npos) << e.what();
  // Each GET in flight gets at most one deadline; the pool stops starting new ones.
  EXPECT_LT(took, o.deadline + 2s) << e.what();
  EXPECT_LT(c.stats().get_requests, 16u * 3u);
}

// The stand-in for an overloaded server (503 SlowDown), and a socket that never answers.
struct Flaky {
  std::unique_ptr<Child> child;
  std::string endpoint;
  explicit Flaky(int failures) {
    child = std::make_unique<Child>(std::vector<std::string>{
        "/usr/bin/python3", std::string(CHORUS_S3_TEST_DIR) + "/flaky_server.py", std::to_string(failures)});
    int port = child->wait_for_port(20s);
    if (port <= 0) throw std::runtime_error("flaky_server.py did not start");
    endpoint = "http://127.0.0.1:" + std::to_string(port);
  }
  int requests() { return count_substr(child->output(), "REQUEST GET"); }
};

S3Options flaky_options(const std::string& endpoint) {
  S3Options o;
  o.access_key_id = o.secret_access_key = "K";
  o.endpoint = endpoint;
  o.max_attempts = 4;
  o.backoff_base = 10ms;
  o.deadline = 5000ms;
  return o;
}

TEST(S3ServerRetry, SlowDownIsRetriedThenSucceeds) {
  Flaky server(2);
  S3Client c(flaky_options(server.endpoint));
  EXPECT_EQ(c.get("bucket", "a b"), bytes_of("payload of /bucket/a%20b"));
  EXPECT_EQ(c.stats().get_requests, 3u);
  EXPECT_EQ(server.requests(), 3);
}

TEST(S3ServerRetry, GivesUpAfterMaxAttempts) {
  Flaky server(100);
  S3Options o = flaky_options(server.endpoint);
  o.max_attempts = 3;
  S3Client c(o);
  S3Error e = expect_s3_error([&] { c.get("bucket", "k"); });
  EXPECT_EQ(e.kind(), S3Error::Kind::kServer) << e.what();
  EXPECT_EQ(e.http_status(), 503);
  EXPECT_EQ(e.code(), "SlowDown");
  EXPECT_NE(std::string(e.what()).find("after 3 attempts"), std::string::npos) << e.what();
  EXPECT_EQ(server.requests(), 3);
}

TEST(S3ServerRetry, SilentServerEndsAtTheDeadline) {
  // Listens (the kernel completes connections) but never accepts nor answers.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(fd, 16), 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  S3Options o = flaky_options("http://127.0.0.1:" + std::to_string(ntohs(a.sin_port)));
  o.request_timeout = 300ms;
  o.deadline = 1000ms;
  o.max_attempts = 100;
  S3Client c(o);
  auto start = Clock::now();
  S3Error e = expect_s3_error([&] { c.get("bucket", "k"); });
  auto took = Clock::now() - start;
  ::close(fd);
  EXPECT_EQ(e.kind(), S3Error::Kind::kTimeout) << e.what();
  EXPECT_GE(took, 800ms);
  EXPECT_LT(took, 1500ms);
  EXPECT_GE(c.stats().get_requests, 3u);  // timeouts are retried
}

}  // namespace
}  // namespace chorus::data
