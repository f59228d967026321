// fashion_mnist_ddp: the hand-written data-parallel training loop on Fashion-MNIST, kept as the
// benchmark and fault-injection harness. The example users copy is examples/fashion_mnist (the
// Accelerator API); this program drives chorus_ddp, chorus_data's sampler and evaluation and
// chorus_train's checkpoints by hand, so every knob a benchmark or a failure test needs is here:
//
//   --sync on|off|lockstep    DDP as a user runs it, or the no-comm and barrier-only bounds
//   --compression, --overlap, --bucket-cap-mb, --[no-]gradient-as-bucket-view   DDP's options
//   --powersgd-rank R, --powersgd-start N   PowerSGD as the comm hook (bench/compare-powersgd)
//   --bind-cpu                pin each rank to one CPU (bench/compare-ddp)
//   --fail-at-step N          the last rank throws after step N (launcher and restart tests)
//   --metrics-json FILE       rank 0's summary: samples/s, step times, DDP's comm figures
//   --model cnn|mlp|resnet18, --eval-limit, --log-every, --checkpoint-dir, --checkpoint-every, --no-checkpoint
//
//   build/bin/fashion_mnist_ddp --nproc 2               # starts 2 local ranks itself
//   RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. build/bin/fashion_mnist_ddp   # one rank of a job
//   srun -n 2 build/bin/fashion_mnist_ddp, mpirun -np 2 build/bin/fashion_mnist_ddp   # likewise
//
// Every rank loads the whole data set (uint8, 55 MB), trains on its DistributedSampler share with
// DDP averaging the gradients, evaluates exactly once per item of the test set at the end of every
// epoch, and checkpoints. Rank 0 prints the progress and writes --metrics-json. Users: these
// benchmark knobs are no part of the example's interface; start from examples/fashion_mnist.
#include <CLI/CLI.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/nn/functional/upsampling.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>
#include <dlfcn.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/comm/signals.h"
#include "chorus/data/evaluation.h"
#include "chorus/data/sampler.h"
#include "chorus/ddp/ddp.h"
#include "chorus/torch/distributed.h"
#include "chorus/train/accelerator.h"
#include "chorus/models/resnet.h"
#include "chorus/train/checkpoint.h"
#include "idx.h"
#include "models.h"

namespace fashion_mnist {
namespace {

namespace dist = chorus::dist;
using Clock = std::chrono::steady_clock;

// bench/compare-resnet's network: chorus::models' ResNet-18 (one input channel, 10 classes) on the
// images upsampled to 64 px per batch (bilinear), log-softmax for the harness's NLL loss. The
// Python side of bench/compare-ddp builds the same from torchvision.
constexpr int64_t kResnetImageSize = 64;
struct Resnet18 : Classifier {
  Resnet18() {
    chorus::models::ResNetOptions o;
    o.depth = 18;
    o.in_channels = 1;
    o.num_classes = 10;
    net = register_module("net", chorus::models::ResNet(o));
  }
  at::Tensor forward(at::Tensor x) override {
    namespace F = torch::nn::functional;
    x = F::interpolate(x, F::InterpolateFuncOptions()
                              .size(std::vector<int64_t>{kResnetImageSize, kResnetImageSize})
                              .mode(torch::kBilinear)
                              .align_corners(false));
    return torch::log_softmax(net->forward(x), 1);
  }
  chorus::models::ResNet net{nullptr};
};

std::shared_ptr<Classifier> make_bench_model(const std::string& name) {
  if (name == "resnet18") return std::make_shared<Resnet18>();
  return make_model(name);
}

struct Config {
  int nproc = 0;
  std::string data = "/usr/share/datasets/fashion-mnist";
  int64_t epochs = 1;
  int64_t max_steps = 0;  // 0: no limit
  int64_t batch_size = 64;
  double lr = 0.01;
  double momentum = 0.9;
  std::string model = "cnn";
  int threads = 1;
  uint64_t seed = 1;
  std::string metrics_json;
  std::string checkpoint_dir = "runs/fashion_mnist_ddp";  // relative to the current directory; git ignores runs/
  bool no_checkpoint = false;
  bool resume = false;
  bool overwrite = false;
  std::string sync = "on";
  std::string compression = "none";
  int64_t powersgd_rank = 0;  // 0: no PowerSGD hook
  int64_t powersgd_start = 10;
  std::string overlap = "on";
  double bucket_cap_mb = 25.0;
  bool bucket_view = true;
  bool bind_cpu = false;
  int64_t eval_limit = 0;  // 0: the whole test set
  int64_t log_every = 50;
  int64_t checkpoint_every = 0;  // also checkpoint every N steps (0: per epoch only)
  int64_t fail_at_step = 0;      // test hook: the last rank throws after this step in the first attempt
};

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string hms(double s) {
  const int64_t t = static_cast<int64_t>(s + 0.5);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%" PRId64 ":%02d:%02d", t / 3600, static_cast<int>(t / 60 % 60),
                static_cast<int>(t % 60));
  return buf;
}

// Rank 0's progress: one line rewritten in place on a terminal, else a line every log_every steps.
class Progress {
 public:
  Progress(bool active, int64_t log_every) : active_(active), tty_(chorus::train::stdout_rewrites_in_place()), log_every_(log_every) {}

