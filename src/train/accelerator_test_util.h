// Shared by the Accelerator's test programs (accelerator_test.cc, accelerator_state_test.cc):
// the temporary root of every test's run directory, a test's AcceleratorOptions, and the small
// dataset of numbered items every rank and the references share. Each test program includes it
// from one source file (it registers the temporary root with gtest).
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>

#include "chorus/train/accelerator.h"

namespace chorus::train {
namespace {

namespace fs = std::filesystem;
using torch::data::transforms::Stack;

inline void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

// Every test's run directories live under one temporary directory, made in the parent before any
// test forks its ranks and removed after the last test.
class RunRoot : public ::testing::Environment {
 public:
  void SetUp() override {
    char tmpl[] = "/tmp/chorus-accelerator-test-XXXXXX";
    require(::mkdtemp(tmpl) != nullptr, "mkdtemp failed");
    path() = tmpl;
  }
  void TearDown() override { fs::remove_all(path()); }
  static std::string& path() {
    static std::string p;
    return p;
  }
};
const auto* const kRunRoot = ::testing::AddGlobalTestEnvironment(new RunRoot);

// Options for a test's Accelerator: its run directory is named after the running test (the same in
// every forked rank), under the temporary root; no progress on stdout, no fsync.
inline AcceleratorOptions test_options(const std::string& suffix = "") {
  AcceleratorOptions o;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = std::string(info->test_suite_name()) + "." + info->name() + suffix;
  for (char& c : name) {
    if (c == '/') c = '_';
  }
  o.project_dir = RunRoot::path();
  o.run_name = name;
  o.progress = false;
  o.fsync = false;
  return o;
}

// Item i: data = features[i], target = i (so a batch names its items).
struct Items : torch::data::datasets::Dataset<Items> {
  explicit Items(at::Tensor features) : features(std::move(features)) {}
  torch::data::Example<> get(size_t i) override {
    return {features[static_cast<int64_t>(i)], torch::tensor(static_cast<int64_t>(i))};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(features.size(0)); }
  at::Tensor features;
};

// The fixed data every rank and the references share.
inline at::Tensor features(int64_t n, int64_t dim) {
  auto gen = at::detail::createCPUGenerator(42);
  return at::randn({n, dim}, gen);
}

}  // namespace
}  // namespace chorus::train
