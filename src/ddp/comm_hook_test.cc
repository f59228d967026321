// Communication hooks without a reference: a custom hook's result is what .grad gets (an async one
// that sums instead of averaging), a throwing hook gives a clear error, registration is checked on
// every rank, Options::compression and the fp16/bf16 hooks registered by hand train identically,
// PowerSGD's seeds are numpy's, and PowerSGD runs under join() with the finished ranks running
// the hook on zeros, without hanging.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <random>
#include <string>

#include "chorus/comm/error.h"
#include "chorus/ddp/ddp.h"
#include "chorus/torch/distributed.h"
#include "testing.h"

namespace chorus::ddp {
namespace {

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(10, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 16));
    head = register_module("head", torch::nn::Linear(16, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(torch::relu(fc2(torch::relu(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, head{nullptr};
};
TORCH_MODULE(Mlp);

std::pair<torch::Tensor, torch::Tensor> data(int step, int rank) {
  auto gen = at::detail::createCPUGenerator(100 + step * 10 + rank);
  return {at::randn({4, 10}, gen), at::randint(0, 3, {4}, gen)};
}

// Two models with the same weights, for DDP with two hooks side by side.
std::pair<Mlp, Mlp> two_equal_models() {
  torch::manual_seed(0);
  Mlp a, b;
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < a->parameters().size(); ++k) b->parameters()[k].copy_(a->parameters()[k]);
  return {a, b};
}

torch::Tensor loss(DistributedDataParallel<MlpImpl>& ddp, int step, int rank) {
  auto [x, y] = data(step, rank);
  return torch::nn::functional::cross_entropy(ddp.forward(x), y);
}

// Sums over ranks (no division), from the hook thread: the asynchronous path.
class SumHook final : public CommHook {
 public:
  std::string describe() const override { return "sum"; }
  std::shared_ptr<Work> run(GradBucket& bucket) override {
    return bucket.run_async([&bucket] { dist::all_reduce(bucket.buffer, ReduceOp::kSum, bucket.group); });
  }
};

class ThrowingHook final : public CommHook {
 public:
  explicit ThrowingHook(bool in_task) : in_task_(in_task) {}
  std::string describe() const override { return "throwing"; }
  std::shared_ptr<Work> run(GradBucket& bucket) override {
    if (!in_task_) throw std::runtime_error("boom in run");
    return bucket.run_async([] { throw std::runtime_error("boom in the task"); });
  }

 private:
  bool in_task_;
};

TEST(CommHook, NumpyRandintIsRandomStatesSequence) {
  // numpy.random.RandomState(0).randint(1_000_000_000), four times (python3-numpy 1.24).
  std::mt19937 rng(0);
  for (int64_t want : {209652396, 398764591, 924231285, 404868288}) EXPECT_EQ(numpy_randint(rng, 1000000000), want);
  std::mt19937 one(5);
  EXPECT_EQ(numpy_randint(one, 1), 0);
}

TEST(CommHook, ACustomHookIsHonoured) {
  for (int world : {2, 3}) {
    std::string err = testing::run_ranks(world, [](int rank, int world, std::shared_ptr<Store>) {
      dist::init_process_group();
      auto [a, b] = two_equal_models();
      Options o;
      o.first_bucket_mb = 0.0005;  // several buckets
      o.bucket_cap_mb = 0.0005;
      DistributedDataParallel average(a, o);
      DistributedDataParallel sum(b, o);
      sum.register_comm_hook(std::make_shared<SumHook>());
      if (average.stats().buckets < 2) throw std::runtime_error("expected several buckets");
      loss(average, 0, rank).backward();
      loss(sum, 0, rank).backward();
      for (size_t k = 0; k < a->parameters().size(); ++k) {
        auto want = a->parameters()[k].grad() * world;
        if (!torch::allclose(b->parameters()[k].grad(), want, 1e-5, 1e-6)) {
          throw std::runtime_error("parameter " + std::to_string(k) + ": the sum hook's .grad is not W x the average");
        }
      }
    });
    EXPECT_EQ(err, "") << "W=" << world;
  }
}

TEST(CommHook, AThrowingHookNamesItselfAndTheBucket) {
  for (bool in_task : {false, true}) {
    std::string err = testing::run_ranks(2, [in_task](int rank, int, std::shared_ptr<Store>) {
      dist::init_process_group();
      torch::manual_seed(0);
      Mlp net;
      DistributedDataParallel ddp(net);
      ddp.register_comm_hook(std::make_shared<ThrowingHook>(in_task));
      try {
        loss(ddp, 0, rank).backward();
      } catch (const Error& e) {
        const std::string what = e.what();
        for (const char* part : {"communication hook throwing", "bucket 0 of 1", "boom"}) {
          if (what.find(part) == std::string::npos) throw std::runtime_error("unhelpful message: " + what);
        }
        return;
      }
      throw std::runtime_error("no error from a throwing hook");
    });
    EXPECT_EQ(err, "") << (in_task ? "in the task" : "in run");
  }
}

TEST(CommHook, RegistrationIsCheckedOnEveryRank) {
  std::string err = testing::run_ranks(2, [](int rank, int, std::shared_ptr<Store>) {
    dist::init_process_group();
    torch::manual_seed(0);
    auto expect = [](const std::string& what, const std::vector<std::string>& parts) {
      for (const auto& part : parts) {
        if (what.find(part) == std::string::npos) throw std::runtime_error("unhelpful message: " + what);
      }
    };
    Mlp a;
    DistributedDataParallel different(a);
    expect(testing::usage_error([&] {
             different.register_comm_hook(rank == 0 ? fp16_compress_hook() : bf16_compress_hook());
           }),
           {"rank 0 registers fp16_compress_hook", "rank 1 registers bf16_compress_hook"});
    Mlp b;
    Options o;
    o.compression = Compression::kBFloat16;
    DistributedDataParallel twice(b, o);
    expect(testing::usage_error([&] { twice.register_comm_hook(allreduce_hook()); }),
           {"rank 0: a communication hook is already registered (Options::compression)", "rank 1:"});
    Mlp c;
    DistributedDataParallel late(c);
    loss(late, 0, rank).backward();
    expect(testing::usage_error([&] { late.register_comm_hook(allreduce_hook()); }),
           {"before the first backward"});
    expect(testing::usage_error([] {
             PowerSGDOptions p;
             p.start_powerSGD_iter = 1;
             PowerSGDHook hook(p);
           }),
           {"start_powerSGD_iter must be > 1"});
  });
  EXPECT_EQ(err, "");
}

TEST(CommHook, CompressionHooksTrainAsTheCompressionOption) {
  for (auto [compression, hook] : {std::make_pair(Compression::kFloat16, &fp16_compress_hook),
                                   std::make_pair(Compression::kBFloat16, &bf16_compress_hook)}) {
    std::string err = testing::run_ranks(2, [compression = compression, hook = hook](int rank, int, std::shared_ptr<Store>) {
      dist::init_process_group();
      auto [a, b] = two_equal_models();
      Options o;
      o.compression = compression;
      DistributedDataParallel by_option(a, o);
      DistributedDataParallel by_hook(b);
      by_hook.register_comm_hook(hook());
      torch::optim::SGD opt_a(a->parameters(), 0.1), opt_b(b->parameters(), 0.1);
      for (int step = 0; step < 3; ++step) {
        opt_a.zero_grad();
        opt_b.zero_grad();
        loss(by_option, step, rank).backward();
        loss(by_hook, step, rank).backward();
        opt_a.step();
        opt_b.step();
      }
      for (size_t k = 0; k < a->parameters().size(); ++k) {
        if (!torch::equal(a->parameters()[k], b->parameters()[k])) throw std::runtime_error("parameters differ");
      }
    });
    EXPECT_EQ(err, "");
  }
}

// Rank r trains 3 + 2r steps; PowerSGD from the second. The finished ranks shadow the others'
// backward with the hook on zeros, so every rank's hook counts every rank's last step.
TEST(CommHook, PowerSGDUnderJoin) {
  for (int world : {2, 3}) {
    std::string err = testing::run_ranks(world, [](int rank, int world, std::shared_ptr<Store>) {
      dist::init_process_group();
      torch::manual_seed(0);
      Mlp net;
      Options o;
      o.first_bucket_mb = 0.0005;
      o.bucket_cap_mb = 0.0005;
      DistributedDataParallel ddp(net, o);
      PowerSGDOptions p;
      p.start_powerSGD_iter = 2;
      auto hook = std::make_shared<PowerSGDHook>(p);
      ddp.register_comm_hook(hook);
      torch::optim::SGD opt(net->parameters(), 0.05);
      const int steps = 3 + 2 * rank;
      ddp.join([&] {
        for (int step = 0; step < steps; ++step) {
          opt.zero_grad();
          loss(ddp, step, rank).backward();
          opt.step();
        }
      });
      const int64_t most = 3 + 2 * (world - 1);
      if (hook->iteration() != most) {
        throw std::runtime_error("rank " + std::to_string(rank) + ": the hook ran " +
                                 std::to_string(hook->iteration()) + " iterations, expected " + std::to_string(most));
      }
      if (hook->compression_stats().numel_after == 0) throw std::runtime_error("nothing was compressed");
      for (const auto& param : net->parameters()) {
        auto all = dist::all_gather_object(std::to_string(param.sum().item<double>()));
        for (const auto& s : all) {
          if (s != all[0]) throw std::runtime_error("the ranks end with different parameters");
        }
      }
    });
    EXPECT_EQ(err, "") << "W=" << world;
  }
}

}  // namespace
}  // namespace chorus::ddp
