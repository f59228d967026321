// Shared by the checkpoint test programs (checkpoint_test.cc, checkpoint_recovery_test.cc): the
// small model (named like the Python module in checkpoint_python_test.py) and its SGD optimizer,
// exact views of their state, a fixture with a temporary directory per test, and a forked child
// to run libtorch in. Each test program includes it from one source file.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "chorus/torch/compat.h"
#include "testing.h"

namespace chorus::train {
namespace {

namespace fs = std::filesystem;

inline void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

// A small model with a BatchNorm buffer and dropout, named like the Python module in
// checkpoint_python_test.py.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(4, 8));
    bn = register_module("bn", torch::nn::BatchNorm1d(8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 3));
  }
  at::Tensor forward(at::Tensor x) {
    x = torch::relu(bn(fc1(x)));
    x = torch::dropout(x, 0.25, is_training());
    return fc2(x);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Net);

inline torch::optim::SGD make_sgd(Net& net) {
  return torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
}

// Every parameter and buffer of net as one flat double tensor, for exact comparison.
inline at::Tensor flat(torch::nn::Module& net) {
  std::vector<at::Tensor> parts;
  for (const auto& p : net.named_parameters()) parts.push_back(p.value().detach().reshape(-1).to(at::kDouble));
  for (const auto& b : net.named_buffers()) parts.push_back(b.value().detach().reshape(-1).to(at::kDouble));
  return at::cat(parts);
}

inline at::Tensor momentum_of(torch::optim::SGD& opt, const at::Tensor& p) {
  auto& state = opt.state().at(chorus::compat::optimizer_state_key(opt, p));
  return static_cast<torch::optim::SGDParamState&>(*state).momentum_buffer();
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/chorus-ckpt-XXXXXX";
    std::vector<char> buf(pattern.begin(), pattern.end());
    buf.push_back('\0');
    ASSERT_NE(::mkdtemp(buf.data()), nullptr);
    root_ = buf.data();
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  std::string path(const std::string& name) const { return root_ + "/" + name; }
  std::string root_;
};

// Runs fn in a forked child (no process group); returns "" or its error.
inline std::string in_child(const std::function<void()>& fn) {
  return testing::run_ranks(1, [&](int, int, std::shared_ptr<Store>) {
    torch::set_num_threads(1);
    fn();
  });
}

}  // namespace
}  // namespace chorus::train
