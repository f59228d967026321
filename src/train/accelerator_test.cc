// Accelerator: accumulation equals the large-batch step (and communicates only on sync steps),
// bf16 autocast within tolerance of fp32, the fp16 error, malloc tuning and when the progress line
// is rewritten in place (decided from the environment), exact gather_for_metrics on uneven shards,
// reduce, the prepare errors, main_process_first ordering and clip_grad_norm_. State, resume,
// signals and records are in accelerator_state_test.cc.
//
// Libtorch work runs in forked ranks (run_ranks) only, so the gtest process can fork safely.
#include "chorus/train/accelerator.h"

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <malloc.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "accelerator_test_util.h"
#include "testing.h"

namespace chorus::train {
namespace {

at::Tensor regression_targets(int64_t n) {
  auto gen = at::detail::createCPUGenerator(43);
  return at::randn({n, 2}, gen);
}

struct NetImpl : torch::nn::Module {
  NetImpl(int in = 6, int hidden = 8, int out = 2) {
    fc1 = register_module("fc1", torch::nn::Linear(in, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, out));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = fc1(x);
    hidden_dtype = h.scalar_type();
    return fc2(torch::relu(h));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  c10::ScalarType hidden_dtype = c10::ScalarType::Undefined;
};
TORCH_MODULE(Net);

std::vector<at::Tensor> gather_all(const at::Tensor& t) {
  std::vector<at::Tensor> all;
  for (int r = 0; r < dist::get_world_size(); ++r) all.push_back(at::empty_like(t));
  dist::all_gather(all, t.contiguous());
  return all;
}

double max_diff(Net& a, Net& b) {
  double worst = 0;
  auto pb = b->named_parameters();
  for (const auto& item : a->named_parameters()) {
    worst = std::max(worst, (item.value() - pb[item.key()]).abs().max().item<double>());
  }
  return worst;
}

// ---- Accumulation: N ranks x k micro-steps = one process on the concatenated batch ----------------

struct AccumulationCase {
  int world;
  int k;
  int64_t items;
  int64_t batch;
};

constexpr uint64_t kSeed = 7;
constexpr int kEpochs = 2;
constexpr double kLr = 0.1, kGamma = 0.7;

void run_accumulation(int rank, int world, const AccumulationCase& c) {
  AcceleratorOptions o = test_options();
  o.gradient_accumulation_steps = c.k;
  o.seed = kSeed;
  Accelerator accelerator(o);
  const at::Tensor x = features(c.items, 6), y = regression_targets(c.items);
  torch::manual_seed(0);
  Net net;
  auto model = accelerator.prepare_model(net);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(kLr).momentum(0.9));
  auto optimizer = accelerator.prepare_optimizer(sgd);
  torch::optim::StepLR step_lr(sgd, 1, kGamma);
  auto scheduler = accelerator.prepare_scheduler(step_lr);
  auto loader = accelerator.prepare_data_loader(Items(x).map(Stack<>()), torch::data::DataLoaderOptions(c.batch));

  int64_t micro = 0, syncs = 0;
  for (int epoch = 0; epoch < kEpochs; ++epoch) {
    for (auto& batch : loader) {
      optimizer.zero_grad();
      auto loss = torch::mse_loss(model(batch.data), y.index_select(0, batch.target));
      accelerator.backward(loss);
      ++micro;
      const at::Tensor grad = net->fc1->weight.grad().clone();
      if (!accelerator.sync_gradients()) {
        require(std::isnan(accelerator.clip_grad_norm_(1e9)), "clip_grad_norm_ acted on a non-sync step");
        // Nothing was averaged: each rank holds the gradient of its own (different) data.
        if (world > 1) {
          auto all = gather_all(grad);
          require(!at::equal(all[0], all[1]), "rank 0 and 1 hold equal gradients after a no_sync micro-step");
        }
      } else {
        ++syncs;
        auto all = gather_all(grad);
        for (const auto& g : all) require(at::equal(g, all[0]), "gradients differ across ranks after a sync step");
      }
      optimizer.step();
      scheduler.step();
    }
    require(loader.epoch() == epoch, "the loader's epoch during pass " + std::to_string(epoch) + " is " +
                                         std::to_string(loader.epoch()));
  }
  require(syncs == accelerator.global_step(), "global_step disagrees with the sync steps seen");

