// SyncBatchNorm at W=2 and W=3 with uneven batches (ranks with 1 sample, a rank with none) matches
// one process on the concatenated batch, for 3 training steps and an eval forward: libtorch's own
// BatchNorm in every rank, and PyTorch's (sync_batch_norm_test.py, run once for all cases) when
// /usr/bin/python3 imports torch. Also: the errors, eval mode without communication, a world of
// one and no process group. All libtorch work runs in the forked ranks, none in the parent.
#include "chorus/ddp/sync_batch_norm.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/torch/distributed.h"
#include "sync_batch_norm_test_util.h"
#include "testing.h"

#ifndef CHORUS_SYNC_BATCH_NORM_SCRIPT
#define CHORUS_SYNC_BATCH_NORM_SCRIPT "src/ddp/sync_batch_norm_test.py"
#endif

namespace chorus::ddp {
namespace {

constexpr int kSteps = 3;

struct Case {
  std::string name;
  std::vector<int64_t> batches;  // per rank
  std::vector<int64_t> spatial;  // {} for (N, C), {L}, {H, W}, {D, H, W}
  int64_t channels = 3;
  c10::optional<double> momentum = 0.1;
  bool affine = true;
  bool track = true;

  int world() const { return static_cast<int>(batches.size()); }
  int64_t batch() const { return sum(batches, 0, batches.size()); }
  int64_t offset(int rank) const { return sum(batches, 0, rank); }
  int64_t per_sample() const { return channels * product(spatial); }
  std::vector<int64_t> shape(int64_t n) const {
    std::vector<int64_t> s = {n, channels};
    s.insert(s.end(), spatial.begin(), spatial.end());
    return s;
  }
};

const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {"W2_NC_batches_1_5", {1, 5}, {}, 4},
      {"W2_NCHW_batches_3_1", {3, 1}, {3, 2}},
      {"W2_NCDHW_batches_2_1_momentum_0_3", {2, 1}, {2, 2, 2}, 2, 0.3},
      {"W3_NCL_batches_2_1_4", {2, 1, 4}, {5}},
      {"W3_NCHW_empty_rank_cumulative_average", {0, 2, 3}, {2, 3}, 2, c10::nullopt},
      {"W3_NC_no_affine_no_running_stats", {2, 0, 3}, {}, 3, 0.1, false, false},
  };
  return all;
}

// The values of one case, the same in every process and in Python.
struct CaseData {
  std::vector<float> weight, bias, eval_x;
  std::vector<std::vector<float>> x, loss_weights;
};

CaseData data_of(const Case& c, uint64_t index) {
  CaseData d;
  const int64_t n = c.batch() * c.per_sample();
  d.weight = dyadic_values(c.channels, index * 100 + 1, 0.5f, 1.0f);
  d.bias = dyadic_values(c.channels, index * 100 + 2, 0.5f, 0.0f);
  d.eval_x = dyadic_values(n, index * 100 + 3, 2.0f, 3.0f);
  for (int step = 0; step < kSteps; ++step) {
    // Mean 3 + step, spread 2: away from zero, so the variance is not the mean square.
    d.x.push_back(dyadic_values(n, index * 100 + 10 + step, 2.0f, 3.0f + step));
    d.loss_weights.push_back(dyadic_values(n, index * 100 + 20 + step, 1.0f, 0.25f));
  }
  return d;
}

nlohmann::json python_input() {
  nlohmann::json out = {{"cases", nlohmann::json::array()}};
  for (size_t i = 0; i < cases().size(); ++i) {
    const Case& c = cases()[i];
    const CaseData d = data_of(c, i);
    nlohmann::json steps = nlohmann::json::array();
    for (int s = 0; s < kSteps; ++s) steps.push_back({{"x", d.x[s]}, {"loss_weights", d.loss_weights[s]}});
    out["cases"].push_back({{"name", c.name}, {"channels", c.channels}, {"spatial", c.spatial},
                            {"batch", c.batch()}, {"eps", 1e-5},
                            {"momentum", c.momentum ? nlohmann::json(*c.momentum) : nlohmann::json(nullptr)},
                            {"affine", c.affine}, {"track_running_stats", c.track}, {"weight", d.weight},
                            {"bias", d.bias}, {"steps", steps}, {"eval_x", d.eval_x}});
  }
  return out;
}

