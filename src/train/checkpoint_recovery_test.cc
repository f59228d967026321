// Checkpoints under failure: a writer killed at every step of a save, and at random times, leaves
// the last good checkpoint; prepare_checkpoint_dir checks the directory before training; and a
// run resumed from a checkpoint gives exactly the losses of an uninterrupted run (W=2).
//
// All libtorch work runs in forked children (run_ranks or fork_child): the gtest process itself
// never starts libtorch's thread pools, so forking stays safe.
#include "chorus/train/checkpoint.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint_test_util.h"
#include "chorus/torch/distributed.h"
#include "testing.h"

namespace chorus::train {
namespace {

// A model whose parameters, buffers and momentum buffers all hold `v`.
void fill_state(Net& net, torch::optim::SGD& opt, double v) {
  for (auto& p : net->parameters()) p.mutable_grad() = torch::full_like(p, v);
  opt.step();  // first step of a fresh optimizer: momentum buffer = grad
  torch::NoGradGuard no_grad;
  for (auto& p : net->parameters()) p.fill_(v);
  for (auto& b : net->buffers()) b.fill_(v);
}

// Checks that net and opt hold `v` everywhere, as fill_state left them.
void check_filled(Net& net, torch::optim::SGD& opt, double v) {
  for (auto& p : net->parameters()) {
    require(at::all(p == v).item<bool>(), "parameter not " + std::to_string(v));
    require(at::all(momentum_of(opt, p) == v).item<bool>(), "momentum not " + std::to_string(v));
  }
  for (auto& b : net->buffers()) require(at::all(b == v).item<bool>(), "buffer not " + std::to_string(v));
}

// ---- atomicity ----------------------------------------------------------------------------------

struct Child {
  pid_t pid = -1;
  int fd = -1;  // read end of the child's pipe
};

// Forks a child that runs fn(write_fd) and exits 0, or writes "error: ..." and exits 1.
Child fork_child(const std::function<void(int fd)>& fn) {
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
  std::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(p[0]);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    int code = 0;
    try {
      torch::set_num_threads(1);
      fn(p[1]);
    } catch (const std::exception& e) {
      std::string msg = std::string("error: ") + e.what();
      ssize_t ignored = ::write(p[1], msg.data(), msg.size());
      (void)ignored;
      code = 1;
    }
    ::_exit(code);
  }
  ::close(p[1]);
  return {pid, p[0]};
}

// Reads what is available within timeout_ms (until EOF when wait_eof).
std::string read_some(int fd, int timeout_ms, bool wait_eof) {
  std::string out;
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                    until - std::chrono::steady_clock::now()).count());
    if (left <= 0) break;
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, left) <= 0) break;
    char buf[4096];
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (!wait_eof) break;
  }
  return out;
}

// Waits for a child that should exit by itself; returns "" when it succeeded (its output then goes
// to *output), else its error.
std::string finish(Child c, std::string* output = nullptr) {
  std::string out = read_some(c.fd, 60000, true);
  ::close(c.fd);
  int status = 0;
  ::waitpid(c.pid, &status, 0);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
    if (output) *output = out;
    return "";
  }
  return out.empty() ? "child failed with status " + std::to_string(status) : out;
}

void save_filled(const std::string& dir, double v, const CheckpointOptions& options = {}) {
  Net net;
  auto opt = make_sgd(net);
  fill_state(net, opt, v);
  CheckpointState st;
  st.step = static_cast<int64_t>(v);
  save_checkpoint(dir, *net, &opt, st, options);
}

// Loads dir and checks it is one intact version (every file from the same save); returns its step.
int64_t load_filled(const std::string& dir) {
  torch::manual_seed(123);
  Net net;
  auto opt = make_sgd(net);
  fill_state(net, opt, -1);  // creates momentum buffers to load into
  auto st = load_checkpoint(dir, *net, &opt);
  require(st.has_value(), "no checkpoint");
  check_filled(net, opt, static_cast<double>(st->step));
  return st->step;
}

