// Golden parity: W ranks x k steps of DDP match one process that runs the same shards itself, on a
// model with conv, BatchNorm (buffers), an embedding, a branch some ranks skip on some steps, and
// parameter sizes not divisible by W. Also no_sync accumulation, compression, gradient views and
// the errors for unused parameters and mismatched models.
#include "chorus/ddp/ddp.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "chorus/comm/error.h"
#include "chorus/torch/distributed.h"
#include "testing.h"

namespace chorus::ddp {
namespace {

struct GoldenNetImpl : torch::nn::Module {
  explicit GoldenNetImpl(int hidden = 7) {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 3, 3)));
    bn = register_module("bn", torch::nn::BatchNorm2d(3));
    emb = register_module("emb", torch::nn::Embedding(10, 5));
    fc1 = register_module("fc1", torch::nn::Linear(3 * 6 * 6 + 5, hidden));
    branch = register_module("branch", torch::nn::Linear(hidden, hidden));
    out = register_module("out", torch::nn::Linear(hidden, 3));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& ids, bool use_branch) {
    auto h = torch::relu(bn(conv(x))).flatten(1);
    h = torch::relu(fc1(torch::cat({h, emb(ids)}, 1)));
    if (use_branch) h = h + branch(h);
    return out(h);
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear fc1{nullptr}, branch{nullptr}, out{nullptr};
};
TORCH_MODULE(GoldenNet);

constexpr int kPerRank = 4;
constexpr int kSteps = 4;

struct Shard {
  torch::Tensor x, ids, y;
};

// The global batch of a step (same on every rank), and rank r's shard of it.
Shard shard(int step, int micro, int rank, int world) {
  auto gen = at::detail::createCPUGenerator(1000 + step * 10 + micro);
  const int n = kPerRank * world;
  auto x = at::randn({n, 1, 8, 8}, gen);
  auto ids = at::randint(0, 10, {n}, gen);
  auto y = at::randint(0, 3, {n}, gen);
  auto take = [&](const torch::Tensor& t) { return t.narrow(0, rank * kPerRank, kPerRank).contiguous(); };
  return {take(x), take(ids), take(y)};
}

bool uses_branch(int step, int rank) { return (step + rank) % 2 == 0; }

torch::Tensor loss_of(GoldenNet& net, const Shard& s, bool branch) {
  return torch::nn::functional::cross_entropy(net->forward(s.x, s.ids, branch), s.y);
}

// One process, every shard: the gradient is the mean over ranks of each shard's gradient.
GoldenNet reference(int world, int micro_batches) {
  torch::manual_seed(0);
  GoldenNet net;
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    torch::Tensor total = torch::zeros({});
    for (int m = 0; m < micro_batches; ++m) {
      for (int r = 0; r < world; ++r) total = total + loss_of(net, shard(step, m, r, world), uses_branch(step, r));
    }
    (total / world).backward();
    opt.step();
  }
  return net;
}

struct Variant {
  Options options;
  int micro_batches = 1;
  double tolerance = 1e-5;
  std::string backend = "chorus";  // the transport: auto, or one forced
};

void run_variant(int rank, int world, const Variant& v) {
  dist::init_process_group(v.backend);
  torch::manual_seed(0);
  GoldenNet net;
  Options o = v.options;
  o.find_unused_parameters = true;
  o.first_bucket_mb = 0.0001;  // tiny buckets (about 100 and 300 bytes): several, launched in order
  o.bucket_cap_mb = 0.0003;
  DistributedDataParallel ddp(net, o);
  if (ddp.stats().buckets < 3) throw std::runtime_error("expected several buckets");
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    for (int m = 0; m < v.micro_batches; ++m) {
      auto s = shard(step, m, rank, world);
      auto loss = torch::nn::functional::cross_entropy(ddp.forward(s.x, s.ids, uses_branch(step, rank)), s.y);
      if (m + 1 < v.micro_batches) {
        auto guard = ddp.no_sync();
        loss.backward();
      } else {
        loss.backward();
      }
    }
    opt.step();
  }
  GoldenNet ref = reference(world, v.micro_batches);
  auto a = net->named_parameters();
  auto b = ref->named_parameters();
  for (const auto& item : a) {
    double diff = (item.value() - b[item.key()]).abs().max().item<double>();
    if (!(diff <= v.tolerance)) {
      throw std::runtime_error("rank " + std::to_string(rank) + ": parameter " + item.key() + " differs by " +
                               std::to_string(diff) + " (tolerance " + std::to_string(v.tolerance) + ")");
    }
  }
  dist::destroy_process_group();
}

class Golden : public ::testing::TestWithParam<int> {};

TEST_P(Golden, MatchesOneProcessOnTheConcatenatedBatch) {
  EXPECT_EQ(testing::run_ranks(GetParam(), [](int r, int w, std::shared_ptr<Store>) { run_variant(r, w, {}); }), "");
}