  // The reference: one process, the same batches, one optimizer step per sync group.
  torch::manual_seed(0);
  Net ref;
  torch::optim::SGD ref_sgd(ref->parameters(), torch::optim::SGDOptions(kLr).momentum(0.9));
  torch::optim::StepLR ref_lr(ref_sgd, 1, kGamma);
  int64_t ref_steps = 0;
  for (int epoch = 0; epoch < kEpochs; ++epoch) {
    std::vector<std::vector<int64_t>> order;  // per rank
    for (int r = 0; r < world; ++r) {
      data::DistributedSamplerOptions so;
      so.num_replicas = world;
      so.rank = r;
      so.seed = kSeed;
      data::DistributedSampler s(c.items, so);
      s.set_epoch(epoch);
      order.push_back(s.indices());
    }
    const int64_t per_rank = static_cast<int64_t>(order[0].size());
    const int64_t batches = per_rank / c.batch;
    require(batches * c.batch == per_rank, "test sizes must give equal batches");
    for (int64_t first = 0; first < batches; first += c.k) {
      const int64_t group = std::min<int64_t>(c.k, batches - first);  // short at the end of a pass
      std::vector<int64_t> concatenated;
      for (int r = 0; r < world; ++r) {
        for (int64_t m = first; m < first + group; ++m) {
          for (int64_t i = 0; i < c.batch; ++i) concatenated.push_back(order[r][m * c.batch + i]);
        }
      }
      auto idx = torch::tensor(concatenated);
      ref_sgd.zero_grad();
      // Accelerate's scaling: 1/k also when the group is short.
      auto loss = torch::mse_loss(ref->forward(x.index_select(0, idx)), y.index_select(0, idx)) *
                  (static_cast<double>(group) / c.k);
      loss.backward();
      ref_sgd.step();
      ref_lr.step();
      ++ref_steps;
    }
  }
  require(ref_steps == accelerator.global_step(),
          "optimizer steps: " + std::to_string(accelerator.global_step()) + ", reference " + std::to_string(ref_steps));
  const double diff = max_diff(net, ref);
  require(diff <= 1e-5, "rank " + std::to_string(rank) + ": parameters differ from the reference by " +
                            std::to_string(diff));
  // The scheduler advanced once per optimizer step, as the reference's did.
  auto lr_of = [](torch::optim::Optimizer& o) {
    return static_cast<torch::optim::SGDOptions&>(o.param_groups()[0].options()).lr();
  };
  require(lr_of(sgd) == lr_of(ref_sgd) && lr_of(sgd) < kLr,
          "lr " + std::to_string(lr_of(sgd)) + ", reference " + std::to_string(lr_of(ref_sgd)));
}

class Accumulation : public ::testing::TestWithParam<AccumulationCase> {};

TEST_P(Accumulation, EqualsTheLargeBatchStepAndCommunicatesOnlyOnSyncSteps) {
  const AccumulationCase c = GetParam();
  EXPECT_EQ(testing::run_ranks(c.world, [&](int r, int w, std::shared_ptr<Store>) { run_accumulation(r, w, c); }), "");
}

// 48 items: W=2 gives 6 batches of 4 per rank and pass, W=3 gives 4; k=4 on 6 batches ends each
// pass with a short group of 2, which must sync at the last batch.
INSTANTIATE_TEST_SUITE_P(Cases, Accumulation,
                         ::testing::Values(AccumulationCase{2, 2, 48, 4}, AccumulationCase{3, 2, 48, 4},
                                           AccumulationCase{2, 4, 48, 4}, AccumulationCase{1, 3, 12, 2}),
                         [](const auto& info) {
                           return "W" + std::to_string(info.param.world) + "_k" + std::to_string(info.param.k);
                         });

// ---- Mixed precision --------------------------------------------------------------------------

// Mean loss over ranks per step, training a classifier with the given precision.
std::vector<double> train_losses(MixedPrecision precision, c10::ScalarType* hidden_dtype) {
  AcceleratorOptions o = test_options();
  o.mixed_precision = precision;
  Accelerator accelerator(o);
  const int64_t n = 96;
  const at::Tensor x = features(n, 16);
  const at::Tensor classes = (x.narrow(1, 0, 4).argmax(1));  // learnable
  torch::manual_seed(0);
  Net net(16, 32, 4);
  auto model = accelerator.prepare_model(net);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.2));
  auto optimizer = accelerator.prepare_optimizer(sgd);
  auto loader = accelerator.prepare_data_loader(Items(x).map(Stack<>()), torch::data::DataLoaderOptions(8));
  std::vector<double> losses;
  for (int epoch = 0; epoch < 3; ++epoch) {
    for (auto& batch : loader) {
      optimizer.zero_grad();
      at::Tensor out = model(batch.data);
      require(out.scalar_type() == at::kFloat, "the prepared forward did not return float32");
      require(!at::autocast::is_cpu_enabled(), "autocast still enabled after the forward");
      auto loss = torch::cross_entropy_loss(out, classes.index_select(0, batch.target));
      accelerator.backward(loss);
      optimizer.step();
      losses.push_back(accelerator.reduce(loss.detach(), Reduction::kMean).item<double>());
    }
  }
  *hidden_dtype = net->hidden_dtype;
  require(net->fc1->weight.scalar_type() == at::kFloat, "parameters left float32");
  return losses;
}

