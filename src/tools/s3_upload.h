// `chorus data upload DIR s3://BUCKET/PREFIX`: copies a local tree (an ImageFolder, a CSV dataset)
// into a bucket, file by file, with parallel PUTs; credentials and endpoint from the AWS_*
// variables (S3Options::from_env).
#pragma once

#include <CLI/CLI.hpp>

#include <string>

namespace chorus::tools {

struct UploadArgs {
  std::string dir;
  std::string url;
  int parallel = 8;
};

void add_upload_options(CLI::App& app, UploadArgs& args);
// Returns the exit status; errors are thrown (S3Error, UsageError).
int run_upload(const UploadArgs& args);

}  // namespace chorus::tools