TEST_F(CheckpointTest, WriterKilledAtEveryStepLeavesLastGoodCheckpoint) {
  for (const std::string stage : {"model.pt", "optimizer.pt", "rng.pt", "state.json", "version", "latest"}) {
    SCOPED_TRACE(stage);
    const std::string dir = path("kill-" + stage);
    Child writer = fork_child([&](int fd) {
      save_filled(dir, 1);
      CheckpointOptions o;
      o.on_save_step = [&](const std::string& s) {
        if (s != stage) return;
        ssize_t ignored = ::write(fd, "!", 1);
        (void)ignored;
        for (;;) ::pause();  // killed here, mid-save
      };
      save_filled(dir, 2, o);
    });
    ASSERT_EQ(read_some(writer.fd, 30000, false), "!") << "the writer never reached " << stage;
    ::kill(writer.pid, SIGKILL);
    int status = 0;
    ::waitpid(writer.pid, &status, 0);
    ::close(writer.fd);
    ASSERT_TRUE(WIFSIGNALED(status));

    const int64_t want = stage == "latest" ? 2 : 1;
    EXPECT_EQ(finish(fork_child([&](int) {
      require(load_filled(dir) == want, "loaded the wrong version");
      for (const auto& e : fs::directory_iterator(dir)) {  // the load alone clears the leftovers
        require(e.path().filename().string().rfind(".tmp-", 0) != 0, "leftover after load " + e.path().string());
      }
      save_filled(dir, 3);  // the next save succeeds
      require(load_filled(dir) == 3, "the save after the crash did not become current");
      for (const auto& e : fs::directory_iterator(dir)) {
        require(e.path().filename().string().rfind(".tmp-", 0) != 0, "leftover " + e.path().string());
      }
    })), "");
  }
}

TEST_F(CheckpointTest, PrepareCheckpointDirChecksBeforeTraining) {
  const std::string fresh = path("a/b/fresh");
  const std::string used = path("used");
  const std::string blocked = path("file/sub");
  std::ofstream(path("file")) << "a regular file, not a directory\n";
  EXPECT_EQ(in_child([&] {
    require(!prepare_checkpoint_dir(fresh).has_value(), "a fresh directory reported a checkpoint");
    require(fs::is_directory(fresh), "the directory was not created");
    require(fs::is_empty(fresh), "the writability probe was left behind");

    save_filled(used, 7);
    fs::create_directories(used + "/.tmp-ckpt-000009-leftover");  // a writer killed mid-save
    std::ofstream(used + "/.tmp-ckpt-000009-leftover/model.pt") << "partial";
    auto st = prepare_checkpoint_dir(used);
    require(st.has_value() && st->step == 7, "the existing checkpoint was not reported");
    require(!fs::exists(used + "/.tmp-ckpt-000009-leftover"), "the leftover was not swept");
    require(load_filled(used) == 7, "the checkpoint itself was touched");

    try {
      prepare_checkpoint_dir(blocked);
    } catch (const CheckpointError& e) {
      require(std::string(e.what()).find(blocked) != std::string::npos, std::string("no path in: ") + e.what());
      return;
    }
    throw std::runtime_error("no CheckpointError for a directory under a regular file");
  }), "");
}

TEST_F(CheckpointTest, WriterKilledAtRandomTimes) {
  const std::string dir = path("random-kill");
  std::mt19937 rng(12345);
  int64_t current = 0;  // the version known to be current (0: none yet)
  for (int round = 0; round < 12; ++round) {
    const int64_t base = (round + 1) * 1000;
    Child writer = fork_child([&](int fd) {
      for (int64_t v = base + 1;; ++v) {
        save_filled(dir, static_cast<double>(v));
        std::string line = std::to_string(v) + "\n";
        ssize_t ignored = ::write(fd, line.data(), line.size());
        (void)ignored;
      }
    });
    // The first save of a round costs more (fresh libtorch); kill anywhere in the next ones.
    std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(5, 120)(rng)));
    ::kill(writer.pid, SIGKILL);
    int status = 0;
    ::waitpid(writer.pid, &status, 0);
    std::string done = read_some(writer.fd, 1000, true);
    ::close(writer.fd);
    std::istringstream in(done);
    for (int64_t v; in >> v;) current = v;
    // The killed save may or may not have made its version current: either it or the one current
    // before it loads, intact.
    const int64_t killed = current > base ? current + 1 : base + 1;
    std::string loaded;
    ASSERT_EQ(finish(fork_child([&](int fd) {
      if (current == 0 && !latest_checkpoint(dir)) return;  // killed before any save finished
      int64_t got = load_filled(dir);
      require(got == current || got == killed, "loaded step " + std::to_string(got) + ", current was " +
                                                   std::to_string(current) + ", killed " + std::to_string(killed));
      std::string text = std::to_string(got);
      ssize_t ignored = ::write(fd, text.data(), text.size());
      (void)ignored;
    }), &loaded), "") << "round " << round;
    if (!loaded.empty()) current = std::stoll(loaded);
  }
  EXPECT_GT(current, 0) << "no save ever completed: the kill delays are too short for this machine";
}

