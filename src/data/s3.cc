// S3Client: requests through libcurl (SigV4 by curl), retries under a deadline, errors with their fix.
#include "chorus/data/s3.h"

#include <curl/curl.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "s3_internal.h"

namespace chorus::data {

using s3_detail::uri_encode;
using Clock = std::chrono::steady_clock;

namespace {

const char* kWhere = "chorus::data::S3Client: ";

bool valid_bucket_name(const std::string& b) {
  if (b.size() < 3 || b.size() > 63) return false;
  for (char c : b) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '.' || c == '_')) return false;
  }
  return true;
}

std::string seconds(Clock::duration d) {
  std::ostringstream out;
  out.precision(3);
  out << std::chrono::duration<double>(d).count() << " s";
  return out.str();
}

std::string seconds(std::chrono::milliseconds d) { return seconds(Clock::duration(d)); }

struct Response {
  CURLcode curl = CURLE_OK;
  std::string curl_error;  // curl's error buffer: names host, port and the system error
  long status = 0;
  std::vector<std::uint8_t> body;
};

// One operation, for its messages: "GET s3://bucket/key".
struct Operation {
  std::string verb;  // GET, LIST, PUT, DELETE
  std::string bucket;
  std::string key;   // the prefix for LIST
  std::string describe() const { return verb + " s3://" + bucket + "/" + key; }
};

bool retryable(const Response& r) {
  switch (r.curl) {
    case CURLE_OK:
      return r.status >= 500 || r.status == 429;
    case CURLE_COULDNT_CONNECT:     // a restarting server; bounded by attempts and the deadline
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_RECV_ERROR:
    case CURLE_SEND_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
      return true;
    default:
      return false;
  }
}

size_t append_body(char* data, size_t size, size_t n, void* user) {
  auto* body = static_cast<std::vector<std::uint8_t>*>(user);
  body->insert(body->end(), data, data + size * n);
  return size * n;
}

}  // namespace

S3Url parse_s3_url(const std::string& url) {
  const std::string scheme = "s3://";
  if (url.rfind(scheme, 0) != 0) {
    throw UsageError(std::string(kWhere) + "'" + url + "' is not an S3 URL; write s3://BUCKET/PREFIX");
  }
  std::string rest = url.substr(scheme.size());
  std::size_t slash = rest.find('/');
  S3Url out;
  out.bucket = rest.substr(0, slash);
  out.prefix = slash == std::string::npos ? "" : rest.substr(slash + 1);
  if (!valid_bucket_name(out.bucket)) {
    throw UsageError(std::string(kWhere) + "'" + url + "': bucket name '" + out.bucket +
                     "' is not valid (3-63 characters: lower-case letters, digits, '-', '.'); write s3://BUCKET/PREFIX");
  }
  return out;
}

S3Options S3Options::from_env(const Environment& env) {
  auto var = [&env](const char* name) -> std::string {
    auto it = env.find(name);
    return it == env.end() ? "" : it->second;
  };
  S3Options o;
  o.access_key_id = var("AWS_ACCESS_KEY_ID");
  o.secret_access_key = var("AWS_SECRET_ACCESS_KEY");
  o.session_token = var("AWS_SESSION_TOKEN");
  if (!var("AWS_REGION").empty()) {
    o.region = var("AWS_REGION");
  } else if (!var("AWS_DEFAULT_REGION").empty()) {
    o.region = var("AWS_DEFAULT_REGION");
  }
  o.endpoint = var("AWS_ENDPOINT_URL");
  return o;
}

S3Options S3Options::from_env() { return from_env(current_environment()); }

struct S3Client::Impl {
  const S3Options& options;
  std::string endpoint_name;  // for messages: the endpoint, or AWS's regional host
  std::optional<s3_detail::DiskCache> cache;
  std::atomic<std::uint64_t> get_requests{0};
  std::atomic<std::uint64_t> list_requests{0};
  std::atomic<std::uint64_t> cache_hits{0};
  std::mutex handles_mu;
  std::vector<CURL*> idle_handles;  // reused: they keep their connections open

