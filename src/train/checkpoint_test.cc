// Checkpoints: round trip (single process and W=2), Python's torch.load of model.pt, errors that
// reach every rank, a writer killed at every step of a save (and at random times), and resume
// giving exactly the losses of an uninterrupted run.
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
#include <torch/torch.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "chorus/torch/distributed.h"
#include "testing.h"

namespace chorus::train {
namespace {

namespace fs = std::filesystem;

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

// A small model with a BatchNorm buffer and dropout, named like the Python module in
// checkpoint_python_test.py.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(4, 8));
    bn = register_module("bn", torch::nn::BatchNorm1d(8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 3));
  }
  at::Tensor forward(at::Tensor x) {
    x = torch::relu(bn(fc1(x)));
    x = torch::dropout(x, 0.25, is_training());
    return fc2(x);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Net);

torch::optim::SGD make_sgd(Net& net) {
  return torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
}

// Every parameter and buffer of net as one flat double tensor, for exact comparison.
at::Tensor flat(torch::nn::Module& net) {
  std::vector<at::Tensor> parts;
  for (const auto& p : net.named_parameters()) parts.push_back(p.value().detach().reshape(-1).to(at::kDouble));
  for (const auto& b : net.named_buffers()) parts.push_back(b.value().detach().reshape(-1).to(at::kDouble));
  return at::cat(parts);
}

at::Tensor momentum_of(torch::optim::SGD& opt, const at::Tensor& p) {
  auto& state = opt.state().at(c10::guts::to_string(p.unsafeGetTensorImpl()));
  return static_cast<torch::optim::SGDParamState&>(*state).momentum_buffer();
}

// One training step on a fixed batch.
double train_step(Net& net, torch::optim::SGD& opt, const at::Tensor& x, const at::Tensor& y) {
  opt.zero_grad();
  at::Tensor loss = torch::cross_entropy_loss(net->forward(x), y);
  loss.backward();
  opt.step();
  return loss.item<double>();
}

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

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/chorus-ckpt-XXXXXX";
    std::vector<char> buf(pattern.begin(), pattern.end());
    buf.push_back('\0');
    ASSERT_NE(::mkdtemp(buf.data()), nullptr);
    root_ = buf.data();
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  std::string path(const std::string& name) const { return root_ + "/" + name; }
  std::string root_;
};

// Runs fn in a forked child (no process group); returns "" or its error.
std::string in_child(const std::function<void()>& fn) {
  return testing::run_ranks(1, [&](int, int, std::shared_ptr<Store>) {
    torch::set_num_threads(1);
    fn();
  });
}

TEST_F(CheckpointTest, NoCheckpointGivesNullopt) {
  const std::string dir = path("none");
  EXPECT_EQ(in_child([&] {
    Net net;
    auto opt = make_sgd(net);
    require(!load_checkpoint(dir, *net, &opt).has_value(), "missing directory gave a checkpoint");
    fs::create_directories(dir);
    require(!load_checkpoint(dir, *net, &opt).has_value(), "empty directory gave a checkpoint");
    require(!latest_checkpoint(dir).has_value(), "latest_checkpoint of an empty directory");
  }), "");
}