char* volatile g_escape = nullptr;

// tune_malloc_for_training, in a forked rank (it changes the process's malloc): the user's own
// settings or CHORUS_MALLOC_TUNING=0 leave malloc alone; applied, a 24 MiB block comes from the
// heap (no new mapping) and freeing it keeps the heap (no trim). With glibc's defaults (mmap
// threshold 128 KiB) the same block would be a mapping of its own.
TEST(TuneMalloc, LargeBlocksStayInTheHeapUnlessTheUserSaysOtherwise) {
  EXPECT_EQ(testing::run_ranks(1, [](int, int, std::shared_ptr<Store>) {
    ::setenv("MALLOC_TRIM_THRESHOLD_", "1000000", 1);
    require(!tune_malloc_for_training(), "applied although MALLOC_TRIM_THRESHOLD_ is set");
    ::unsetenv("MALLOC_TRIM_THRESHOLD_");
    ::setenv("CHORUS_MALLOC_TUNING", "0", 1);
    require(!tune_malloc_for_training(), "applied although CHORUS_MALLOC_TUNING=0");
    ::unsetenv("CHORUS_MALLOC_TUNING");
    require(tune_malloc_for_training(), "not applied");
    require(tune_malloc_for_training(), "a second call failed");
    const size_t mapped_before = ::mallinfo2().hblkhd;
    auto* block = static_cast<char*>(std::malloc(size_t{24} << 20));
    require(block != nullptr, "malloc failed");
    std::memset(block, 1, size_t{24} << 20);
    g_escape = block;  // so that the compiler cannot drop the malloc, memset and free as unused
    const struct mallinfo2 holding = ::mallinfo2();
    require(holding.hblkhd == mapped_before, "the 24 MiB block is a mapping of its own: " +
                                                  std::to_string(holding.hblkhd - mapped_before) + " bytes mapped");
    std::free(block);
    require(::mallinfo2().arena >= holding.arena, "freeing the block gave the heap back to the kernel");
  }), "");
}

// The same decision from an Environment value (no setenv): the user's MALLOC_* settings, even
// empty, or CHORUS_MALLOC_TUNING=0 leave malloc alone, and nothing is changed then; any other
// CHORUS_MALLOC_TUNING applies it (in a forked rank, as it changes the process's malloc).
TEST(TuneMalloc, TheEnvironmentValueDecides) {
  EXPECT_FALSE(tune_malloc_for_training(Environment{{"MALLOC_MMAP_THRESHOLD_", "65536"}}));
  EXPECT_FALSE(tune_malloc_for_training(Environment{{"MALLOC_TRIM_THRESHOLD_", ""}}));
  EXPECT_FALSE(tune_malloc_for_training(Environment{{"CHORUS_MALLOC_TUNING", "0"}}));
  EXPECT_EQ(testing::run_ranks(1, [](int, int, std::shared_ptr<Store>) {
    require(tune_malloc_for_training(Environment{{"CHORUS_MALLOC_TUNING", "1"}}), "not applied");
  }), "");
}