// PyTorch's results for every case, computed once per test process.
struct PythonGolden {
  bool available = false;
  std::string error;  // the script ran and failed
  nlohmann::json cases;
};

const PythonGolden& python_golden() {
  static const PythonGolden golden = [] {
    PythonGolden g;
    const std::string python = testing::parity_python();
    int status = 0;
    testing::run_capture(python + " -c 'import torch' >/dev/null 2>&1", &status);
    if (status != 0) return g;
    char tmpl[] = "/tmp/chorus-sync-bn-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) {
      g.error = "mkdtemp failed";
      return g;
    }
    const std::string dir = tmpl;
    std::ofstream(dir + "/input.json") << python_input().dump();
    const std::string output = testing::run_capture(python + " " + CHORUS_SYNC_BATCH_NORM_SCRIPT + " --input " + dir +
                                                        "/input.json --output " + dir + "/golden.json 2>&1",
                                                    &status);
    g.available = true;
    if (status != 0 || output.find("OK: ") == std::string::npos) {
      g.error = "sync_batch_norm_test.py failed: " + output;
    } else {
      std::ifstream in(dir + "/golden.json");
      g.cases = nlohmann::json::parse(in);
    }
    std::filesystem::remove_all(dir);
    return g;
  }();
  return golden;
}

torch::Tensor tensor_of(const std::vector<float>& v, const std::vector<int64_t>& shape) {
  return torch::tensor(v, torch::kFloat32).reshape(shape);
}

// What one module did over the steps: each step's output and gradients, the running statistics
// after it, and an eval-mode output at the end.
struct Trace {
  std::vector<torch::Tensor> out, grad_input, grad_weight, grad_bias, running_mean, running_var;
  torch::Tensor eval_out;
};

// Rows [offset, offset + rows) of each global tensor of the case go through bn (all rows: one process).
struct Slice {
  int64_t offset = 0;
  int64_t rows = 0;
};

using Forward = std::function<torch::Tensor(const torch::Tensor&)>;

Trace run_trace(torch::nn::Module& bn, const Forward& forward, const Case& c, const CaseData& d, Slice slice,
                const Forward& sum_over_ranks) {
  auto params = bn.named_parameters();
  auto buffers = bn.named_buffers();
  if (c.affine) {
    torch::NoGradGuard no_grad;
    params["weight"].copy_(tensor_of(d.weight, {c.channels}));
    params["bias"].copy_(tensor_of(d.bias, {c.channels}));
  }
  auto rows = [&](const std::vector<float>& v) {
    return tensor_of(v, c.shape(c.batch())).narrow(0, slice.offset, slice.rows).clone();
  };
  auto reduced = [&](const char* name) {
    const auto& g = params[name].grad();
    return sum_over_ranks ? sum_over_ranks(g) : g.clone();
  };
  auto buffer = [&](const char* name) {
    const auto* b = buffers.find(name);  // absent without track_running_stats
    return b != nullptr && b->defined() ? b->clone() : torch::Tensor();
  };
  Trace t;
  bn.train();
  for (int s = 0; s < kSteps; ++s) {
    bn.zero_grad();
    auto x = rows(d.x[s]).requires_grad_();
    auto out = forward(x);
    (out * rows(d.loss_weights[s])).sum().backward();
    t.out.push_back(out.detach());
    t.grad_input.push_back(x.grad());
    t.grad_weight.push_back(c.affine ? reduced("weight") : torch::Tensor());
    t.grad_bias.push_back(c.affine ? reduced("bias") : torch::Tensor());
    t.running_mean.push_back(buffer("running_mean"));
    t.running_var.push_back(buffer("running_var"));
  }
  bn.eval();
  torch::NoGradGuard no_grad;
  t.eval_out = forward(rows(d.eval_x));
  return t;
}