  explicit Impl(const S3Options& o) : options(o) {}
  ~Impl() {
    for (CURL* h : idle_handles) curl_easy_cleanup(h);
  }

  std::string object_url(const std::string& bucket, const std::string& key) const {
    if (options.endpoint.empty()) {
      return "https://" + bucket + ".s3." + options.region + ".amazonaws.com/" + uri_encode(key, true);
    }
    return options.endpoint + "/" + bucket + "/" + uri_encode(key, true);
  }

  CURL* acquire() {
    {
      std::lock_guard<std::mutex> lock(handles_mu);
      if (!idle_handles.empty()) {
        CURL* h = idle_handles.back();
        idle_handles.pop_back();
        return h;
      }
    }
    CURL* h = curl_easy_init();
    if (h == nullptr) throw Error(std::string(kWhere) + "curl_easy_init failed (out of memory?)");
    return h;
  }
  void release(CURL* h) {
    std::lock_guard<std::mutex> lock(handles_mu);
    idle_handles.push_back(h);
  }

  // One attempt. timeout: this attempt's whole budget (already cut to the deadline).
  Response perform(const std::string& method, const std::string& url, const std::vector<std::uint8_t>* body,
                   std::chrono::milliseconds timeout) {
    CURL* h = acquire();
    curl_easy_reset(h);
    Response r;
    char error_buffer[CURL_ERROR_SIZE] = {0};
    std::string payload_hash = s3_detail::sha256_hex(body ? body->data() : nullptr, body ? body->size() : 0);
    struct curl_slist* headers = nullptr;
    headers = curl_slist_append(headers, ("x-amz-content-sha256: " + payload_hash).c_str());
    if (!options.session_token.empty()) {
      headers = curl_slist_append(headers, ("x-amz-security-token: " + options.session_token).c_str());
    }
    if (body != nullptr) {
      headers = curl_slist_append(headers, "Content-Type: application/octet-stream");
      headers = curl_slist_append(headers, "Expect:");
    }
    std::string sigv4 = "aws:amz:" + options.region + ":s3";
    curl_easy_setopt(h, CURLOPT_URL, url.c_str());
    curl_easy_setopt(h, CURLOPT_PATH_AS_IS, 1L);  // keys like "a/../b" are names, not paths to normalise
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);    // threads: no SIGALRM for DNS timeouts
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, error_buffer);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(h, CURLOPT_AWS_SIGV4, sigv4.c_str());
    curl_easy_setopt(h, CURLOPT_USERNAME, options.access_key_id.c_str());
    curl_easy_setopt(h, CURLOPT_PASSWORD, options.secret_access_key.c_str());
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS,
                     static_cast<long>(std::max<std::int64_t>(1, std::min(options.connect_timeout, timeout).count())));
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, static_cast<long>(std::max<std::int64_t>(1, timeout.count())));
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, append_body);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &r.body);
    if (method == "PUT") {
      // As POSTFIELDS (not an upload callback) so that curl signs the body it sends.
      curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(body->size()));
      curl_easy_setopt(h, CURLOPT_POSTFIELDS, body->empty() ? "" : reinterpret_cast<const char*>(body->data()));
      curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, "PUT");
    } else if (method != "GET") {
      curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, method.c_str());
    }
    r.curl = curl_easy_perform(h);
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &r.status);
    r.curl_error = error_buffer[0] != '\0' ? error_buffer : curl_easy_strerror(r.curl);
    // The idle handle must not keep pointers to this frame's buffers.
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, nullptr);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, nullptr);
    curl_slist_free_all(headers);
    if (r.curl == CURLE_OK) {
      release(h);
    } else {
      curl_easy_cleanup(h);  // a broken connection is not worth keeping
    }
    return r;
  }

  // Retries a request under options' attempts, backoff and deadline; returns the 2xx response or
  // throws the error that ended it.
  Response request(const Operation& op, const std::string& method, const std::string& url,
                   const std::vector<std::uint8_t>* body, std::atomic<std::uint64_t>& counter) {
    const Clock::time_point start = Clock::now();
    const Clock::time_point deadline = start + options.deadline;
    thread_local std::mt19937_64 rng(std::random_device{}());
    for (int attempt = 1;; ++attempt) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      counter.fetch_add(1);
      Response r = perform(method, url, body, std::min(options.request_timeout, left));
      if (r.curl == CURLE_OK && r.status >= 200 && r.status < 300) return r;
      bool again = retryable(r) && attempt < options.max_attempts;
      if (again) {
        auto cap = std::min<std::int64_t>(options.backoff_max.count(),
                                          options.backoff_base.count() << std::min(attempt - 1, 20));
        std::uniform_int_distribution<std::int64_t> pick(0, std::max<std::int64_t>(0, cap));
        auto wait = std::chrono::milliseconds(pick(rng));
        if (Clock::now() + wait + std::chrono::milliseconds(1) >= deadline) {
          again = false;
        } else {
          std::this_thread::sleep_for(wait);
        }
      }
      if (!again) throw error_for(op, r, attempt, Clock::now() - start);
    }
  }

  S3Error error_for(const Operation& op, const Response& r, int attempts, Clock::duration took) const {
    const std::string at = op.describe() + " at " + endpoint_name;
    const std::string tries =
        " after " + std::to_string(attempts) + (attempts == 1 ? " attempt" : " attempts") + " in " + seconds(took);
    using Kind = S3Error::Kind;
    if (r.curl == CURLE_OPERATION_TIMEDOUT) {
      return S3Error(Kind::kTimeout, 0, "",
                     kWhere + at + ": no complete answer" + tries + " (" + r.curl_error + "; attempt timeout " +
                         seconds(options.request_timeout) + ", connect timeout " + seconds(options.connect_timeout) +
                         ", deadline " + seconds(options.deadline) +
                         "); the server is slow or unreachable: check the network, or raise S3Options' timeouts");
    }
    if (r.curl != CURLE_OK) {
      return S3Error(Kind::kUnreachable, 0, "",
                     kWhere + at + ": cannot reach " + endpoint_name + tries + " (" + r.curl_error +
                         "); is the server running and the endpoint (AWS_ENDPOINT_URL) right?");
    }
    std::string text(r.body.begin(), r.body.end());
    s3_detail::ErrorBody e = s3_detail::parse_error_body(text);
    std::string answer = "HTTP " + std::to_string(r.status) + (e.code.empty() ? "" : " " + e.code) +
                         (e.message.empty() ? "" : " (" + e.message + ")");
    std::string head = kWhere + at + ": " + answer + tries;
    if (e.code == "NoSuchBucket" || (r.status == 404 && op.verb == "LIST" && e.code.empty())) {
      return S3Error(Kind::kNoSuchBucket, r.status, e.code,
                     head + "; bucket '" + op.bucket + "' does not exist at this endpoint: check the bucket name in "
                            "s3://BUCKET/... and the endpoint/region");
    }
    if (e.code == "NoSuchKey" || (r.status == 404 && op.verb == "GET")) {
      return S3Error(Kind::kNoSuchKey, r.status, e.code,
                     head + "; object '" + op.key + "' is gone: it was deleted or renamed after it was listed, "
                            "or the key is wrong: list again");
    }
    if (r.status == 403 || r.status == 401) {
      std::string fix = "the credentials lack permission (s3:ListBucket to list, s3:GetObject to read) on bucket '" +
                        op.bucket + "': check the access policy";
      if (e.code == "InvalidAccessKeyId") {
        fix = "the access key id '" + options.access_key_id +
              "' is unknown to this endpoint: check AWS_ACCESS_KEY_ID and AWS_ENDPOINT_URL";
      } else if (e.code == "SignatureDoesNotMatch") {
        fix = "check AWS_SECRET_ACCESS_KEY (it does not match the access key id) and AWS_REGION";
      } else if (e.code == "ExpiredToken" || e.code == "InvalidToken" || e.code == "TokenRefreshRequired") {
        fix = "the session token is expired or invalid: refresh AWS_SESSION_TOKEN";
      } else if (e.code == "RequestTimeTooSkewed") {
        fix = "this machine's clock is off by more than 15 minutes: synchronise it (NTP)";
      }
      return S3Error(Kind::kAccessDenied, r.status, e.code, head + "; " + fix);
    }
    if (e.code == "PermanentRedirect" || e.code == "AuthorizationHeaderMalformed" || r.status == 301) {
      return S3Error(Kind::kServer, r.status, e.code,
                     head + "; the bucket is in another region than '" + options.region + "': set AWS_REGION");
    }
    if (r.status >= 500 || r.status == 429) {
      return S3Error(Kind::kServer, r.status, e.code,
                     head + "; the server is failing or throttling (limit " + std::to_string(options.max_attempts) +
                         " attempts, deadline " + seconds(options.deadline) +
                         "): lower S3Options::parallel_requests or retry later");
    }
    return S3Error(Kind::kServer, r.status, e.code, head);
  }

  std::string cache_name(const std::string& bucket, const std::string& key, const std::string& etag) const {
    std::string id = endpoint_name + "\n" + bucket + "\n" + key + "\n" + etag;
    return s3_detail::sha256_hex(id.data(), id.size());
  }

  std::vector<std::uint8_t> get(const std::string& bucket, const std::string& key, const std::string& etag,
                                std::int64_t expected_size) {
    std::string name;
    if (cache) {
      name = cache_name(bucket, key, etag);
      if (auto hit = cache->get(name, expected_size)) {
        cache_hits.fetch_add(1);
        return std::move(*hit);
      }
    }
    Response r = request({"GET", bucket, key}, "GET", object_url(bucket, key), nullptr, get_requests);
    if (cache) cache->put(name, r.body);
    return std::move(r.body);
  }
};