// Progress lines rewritten in place: only on a terminal, not with TERM=dumb, and not under a
// launcher that relays the output (its variable set, even to "").
TEST(Progress, RewritesInPlaceOnlyOnATerminalNoLauncherRelays) {
  EXPECT_TRUE(stdout_rewrites_in_place(Environment{{"TERM", "xterm-256color"}}, true));
  EXPECT_TRUE(stdout_rewrites_in_place(Environment{}, true));
  EXPECT_FALSE(stdout_rewrites_in_place(Environment{{"TERM", "xterm"}}, false));
  EXPECT_FALSE(stdout_rewrites_in_place(Environment{{"TERM", "dumb"}}, true));
  for (const char* relay : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_STEP_ID", "SLURM_STEPID"}) {
    EXPECT_FALSE(stdout_rewrites_in_place(Environment{{"TERM", "xterm"}, {relay, "2"}}, true)) << relay;
    EXPECT_FALSE(stdout_rewrites_in_place(Environment{{relay, ""}}, true)) << relay << " set to \"\"";
  }
}

TEST(MixedPrecision, BF16LossStaysWithinToleranceOfFP32) {
  EXPECT_EQ(testing::run_ranks(2, [](int rank, int, std::shared_ptr<Store>) {
    c10::ScalarType fp32_hidden, bf16_hidden;
    auto fp32 = train_losses(MixedPrecision::kNo, &fp32_hidden);
    auto bf16 = train_losses(MixedPrecision::kBF16, &bf16_hidden);
    require(fp32_hidden == at::kFloat, "fp32 run computed in " + std::string(c10::toString(fp32_hidden)));
    require(bf16_hidden == at::kBFloat16, "bf16 run computed in " + std::string(c10::toString(bf16_hidden)));
    require(fp32.size() == bf16.size() && fp32.size() == 18, "unexpected step count");
    double worst = 0;
    for (size_t i = 0; i < fp32.size(); ++i) worst = std::max(worst, std::abs(bf16[i] - fp32[i]) / fp32[i]);
    if (rank == 0) {
      std::printf("bf16 vs fp32 over %zu steps: loss %.4f -> %.4f vs %.4f -> %.4f, worst relative difference %.3f%%\n",
                  fp32.size(), bf16.front(), bf16.back(), fp32.front(), fp32.back(), worst * 100);
    }
    // bfloat16 keeps 8 significant bits (relative rounding 2^-9 per operation); measured 0.055%.
    require(worst < 0.01, "bf16 loss differs from fp32 by " + std::to_string(worst * 100) + "%");
    require(worst > 0, "bf16 losses equal fp32 exactly: autocast did nothing");
    require(fp32.back() < fp32.front(), "the fp32 run did not learn");
  }), "");
}

TEST(MixedPrecision, FP16OnCpuIsAUsageErrorThatSuggestsBF16) {
  AcceleratorOptions o = test_options();
  o.mixed_precision = MixedPrecision::kFP16;
  try {
    Accelerator accelerator(o);
    FAIL() << "no error for fp16";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("kBF16"), std::string::npos) << e.what();
  }
  AcceleratorOptions zero;
  zero.gradient_accumulation_steps = 0;
  EXPECT_THROW(Accelerator{zero}, UsageError);
}

// ---- Metrics ----------------------------------------------------------------------------------