// got (one rank's run) against want (the whole batch): rows of outputs, whole per-channel tensors.
void expect_trace_slice(const std::string& where, const Trace& got, const Trace& want, Slice slice, bool eval) {
  auto rows = [&](const torch::Tensor& t) { return t.narrow(0, slice.offset, slice.rows); };
  for (int s = 0; s < kSteps; ++s) {
    const std::string at = where + " step " + std::to_string(s) + " ";
    expect_close(at + "output", got.out[s], rows(want.out[s]));
    expect_close(at + "grad_input", got.grad_input[s], rows(want.grad_input[s]));
    expect_close(at + "grad_weight summed over ranks", got.grad_weight[s], want.grad_weight[s]);
    expect_close(at + "grad_bias summed over ranks", got.grad_bias[s], want.grad_bias[s]);
    expect_close(at + "running_mean", got.running_mean[s], want.running_mean[s]);
    expect_close(at + "running_var", got.running_var[s], want.running_var[s]);
  }
  // Without running statistics, eval mode normalises each rank's batch by itself.
  if (eval) expect_close(where + " eval-mode output", got.eval_out, rows(want.eval_out));
}

Trace python_trace(const Case& c, const nlohmann::json& golden) {
  auto t = [&](const nlohmann::json& j, const std::vector<int64_t>& shape) {
    return j.is_null() ? torch::Tensor() : tensor_of(j.get<std::vector<float>>(), shape);
  };
  Trace trace;
  const auto shape = c.shape(c.batch());
  for (const auto& s : golden["steps"]) {
    trace.out.push_back(t(s["out"], shape));
    trace.grad_input.push_back(t(s["grad_input"], shape));
    trace.grad_weight.push_back(t(s["grad_weight"], {c.channels}));
    trace.grad_bias.push_back(t(s["grad_bias"], {c.channels}));
    trace.running_mean.push_back(t(s["running_mean"], {c.channels}));
    trace.running_var.push_back(t(s["running_var"], {c.channels}));
  }
  trace.eval_out = t(golden["eval_out"], shape);
  return trace;
}

// The reference: libtorch's BatchNorm on the whole batch in this one process.
Trace libtorch_trace(const Case& c, const CaseData& d) {
  torch::nn::BatchNormOptions o(c.channels);
  o.momentum(c.momentum).affine(c.affine).track_running_stats(c.track);
  torch::nn::AnyModule bn;
  if (c.spatial.size() <= 1) bn = torch::nn::AnyModule(torch::nn::BatchNorm1d(o));
  if (c.spatial.size() == 2) bn = torch::nn::AnyModule(torch::nn::BatchNorm2d(o));
  if (c.spatial.size() == 3) bn = torch::nn::AnyModule(torch::nn::BatchNorm3d(o));
  return run_trace(*bn.ptr(), [&](const torch::Tensor& x) { return bn.forward(x); }, c, d, {0, c.batch()}, nullptr);
}

void train_rank(const Case& c, const CaseData& d, int rank) {
  dist::init_process_group();
  SyncBatchNorm bn(SyncBatchNormOptions(c.channels).momentum(c.momentum).affine(c.affine).track_running_stats(c.track));
  // Sums each step's grad_weight and grad_bias over the ranks (each rank's are its own, as in PyTorch).
  auto sum_over_ranks = [](const torch::Tensor& t) {
    auto s = t.clone();
    dist::all_reduce(s);
    return s;
  };
  const Slice slice{c.offset(rank), c.batches[rank]};
  const Trace got = run_trace(*bn, [&](const torch::Tensor& x) { return bn(x); }, c, d, slice, sum_over_ranks);
  dist::destroy_process_group();
  const std::string where = c.name + " rank " + std::to_string(rank);
  expect_trace_slice(where + " vs libtorch BatchNorm", got, libtorch_trace(c, d), slice, c.track);
  const PythonGolden& py = python_golden();
  if (py.available && py.error.empty()) {
    expect_trace_slice(where + " vs PyTorch", got, python_trace(c, py.cases.at(c.name)), slice, c.track);
  }
}

class SyncBatchNormGolden : public ::testing::TestWithParam<size_t> {};

TEST_P(SyncBatchNormGolden, RanksMatchOneProcessOnTheGlobalBatch) {
  const Case& c = cases()[GetParam()];
  const CaseData d = data_of(c, GetParam());
  const PythonGolden& py = python_golden();  // before forking: the ranks share its result
  ASSERT_EQ(py.error, "");
  EXPECT_EQ(testing::run_ranks(c.world(), [&](int rank, int, std::shared_ptr<Store>) { train_rank(c, d, rank); }), "");
}

INSTANTIATE_TEST_SUITE_P(Cases, SyncBatchNormGolden, ::testing::Range<size_t>(0, cases().size()),
                         [](const auto& info) { return cases()[info.param].name; });