  void step(int64_t epoch, int64_t epochs, int64_t step, int64_t planned, double loss, double samples_per_s,
            double step_seconds) {
    if (!active_) return;
    loss_sum_ += loss;
    ++loss_n_;
    const bool last = step == planned;
    if (tty_) {
      if (!last && seconds_since(last_print_) < 0.25) return;
    } else if (!last && step % log_every_ != 0) {
      return;
    }
    std::printf("%sepoch %" PRId64 "/%" PRId64 "  step %" PRId64 "/%" PRId64 "  loss %.4f  %.0f samples/s  ETA %s%s",
                tty_ ? "\r" : "", epoch + 1, epochs, step, planned, loss_sum_ / loss_n_, samples_per_s,
                hms(static_cast<double>(planned - step) * step_seconds).c_str(), tty_ ? "\x1b[K" : "\n");
    std::fflush(stdout);
    open_line_ = tty_;
    loss_sum_ = 0;
    loss_n_ = 0;
    last_print_ = Clock::now();
  }

  // Prints a whole line (after ending the progress line, on a terminal).
  void line(const std::string& text) {
    if (!active_) return;
    std::printf("%s%s\n", open_line_ ? "\n" : "", text.c_str());
    std::fflush(stdout);
    open_line_ = false;
  }

 private:
  bool active_;
  bool tty_;
  int64_t log_every_;
  double loss_sum_ = 0;
  int64_t loss_n_ = 0;
  bool open_line_ = false;
  Clock::time_point last_print_ = Clock::now();
};

struct Evaluation {
  double accuracy = 0;
  double loss = 0;  // mean NLL; on rank 0 only
  int64_t items = 0;
};

// Exact: each of the first n test items is evaluated once, by one rank. No collective runs in the
// loop (ranks may hold one item more than others), only in exact_accuracy / gather_evaluation.
Evaluation evaluate(Classifier& model, const Split& test, int64_t n) {
  torch::NoGradGuard no_grad;
  model.eval();
  auto range = chorus::data::evaluation_range(n, dist::get_world_size(), dist::get_rank());
  std::vector<at::Tensor> outputs;
  for (int64_t b = range.begin; b < range.end; b += 1000) {
    const int64_t e = std::min(range.end, b + 1000);
    outputs.push_back(model.forward(normalise(test.images.slice(0, b, e))));
  }
  at::Tensor logp = outputs.empty() ? at::empty({0, 10}) : at::cat(outputs);
  at::Tensor targets = test.labels.slice(0, range.begin, range.end);
  Evaluation ev;
  ev.items = n;
  ev.accuracy = chorus::data::exact_accuracy(logp, targets, n);
  at::Tensor item_loss = torch::nll_loss(logp, targets, {}, at::Reduction::None);
  at::Tensor all = chorus::data::gather_evaluation(item_loss, n, nullptr, 0);
  if (all.defined() && n > 0) ev.loss = all.to(at::kDouble).mean().item<double>();
  model.train();
  return ev;
}

chorus::ddp::Compression parse_compression(const std::string& s) {
  if (s == "fp16") return chorus::ddp::Compression::kFloat16;
  if (s == "bf16") return chorus::ddp::Compression::kBFloat16;
  return chorus::ddp::Compression::kNone;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// torch::set_num_threads covers libtorch's own pools; OpenBLAS (Debian's libblas.so.3 alternative)
// keeps its own, which by default has a thread per core: two ranks on two cores would then run
// four BLAS threads. Set it too when OpenBLAS is the BLAS in use.
void set_blas_threads(int n) {
  using SetThreads = void (*)(int);
  if (auto f = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) f(n);
}

// Pins this process to the LOCAL_RANK-th CPU it may run on, when the host's ranks fit its CPUs:
// ranks then never share a core or migrate, which steadies benchmarks on small machines. Called
// before any thread starts, so the group's worker thread inherits it. Returns the CPU, or -1.
int bind_to_cpu() {
  const char* lr = std::getenv("LOCAL_RANK");
  const char* lws = std::getenv("LOCAL_WORLD_SIZE");
  const int local_rank = lr ? std::atoi(lr) : 0;
  const int local_world = lws ? std::atoi(lws) : 1;
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (::sched_getaffinity(0, sizeof(allowed), &allowed) != 0 || local_world > CPU_COUNT(&allowed)) return -1;
  int seen = 0;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &allowed)) continue;
    if (seen++ != local_rank) continue;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    return ::sched_setaffinity(0, sizeof(one), &one) == 0 ? cpu : -1;
  }
  return -1;
}