TEST_F(CheckpointTest, RoundTripSingleProcess) {
  const std::string dir = path("rt");
  EXPECT_EQ(in_child([&] {
    torch::manual_seed(1);
    Net net;
    auto opt = make_sgd(net);
    at::Tensor x = torch::randn({16, 4});
    at::Tensor y = torch::randint(0, 3, {16});
    for (int i = 0; i < 3; ++i) train_step(net, opt, x, y);  // momentum and running stats move
    CheckpointState st;
    st.epoch = 3;
    st.step = 17;
    st.extra = {{"note", "hello \"world\"\n"}, {"lr", "0.05"}};
    save_checkpoint(dir, *net, &opt, st);
    at::Tensor saved = flat(*net);
    at::Tensor next_random = torch::rand({5});  // what the RNG gives right after the save

    torch::manual_seed(99);
    Net other;
    auto other_opt = make_sgd(other);
    require(!at::equal(flat(*other), saved), "models already equal");
    auto got = load_checkpoint(dir, *other, &other_opt);
    require(got.has_value(), "no checkpoint loaded");
    require(got->epoch == 3 && got->step == 17 && got->extra == st.extra, "state differs");
    require(at::equal(flat(*other), saved), "parameters or buffers differ");
    require(at::equal(torch::rand({5}), next_random), "RNG state not restored");
    auto params = net->parameters();
    auto other_params = other->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      require(at::equal(momentum_of(opt, params[i]), momentum_of(other_opt, other_params[i])), "momentum differs");
    }
    // Same next step from both (eval mode: no dropout draw, BatchNorm uses running stats).
    net->eval();
    other->eval();
    train_step(net, opt, x, y);
    train_step(other, other_opt, x, y);
    require(at::equal(flat(*net), flat(*other)), "the step after loading differs");

    // Layout: `latest` names the current version; keep_last versions are kept.
    CheckpointOptions keep2;
    keep2.keep_last = 2;
    for (int i = 0; i < 3; ++i) save_checkpoint(dir, *net, &opt, st, keep2);
    int versions = 0;
    for (const auto& e : fs::directory_iterator(dir)) {
      std::string name = e.path().filename().string();
      require(name.rfind(".tmp-", 0) != 0, "temporary left behind: " + name);
      if (name.rfind("ckpt-", 0) == 0) ++versions;
    }
    require(versions == 2, "expected 2 versions, found " + std::to_string(versions));
    require(latest_checkpoint(dir) == dir + "/ckpt-000004", "latest is not ckpt-000004");
    // A version's own directory loads too.
    require(load_checkpoint(dir + "/ckpt-000003", *other, &other_opt).has_value(), "version dir did not load");

    // Without optimizer state in the checkpoint, asking for it is an error; nullptr is fine.
    save_checkpoint(dir, *net, nullptr, st);
    require(load_checkpoint(dir, *other, nullptr).has_value(), "load without optimizer");
    bool threw = false;
    try {
      load_checkpoint(dir, *other, &other_opt);
    } catch (const CheckpointError& e) {
      threw = std::string(e.what()).find("no optimizer state") != std::string::npos;
    }
    require(threw, "missing optimizer state was not reported");
  }), "");
}

TEST_F(CheckpointTest, ModelMismatchIsReported) {
  const std::string dir = path("mismatch");
  EXPECT_EQ(in_child([&] {
    Net net;
    save_checkpoint(dir, *net, nullptr, {});
    torch::nn::Sequential other(torch::nn::Linear(4, 8), torch::nn::Linear(8, 3));
    try {
      load_checkpoint(dir, *other, nullptr);
    } catch (const CheckpointError& e) {
      std::string what = e.what();
      require(what.find("missing from the checkpoint: 0.weight") != std::string::npos, what);
      require(what.find("not in the model: bn.bias, bn.num_batches_tracked") != std::string::npos, what);
      return;
    }
    throw std::runtime_error("a mismatched model loaded");
  }), "");
}

TEST_F(CheckpointTest, DamagedFileIsReported) {
  const std::string dir = path("damaged");
  EXPECT_EQ(in_child([&] {
    Net net;
    save_checkpoint(dir, *net, nullptr, {});
    const std::string model = *latest_checkpoint(dir) + "/model.pt";
    fs::resize_file(model, fs::file_size(model) - 10);
    try {
      load_checkpoint(dir, *net, nullptr);
    } catch (const CheckpointError& e) {
      require(std::string(e.what()).find("model.pt is damaged") != std::string::npos, e.what());
      return;
    }
    throw std::runtime_error("a truncated model.pt loaded");
  }), "");
}

TEST_F(CheckpointTest, PythonTorchLoadReadsModel) {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "python3-torch is not installed";
  }
  const std::string dir = path("py");
  const std::string expected = path("expected.json");
  ASSERT_EQ(in_child([&] {
    torch::manual_seed(3);
    Net net;
    auto opt = make_sgd(net);
    at::Tensor x = torch::randn({8, 4});
    at::Tensor y = torch::randint(0, 3, {8});
    for (int i = 0; i < 2; ++i) train_step(net, opt, x, y);
    save_checkpoint(dir, *net, &opt, {});
    nlohmann::json doc = nlohmann::json::object();
    auto add = [&](const std::string& name, const at::Tensor& t) {
      at::Tensor d = t.detach().reshape(-1).to(at::kDouble).contiguous();
      std::vector<double> values(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
      doc[name] = {{"shape", t.sizes().vec()}, {"dtype", std::string(c10::toString(t.scalar_type()))},
                   {"values", values}};
    };
    for (const auto& p : net->named_parameters()) add(p.key(), p.value());
    for (const auto& b : net->named_buffers()) add(b.key(), b.value());
    std::ofstream(expected) << doc.dump();
  }), "");
  const std::string model = dir + "/ckpt-000001/model.pt";
  const std::string cmd = std::string("/usr/bin/python3 ") + CHORUS_CHECKPOINT_PY + " " + model + " " + expected;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  int rc = ::pclose(p);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("OK"), std::string::npos) << out;
}