TEST(SyncBatchNormPython, ReferenceAvailable) {
  const PythonGolden& py = python_golden();
  if (!py.available) {
    GTEST_SKIP() << testing::parity_python() << " cannot import torch (install python3-torch); the golden cases "
                 << "were checked against libtorch's BatchNorm only";
  }
  EXPECT_EQ(py.error, "");
}

TEST(SyncBatchNorm, GlobalCountOfOneRaisesOnEveryRankAndTheGroupStillWorks) {
  EXPECT_EQ(testing::run_ranks(2, [](int rank, int, std::shared_ptr<Store>) {
              dist::init_process_group();
              SyncBatchNorm bn(3);
              const std::string what = testing::usage_error([&] { bn(torch::ones({rank == 0 ? 1 : 0, 3})); });
              if (what.find("expected more than 1 value per channel") == std::string::npos) {
                throw std::runtime_error("rank " + std::to_string(rank) + ": " + what);
              }
              auto out = bn(torch::arange(3 * (rank + 1), torch::kFloat32).reshape({rank + 1, 3}));
              if (out.size(0) != rank + 1) throw std::runtime_error("forward after the error");
              dist::destroy_process_group();
            }),
            "");
}

TEST(SyncBatchNorm, EvalModeAndInputsWithoutGradNeedNoOtherRank) {
  EXPECT_EQ(testing::run_ranks(2, [](int rank, int, std::shared_ptr<Store>) {
              dist::init_process_group();
              SyncBatchNorm bn(2);
              bn->eval();
              if (rank == 0) {
                for (int i = 0; i < 5; ++i) bn(torch::randn({4, 2}));  // alone: would hang if it communicated
              }
              bn->train();
              auto x = torch::full({rank + 1, 2}, static_cast<float>(rank));  // needs no grad: local backward
              bn(x).sum().backward();
              auto mean = bn->running_mean.clone();
              auto other = mean.clone();
              dist::broadcast(other, 0);
              // Global batch {0, 0 | 1, 1, 1, 1} per channel: mean 2/3, running mean 0.1 * 2/3.
              if (!torch::allclose(mean, other) || std::abs(mean[0].item<float>() - 0.2f / 3) > 1e-6) {
                throw std::runtime_error("running_mean " + std::to_string(mean[0].item<float>()));
              }
              dist::destroy_process_group();
            }),
            "");
}

// One rank, with and without an initialised group: exactly torch::nn::BatchNorm2d, no communication.
TEST(SyncBatchNorm, WorldOfOneAndNoGroupAreBatchNorm) {
  for (bool init : {false, true}) {
    EXPECT_EQ(testing::run_ranks(1, [&](int, int, std::shared_ptr<Store>) {
                if (init) dist::init_process_group();
                SyncBatchNorm sync(3);
                torch::nn::BatchNorm2d plain(3);
                auto x = torch::randn({4, 3, 2, 2}) * 2 + 1;
                auto xs = x.clone().requires_grad_();
                auto xp = x.clone().requires_grad_();
                sync(xs).pow(2).sum().backward();
                plain(xp).pow(2).sum().backward();
                if (!torch::equal(xs.grad(), xp.grad()) || !torch::equal(sync->weight.grad(), plain->weight.grad()) ||
                    !torch::equal(sync->running_var, plain->running_var)) {
                  throw std::runtime_error(std::string("differs from BatchNorm2d, init ") + (init ? "yes" : "no"));
                }
                if (init) dist::destroy_process_group();
              }),
              "");
  }
}

TEST(SyncBatchNorm, BadInputsRaiseUsageError) {
  EXPECT_EQ(testing::run_ranks(1, [](int, int, std::shared_ptr<Store>) {
              SyncBatchNorm bn(3);
              const std::string channels = testing::usage_error([&] { bn(torch::ones({2, 4, 5})); });
              const std::string dims = testing::usage_error([&] { bn(torch::ones({3})); });
              if (channels.find("has 4 channels (dimension 1); expected 3") == std::string::npos ||
                  dims.find("expected an input of shape (N, C)") == std::string::npos) {
                throw std::runtime_error(channels + " / " + dims);
              }
            }),
            "");
}

}  // namespace
}  // namespace chorus::ddp