struct BnNetImpl : torch::nn::Module {
  BnNetImpl() {
    fc = register_module("fc", torch::nn::Linear(6, 3));
    bn = register_module("bn", torch::nn::BatchNorm1d(3));
  }
  at::Tensor forward(const at::Tensor& x) { return bn(fc(x)); }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(BnNet);

TEST(Metrics, GatherForMetricsIsExactOnUnevenShards) {
  EXPECT_EQ(testing::run_ranks(3, [](int rank, int, std::shared_ptr<Store>) {
    Accelerator accelerator(test_options());
    const int64_t n = 10;  // 4, 3, 3 items
    const at::Tensor x = features(n, 6);
    torch::manual_seed(0);
    BnNet net;
    auto model = accelerator.prepare_model(net);
    // One training forward on rank-dependent data gives each rank its own BatchNorm statistics.
    model(x + rank);
    model.eval();  // collective: rank 0's statistics everywhere
    auto loader = accelerator.prepare_eval_loader(Items(x).map(Stack<>()), torch::data::DataLoaderOptions(1));
    std::vector<at::Tensor> ids, outputs;
    torch::NoGradGuard no_grad;
    for (auto& batch : *loader) {  // 4 batches on rank 0, 3 elsewhere: no collective may run here
      ids.push_back(batch.target);
      outputs.push_back(model(batch.data));
    }
    at::Tensor all_ids = accelerator.gather_for_metrics(torch::cat(ids), n);
    require(at::equal(all_ids, torch::arange(n)), "gathered ids are not 0..9 once each in order");
    at::Tensor all_out = accelerator.gather_for_metrics(torch::cat(outputs), n);
    at::Tensor local_all = net->forward(x);
    require(all_out.size(0) == n, "gathered rows: " + std::to_string(all_out.size(0)));
    require((all_out - local_all).abs().max().item<double>() < 1e-5, "gathered outputs differ from the model's");
  }), "");
}

TEST(Metrics, ReduceSumAndMean) {
  EXPECT_EQ(testing::run_ranks(3, [](int rank, int, std::shared_ptr<Store>) {
    Accelerator accelerator(test_options());
    auto t = torch::tensor({static_cast<float>(rank + 1), 2.0f * rank});
    require(at::equal(accelerator.reduce(t), torch::tensor({6.0f, 6.0f})), "sum");
    require(at::equal(accelerator.reduce(t, Reduction::kMean), torch::tensor({2.0f, 2.0f})), "mean");
    require(at::equal(t, torch::tensor({static_cast<float>(rank + 1), 2.0f * rank})), "input changed");
    auto counts = torch::tensor({int64_t{rank} * 3});
    auto mean = accelerator.reduce(counts, Reduction::kMean);
    require(mean.is_floating_point() && mean.item<double>() == 3.0, "integer mean");
    require(accelerator.reduce(counts).item<int64_t>() == 9, "integer sum");
  }), "");
}

// ---- Errors and helpers -----------------------------------------------------------------------

void expect_usage_error(const std::function<void()>& fn, const std::vector<std::string>& phrases) {
  try {
    fn();
  } catch (const UsageError& e) {
    const std::string what = e.what();
    for (const auto& p : phrases) require(what.find(p) != std::string::npos, "message lacks '" + p + "': " + what);
    return;
  }
  throw std::runtime_error("no UsageError");
}

TEST(PrepareErrors, DoublePrepareAndForeignOptimizerParameters) {
  EXPECT_EQ(testing::run_ranks(2, [](int, int, std::shared_ptr<Store>) {
    Accelerator accelerator(test_options());
    torch::manual_seed(0);
    Net net, other;
    auto model = accelerator.prepare_model(net);
    expect_usage_error([&] { accelerator.prepare_model(net); }, {"prepared already", "rank "});
    expect_usage_error([&] { accelerator.prepare_model(net->fc1); }, {"2 of this model's", "Prepare only the outer"});
    torch::optim::SGD wrong(other->parameters(), 0.1);
    expect_usage_error([&] { accelerator.prepare_optimizer(wrong); },
                       {"4 of the optimizer's 4 parameters", "[8, 6]", "prepare_model"});
    auto params = net->parameters();
    params.push_back(torch::zeros({5, 5}, torch::requires_grad()));
    torch::optim::Adam extra(params, 0.1);
    expect_usage_error([&] { accelerator.prepare_optimizer(extra); }, {"1 of the optimizer's 5", "[5, 5]"});
    torch::optim::SGD right(net->parameters(), 0.1);
    accelerator.prepare_optimizer(right);  // no error
    expect_usage_error([&] {
      accelerator.prepare_data_loader(Items(features(4, 6)).map(Stack<>()), torch::data::DataLoaderOptions(0));
    }, {"batch_size"});
    torch::optim::SGD nan_lr(net->parameters(), 0.1);  // libtorch checks at construction only
    nan_lr.param_groups()[0].options().set_lr(std::nan(""));
    expect_usage_error([&] { accelerator.prepare_optimizer(nan_lr); }, {"learning rate", "finite"});
  }), "");
}

TEST(MainProcess, FirstRunsOnRankZeroBeforeTheOthers) {
  const fs::path marker = fs::temp_directory_path() / testing::unique_name("accelerator-first");
  EXPECT_EQ(testing::run_ranks(3, [&](int rank, int, std::shared_ptr<Store>) {
    Accelerator accelerator(test_options());
    require(accelerator.is_main_process() == (rank == 0), "is_main_process");
    accelerator.main_process_first([&] {
      if (rank == 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        std::ofstream(marker) << "cache";
      } else {
        require(fs::exists(marker), "rank " + std::to_string(rank) + " ran before rank 0 finished");
      }
    });
    accelerator.wait_for_everyone();
    // Rank 0's failure reaches the others, who do not run the function.
    bool ran = false;
    try {
      accelerator.main_process_first([&] {
        ran = true;
        if (rank == 0) throw std::runtime_error("cache build failed");
      });
    } catch (const std::exception& e) {
      require(std::string(e.what()).find("cache build failed") != std::string::npos, e.what());
      require(rank == 0 ? ran : !ran, "rank " + std::to_string(rank) + " ran after rank 0 failed");
      return;
    }
    throw std::runtime_error("no error after rank 0 failed");
  }), "");
  fs::remove(marker);
}

// ---- Clipping ---------------------------------------------------------------------------------

TEST(ClipGradNorm, SameOnEveryRankAndEqualToTheAveragedGradientsNorm) {
  EXPECT_EQ(testing::run_ranks(3, [](int rank, int world, std::shared_ptr<Store>) {
    Accelerator accelerator(test_options());
    const at::Tensor x = features(12, 6), y = regression_targets(12);
    torch::manual_seed(0);
    Net net;
    auto model = accelerator.prepare_model(net);
    auto mine = torch::arange(rank * 4, rank * 4 + 4);
    accelerator.backward(torch::mse_loss(model(x.index_select(0, mine)), y.index_select(0, mine)));
    const double max_norm = 0.05;
    const double norm = accelerator.clip_grad_norm_(max_norm);
    auto norms = gather_all(torch::tensor({norm}, torch::kDouble));
    for (const auto& n : norms) require(at::equal(n, norms[0]), "ranks got different norms");
    // The reference: the norm of the gradient averaged over the ranks' losses, in one process.
    torch::manual_seed(0);
    Net ref;
    at::Tensor total = torch::zeros({});
    for (int r = 0; r < world; ++r) {
      auto idx = torch::arange(r * 4, r * 4 + 4);
      total = total + torch::mse_loss(ref->forward(x.index_select(0, idx)), y.index_select(0, idx));
    }
    (total / world).backward();
    double sq = 0;
    for (const auto& p : ref->parameters()) sq += p.grad().pow(2).sum().item<double>();
    const double expected = std::sqrt(sq);
    require(expected > max_norm, "the test must clip");
    require(std::abs(norm - expected) <= 1e-5 * expected,
            "norm " + std::to_string(norm) + ", averaged gradient's " + std::to_string(expected));
    double after = 0;
    for (const auto& p : net->parameters()) after += p.grad().pow(2).sum().item<double>();
    require(std::abs(std::sqrt(after) - max_norm) < 1e-4, "not clipped to max_norm: " + std::to_string(std::sqrt(after)));
  }), "");
}

}  // namespace
}  // namespace chorus::train