// ---- resume -------------------------------------------------------------------------------------

// Trains on a fixed per-rank data set with manually averaged gradients and broadcast buffers (what
// DDP does), dropout and BatchNorm, so that the model, the optimizer, the RNG and the step all matter for the losses.
struct Trainer {
  Net net;
  torch::optim::SGD opt;
  at::Tensor x, y;
  explicit Trainer(int rank) : opt(make_sgd(net)) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7000 + rank);
    x = at::randn({64, 4}, gen);
    y = at::randint(0, 3, {64}, gen);
  }
  double step(int64_t i) {
    const int64_t b = (i % 4) * 16;
    // As DDP does: rank 0's buffers (the BatchNorm statistics, which the checkpoint holds) first.
    for (auto& buf : net->buffers()) dist::broadcast(buf, 0);
    opt.zero_grad();
    at::Tensor loss = torch::cross_entropy_loss(net->forward(x.slice(0, b, b + 16)), y.slice(0, b, b + 16));
    loss.backward();
    for (auto& p : net->parameters()) dist::all_reduce(p.mutable_grad(), ReduceOp::kAvg);
    opt.step();
    return loss.item<double>();
  }
};

std::string hex(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%a", v);
  return buf;
}

TEST_F(CheckpointTest, ResumeGivesTheSameLosses) {
  const std::string dir = path("resume");
  const int k = 5, m = 7;
  // Uninterrupted: k steps, checkpoint, m more; record the m losses and the final model.
  ASSERT_EQ(testing::run_ranks(2, [&](int rank, int, std::shared_ptr<Store>) {
    torch::set_num_threads(1);
    dist::init_process_group();
    torch::manual_seed(1);
    Trainer t(rank);
    torch::manual_seed(500 + rank);
    for (int64_t i = 0; i < k; ++i) t.step(i);
    save_checkpoint(dir, *t.net, &t.opt, CheckpointState{0, k, {}});
    std::ofstream out(path("losses-" + std::to_string(rank)));
    for (int64_t i = k; i < k + m; ++i) out << hex(t.step(i)) << "\n";
    at::Tensor f = flat(*t.net);
    for (int64_t j = 0; j < f.numel(); ++j) out << hex(f[j].item<double>()) << "\n";
    dist::destroy_process_group();
  }), "");
  // Fresh processes, other initial weights and RNG: load and continue m steps.
  ASSERT_EQ(testing::run_ranks(2, [&](int rank, int, std::shared_ptr<Store>) {
    torch::set_num_threads(1);
    dist::init_process_group();
    torch::manual_seed(77);
    Trainer t(rank);
    torch::manual_seed(900 + rank);
    auto st = load_checkpoint(dir, *t.net, &t.opt);
    require(st && st->step == k, "no checkpoint at step k");
    std::ifstream in(path("losses-" + std::to_string(rank)));
    std::string want;
    for (int64_t i = st->step; i < k + m; ++i) {
      std::getline(in, want);
      std::string got = hex(t.step(i));
      require(got == want, "rank " + std::to_string(rank) + " step " + std::to_string(i) + ": loss " + got +
                               " after resume, " + want + " uninterrupted");
    }
    at::Tensor f = flat(*t.net);
    for (int64_t j = 0; j < f.numel(); ++j) {
      std::getline(in, want);
      require(hex(f[j].item<double>()) == want, "final model differs after resume");
    }
    dist::destroy_process_group();
  }), "");
}

}  // namespace
}  // namespace chorus::train
