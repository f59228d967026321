// Unit tests of chorus_models without Python: the state_dict's layout and torchvision's init, state
// dict files (round trip, strict and non-strict loading, the exact error messages, unreadable
// files) and the transfer-learning helpers (freeze that train() cannot undo, head replacement,
// parameter groups, unfreeze).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "chorus/models/resnet.h"
#include "chorus/models/state_dict.h"
#include "chorus/models/transfer.h"
#include "testing.h"

namespace chorus::models {
namespace {

ResNet make(int depth, int64_t classes = 10, int64_t in_channels = 3, uint64_t seed = 0) {
  torch::manual_seed(seed);
  ResNetOptions o;
  o.depth = depth;
  o.num_classes = classes;
  o.in_channels = in_channels;
  return ResNet(o);
}

// A temporary directory removed at the end of the test.
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/chorus-models-XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};

std::vector<std::string> keys(const StateDict& s) {
  std::vector<std::string> out;
  for (const auto& [k, t] : s) out.push_back(k);
  return out;
}

bool same_state(const StateDict& a, const StateDict& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first || !torch::equal(a[i].second, b[i].second)) return false;
  }
  return true;
}

StateDict cloned(const StateDict& s) {
  StateDict out;
  for (const auto& [k, t] : s) out.emplace_back(k, t.clone());
  return out;
}

// ---- layout and init ----------------------------------------------------------------------------

TEST(ResNetLayout, TorchvisionKeysInTorchvisionOrder) {
  const auto k18 = keys(state_dict(*make(18)));
  ASSERT_EQ(k18.size(), 122u);  // torchvision resnet18().state_dict()
  const std::vector<std::string> head = {"conv1.weight",     "bn1.weight",          "bn1.bias",
                                         "bn1.running_mean", "bn1.running_var",     "bn1.num_batches_tracked",
                                         "layer1.0.conv1.weight", "layer1.0.bn1.weight"};
  EXPECT_EQ(std::vector<std::string>(k18.begin(), k18.begin() + 8), head);
  EXPECT_EQ(k18[k18.size() - 2], "fc.weight");
  EXPECT_EQ(k18.back(), "fc.bias");
  auto at = [&](const std::string& k) { return std::find(k18.begin(), k18.end(), k) - k18.begin(); };
  // A block: conv1, bn1 (5 entries), conv2, bn2, then its shortcut.
  EXPECT_EQ(at("layer2.0.downsample.0.weight"), at("layer2.0.bn2.num_batches_tracked") + 1);
  EXPECT_EQ(at("layer2.0.downsample.1.weight"), at("layer2.0.downsample.0.weight") + 1);
  EXPECT_EQ(at("layer1.0.downsample.0.weight"), static_cast<long>(k18.size()));  // no shortcut there
  EXPECT_EQ(keys(state_dict(*make(34))).size(), 218u);
  const auto s50 = state_dict(*make(50, 1000));
  ASSERT_EQ(s50.size(), 320u);
  EXPECT_EQ(s50[s50.size() - 2].second.sizes().vec(), (std::vector<int64_t>{1000, 2048}));
  // ResNet-50's first block has a shortcut (64 -> 256 channels at stride 1).
  bool found = false;
  for (const auto& [k, t] : s50) {
    if (k == "layer1.0.downsample.0.weight") {
      found = true;
      EXPECT_EQ(t.sizes().vec(), (std::vector<int64_t>{256, 64, 1, 1}));
    }
  }
  EXPECT_TRUE(found);
}

