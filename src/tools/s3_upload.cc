// `chorus data upload`: a local tree into s3://BUCKET/PREFIX/, one PUT per file.
#include "s3_upload.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <thread>
#include <vector>

#include "chorus/data/s3.h"

namespace chorus::tools {

void add_upload_options(CLI::App& app, UploadArgs& args) {
  app.add_option("DIR", args.dir, "the local directory to copy (every file below it)")->required();
  app.add_option("URL", args.url, "s3://BUCKET/PREFIX: DIR/a/b.png becomes PREFIX/a/b.png")->required();
  app.add_option("--parallel", args.parallel, "PUTs in flight")->check(CLI::Range(1, 256))->capture_default_str();
}

int run_upload(const UploadArgs& args) {
  namespace fs = std::filesystem;
  data::S3Url url = data::parse_s3_url(args.url);
  if (!url.prefix.empty() && url.prefix.back() != '/') url.prefix += '/';
  std::error_code ec;
  if (!fs::is_directory(args.dir, ec)) throw UsageError("chorus data upload: " + args.dir + " is not a directory");
  std::vector<fs::path> files;
  for (auto it = fs::recursive_directory_iterator(args.dir, fs::directory_options::follow_directory_symlink);
       it != fs::recursive_directory_iterator(); ++it) {
    if (it->is_regular_file()) files.push_back(it->path());
  }
  std::sort(files.begin(), files.end());
  data::S3Client client(data::S3Options::from_env());

  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::atomic<uint64_t> bytes{0};
  std::mutex error_mu;
  std::exception_ptr first_error;
  auto worker = [&] {
    for (size_t i = next++; i < files.size() && !failed; i = next++) {
      try {
        std::ifstream in(files[i], std::ios::binary);
        std::vector<uint8_t> body((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        if (in.bad()) throw Error("chorus data upload: cannot read " + files[i].string());
        client.put(url.bucket, url.prefix + fs::relative(files[i], args.dir).generic_string(), body);
        bytes += body.size();
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (!first_error) first_error = std::current_exception();
        failed = true;
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 1; t < args.parallel && static_cast<size_t>(t) < files.size(); ++t) threads.emplace_back(worker);
  worker();
  for (auto& t : threads) t.join();
  if (first_error) std::rethrow_exception(first_error);
  std::printf("chorus data upload: %zu files, %llu bytes to s3://%s/%s\n", files.size(),
              static_cast<unsigned long long>(bytes.load()), url.bucket.c_str(), url.prefix.c_str());
  return 0;
}

}  // namespace chorus::tools