TEST_P(Golden, NoSyncAccumulationMatches) {
  Variant v;
  v.micro_batches = 2;
  EXPECT_EQ(testing::run_ranks(GetParam(), [&](int r, int w, std::shared_ptr<Store>) { run_variant(r, w, v); }), "");
}

TEST_P(Golden, GradientCopiesMatch) {
  Variant v;
  v.options.gradient_as_bucket_view = false;
  EXPECT_EQ(testing::run_ranks(GetParam(), [&](int r, int w, std::shared_ptr<Store>) { run_variant(r, w, v); }), "");
}

// Both ways of running the bucket allreduces, on both transports.
TEST_P(Golden, OverlappedOverTcpMatches) {
  Variant v;
  v.backend = "tcp";
  v.options.overlap = Options::Overlap::kAlways;
  EXPECT_EQ(testing::run_ranks(GetParam(), [&](int r, int w, std::shared_ptr<Store>) { run_variant(r, w, v); }), "");
}

TEST_P(Golden, OverlappedOverSharedMemoryMatches) {
  Variant v;
  v.backend = "shm";
  v.options.overlap = Options::Overlap::kAlways;
  EXPECT_EQ(testing::run_ranks(GetParam(), [&](int r, int w, std::shared_ptr<Store>) { run_variant(r, w, v); }), "");
}

TEST_P(Golden, InBackwardThreadOverTcpMatches) {
  Variant v;
  v.backend = "tcp";
  v.options.overlap = Options::Overlap::kNever;
  EXPECT_EQ(testing::run_ranks(GetParam(), [&](int r, int w, std::shared_ptr<Store>) { run_variant(r, w, v); }), "");
}

// Compression rounds each averaged gradient to 11 (fp16) or 8 (bf16) significant bits; over 4 SGD
// steps at lr 0.1 the parameters stay within these bounds of the exact run.
TEST_P(Golden, Float16CompressionWithinTolerance) {
  Variant v;
  v.options.compression = Compression::kFloat16;
  v.tolerance = 5e-4;
  EXPECT_EQ(testing::run_ranks(GetParam(), [&](int r, int w, std::shared_ptr<Store>) { run_variant(r, w, v); }), "");
}

TEST_P(Golden, BFloat16CompressionWithinTolerance) {
  Variant v;
  v.options.compression = Compression::kBFloat16;
  v.tolerance = 1e-3;
  EXPECT_EQ(testing::run_ranks(GetParam(), [&](int r, int w, std::shared_ptr<Store>) { run_variant(r, w, v); }), "");
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Golden, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

TEST(DdpErrors, UnusedParameterWithoutTheOptionNamesItAndTheFix) {
  std::string err = testing::run_ranks(2, [](int rank, int world, std::shared_ptr<Store>) {
    dist::init_process_group();
    torch::manual_seed(0);
    GoldenNet net;
    DistributedDataParallel ddp(net);
    auto s = shard(0, 0, rank, world);
    try {
      torch::nn::functional::cross_entropy(ddp.forward(s.x, s.ids, false), s.y).backward();
    } catch (const std::exception& e) {
      std::string what = e.what();
      if (what.find("branch.weight") == std::string::npos || what.find("find_unused_parameters") == std::string::npos) {
        throw std::runtime_error("unhelpful message: " + what);
      }
      return;
    }
    throw std::runtime_error("no error for an unused parameter");
  });
  EXPECT_EQ(err, "");
}

TEST(DdpErrors, DifferentModelsAreRefusedOnEveryRankListingTheNames) {
  std::string err = testing::run_ranks(2, [](int rank, int, std::shared_ptr<Store>) {
    dist::init_process_group();
    GoldenNet net(rank == 0 ? 7 : 8);
    try {
      DistributedDataParallel ddp(net);
    } catch (const UsageError& e) {
      std::string what = e.what();
      if (what.find("fc1.weight") == std::string::npos || what.find("rank 1 has") == std::string::npos) {
        throw std::runtime_error("unhelpful message: " + what);
      }
      return;
    }
    throw std::runtime_error("no error for different models");
  });
  EXPECT_EQ(err, "");
}

TEST(DdpBuckets, OneExtraGradientCopyAndNoneWithViews) {
  std::string err = testing::run_ranks(1, [](int, int, std::shared_ptr<Store>) {
    dist::init_process_group();
    GoldenNet a, b;
    Options o;
    o.gradient_as_bucket_view = false;
    DistributedDataParallel copy(a, o);
    DistributedDataParallel view(b);  // the default
    if (copy.stats().bucket_bytes != copy.stats().gradient_bytes) throw std::runtime_error("copy mode: not one copy");
    if (view.stats().bucket_bytes != 0) throw std::runtime_error("view mode: extra bytes");
  });
  EXPECT_EQ(err, "");
}

}  // namespace
}  // namespace chorus::ddp
