// Parity with torchvision 0.14: for random-weight ResNet-18, 34 and 50 (and ResNet-18 with one input
// channel), torchvision's torch.save(state_dict) loads strictly into chorus's ResNet, whose
// state_dict then has the same keys, order and shapes (against the list the script wrote, not just
// the file's dict), and whose eval-mode logits match torchvision's within 1e-4. The other way round,
// a chorus model saved with save_state_dict loads strictly into torchvision with torch.load and
// gives the logits chorus computed.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <tuple>

#include "chorus/models/resnet.h"
#include "chorus/models/state_dict.h"
#include "testing.h"

#ifndef CHORUS_RESNET_PARITY_SCRIPT
#define CHORUS_RESNET_PARITY_SCRIPT "src/models/resnet_parity_test.py"
#endif

namespace chorus::models {
namespace {

constexpr double kTolerance = 1e-4;

torch::Tensor read_tensor(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return torch::pickle_load(bytes).toTensor();
}

void write_tensor(const torch::Tensor& t, const std::string& path) {
  const std::vector<char> bytes = torch::pickle_save(t);
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// keys.txt: "name d0,d1,..." per line.
std::vector<std::pair<std::string, std::vector<int64_t>>> read_keys(const std::string& path) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string name, dims;
    ls >> name >> dims;
    std::vector<int64_t> shape;
    std::istringstream ds(dims);
    for (std::string d; std::getline(ds, d, ',');) shape.push_back(std::stoll(d));
    out.emplace_back(name, shape);
  }
  return out;
}

using Case = std::tuple<int, int64_t, int64_t>;  // depth, classes, in_channels

class TorchvisionParity : public ::testing::TestWithParam<Case> {};

TEST_P(TorchvisionParity, SameKeysOrderShapesAndLogits) {
  const auto& [depth, classes, in_channels] = GetParam();
  const std::string python = testing::parity_python();
  int status = 0;
  testing::run_capture(python + " -c 'import torchvision' >/dev/null 2>&1", &status);
  if (status != 0) {
    GTEST_SKIP() << python << " cannot import torchvision (install python3-torchvision); no reference to compare";
  }
  char tmpl[] = "/tmp/chorus-resnet-parity-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  struct Cleanup {
    std::string dir;
    ~Cleanup() { std::filesystem::remove_all(dir); }
  } cleanup{dir};
  const std::string args = " --arch resnet" + std::to_string(depth) + " --classes " + std::to_string(classes) +
                           " --in-channels " + std::to_string(in_channels) + " --dir " + dir + " 2>&1";
  std::string out = testing::run_capture(python + " " CHORUS_RESNET_PARITY_SCRIPT " gen" + args, &status);
  ASSERT_EQ(status, 0) << out;

  torch::set_num_threads(1);
  ResNetOptions options;
  options.depth = depth;
  options.num_classes = classes;
  options.in_channels = in_channels;
  ResNet model(options);
  const LoadResult result = load_state_dict(*model, dir + "/model.pt");
  EXPECT_TRUE(result.missing.empty());
  EXPECT_TRUE(result.unexpected.empty());

  const auto expected = read_keys(dir + "/keys.txt");
  const StateDict ours = state_dict(*model);
  ASSERT_EQ(ours.size(), expected.size());
  for (size_t i = 0; i < ours.size(); ++i) {
    EXPECT_EQ(ours[i].first, expected[i].first) << "#" << i;
    EXPECT_EQ(ours[i].second.sizes().vec(), expected[i].second) << ours[i].first;
  }
  // The file's own order too (the OrderedDict read back through pickle_load).
  const StateDict file = read_state_dict(dir + "/model.pt");
  ASSERT_EQ(file.size(), expected.size());
  for (size_t i = 0; i < file.size(); ++i) EXPECT_EQ(file[i].first, expected[i].first) << "#" << i;

  model->eval();
  const torch::Tensor x = read_tensor(dir + "/input.pt");
  torch::NoGradGuard no_grad;
  const double diff = (model->forward(x) - read_tensor(dir + "/logits.pt")).abs().max().item<double>();
  EXPECT_LE(diff, kTolerance) << "logits differ from torchvision's";

  // The other way: a fresh chorus model (its own init), saved, read by torchvision.
  torch::manual_seed(99);
  ResNet fresh(options);
  fresh->eval();
  save_state_dict(*fresh, dir + "/cpp_model.pt");
  write_tensor(fresh->forward(x), dir + "/cpp_logits.pt");
  out = testing::run_capture(python + " " CHORUS_RESNET_PARITY_SCRIPT " check" + args, &status);
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("OK: "), std::string::npos) << out;
}

INSTANTIATE_TEST_SUITE_P(Archs, TorchvisionParity,
                         ::testing::Values(Case{18, 10, 3}, Case{18, 7, 1}, Case{34, 10, 3}, Case{50, 10, 3}),
                         [](const auto& info) {
                           return "ResNet" + std::to_string(std::get<0>(info.param)) + "_in" +
                                  std::to_string(std::get<2>(info.param));
                         });

}  // namespace
}  // namespace chorus::models