S3Client::S3Client(S3Options options) : options_(std::move(options)) {
  static std::once_flag curl_init;
  std::call_once(curl_init, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  while (!options_.endpoint.empty() && options_.endpoint.back() == '/') options_.endpoint.pop_back();
  if (!options_.endpoint.empty() && options_.endpoint.rfind("http://", 0) != 0 &&
      options_.endpoint.rfind("https://", 0) != 0) {
    throw UsageError(std::string(kWhere) + "endpoint '" + options_.endpoint +
                     "' has no scheme; write http://HOST:PORT or https://HOST (AWS_ENDPOINT_URL)");
  }
  if (options_.max_attempts < 1 || options_.parallel_requests < 1 || options_.max_keys < 1 ||
      options_.max_keys > 1000 || options_.deadline.count() <= 0 || options_.request_timeout.count() <= 0 ||
      options_.connect_timeout.count() <= 0) {
    throw UsageError(std::string(kWhere) +
                     "max_attempts and parallel_requests must be >= 1, max_keys in 1..1000, and the timeouts "
                     "and deadline positive");
  }
  impl_ = std::make_unique<Impl>(options_);
  impl_->endpoint_name =
      options_.endpoint.empty() ? "https://s3." + options_.region + ".amazonaws.com" : options_.endpoint;
  if (options_.access_key_id.empty() || options_.secret_access_key.empty()) {
    throw S3Error(S3Error::Kind::kNoCredentials, 0, "",
                  std::string(kWhere) + "no credentials for " + impl_->endpoint_name + ": " +
                      (options_.access_key_id.empty() ? "access key id" : "secret access key") +
                      " is empty; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or S3Options' fields)");
  }
  if (!options_.cache_dir.empty()) impl_->cache.emplace(options_.cache_dir, options_.cache_max_bytes);
}

S3Client::~S3Client() = default;

std::vector<S3Object> S3Client::list(const S3Url& url) {
  std::vector<S3Object> all;
  std::string token;
  const std::string base = options_.endpoint.empty()
                               ? "https://" + url.bucket + ".s3." + options_.region + ".amazonaws.com/"
                               : options_.endpoint + "/" + url.bucket;
  do {
    Response r = impl_->request({"LIST", url.bucket, url.prefix}, "GET",
                                base + "?" + s3_detail::list_query(url.prefix, options_.max_keys, token), nullptr,
                                impl_->list_requests);
    s3_detail::ListPage page;
    try {
      page = s3_detail::parse_list_page(std::string(r.body.begin(), r.body.end()));
    } catch (const S3Error& e) {
      throw S3Error(e.kind(), e.http_status(), e.code(),
                    kWhere + std::string("LIST s3://") + url.bucket + "/" + url.prefix + " at " +
                        impl_->endpoint_name + ": " + e.what());
    }
    for (S3Object& o : page.objects) all.push_back(std::move(o));
    token = page.is_truncated ? page.next_continuation_token : "";
  } while (!token.empty());
  if (all.empty()) {
    throw S3Error(S3Error::Kind::kEmptyListing, 200, "",
                  kWhere + std::string("LIST s3://") + url.bucket + "/" + url.prefix + " at " + impl_->endpoint_name +
                      ": no objects under prefix '" + url.prefix +
                      "' (the bucket exists); check the prefix: keys are case-sensitive and a prefix matches the "
                      "start of keys ('train/' the folder, 'train' also 'training/...')");
  }
  return all;
}

std::vector<std::uint8_t> S3Client::get(const std::string& bucket, const std::string& key, const std::string& etag) {
  return impl_->get(bucket, key, etag, -1);
}

std::vector<std::uint8_t> S3Client::get(const std::string& bucket, const S3Object& object) {
  return impl_->get(bucket, object.key, object.etag, static_cast<std::int64_t>(object.size));
}

std::vector<std::vector<std::uint8_t>> S3Client::get_many(const std::string& bucket,
                                                          const std::vector<S3Object>& objects) {
  std::vector<std::vector<std::uint8_t>> out(objects.size());
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex error_mu;
  std::exception_ptr first_error;
  auto worker = [&] {
    for (std::size_t i = next.fetch_add(1); i < objects.size() && !failed.load(); i = next.fetch_add(1)) {
      try {
        out[i] = get(bucket, objects[i]);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (!first_error) first_error = std::current_exception();
        failed.store(true);
      }
    }
  };
  std::size_t n = std::min<std::size_t>(static_cast<std::size_t>(options_.parallel_requests), objects.size());
  std::vector<std::thread> threads;
  for (std::size_t t = 1; t < n; ++t) threads.emplace_back(worker);
  worker();
  for (std::thread& t : threads) t.join();
  if (first_error) std::rethrow_exception(first_error);
  return out;
}

void S3Client::put(const std::string& bucket, const std::string& key, const std::vector<std::uint8_t>& bytes) {
  std::atomic<std::uint64_t> uncounted{0};
  impl_->request({"PUT", bucket, key}, "PUT", impl_->object_url(bucket, key), &bytes, uncounted);
}

void S3Client::remove(const std::string& bucket, const std::string& key) {
  std::atomic<std::uint64_t> uncounted{0};
  impl_->request({"DELETE", bucket, key}, "DELETE", impl_->object_url(bucket, key), nullptr, uncounted);
}

S3Stats S3Client::stats() const {
  S3Stats s;
  s.get_requests = impl_->get_requests.load();
  s.list_requests = impl_->list_requests.load();
  s.cache_hits = impl_->cache_hits.load();
  return s;
}

}  // namespace chorus::data