void run_rank(const Config& cfg) {
  const auto start = Clock::now();
  const int bound_cpu = cfg.bind_cpu ? bind_to_cpu() : -1;
  torch::set_num_threads(cfg.threads);
  set_blas_threads(cfg.threads);
  dist::init_process_group();
  const int rank = dist::get_rank();
  const int world = dist::get_world_size();
  Progress progress(rank == 0, std::max<int64_t>(1, cfg.log_every));
  if (!cfg.no_checkpoint) {
    // Before any training: an unwritable directory, or a checkpoint this run would replace, is an
    // error now rather than at the first save.
    auto existing = chorus::train::prepare_checkpoint_dir(cfg.checkpoint_dir);
    if (existing && !cfg.resume && !cfg.overwrite) {
      throw chorus::UsageError(cfg.checkpoint_dir + " already holds a checkpoint (epoch " +
                               std::to_string(existing->epoch) + ", step " + std::to_string(existing->step) +
                               "); pass --resume to continue from it, --overwrite to start afresh and replace it, or "
                               "another --checkpoint-dir");
    }
  }

  const Split train = load_split(cfg.data, true);
  const Split test = load_split(cfg.data, false);
  const int64_t eval_n = cfg.eval_limit > 0 ? std::min(cfg.eval_limit, test.size()) : test.size();

  torch::manual_seed(cfg.seed);  // the same initial weights everywhere (DDP broadcasts rank 0's anyway)
  std::shared_ptr<Classifier> model = make_bench_model(cfg.model);
  chorus::ddp::Options ddp_options;
  ddp_options.bucket_cap_mb = cfg.bucket_cap_mb;
  ddp_options.gradient_as_bucket_view = cfg.bucket_view;
  ddp_options.compression = parse_compression(cfg.compression);
  ddp_options.overlap =
      cfg.overlap == "off" ? chorus::ddp::Options::Overlap::kNever : chorus::ddp::Options::Overlap::kAlways;
  chorus::ddp::DistributedDataParallel<Classifier> ddp(model, ddp_options);
  std::shared_ptr<chorus::ddp::PowerSGDHook> powersgd;
  if (cfg.powersgd_rank > 0) {
    chorus::ddp::PowerSGDOptions po;
    po.matrix_approximation_rank = cfg.powersgd_rank;
    po.start_powerSGD_iter = cfg.powersgd_start;
    powersgd = std::make_shared<chorus::ddp::PowerSGDHook>(po);
    ddp.register_comm_hook(powersgd);
  }
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(cfg.lr).momentum(cfg.momentum));
  torch::manual_seed(cfg.seed + 1000003ull * static_cast<uint64_t>(rank + 1));  // per-rank dropout masks

  chorus::data::DistributedSamplerOptions so;
  so.num_replicas = world;
  so.rank = rank;
  so.shuffle = true;
  so.seed = cfg.seed;
  chorus::data::DistributedSampler sampler(train.size(), so);
  const int64_t steps_per_epoch = (sampler.num_samples() + cfg.batch_size - 1) / cfg.batch_size;
  int64_t planned = cfg.epochs * steps_per_epoch;
  if (cfg.max_steps > 0) planned = std::min(planned, cfg.max_steps);

  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  char head[512];
  std::snprintf(head, sizeof(head),
                "fashion_mnist_ddp: %d rank(s) x %d thread(s), transport %s, model %s (%" PRId64 " parameters), batch %" PRId64
                "/rank, %" PRId64 " steps/epoch, sync %s, compression %s, data %s",
                world, cfg.threads, dist::default_group().transport().c_str(), cfg.model.c_str(), params,
                cfg.batch_size, steps_per_epoch, cfg.sync.c_str(), cfg.compression.c_str(), cfg.data.c_str());
  progress.line(head);

  // Resume: the model, optimizer and RNG come from the checkpoint; the position from its state.
  int64_t epoch = 0, step = 0, skip = 0;
  std::optional<int64_t> resumed_from;
  chorus::train::CheckpointOptions co;
  if (cfg.resume && !cfg.no_checkpoint) {
    if (auto st = chorus::train::load_checkpoint(cfg.checkpoint_dir, *model, &optimizer, co)) {
      auto extra = [&](const char* key, int64_t fallback) {
        auto it = st->extra.find(key);
        return it == st->extra.end() ? fallback : std::stoll(it->second);
      };
      epoch = st->epoch;
      step = st->step;
      skip = extra("batch_in_epoch", 0);
      const int64_t saved_world = extra("world_size", world);
      const int64_t saved_batch = extra("batch_size", cfg.batch_size);
      if (saved_world != world || saved_batch != cfg.batch_size) {
        // Batch b of an epoch covers the sampler's first (b+1) x batch x world positions of the
        // epoch's shuffled order, at any world size: resume at the last batch boundary before the
        // samples already trained on.
        const int64_t done = skip * saved_batch * saved_world;
        skip = done / (cfg.batch_size * world);
        progress.line("note: the checkpoint was written by " + std::to_string(saved_world) + " rank(s) x batch " +
                      std::to_string(saved_batch) + ", this run has " + std::to_string(world) + " x " +
                      std::to_string(cfg.batch_size) + ": an epoch is now " + std::to_string(steps_per_epoch) +
                      " steps per rank, the sampler deals each epoch's order to " + std::to_string(world) +
                      " rank(s) so every rank's batches differ from the original run's, and this epoch resumes at "
                      "batch " + std::to_string(skip) + " (" + std::to_string(done - skip * cfg.batch_size * world) +
                      " sample(s) trained on again)");
      }
      if (skip >= steps_per_epoch) ++epoch, skip = 0;
      resumed_from = step;
      progress.line("resumed from " + cfg.checkpoint_dir + " at epoch " + std::to_string(epoch + 1) + ", step " +
                    std::to_string(step));
    } else {
      progress.line("no checkpoint in " + cfg.checkpoint_dir + ": starting afresh");
    }
  }
  auto save = [&](int64_t ep, int64_t batch_in_epoch) {
    if (cfg.no_checkpoint) return;
    chorus::train::CheckpointState st{ep, step, {{"batch_in_epoch", std::to_string(batch_in_epoch)},
                                                {"model", cfg.model}, {"world_size", std::to_string(world)},
                                                {"batch_size", std::to_string(cfg.batch_size)}}};
    chorus::train::save_checkpoint(cfg.checkpoint_dir, *model, &optimizer, st, co);
  };

  const bool sync = cfg.sync == "on";
  const bool lockstep = cfg.sync == "lockstep";
  const int64_t first_step = step;
  const char* attempt_env = std::getenv("CHORUS_RESTART_COUNT");
  const bool first_attempt = attempt_env == nullptr || std::string(attempt_env) == "0";
  bool stopped_by_signal = false;
  chorus::watch_signals();
  double train_seconds = 0, loss_sum = 0, comm_wait_ms = 0, comm_ms = 0, last_loss = 0;
  double forward_s = 0, backward_s = 0, optimizer_s = 0;  // rank 0's phases, summed over steps
  int64_t samples = 0;
  std::vector<double> step_ms;
  std::optional<Evaluation> last_eval;

  while (epoch < cfg.epochs && step < planned) {
    sampler.set_epoch(epoch);
    const std::vector<int64_t> order = sampler.indices();
    int64_t b = skip;
    skip = 0;
    for (; b < steps_per_epoch && step < planned; ++b) {
      const auto t0 = Clock::now();
      const int64_t begin = b * cfg.batch_size;
      const int64_t end = std::min<int64_t>(begin + cfg.batch_size, static_cast<int64_t>(order.size()));
      at::Tensor idx = at::from_blob(const_cast<int64_t*>(order.data()) + begin, {end - begin}, at::kLong);
      at::Tensor x = normalise(train.images.index_select(0, idx));
      at::Tensor y = train.labels.index_select(0, idx);

      optimizer.zero_grad();
      const auto t_forward = Clock::now();
      at::Tensor loss = torch::nll_loss(ddp.forward(x), y);
      const auto t_backward = Clock::now();
      if (sync) {
        loss.backward();  // DDP averages the gradients here
      } else {
        auto guard = ddp.no_sync();  // the no-communication bound: every rank trains on its own
        loss.backward();
      }
      if (lockstep) ddp.reducer().group().barrier()->wait();  // no data, but the ranks wait for each other
      const auto t_optimizer = Clock::now();
      optimizer.step();
      const double l = loss.item<double>();
      forward_s += std::chrono::duration<double>(t_backward - t_forward).count();
      backward_s += std::chrono::duration<double>(t_optimizer - t_backward).count();
      optimizer_s += seconds_since(t_optimizer);
      const double dt = seconds_since(t0);

      ++step;
      train_seconds += dt;
      step_ms.push_back(dt * 1e3);
      loss_sum += l;
      last_loss = l;
      samples += (end - begin) * world;
      if (sync) {
        comm_wait_ms += ddp.stats().comm_wait_ms;
        comm_ms += ddp.stats().comm_ms;
      }
      progress.step(epoch, cfg.epochs, step, planned, l, static_cast<double>(samples) / train_seconds,
                    train_seconds / static_cast<double>(step - first_step));
      if (cfg.fail_at_step > 0 && step == cfg.fail_at_step && rank == world - 1 && first_attempt) {
        throw std::runtime_error("injected failure after step " + std::to_string(step) + " (--fail-at-step)");
      }
      if (cfg.checkpoint_every > 0 && step % cfg.checkpoint_every == 0 && b + 1 < steps_per_epoch) save(epoch, b + 1);
      // A forwarded SIGTERM/SIGUSR1 (e.g. Slurm's preemption notice) reaches the ranks at slightly
      // different steps: agree on it with a one-element allreduce, then all save and stop together.
      if (world > 1 || chorus::pending_signal() != 0) {
        at::Tensor sig = at::tensor({static_cast<int64_t>(chorus::pending_signal())}, at::kLong);
        if (world > 1) dist::all_reduce(sig, chorus::ReduceOp::kMax);
        if (sig.item<int64_t>() != 0) {
          save(epoch, b + 1);
          progress.line("stopping at step " + std::to_string(step) + " on signal " + std::to_string(sig.item<int64_t>()) +
                        (cfg.no_checkpoint ? "" : "; checkpoint saved, --resume continues from it"));
          stopped_by_signal = true;
          break;
        }
      }
    }
    if (stopped_by_signal) break;
    if (b < steps_per_epoch) {  // stopped by --max-steps inside the epoch
      last_eval = evaluate(*model, test, eval_n);
      save(epoch, b);
      break;
    }
    const auto t_eval = Clock::now();
    last_eval = evaluate(*model, test, eval_n);
    ++epoch;
    save(epoch, 0);
    char line[256];
    std::snprintf(line, sizeof(line), "epoch %" PRId64 ": test accuracy %.2f%% (%" PRId64 " items), test loss %.4f, "
                  "eval+checkpoint %.1f s", epoch, 100.0 * last_eval->accuracy, last_eval->items, last_eval->loss,
                  seconds_since(t_eval));
    progress.line(line);
  }
  if (!last_eval) last_eval = evaluate(*model, test, eval_n);  // nothing left to train (resumed at the end)

  // Mean training loss over every rank's steps of this run.
  at::Tensor totals = at::tensor({loss_sum, static_cast<double>(step - first_step)}, at::kDouble);
  dist::all_reduce(totals);
  const double train_loss = totals[1].item<double>() > 0 ? totals[0].item<double>() / totals[1].item<double>() : 0;

  const int64_t steps = step - first_step;
  const double samples_per_s = train_seconds > 0 ? static_cast<double>(samples) / train_seconds : 0;
  char done[256];
  std::snprintf(done, sizeof(done), "done: %" PRId64 " steps, %.0f samples/s, train loss %.4f, test accuracy %.2f%%, %.1f s",
                steps, samples_per_s, train_loss, 100.0 * last_eval->accuracy, seconds_since(start));
  progress.line(done);

  if (rank == 0 && !cfg.metrics_json.empty()) {
    nlohmann::json m = {
        {"world_size", world},
        {"transport", dist::default_group().transport()},
        {"model", cfg.model},
        {"steps", steps},
        {"total_steps", step},
        {"resumed_from_step", resumed_from ? nlohmann::json(*resumed_from) : nlohmann::json(nullptr)},
        {"epochs_completed", epoch},
        {"batch_size", cfg.batch_size},
        {"global_batch_size", cfg.batch_size * world},
        {"threads", cfg.threads},
        {"sync", sync},
        {"sync_mode", cfg.sync},
        {"bound_cpu", bound_cpu},
        {"compression", cfg.compression},
        {"powersgd_rank", cfg.powersgd_rank},
        {"powersgd_compression_rate", powersgd ? powersgd->compression_stats().rate : 0.0},
        {"bucket_cap_mb", cfg.bucket_cap_mb},
        {"gradient_as_bucket_view", cfg.bucket_view},
        {"overlap", cfg.overlap},
        {"samples", samples},
        {"samples_per_s", samples_per_s},
        {"train_seconds", train_seconds},
        {"step_ms_p50", median(step_ms)},
        // Rank 0's mean time per step in each phase; backward includes DDP's gradient sync (and
        // the lockstep barrier). The rest of a step is cutting and normalising the batch.
        {"phase_ms_mean",
         {{"forward", steps > 0 ? 1e3 * forward_s / static_cast<double>(steps) : 0.0},
          {"backward", steps > 0 ? 1e3 * backward_s / static_cast<double>(steps) : 0.0},
          {"optimizer", steps > 0 ? 1e3 * optimizer_s / static_cast<double>(steps) : 0.0}}},
        {"wall_seconds", seconds_since(start)},
        {"train_loss", train_loss},
        {"last_loss", last_loss},  // rank 0's loss at the last step, exactly (resume checks)
        {"test_accuracy", last_eval->accuracy},
        {"test_loss", last_eval->loss},
        {"test_items", last_eval->items},
        {"ddp",
         {{"buckets", ddp.stats().buckets},
          {"gradient_bytes", ddp.stats().gradient_bytes},
          {"comm_wait_ms_mean", sync && steps > 0 ? comm_wait_ms / static_cast<double>(steps) : 0.0},
          {"comm_ms_mean", sync && steps > 0 ? comm_ms / static_cast<double>(steps) : 0.0},
          // Share of the allreduce time that ran while backward was still computing.
          {"hidden_fraction", sync && comm_ms > 0 ? std::max(0.0, 1.0 - comm_wait_ms / comm_ms) : 0.0},
          {"bucket_bytes", ddp.stats().bucket_bytes},
          {"shared_bytes", ddp.stats().shared_bytes}}},
    };
    std::ofstream out(cfg.metrics_json);
    out << m.dump(2) << "\n";
    if (!out) throw std::runtime_error("cannot write " + cfg.metrics_json);
  }
  dist::destroy_process_group();
}

