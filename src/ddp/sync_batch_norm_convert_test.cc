// convert_sync_batchnorm: BatchNorms in Sequentials nested in user modules, ModuleList, ModuleDict,
// a BatchNorm registered twice and a BatchNorm root are converted with their tensors shared and
// their options and mode kept; a BatchNorm held by a field is refused and nothing changes. A
// converted model trained with DDP at W=2 and W=3 (uneven batches, an empty rank) matches the
// unconverted model trained in one process on the concatenated batch.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/ddp/ddp.h"
#include "chorus/ddp/sync_batch_norm.h"
#include "chorus/torch/distributed.h"
#include "sync_batch_norm_test_util.h"
#include "testing.h"

namespace chorus::ddp {
namespace {

namespace nn = torch::nn;

struct BlockImpl : nn::Module {
  BlockImpl() {
    body = register_module("body", nn::Sequential(nn::Conv2d(nn::Conv2dOptions(2, 3, 3).padding(1)),
                                                  nn::BatchNorm2d(3), nn::ReLU()));
  }
  torch::Tensor forward(const torch::Tensor& x) { return body->forward(x); }
  nn::Sequential body{nullptr};
};
TORCH_MODULE(Block);

struct NetImpl : nn::Module {
  NetImpl() {
    block = register_module("block", Block());
    head = register_module("head", nn::Sequential(nn::Linear(3 * 4 * 4, 5),
                                                  nn::BatchNorm1d(nn::BatchNormOptions(5).momentum(0.2).eps(1e-3)),
                                                  nn::Tanh(), nn::Linear(5, 2)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head->forward(block(x).flatten(1)); }
  Block block{nullptr};
  nn::Sequential head{nullptr};
};
TORCH_MODULE(Net);

Net make_net() {
  torch::manual_seed(7);
  return Net();
}

std::string run_alone(const std::function<void()>& fn) {
  return testing::run_ranks(1, [&](int, int, std::shared_ptr<Store>) { fn(); });
}

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

TEST(ConvertSyncBatchnorm, NestedSequentialsShareTensorsOptionsAndMode) {
  EXPECT_EQ(run_alone([] {
              Net net = make_net();
              for (int i = 0; i < 2; ++i) net(torch::randn({4, 2, 4, 4}) + 1);  // running stats, 2 batches
              auto old_bn = net->head[1];  // as a shared_ptr<Module>, dropped before converting
              auto old_weight = net->head[1]->named_parameters()["weight"];
              auto old_mean = net->head[1]->named_buffers()["running_mean"];
              old_bn.reset();
              net->named_parameters()["head.1.bias"].set_requires_grad(false);  // frozen stays frozen
              net->block->body[1]->eval();
              const auto names = net->named_parameters().keys();
              net->eval();
              auto x = torch::randn({3, 2, 4, 4});
              auto before = net(x);
              net->train();
              net->block->body[1]->eval();

              require(convert_sync_batchnorm(net.ptr()) == net.ptr(), "the root is returned");
              auto* head_bn = net->head[1]->as<SyncBatchNormImpl>();
              auto* body_bn = net->block->body[1]->as<SyncBatchNormImpl>();
              require(head_bn != nullptr && body_bn != nullptr, "Sequential slots hold SyncBatchNorm");
              require(net->named_children()["head"]->named_children()["1"]->as<SyncBatchNormImpl>() == head_bn,
                      "registered child replaced");
              require(head_bn->weight.is_same(old_weight) && head_bn->running_mean.is_same(old_mean),
                      "tensors shared, not copied");
              require(head_bn->num_batches_tracked.item<int64_t>() == 2, "num_batches_tracked carried");
              require(head_bn->options.eps() == 1e-3 && head_bn->options.momentum() == 0.2 &&
                          head_bn->options.affine() && head_bn->options.track_running_stats(),
                      "options carried");
              require(!head_bn->bias.requires_grad() && head_bn->weight.requires_grad(), "requires_grad kept");
              require(head_bn->is_training() && !body_bn->is_training(), "training mode kept");
              require(net->named_parameters().keys() == names, "state names unchanged");
              std::ostringstream printed;
              printed << *net;
              require(printed.str().find("chorus::ddp::SyncBatchNorm(5, eps=0.001, momentum=0.2, affine=true") !=
                          std::string::npos,
                      printed.str());
              net->eval();
              expect_close("eval output after converting", net(x), before, 0);
            }),
            "");
}

TEST(ConvertSyncBatchnorm, ModuleListModuleDictSharedAndRoot) {
  EXPECT_EQ(run_alone([] {
              nn::ModuleList list(nn::BatchNorm1d(2), nn::Linear(2, 2));
              nn::ModuleDict dict(std::vector<std::pair<std::string, std::shared_ptr<nn::Module>>>{
                  {"bn", nn::BatchNorm3d(2).ptr()}});
              nn::Sequential twice;
              {
                nn::BatchNorm1d bn(2);
                twice->push_back(bn);
                twice->push_back(bn);
              }
              auto root = std::make_shared<nn::Module>();
              root->register_module("list", list);
              root->register_module("dict", dict);
              root->register_module("twice", twice);
              convert_sync_batchnorm(root);
              require(list[0]->as<SyncBatchNormImpl>() != nullptr, "ModuleList slot");
              require(list->named_children()["0"]->as<SyncBatchNormImpl>() != nullptr, "ModuleList child");
              require(dict["bn"]->as<SyncBatchNormImpl>() != nullptr, "ModuleDict slot");
              require(twice->ptr(0) == twice->ptr(1) && twice[0]->as<SyncBatchNormImpl>() != nullptr,
                      "one SyncBatchNorm for a BatchNorm registered twice");
              auto x = torch::randn({3, 2});
              require(twice->forward(x).sizes() == x.sizes(), "Sequential forward runs the new module");
              auto converted = convert_sync_batchnorm(nn::BatchNorm2d(3).ptr());
              require(std::dynamic_pointer_cast<SyncBatchNormImpl>(converted) != nullptr, "a BatchNorm root");
            }),
            "");
}

struct FieldNetImpl : nn::Module {
  FieldNetImpl() {
    bn = register_module("bn", nn::BatchNorm2d(3));
    seq = register_module("seq", nn::Sequential(nn::BatchNorm1d(2)));
  }
  nn::BatchNorm2d bn{nullptr};
  nn::Sequential seq{nullptr};
};
TORCH_MODULE(FieldNet);

TEST(ConvertSyncBatchnorm, FieldHeldBatchNormIsRefusedAndNothingChanges) {
  EXPECT_EQ(run_alone([] {
              FieldNet net;
              const std::string what = testing::usage_error([&] { convert_sync_batchnorm(net.ptr()); });
              require(what.find("the BatchNorm at 'bn' is also held outside the module tree") != std::string::npos &&
                          what.find("declare the field as chorus::ddp::SyncBatchNorm") != std::string::npos,
                      what);
              require(net->named_children()["bn"] == net->bn.ptr(), "registered child restored");
              require(net->seq[0]->as<nn::BatchNorm1dImpl>() != nullptr &&
                          net->seq->named_children()["0"]->as<nn::BatchNorm1dImpl>() != nullptr,
                      "Sequential restored");
            }),
            "");
}

// Training: the converted model under DDP against the plain model on the whole batch, 3 SGD steps.
constexpr int kSteps = 3;

void train_converted(const std::vector<int64_t>& batches, int rank) {
  dist::init_process_group();
  const int world = static_cast<int>(batches.size());
  const int64_t total = sum(batches, 0, batches.size());
  const int64_t offset = sum(batches, 0, rank);
  Net net = make_net();
  convert_sync_batchnorm(net.ptr());
  DistributedDataParallel ddp(net);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  Net ref = make_net();
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int s = 0; s < kSteps; ++s) {
    auto x = torch::tensor(dyadic_values(total * 32, 50 + s, 2.0f, 1.0f)).reshape({total, 2, 4, 4});
    auto lw = torch::tensor(dyadic_values(total * 2, 60 + s, 1.0f, 0.5f)).reshape({total, 2});
    opt.zero_grad();
    auto out = ddp(x.narrow(0, offset, batches[rank]));
    (out * lw.narrow(0, offset, batches[rank])).sum().backward();
    opt.step();
    ref_opt.zero_grad();
    auto ref_out = ref(x);
    ((ref_out * lw).sum() / world).backward();  // DDP averages the ranks' gradients
    ref_opt.step();
    expect_close("rank " + std::to_string(rank) + " step " + std::to_string(s) + " output", out,
                 ref_out.narrow(0, offset, batches[rank]));
  }
  auto ref_params = ref->named_parameters();
  for (const auto& p : net->named_parameters()) expect_close(p.key(), p.value(), ref_params[p.key()]);
  auto ref_buffers = ref->named_buffers();
  for (const auto& b : net->named_buffers()) expect_close(b.key(), b.value(), ref_buffers[b.key()]);
  dist::destroy_process_group();
}

TEST(ConvertSyncBatchnorm, ConvertedModelTrainsLikeOneProcessOnTheGlobalBatch) {
  for (const std::vector<int64_t>& batches : {std::vector<int64_t>{3, 1}, std::vector<int64_t>{2, 0, 3}}) {
    EXPECT_EQ(testing::run_ranks(static_cast<int>(batches.size()),
                                 [&](int rank, int, std::shared_ptr<Store>) { train_converted(batches, rank); }),
              "");
  }
}

}  // namespace
}  // namespace chorus::ddp
