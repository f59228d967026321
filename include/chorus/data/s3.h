// chorus::data::S3Client: list and read objects from Amazon S3 or an S3-compatible server (MinIO,
// Ceph, s3rver) for datasets that live in a bucket. No libtorch here (target chorus_s3).
//
//   chorus::data::S3Options o = chorus::data::S3Options::from_env();  // AWS_* variables
//   o.cache_dir = "/var/tmp/chorus-s3";                                   // optional local cache
//   chorus::data::S3Client s3(o);
//   chorus::data::S3Url url = chorus::data::parse_s3_url("s3://my-bucket/train/");
//   std::vector<chorus::data::S3Object> objects = s3.list(url);           // every page
//   std::vector<std::vector<uint8_t>> bytes = s3.get_many(url.bucket, objects);  // in parallel
//
// Contract:
// - Requests go through libcurl, signed with its built-in AWS Signature V4 (CURLOPT_AWS_SIGV4,
//   service "s3"); x-amz-content-sha256 is set to the SHA-256 of the body (S3 requires it and curl
//   7.88 does not add it); a session token goes in x-amz-security-token.
// - With no endpoint the bucket is addressed virtual-hosted style on https://BUCKET.s3.REGION.amazonaws.com;
//   with an endpoint (AWS_ENDPOINT_URL, e.g. http://127.0.0.1:9000) path style: ENDPOINT/BUCKET/KEY.
// - Every call has a deadline (Options::deadline): connect and per-attempt timeouts inside it, retries
//   with exponential backoff and full jitter on 5xx, 429, timeouts and connection failures, never past
//   it. Other 4xx answers fail at once. A call never hangs.
// - Failures throw S3Error: one line naming the operation, endpoint, bucket and key, the server's
//   error code and the likely fix; kind() says what happened without parsing the text.
// - Thread-safe: any number of threads may call one client. get_many runs up to
//   Options::parallel_requests GETs at once on its own threads and returns in the order asked.
// - Cache (Options::cache_dir non-empty): an object read once is kept as a file named by the hash of
//   endpoint, bucket, key and ETag, so a changed object (new ETag) is fetched again. Files are written
//   to a temporary name and renamed (atomic: a reader sees a whole file or none). Total size is bound by
//   cache_max_bytes, least recently used evicted first (use = file mtime, so the order survives
//   restarts). Several processes may share a directory; each keeps its own size account, so the bound
//   holds per process, and a file evicted by another process is simply fetched again.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "chorus/comm/environment.h"
#include "chorus/comm/error.h"

namespace chorus::data {

// s3://bucket/prefix: bucket without slashes, prefix as given ("" for the whole bucket).
struct S3Url {
  std::string bucket;
  std::string prefix;
};
// Throws UsageError on anything but s3://BUCKET[/PREFIX] with a valid bucket name.
S3Url parse_s3_url(const std::string& url);

struct S3Options {
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;  // temporary credentials (STS); "" = none
  std::string region = "us-east-1";
  // "" = AWS (virtual-hosted https://BUCKET.s3.REGION.amazonaws.com); else scheme://host[:port], path style.
  std::string endpoint;

  std::chrono::milliseconds connect_timeout{3000};   // TCP + TLS connect, per attempt
  std::chrono::milliseconds request_timeout{60000};  // one attempt, whole transfer
  std::chrono::milliseconds deadline{300000};        // one call (get, one list page) with all its retries
  int max_attempts = 6;                              // per request, the first included
  std::chrono::milliseconds backoff_base{100};       // attempt n waits uniform(0, min(max, base * 2^n))
  std::chrono::milliseconds backoff_max{5000};
  int parallel_requests = 8;  // concurrent GETs in get_many
  int max_keys = 1000;        // ListObjectsV2 page size (S3's maximum is 1000)

  std::string cache_dir;                            // "" = no cache
  std::uint64_t cache_max_bytes = 10ull << 30;      // LRU-evicted beyond this; objects larger are not kept

  // The standard variables of `env`: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN,
  // AWS_REGION (else AWS_DEFAULT_REGION, else us-east-1; an empty one counts as unset),
  // AWS_ENDPOINT_URL. Set fields afterwards to override them. Pure: reads only `env`.
  static S3Options from_env(const Environment& env);
  // The same from this process's environment (current_environment()).
  static S3Options from_env();
};

struct S3Object {
  std::string key;
  std::uint64_t size = 0;
  std::string etag;  // as the server sent it, quotes removed
};

class S3Error : public Error {
 public:
  enum class Kind {
    kNoCredentials,  // no access key or secret configured
    kAccessDenied,   // 403: wrong key, wrong secret, no permission (code() has the server's word)
    kNoSuchBucket,
    kNoSuchKey,      // 404 on GET: deleted between list and get, or a wrong key
    kEmptyListing,   // list() found no object under the prefix
    kUnreachable,    // connection refused, DNS, TLS, connection cut: endpoint down
    kTimeout,        // no complete answer within the attempt timeouts and the deadline
    kServer,         // 5xx/429 on every attempt, or another error answer (code() says which)
    kProtocol,       // an answer that is not what S3 sends (bad XML)
  };
  S3Error(Kind kind, int http_status, std::string code, const std::string& what)
      : Error(what), kind_(kind), http_status_(http_status), code_(std::move(code)) {}
  Kind kind() const { return kind_; }
  int http_status() const { return http_status_; }  // 0 when no answer came
  const std::string& code() const { return code_; }  // S3's <Code>, e.g. "SignatureDoesNotMatch"

 private:
  Kind kind_;
  int http_status_;
  std::string code_;
};

// Counters since construction; both are cumulative over all threads.
struct S3Stats {
  std::uint64_t get_requests = 0;  // GET object requests sent (every retry counts)
  std::uint64_t list_requests = 0; // ListObjectsV2 pages requested (every retry counts)
  std::uint64_t cache_hits = 0;    // get()s answered from the cache directory
};

class S3Client {
 public:
  // Throws S3Error(kNoCredentials) when the key or secret is empty, UsageError on a bad endpoint.
  explicit S3Client(S3Options options);
  ~S3Client();
  S3Client(const S3Client&) = delete;
  S3Client& operator=(const S3Client&) = delete;

  // Every object under url.prefix (all pages, in S3's order: by key). Throws kEmptyListing when
  // there is none: a dataset with no files is a mistake in the prefix.
  std::vector<S3Object> list(const S3Url& url);

  // One object's bytes, from the cache when present (keyed with etag; "" = key only).
  std::vector<std::uint8_t> get(const std::string& bucket, const std::string& key,
                                const std::string& etag = "");
  // The same for a listed object: a cached copy must also have the listed size.
  std::vector<std::uint8_t> get(const std::string& bucket, const S3Object& object);
  // Many objects in parallel, result i for objects[i]. On the first failure the remaining GETs are
  // not started, those in flight finish (within their timeouts), and that failure is thrown.
  std::vector<std::vector<std::uint8_t>> get_many(const std::string& bucket,
                                                   const std::vector<S3Object>& objects);

  // Uploads (single PUT, up to 5 GiB) and deletes; tests use them to build fixtures.
  void put(const std::string& bucket, const std::string& key, const std::vector<std::uint8_t>& bytes);
  void remove(const std::string& bucket, const std::string& key);

  S3Stats stats() const;
  const S3Options& options() const { return options_; }

 private:
  struct Impl;
  S3Options options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace chorus::data