// A CLI11 check that a number is finite and in [min, max] ("nan" passes CLI11's own Range).
CLI::Validator finite_in(double min, double max) {
  return CLI::Validator(
      [min, max](std::string& text) -> std::string {
        double v = 0;
        try {
          size_t pos = 0;
          v = std::stod(text, &pos);
          if (pos != text.size()) return "not a number: " + text;
        } catch (const std::exception&) {
          return "not a number: " + text;
        }
        if (!std::isfinite(v) || v < min || v > max) {
          return text + " is not a finite number in [" + CLI::detail::to_string(min) + ", " +
                 CLI::detail::to_string(max) + "]";
        }
        return "";
      },
      "FINITE in [" + CLI::detail::to_string(min) + ", " + CLI::detail::to_string(max) + "]");
}

}  // namespace
}  // namespace fashion_mnist

int main(int argc, char** argv) {
  fashion_mnist::Config cfg;
  CLI::App app{"Fashion-MNIST with chorus DistributedDataParallel, the hand-written loop kept for benchmarks and "
               "fault tests (PyTorch's MNIST example network)"};
  app.add_option("--nproc", cfg.nproc, "start this many local ranks (when not started by a launcher)")
      ->check(CLI::Range(1, 256));
  app.add_option("--data", cfg.data, "directory of the gzipped IDX files")->capture_default_str();
  app.add_option("--epochs", cfg.epochs, "epochs to train")->check(CLI::Range(int64_t{1}, int64_t{1} << 40))
      ->capture_default_str();
  app.add_option("--max-steps", cfg.max_steps, "stop after this many steps in all (0: no limit)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--batch-size", cfg.batch_size, "batch size per rank")->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--lr", cfg.lr, "SGD learning rate")->check(fashion_mnist::finite_in(0, 1000))->capture_default_str();
  app.add_option("--momentum", cfg.momentum, "SGD momentum")->check(fashion_mnist::finite_in(0, 1))
      ->capture_default_str();
  app.add_option("--model", cfg.model, "network")->check(CLI::IsMember({"cnn", "mlp", "resnet18"}))->capture_default_str();
  app.add_option("--threads", cfg.threads, "intra-op threads per rank")->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--seed", cfg.seed, "seed of the weights, the data order and dropout")->capture_default_str();
  app.add_option("--metrics-json", cfg.metrics_json, "write a summary (rank 0) to this file");
  app.add_option("--checkpoint-dir", cfg.checkpoint_dir,
                 "checkpoint after every epoch into this directory (checked for writing at the start)")
      ->capture_default_str();
  CLI::Option* no_ckpt = app.add_flag("--no-checkpoint", cfg.no_checkpoint, "write no checkpoints");
  CLI::Option* resume = app.add_flag("--resume", cfg.resume, "continue from the checkpoint in --checkpoint-dir, if there is one")
      ->excludes(no_ckpt);
  app.add_flag("--overwrite", cfg.overwrite,
               "start afresh even if --checkpoint-dir holds a checkpoint, replacing it (without --resume or this "
               "flag, such a run is refused)")
      ->excludes(no_ckpt)->excludes(resume);
  app.add_option("--sync", cfg.sync,
                 "allreduce the gradients (on); benchmark bounds: off, every rank trains alone; lockstep, every "
                 "rank trains alone but the ranks meet at a barrier after each backward (the cost of "
                 "synchronous steps without any data)")
      ->check(CLI::IsMember({"on", "off", "lockstep"}))->capture_default_str();
  app.add_flag_callback("--no-sync", [&] { cfg.sync = "off"; }, "same as --sync off");
  app.add_option("--compression", cfg.compression, "gradient compression for the allreduce")
      ->check(CLI::IsMember({"none", "fp16", "bf16"}))->capture_default_str();
  app.add_option("--powersgd-rank", cfg.powersgd_rank, "PowerSGD with this matrix rank as DDP's comm hook (0: none)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20))->excludes("--compression")->capture_default_str();
  app.add_option("--powersgd-start", cfg.powersgd_start, "plain allreduce for the first N steps of PowerSGD")
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 40))->capture_default_str();
  app.add_flag("--bind-cpu", cfg.bind_cpu,
               "pin each rank to one CPU (the LOCAL_RANK-th it may use) when the host's ranks fit its CPUs");
  app.add_flag("--gradient-as-bucket-view", cfg.bucket_view, "gradients live in the DDP buckets (the default)");
  app.add_flag_callback("--no-gradient-as-bucket-view", [&] { cfg.bucket_view = false; },
                        "gradients in .grad tensors of their own, copied into the buckets and out");
  app.add_option("--overlap", cfg.overlap,
                 "run bucket allreduces behind backward on the group's thread (on), or in the backward "
                 "thread as each bucket is ready (off)")
      ->check(CLI::IsMember({"on", "off"}))->capture_default_str();
  app.add_option("--bucket-cap-mb", cfg.bucket_cap_mb, "DDP bucket size")->check(fashion_mnist::finite_in(1e-6, 1e6))
      ->capture_default_str();
  app.add_option("--checkpoint-every", cfg.checkpoint_every, "also checkpoint every N steps (0: per epoch only)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--fail-at-step", cfg.fail_at_step,
                 "testing: the last rank throws after this step, in the first attempt only (CHORUS_RESTART_COUNT 0)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--eval-limit", cfg.eval_limit, "evaluate on the first N test items only (0: all)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--log-every", cfg.log_every, "progress line every N steps when stdout is not a terminal")
      ->check(CLI::PositiveNumber)->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;  // --help, or a usage error
  }

  return chorus::train::run_job("fashion_mnist_ddp", cfg.nproc, [&] { fashion_mnist::run_rank(cfg); });
}
