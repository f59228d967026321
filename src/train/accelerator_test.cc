// Accelerator: accumulation equals the large-batch step (and communicates only on sync steps),
// bf16 autocast within tolerance of fp32, the fp16 error, exact gather_for_metrics on uneven
// shards, reduce, the prepare errors, main_process_first ordering and clip_grad_norm_.
//
// Libtorch work runs in forked ranks (run_ranks) only, so the gtest process can fork safely.
#include "chorus/train/accelerator.h"

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <malloc.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <thread>

#include "chorus/comm/signals.h"
#include "chorus/train/checkpoint.h"
#include "testing.h"

namespace chorus::train {
namespace {

namespace fs = std::filesystem;
using torch::data::transforms::Stack;

void require(bool ok, const std::string& what) {
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
AcceleratorOptions test_options(const std::string& suffix = "") {
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
at::Tensor features(int64_t n, int64_t dim) {
  auto gen = at::detail::createCPUGenerator(42);
  return at::randn({n, dim}, gen);
}
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


// ---- State, resume, signals and records ---------------------------------------------------------

struct DropNetImpl : torch::nn::Module {
  DropNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 16));
    drop = register_module("drop", torch::nn::Dropout(0.3));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(drop(torch::relu(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(DropNet);

// One optimizer step as the loop saw it.
struct StepTrace {
  int64_t step = 0;
  int64_t epoch = 0;
  std::vector<int64_t> items;  // the items of its micro-batches, in order
  double loss = 0;             // sum of its micro-batches' losses (compared bit for bit)
  double lr = 0;
  bool operator==(const StepTrace& o) const {
    return step == o.step && epoch == o.epoch && items == o.items && loss == o.loss && lr == o.lr;
  }
};

std::string describe(const StepTrace& t) {
  std::ostringstream out;
  out << "step " << t.step << " epoch " << t.epoch << " loss " << std::hexfloat << t.loss << std::defaultfloat << " lr "
      << t.lr << " items";
  for (auto i : t.items) out << ' ' << i;
  return out.str();
}

struct JobResult {
  std::vector<StepTrace> trace;
  std::string counter;       // a registered user object: the number of steps it has seen
  at::Tensor parameters;     // all parameters, flattened, at the end
  bool stopped = false;
};

constexpr int64_t kStateItems = 45;  // W=2, batch 4: 23 items a rank, 6 batches (the last short), k=2: 3 steps an epoch

// Everything the state holds: dropout (RNG), SGD with momentum, a StepLR scheduler, accumulation,
// a prepared loader and a registered object. on_step runs after each optimizer step.
JobResult state_job(AcceleratorOptions o, int64_t epochs, const std::function<void(Accelerator&)>& on_step = {}) {
  o.gradient_accumulation_steps = 2;
  o.seed = 11;
  Accelerator accelerator(o);
  const at::Tensor x = features(kStateItems, 6);
  const at::Tensor classes = x.narrow(1, 0, 3).argmax(1);
  torch::manual_seed(3 + accelerator.rank());
  DropNet net;
  auto model = accelerator.prepare_model(net);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto optimizer = accelerator.prepare_optimizer(sgd);
  torch::optim::StepLR step_lr(sgd, 2, 0.5);
  auto scheduler = accelerator.prepare_scheduler(step_lr);
  auto loader = accelerator.prepare_data_loader(Items(x).map(Stack<>()), torch::data::DataLoaderOptions(4));
  JobResult result;
  result.counter = "0";
  accelerator.register_for_checkpointing(
      "counter", [&] { return result.counter; }, [&](const std::string& s) { result.counter = s; });
  StepTrace current;
  for (int64_t epoch : accelerator.epochs(epochs)) {
    int64_t items = 0;
    for (auto& batch : loader) {
      optimizer.zero_grad();
      auto loss = torch::cross_entropy_loss(model(batch.data), classes.index_select(0, batch.target));
      accelerator.backward(loss);
      for (int64_t i = 0; i < batch.target.size(0); ++i) current.items.push_back(batch.target[i].item<int64_t>());
      current.loss += loss.item<double>();
      items += batch.target.size(0);
      optimizer.step();
      scheduler.step();
      if (!accelerator.sync_gradients()) continue;
      current.step = accelerator.global_step();
      current.epoch = epoch;
      current.lr = sgd.param_groups()[0].options().get_lr();
      result.trace.push_back(current);
      current = StepTrace();
      result.counter = std::to_string(std::stoll(result.counter) + 1);
      if (on_step) on_step(accelerator);
    }
    accelerator.log({{"epoch_items", items}});
  }
  result.stopped = accelerator.stopped();
  std::vector<at::Tensor> flat;
  for (const auto& p : net->parameters()) flat.push_back(p.detach().flatten());
  result.parameters = at::cat(flat);
  return result;
}

void require_same(const std::vector<StepTrace>& got, const std::vector<StepTrace>& want, const std::string& what) {
  require(got.size() == want.size(), what + ": " + std::to_string(got.size()) + " steps, expected " +
                                         std::to_string(want.size()));
  for (size_t i = 0; i < got.size(); ++i) {
    require(got[i] == want[i], what + ": step " + std::to_string(i) + " differs:\n  got  " + describe(got[i]) +
                                   "\n  want " + describe(want[i]));
  }
}

std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::ifstream in(path);
  require(static_cast<bool>(in), "cannot read " + path);
  std::vector<nlohmann::json> lines;
  std::string text;
  while (std::getline(in, text)) lines.push_back(nlohmann::json::parse(text));
  return lines;
}

std::vector<nlohmann::json> of_type(const std::vector<nlohmann::json>& lines, const std::string& type) {
  std::vector<nlohmann::json> out;
  for (const auto& l : lines) {
    if (l.value("type", "") == type) out.push_back(l);
  }
  return out;
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  require(static_cast<bool>(in), "cannot read " + path);
  return nlohmann::json::parse(in);
}

TEST(State, MidEpochResumeGivesTheSameBatchesLossesAndObjects) {
  EXPECT_EQ(testing::run_ranks(2, [](int, int, std::shared_ptr<Store>) {
    torch::set_num_threads(1);
    const JobResult full = state_job(test_options("_full"), 3);
    require(full.trace.size() == 9, "the uninterrupted run has " + std::to_string(full.trace.size()) + " steps");

    // Saves at step 4 (mid-epoch 1), goes on to step 7 and ends without saving: like a kill after 7.
    AcceleratorOptions first = test_options("_part");
    first.checkpoint_each_epoch = false;
    first.checkpoint_every = 4;
    first.max_steps = 7;
    const JobResult part1 = state_job(first, 3);
    require_same(part1.trace, {full.trace.begin(), full.trace.begin() + 7}, "before the interruption");

    AcceleratorOptions second = test_options("_part");
    second.resume = true;
    const JobResult part2 = state_job(second, 3);
    require_same(part2.trace, {full.trace.begin() + 4, full.trace.end()}, "after resuming at step 4");
    require(part2.counter == full.counter && full.counter == "9", "user object: " + part2.counter + " vs " + full.counter);
    require(at::equal(part2.parameters, full.parameters), "final parameters differ from the uninterrupted run's");

    // The records hold each step once: the resumed run dropped steps 5..7 of the first attempt.
    const std::string dir = RunRoot::path() + "/" + test_options("_part").run_name;
    for (const std::string& file : {dir + "/metrics/rank-" + std::to_string(dist::get_rank()) + ".jsonl",
                                    dir + "/metrics.jsonl"}) {
      if (file == dir + "/metrics.jsonl" && dist::get_rank() != 0) continue;
      auto steps = of_type(read_jsonl(file), "step");
      require(steps.size() == 9, file + ": " + std::to_string(steps.size()) + " step lines, expected 9");
      for (size_t i = 0; i < steps.size(); ++i) {
        require(steps[i]["step"].get<int64_t>() == static_cast<int64_t>(i + 1), file + ": steps out of order");
      }
    }
  }), "");
}

TEST(State, ARestartResumesWithoutAFlagAndAStaleStateIsRefused) {
  EXPECT_EQ(testing::run_ranks(2, [](int, int, std::shared_ptr<Store>) {
    torch::set_num_threads(1);
    const JobResult full = state_job(test_options("_full"), 2);
    AcceleratorOptions first = test_options();
    first.max_steps = 2;
    state_job(first, 2);

    ::setenv("CHORUS_RESTART_COUNT", "1", 1);  // as `chorus run --max-restarts` sets it for attempt 2
    const JobResult restarted = state_job(test_options(), 2);
    ::unsetenv("CHORUS_RESTART_COUNT");
    require_same(restarted.trace, {full.trace.begin() + 2, full.trace.end()}, "after the restart");

    try {
      state_job(test_options(), 2);
      require(false, "a run over a saved state without resume or overwrite was not refused");
    } catch (const UsageError& e) {
      const std::string what = e.what();
      require(what.find("--resume") != std::string::npos && what.find("--overwrite") != std::string::npos &&
                  what.find("step 6") != std::string::npos,
              "refusal does not name the fixes and the saved step: " + what);
    }
    AcceleratorOptions afresh = test_options();
    afresh.overwrite = true;
    require_same(state_job(afresh, 2).trace, full.trace, "overwrite starts afresh");
  }), "");
}

TEST(State, ALoopWithoutEpochsResumesAtTheLoadersFirstPass) {
  EXPECT_EQ(testing::run_ranks(2, [](int, int, std::shared_ptr<Store>) {
    AcceleratorOptions first = test_options();
    first.max_steps = 2;
    state_job(first, 2);
    // The same job, its loop written by hand (no epochs()): the restart still resumes at step 3.
    ::setenv("CHORUS_RESTART_COUNT", "1", 1);
    AcceleratorOptions o = test_options();
    o.gradient_accumulation_steps = 2;
    o.seed = 11;
    Accelerator accelerator(o);
    ::unsetenv("CHORUS_RESTART_COUNT");
    DropNet net;
    auto model = accelerator.prepare_model(net);
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    auto optimizer = accelerator.prepare_optimizer(sgd);
    const at::Tensor x = features(kStateItems, 6);
    auto loader = accelerator.prepare_data_loader(Items(x).map(Stack<>()), torch::data::DataLoaderOptions(4));
    for (auto& batch : loader) {
      require(accelerator.global_step() >= 2, "the first batch came before the state was loaded");
      optimizer.zero_grad();
      accelerator.backward(torch::cross_entropy_loss(model(batch.data), x.narrow(1, 0, 3).argmax(1).index_select(0, batch.target)));
      optimizer.step();
    }
    require(accelerator.global_step() == 3, "after one pass from the resumed position: step " +
                                                std::to_string(accelerator.global_step()));
  }), "");
}

TEST(Signals, SigusrOnOneRankSavesStateOnAllAndExitsZero) {
  auto reports = testing::run_ranks_independent(2, [](int rank, int world) -> std::string {
    torch::set_num_threads(1);
    dist::init_process_group("chorus", "env://", rank, world);
    state_job(test_options(), 100, [rank](Accelerator& a) {
      if (a.global_step() == 5 && rank == 1) ::raise(SIGUSR1);  // as the launcher would forward it
    });
    return "training went on after SIGUSR1";
  });
  for (const auto& r : reports) {
    EXPECT_TRUE(r.exited && r.exit_code == 0) << "rank " << r.rank << ": exit " << r.exit_code << " signal " << r.signal;
    EXPECT_EQ(r.text, "") << "rank " << r.rank;
  }
  const std::string dir = RunRoot::path() + "/" + test_options().run_name;
  auto latest = latest_checkpoint(dir + "/state");
  ASSERT_TRUE(latest.has_value()) << "no state saved in " << dir;
  // Raised after step 5; the ranks agree at the next boundary (the check is one step behind).
  EXPECT_EQ(read_json(*latest + "/state.json")["step"].get<int64_t>(), 6);
  auto summary = read_json(dir + "/summary.json");
  EXPECT_EQ(summary["status"], "stopped");
  EXPECT_EQ(summary["steps"].get<int64_t>(), 6);
  auto events = of_type(read_jsonl(dir + "/metrics/rank-1.jsonl"), "event");
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back()["event"], "stop");
  EXPECT_EQ(events.back()["signal"].get<int>(), SIGUSR1);
}

TEST(Signals, WithoutExitTheLoopsEndAndStoppedIsTrue) {
  EXPECT_EQ(testing::run_ranks(2, [](int rank, int, std::shared_ptr<Store>) {
    AcceleratorOptions o = test_options();
    o.exit_on_signal = false;
    const JobResult r = state_job(o, 100, [rank](Accelerator& a) {
      if (a.global_step() == 3 && rank == 0) ::raise(SIGTERM);
    });
    chorus::clear_pending_signal();
    // Raised after step 3, the last of epoch 0: the epoch's end agrees at once (blocking check).
    require(r.stopped && r.trace.size() == 3, "stopped " + std::to_string(r.stopped) + " after " +
                                                  std::to_string(r.trace.size()) + " steps");
  }), "");
}

TEST(Records, PerRankLinesAggregateConfigSummaryAndLogs) {
  EXPECT_EQ(testing::run_ranks(2, [](int rank, int, std::shared_ptr<Store>) {
    AcceleratorOptions o = test_options();
    o.config = {{"lr", 0.1}, {"note", "records test"}};
    state_job(o, 2);
    dist::barrier();
    if (rank != 0) return;
    const std::string dir = RunRoot::path() + "/" + o.run_name;
    auto r0 = of_type(read_jsonl(dir + "/metrics/rank-0.jsonl"), "step");
    auto r1 = of_type(read_jsonl(dir + "/metrics/rank-1.jsonl"), "step");
    auto all = read_jsonl(dir + "/metrics.jsonl");
    auto agg = of_type(all, "step");
    require(r0.size() == 6 && r1.size() == 6 && agg.size() == 6, "step lines: " + std::to_string(r0.size()) + ", " +
                                                                     std::to_string(r1.size()) + ", aggregate " +
                                                                     std::to_string(agg.size()));
    for (size_t i = 0; i < agg.size(); ++i) {
      for (const char* key : {"epoch", "time", "loss", "lr", "samples", "samples_per_s", "step_ms", "data_ms",
                              "forward_ms", "backward_ms", "optimizer_ms", "comm_ms", "comm_wait_ms", "hidden"}) {
        require(agg[i].contains(key) && r0[i].contains(key), std::string("no ") + key + " in step lines");
      }
      require(agg[i]["samples"].get<int64_t>() == r0[i]["samples"].get<int64_t>() + r1[i]["samples"].get<int64_t>(),
              "aggregate samples are not the sum over ranks");
      const double mean = (r0[i]["loss"].get<double>() + r1[i]["loss"].get<double>()) / 2;
      require(std::abs(agg[i]["loss"].get<double>() - mean) < 1e-12, "aggregate loss is not the mean over ranks");
      require(agg[i]["step_ms"].get<double>() ==
                  std::max(r0[i]["step_ms"].get<double>(), r1[i]["step_ms"].get<double>()),
              "aggregate step_ms is not the slowest rank's");
      require(r0[i]["forward_ms"].get<double>() > 0 && r0[i]["backward_ms"].get<double>() > 0 &&
                  r0[i]["comm_ms"].get<double>() > 0,
              "phases not measured: " + r0[i].dump());
    }
    // 45 items, 23 a rank (one padded): an epoch's steps hold 8 + 8 + 7 samples a rank.
    require(r0[2]["samples"].get<int64_t>() == 7 && agg[0]["samples"].get<int64_t>() == 16, "samples per step");
    // User scalars: after the epoch's last step, in rank 0's file and in the aggregate.
    auto logs = of_type(all, "log");
    require(logs.size() == 2 && logs[0]["step"].get<int64_t>() == 3 && logs[0]["epoch_items"].get<int64_t>() == 23,
            "log lines: " + nlohmann::json(logs).dump());
    size_t log_at = 0;
    while (all[log_at].value("type", "") != "log") ++log_at;
    require(all[log_at - 1].value("type", "") == "step" && all[log_at - 1]["step"].get<int64_t>() == 3,
            "the epoch's log line is not after its last step in the aggregate");
    auto events = of_type(all, "event");
    std::vector<std::string> names;
    for (const auto& e : events) names.push_back(e["event"]);
    require(names == std::vector<std::string>({"start", "save", "save", "finish"}), "events: " + nlohmann::json(names).dump());
    auto config = read_json(dir + "/config.json");
    require(config["run_name"] == o.run_name && config["world_size"] == 2 && config["config"]["note"] == "records test" &&
                config["accelerator"]["gradient_accumulation_steps"] == 2,
            "config.json: " + config.dump());
    auto summary = read_json(dir + "/summary.json");
    require(summary["status"] == "finished" && summary["steps"] == 6 && summary["samples"].get<double>() == 92 &&
                summary["last"]["epoch_items"] == 23 && summary["samples_per_s"].get<double>() > 0,
            "summary.json: " + summary.dump());
    std::ifstream log0(dir + "/logs/rank-0.log"), log1(dir + "/logs/rank-1.log");
    std::string text0((std::istreambuf_iterator<char>(log0)), {});
    require(text0.find("done: 6 steps") != std::string::npos, "rank 0's log: " + text0);
    require(static_cast<bool>(log1), "no rank-1 log");
  }), "");
}

}  // namespace
}  // namespace chorus::train
