// Accelerator: its state (a mid-epoch resume gives the same batches, losses and objects; a
// launcher's restart resumes without a flag; a stale state is refused; a loop without epochs()
// resumes at the first pass), stop signals (saved on every rank, agreed on across ranks) and the
// run records (per-rank lines, rank 0's aggregate, config, summary and logs).
//
// Libtorch work runs in forked ranks (run_ranks) only, so the gtest process can fork safely.
#include "chorus/train/accelerator.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "accelerator_test_util.h"
#include "chorus/comm/process_group.h"
#include "chorus/comm/signals.h"
#include "chorus/train/checkpoint.h"
#include "testing.h"

namespace chorus::train {
namespace {

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

// allreduce "tuned": what it kept travels with the state, so the steps a resumed run does again equal
// the first attempt's bit for bit (without it, the resumed run would try every algorithm again, and
// at 3 ranks their sums differ in the last bits). Each run gets a group of its own, since a group
// keeps what it measured. W=3, 15 items a rank: 2 steps an epoch, one gradient bucket each.
TEST(State, TunedAllreduceKeepsItsDecisionsAcrossAResume) {
  EXPECT_EQ(testing::run_ranks(3, [](int rank, int w, std::shared_ptr<Store>) {
    torch::set_num_threads(1);
    auto group = [&](const std::string& name) {
      ProcessGroupOptions o;
      o.transport = "tcp";
      o.allreduce_algorithm = "tuned";
      o.group_name = name;
      return connect_process_group("env://", rank, w, o);
    };
    // Saves at step 20 (the gradients' class decided after its 18 calls) and runs on to step 24,
    // as if killed then.
    auto first_group = group("first");
    AcceleratorOptions first = test_options("_tuned");
    first.group = first_group.get();
    first.checkpoint_each_epoch = false;
    first.checkpoint_every = 20;
    std::vector<TunedAllreduce> saved;
    const JobResult part1 = state_job(first, 12, [&](Accelerator& a) {
      if (a.global_step() == 20) saved = first_group->tuned_allreduce();
    });
    require(part1.trace.size() == 24, "the first attempt has " + std::to_string(part1.trace.size()) + " steps");
    const TunedAllreduce* tried = nullptr;
    for (const auto& d : saved) {
      if (d.measured_us.size() >= 2) tried = &d;
    }
    require(tried != nullptr, "no size class had more than one candidate to try: the test measures nothing");

    auto second_group = group("second");
    AcceleratorOptions second = test_options("_tuned");
    second.group = second_group.get();
    second.resume = true;
    std::string after_one_step;
    const JobResult part2 = state_job(second, 12, [&](Accelerator& a) {
      if (a.global_step() != 21) return;
      for (const auto& d : second_group->tuned_allreduce()) {
        if (d.min_bytes == tried->min_bytes && d.ranks == tried->ranks) {
          after_one_step = d.chosen;
          for (const auto& [name, us] : d.measured_us) {
            bool same = false;
            for (const auto& m : tried->measured_us) same = same || (m.first == name && m.second == us);
            if (!same) after_one_step += " (measured_us differ: " + name + ")";
          }
        }
      }
    });
    require(after_one_step == tried->chosen, "after the resumed run's first step its class holds '" + after_one_step +
                                                 "', expected the saved decision '" + tried->chosen + "'");
    require_same(part2.trace, {part1.trace.begin() + 20, part1.trace.end()}, "after resuming at step 20");
    require(at::equal(part2.parameters, part1.parameters), "final parameters differ from the first attempt's");
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