// ---- W = 2 --------------------------------------------------------------------------------------

TEST_F(CheckpointTest, RoundTripTwoRanks) {
  const std::string dir = path("w2");
  EXPECT_EQ(testing::run_ranks(2, [&](int rank, int, std::shared_ptr<Store>) {
    torch::set_num_threads(1);
    dist::init_process_group();
    torch::manual_seed(5);
    Net net;
    auto opt = make_sgd(net);
    at::Tensor x = torch::randn({16, 4});
    at::Tensor y = torch::randint(0, 3, {16});
    for (int i = 0; i < 2; ++i) train_step(net, opt, x, y);
    torch::manual_seed(100 + rank);  // per-rank RNG streams, as for dropout
    // Only rank 0 touches the filesystem: the others pass a path that does not exist.
    const std::string my_dir = rank == 0 ? dir : dir + "-rank" + std::to_string(rank) + "/nowhere";
    save_checkpoint(my_dir, *net, &opt, CheckpointState{2, 40, {{"k", "v"}}});
    require(rank == 0 || !fs::exists(dir + "-rank" + std::to_string(rank)), "rank 1 wrote files");
    at::Tensor saved = flat(*net);
    at::Tensor next_random = torch::rand({4});

    torch::manual_seed(1000);
    Net other;
    auto other_opt = make_sgd(other);
    auto got = load_checkpoint(my_dir, *other, &other_opt);
    require(got && got->epoch == 2 && got->step == 40 && got->extra.at("k") == "v", "state");
    require(at::equal(flat(*other), saved), "model differs on rank " + std::to_string(rank));
    require(at::equal(torch::rand({4}), next_random), "RNG of rank " + std::to_string(rank) + " not restored");
    dist::destroy_process_group();
  }), "");
}

TEST_F(CheckpointTest, ErrorsReachEveryRank) {
  const std::string blocker = path("a-file");
  std::ofstream(blocker) << "not a directory";
  const std::string bad = blocker + "/ckpt";  // mkdir fails (ENOTDIR), even as root
  const std::string good = path("good");
  EXPECT_EQ(testing::run_ranks(2, [&](int rank, int, std::shared_ptr<Store>) {
    torch::set_num_threads(1);
    dist::init_process_group();
    Net net;
    auto opt = make_sgd(net);
    try {
      save_checkpoint(bad, *net, &opt, {});
      throw std::runtime_error("save into " + bad + " succeeded");
    } catch (const CheckpointError& e) {
      std::string what = e.what();
      require(rank == 0 || what.find("rank 0 failed to write") != std::string::npos, what);
    }
    // Rank 0 cannot read: every rank raises.
    fs::create_directories(good);
    if (rank == 0) std::ofstream(good + "/latest") << "garbage\n";
    dist::barrier();
    try {
      load_checkpoint(good, *net, &opt);
      throw std::runtime_error("load of a bad 'latest' succeeded");
    } catch (const CheckpointError& e) {
      std::string what = e.what();
      require(what.find("not a version name") != std::string::npos, what);
    }
    // Rank 1's model differs: both ranks raise, rank 0 naming rank 1.
    if (rank == 0) fs::remove(good + "/latest");
    dist::barrier();
    save_checkpoint(good, *net, &opt, {});
    torch::nn::Sequential wrong(torch::nn::Linear(2, 2));
    try {
      if (rank == 0) {
        load_checkpoint(good, *net, &opt);
      } else {
        load_checkpoint(good, *wrong, nullptr);
      }
      throw std::runtime_error("mismatched load succeeded");
    } catch (const CheckpointError& e) {
      std::string what = e.what();
      require(rank == 1 || what.find("rank 1 failed to apply it") != std::string::npos, what);
    }
    // The group is still usable afterwards.
    at::Tensor t = at::ones({3});
    dist::all_reduce(t);
    require(at::all(t == 2).item<bool>(), "group broken after checkpoint errors");
    dist::destroy_process_group();
  }), "");
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