TEST(ResNetLayout, OptionsShapeTheModel) {
  ResNet m = make(18, 5, 1);
  EXPECT_EQ(m->conv1->weight.sizes().vec(), (std::vector<int64_t>{64, 1, 7, 7}));
  EXPECT_EQ(m->forward(torch::randn({2, 1, 32, 32})).sizes().vec(), (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(m->num_features(), 512);
  EXPECT_EQ(make(50)->num_features(), 2048);
  try {
    make(20);
    FAIL() << "no error for depth 20";
  } catch (const UsageError& e) {
    EXPECT_STREQ(e.what(),
                 "ResNet: depth 20 is not one of torchvision's (18, 34, 50, 101, 152); set ResNetOptions::depth to one");
  }
}

TEST(ResNetInit, TorchvisionsInitAndZeroInitResidual) {
  ResNet m = make(50);
  // kaiming_normal, fan_out, relu: std = sqrt(2 / (out_channels * k * k)).
  const torch::Tensor w = m->layer3->named_parameters()["0.conv2.weight"];
  const double expected = std::sqrt(2.0 / (256 * 9));
  EXPECT_NEAR(w.std().item<double>(), expected, 0.05 * expected);
  EXPECT_TRUE(torch::equal(m->bn1->weight, torch::ones({64})));
  EXPECT_TRUE(torch::equal(m->bn1->bias, torch::zeros({64})));
  EXPECT_FALSE(torch::equal(m->layer1->named_parameters()["0.bn3.weight"], torch::zeros({256})));

  ResNetOptions o;
  o.depth = 50;
  o.zero_init_residual = true;
  ResNet z(o);
  for (const auto& [k, t] : state_dict(*z)) {
    const bool last_bn = k.find(".bn3.weight") != std::string::npos;
    if (last_bn) {
      EXPECT_TRUE(torch::equal(t, torch::zeros_like(t))) << k;
    }
    if (k.find(".bn2.weight") != std::string::npos) {
      EXPECT_TRUE(torch::equal(t, torch::ones_like(t))) << k;
    }
  }
  o.depth = 18;
  ResNet z18(o);
  EXPECT_TRUE(torch::equal(z18->layer4->named_parameters()["1.bn2.weight"], torch::zeros({512})));
  // A zero-initialised residual block is the identity after its ReLU: output = relu(input).
  z18->eval();
  auto x = torch::randn({1, 64, 8, 8});
  EXPECT_TRUE(torch::allclose(z18->layer1->forward(x), torch::relu(x)));
}

// ---- state dict files ---------------------------------------------------------------------------

TEST(StateDictFiles, RoundTripIntoAnotherModel) {
  TempDir dir;
  ResNet a = make(18, 10, 3, 1);
  {
    torch::NoGradGuard no_grad;
    a->bn1->running_mean.uniform_(-1, 1);
    a->bn1->num_batches_tracked.fill_(5);
  }
  save_state_dict(*a, dir.path + "/a.pt");
  EXPECT_FALSE(std::filesystem::exists(dir.path + "/a.pt.tmp"));
  ResNet b = make(18, 10, 3, 2);
  ASSERT_FALSE(same_state(state_dict(*a), state_dict(*b)));
  const LoadResult r = load_state_dict(*b, dir.path + "/a.pt");
  EXPECT_TRUE(r.missing.empty() && r.unexpected.empty());
  EXPECT_TRUE(same_state(state_dict(*a), state_dict(*b)));
  EXPECT_TRUE(same_state(read_state_dict(dir.path + "/a.pt"), state_dict(*a)));
  // Loading keeps requires_grad and records no autograd history.
  for (const auto& p : b->parameters()) {
    EXPECT_TRUE(p.requires_grad());
    EXPECT_TRUE(p.is_leaf());
  }
  a->eval();
  b->eval();
  auto x = torch::randn({2, 3, 32, 32});
  EXPECT_TRUE(torch::equal(a->forward(x), b->forward(x)));
}

// The broken state dict of the error tests: fc.bias missing, head.weight unexpected, conv1.weight
// of a one-channel model.
StateDict broken(const ResNet& source) {
  StateDict s;
  for (const auto& [k, t] : state_dict(*source)) {
    if (k == "fc.bias") continue;
    s.emplace_back(k, k == "conv1.weight" ? torch::zeros({64, 1, 7, 7}) : t.clone());
  }
  s.emplace_back("head.weight", torch::zeros({3}));
  return s;
}

TEST(StateDictLoad, StrictErrorListsEveryKeyWithShapesAndChangesNothing) {
  ResNet m = make(18);
  const StateDict before = cloned(state_dict(*m));
  try {
    load_state_dict(*m, broken(make(18, 10, 3, 5)));
    FAIL() << "no error";
  } catch (const StateDictError& e) {
    EXPECT_STREQ(e.what(),
                 "load_state_dict (strict) from a StateDict: the state dict does not fit the model: 1 missing key: "
                 "fc.bias; 1 unexpected key: head.weight; 1 mis-shaped key: conv1.weight (state dict [64, 1, 7, 7], "
                 "model [64, 3, 7, 7]). Fix: build the model as the state dict's was (e.g. depth, in_channels, "
                 "num_classes, then replace_head after loading) or drop those keys from the state dict; "
                 "LoadOptions::strict = false loads the keys both have and skips the rest");
  }
  EXPECT_TRUE(same_state(state_dict(*m), before));
}

TEST(StateDictLoad, NonStrictStillRefusesMisshapedKeysOnly) {
  ResNet m = make(18);
  LoadOptions lenient;
  lenient.strict = false;
  try {
    load_state_dict(*m, broken(make(18, 10, 3, 5)), lenient);
    FAIL() << "no error";
  } catch (const StateDictError& e) {
    EXPECT_STREQ(e.what(),
                 "load_state_dict (non-strict) from a StateDict: the state dict does not fit the model: 1 mis-shaped "
                 "key: conv1.weight (state dict [64, 1, 7, 7], model [64, 3, 7, 7]). Fix: build the model as the "
                 "state dict's was (e.g. depth, in_channels, num_classes, then replace_head after loading) or drop "
                 "those keys from the state dict");
  }
}

TEST(StateDictLoad, NonStrictLoadsWhatBothHaveAndReportsTheRest) {
  ResNet source = make(18, 10, 3, 5);
  StateDict s;
  for (const auto& [k, t] : state_dict(*source)) {
    if (k.rfind("fc.", 0) != 0) s.emplace_back(k, t);
  }
  s.emplace_back("head.weight", torch::zeros({3}));
  s.emplace_back("head.bias", torch::zeros({3}));
  ResNet m = make(18, 10, 3, 6);
  const torch::Tensor fc_before = m->fc->weight.clone();
  LoadOptions lenient;
  lenient.strict = false;
  const LoadResult r = load_state_dict(*m, s, lenient);
  EXPECT_EQ(r.missing, (std::vector<std::string>{"fc.weight", "fc.bias"}));
  EXPECT_EQ(r.unexpected, (std::vector<std::string>{"head.weight", "head.bias"}));
  EXPECT_TRUE(torch::equal(m->conv1->weight, source->conv1->weight));
  EXPECT_TRUE(torch::equal(m->fc->weight, fc_before));
  // Strict, the same dict fails on the four keys.
  EXPECT_THROW(load_state_dict(*m, s), StateDictError);
}

TEST(StateDictLoad, WrongDepthListsEveryKey) {
  TempDir dir;
  save_state_dict(*make(18), dir.path + "/r18.pt");
  ResNet m = make(50);
  try {
    load_state_dict(*m, dir.path + "/r18.pt");
    FAIL() << "no error";
  } catch (const StateDictError& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind("load_state_dict (strict) from " + dir.path + "/r18.pt: ", 0), 0u) << what;
    EXPECT_NE(what.find(" missing keys: "), std::string::npos) << what;
    EXPECT_NE(what.find("layer1.0.conv3.weight"), std::string::npos);  // ResNet-50's, not in 18's
    EXPECT_NE(what.find("layer3.2.bn3.num_batches_tracked"), std::string::npos);
    EXPECT_NE(what.find("fc.weight (state dict [10, 512], model [10, 2048])"), std::string::npos);
  }
}

TEST(StateDictFiles, UnreadableFilesAreNamed) {
  TempDir dir;
  ResNet m = make(18);
  try {
    load_state_dict(*m, dir.path + "/none.pt");
    FAIL();
  } catch (const StateDictError& e) {
    EXPECT_EQ(std::string(e.what()), "read_state_dict: cannot open " + dir.path + "/none.pt: No such file or directory");
  }
  std::ofstream(dir.path + "/text.pt") << "not a checkpoint";
  try {
    read_state_dict(dir.path + "/text.pt");
    FAIL();
  } catch (const StateDictError& e) {
    EXPECT_NE(std::string(e.what()).find(dir.path + "/text.pt is not in torch.save's zip format"), std::string::npos);
  }
  // A torch.save archive cut short: an error naming the file, not a crash.
  save_state_dict(*m, dir.path + "/whole.pt");
  std::filesystem::copy_file(dir.path + "/whole.pt", dir.path + "/cut.pt");
  std::filesystem::resize_file(dir.path + "/cut.pt", std::filesystem::file_size(dir.path + "/whole.pt") / 2);
  try {
    read_state_dict(dir.path + "/cut.pt");
    FAIL();
  } catch (const StateDictError& e) {
    EXPECT_NE(std::string(e.what()).find(dir.path + "/cut.pt is not a readable torch.save archive: "),
              std::string::npos)
        << e.what();
  }
  const std::vector<char> bytes = torch::pickle_save(torch::ones({2}));
  std::ofstream(dir.path + "/tensor.pt", std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  try {
    read_state_dict(dir.path + "/tensor.pt");
    FAIL();
  } catch (const StateDictError& e) {
    EXPECT_EQ(std::string(e.what()), "read_state_dict: " + dir.path +
                                         "/tensor.pt holds a Tensor, not a dict of tensors; save model.state_dict(), "
                                         "not the model");
  }
}

// ---- transfer learning --------------------------------------------------------------------------

std::vector<FreezableBatchNorm2dImpl*> norms(ResNet& m) {
  std::vector<FreezableBatchNorm2dImpl*> out;
  for (const auto& mod : m->modules()) {
    if (auto* bn = mod->as<FreezableBatchNorm2dImpl>()) out.push_back(bn);
  }
  return out;
}

TEST(Freeze, BackboneStaysFrozenWhateverTrainIsCalledOn) {
  ResNet m = make(18, 4, 3, 3);
  m->replace_head(3);
  freeze_backbone(*m);
  for (const auto& p : backbone_parameters(*m)) EXPECT_FALSE(p.requires_grad());
  for (const auto& p : head_parameters(*m)) EXPECT_TRUE(p.requires_grad());
  m->train();
  m->layer1->train();  // directly on a submodule, too
  m->bn1->train();
  ASSERT_EQ(norms(m).size(), 20u);
  for (auto* bn : norms(m)) EXPECT_FALSE(bn->is_training());
  EXPECT_TRUE(m->fc->is_training());
  EXPECT_TRUE(m->is_training());

  const StateDict before = cloned(state_dict(*m));
  auto loss = m->forward(torch::randn({4, 3, 32, 32})).sum();
  loss.backward();
  // Running statistics untouched (eval mode), no gradient for the backbone, one for the head.
  const StateDict after = state_dict(*m);
  for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(torch::equal(after[i].second, before[i].second)) << after[i].first;
  for (const auto& p : backbone_parameters(*m)) EXPECT_FALSE(p.grad().defined());
  for (const auto& p : head_parameters(*m)) EXPECT_TRUE(p.grad().defined());

  unfreeze_backbone(*m);
  for (const auto& p : m->parameters()) EXPECT_TRUE(p.requires_grad());
  for (auto* bn : norms(m)) EXPECT_TRUE(bn->is_training());  // the mode last asked for: train
  m->forward(torch::randn({4, 3, 32, 32}));
  EXPECT_FALSE(torch::equal(m->bn1->running_mean, before[3].second));
  EXPECT_EQ(m->bn1->num_batches_tracked.item<int64_t>(), 1);
}

TEST(Freeze, UnfreezeRestoresTheModeAskedWhileFrozen) {
  ResNet m = make(18);
  freeze_backbone(*m);
  m->eval();
  unfreeze_backbone(*m);
  for (auto* bn : norms(m)) EXPECT_FALSE(bn->is_training());
  m->train();
  for (auto* bn : norms(m)) EXPECT_TRUE(bn->is_training());
}

TEST(Freeze, PlainBatchNormIsRefusedAndNothingChanges) {
  torch::nn::Sequential net(torch::nn::Conv2d(3, 4, 3), torch::nn::BatchNorm2d(4));
  try {
    freeze(*net);
    FAIL() << "no error";
  } catch (const UsageError& e) {
    EXPECT_STREQ(e.what(),
                 "freeze: 1 is a torch::nn BatchNorm, which a later train() would put back in training mode; use "
                 "chorus::models::FreezableBatchNorm2d (the same state) so the freeze holds");
  }
  for (const auto& p : net->parameters()) EXPECT_TRUE(p.requires_grad());
}

TEST(Freeze, ReplacedHeadKeepsItsPlaceAndTrains) {
  ResNet m = make(50, 1000);
  freeze_backbone(*m);
  m->eval();
  m->replace_head(7);
  EXPECT_EQ(m->fc->weight.sizes().vec(), (std::vector<int64_t>{7, 2048}));
  EXPECT_TRUE(m->fc->weight.requires_grad());
  EXPECT_FALSE(m->fc->is_training());  // follows the model's mode
  const auto k = keys(state_dict(*m));
  EXPECT_EQ(k.back(), "fc.bias");
  EXPECT_EQ(k.size(), 320u);
  EXPECT_EQ(m->options().num_classes, 7);
}

TEST(ParamGroups, HeadAndBackboneLearningRatesAndUnfreezeLater) {
  ResNet m = make(18, 3, 3, 4);
  freeze_backbone(*m);
  torch::optim::SGDOptions head(0.5);
  torch::optim::SGD opt(backbone_and_head_groups(*m, head, 0.05), head);
  ASSERT_EQ(opt.param_groups().size(), 2u);
  EXPECT_EQ(opt.param_groups()[0].options().get_lr(), 0.5);
  EXPECT_EQ(opt.param_groups()[1].options().get_lr(), 0.05);
  EXPECT_EQ(opt.param_groups()[0].params().size(), 2u);
  EXPECT_EQ(opt.param_groups()[1].params().size(), m->parameters().size() - 2);

  auto x = torch::randn({4, 3, 32, 32});
  m->train();
  const StateDict before = cloned(state_dict(*m));
  opt.zero_grad();
  m->forward(x).pow(2).mean().backward();
  const torch::Tensor head_grad = m->fc->weight.grad().clone();
  opt.step();
  for (const auto& [k, t] : state_dict(*m)) {
    const auto& old = std::find_if(before.begin(), before.end(), [&](const auto& e) { return e.first == k; })->second;
    if (k.rfind("fc.", 0) == 0) {
      EXPECT_FALSE(torch::equal(t, old)) << k;
    } else {
      EXPECT_TRUE(torch::equal(t, old)) << k;
    }
  }
  EXPECT_TRUE(torch::allclose(m->fc->weight, before[before.size() - 2].second - 0.5 * head_grad));

  unfreeze_backbone(*m);
  opt.zero_grad();
  const torch::Tensor conv_before = m->conv1->weight.clone();
  m->forward(x).pow(2).mean().backward();
  const torch::Tensor conv_grad = m->conv1->weight.grad().clone();
  ASSERT_GT(conv_grad.abs().max().item<double>(), 0);
  opt.step();
  EXPECT_TRUE(torch::allclose(m->conv1->weight, conv_before - 0.05 * conv_grad));
}

}  // namespace
}  // namespace chorus::models
