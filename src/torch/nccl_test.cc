// chorus::dist::nccl (chorus/torch/nccl.h). One GPU allows one NCCL rank, so the operations run at
// W=1: through init_process_group("nccl") and chorus::dist, each against the CPU path (which must
// give the same bytes), on the caller's stream, with async_op. The error paths use more ranks
// without needing more GPUs: a rank that never joins (the others time out naming it), two ranks
// on the one GPU (NCCL refuses; every rank gets an error saying why), abort.
// In a build without NCCL, init_process_group("nccl") and Communicator::create must say how to
// get it; the GPU cases skip with a one-line reason.
#include "chorus/torch/nccl.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/torch/distributed.h"
#include "cuda_probe.h"
#include "testing.h"

namespace chorus::dist {
namespace {

using Clock = std::chrono::steady_clock;

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Why the GPU cases cannot run here ("" when they can).
std::string skip_reason() {
  if (!nccl::built_with_nccl()) return "chorus was built without NCCL (-DCHORUS_WITH_NCCL=OFF)";
  return testing::cuda_unavailable_reason();
}

at::Tensor values(int64_t n, at::ScalarType dtype, int salt = 0) {
  auto e = at::arange(n, at::kLong);
  return ((e * 7 + salt * 5) % 17 - 8).to(dtype);
}

TEST(Nccl, ABuildWithoutNcclSaysHowToGetIt) {
  if (nccl::built_with_nccl()) GTEST_SKIP() << "this build has NCCL (version " << nccl::version() << ")";
  EXPECT_EQ(nccl::version(), "");
  const std::string init = testing::usage_error([] { init_process_group("nccl"); });
  EXPECT_TRUE(contains(init, "backend \"nccl\" is not available")) << init;
  EXPECT_TRUE(contains(init, "-DCHORUS_WITH_NCCL=ON")) << init;
  EXPECT_FALSE(is_initialized());
  const std::string err = testing::run_ranks(1, [](int rank, int world, std::shared_ptr<Store> store) {
    const std::string create = testing::usage_error([&] { nccl::Communicator::create(*store, "nccl", rank, world); });
    require(contains(create, "built without NCCL") && contains(create, "-DCHORUS_WITH_NCCL=ON"), create);
  });
  EXPECT_EQ(err, "");
}

// Every NCCL operation through chorus::dist at W=1, equal to the same call on CPU tensors.
TEST(Nccl, EveryOperationAtWorldSizeOneEqualsTheCpuPath) {
  const std::string why = skip_reason();
  if (!why.empty()) GTEST_SKIP() << why;
  const std::string err = testing::run_ranks(1, [](int rank, int world, std::shared_ptr<Store>) {
    init_process_group("nccl");
    auto comm = nccl::default_communicator();
    require(comm != nullptr, "init_process_group(\"nccl\") made no communicator");
    require(comm->rank() == 0 && comm->size() == 1 && comm->device() == 0, "communicator rank/size/device");
    require(comm->broken().empty(), "a new communicator is broken: " + comm->broken());
    const at::Device gpu(at::kCUDA, 0);
    auto same = [](const at::Tensor& cpu, const at::Tensor& dev, const std::string& what) {
      require(dev.is_cuda(), what + ": the result left the GPU");
      require(at::equal(cpu, dev.cpu()), what + ": the NCCL result differs from the CPU path's");
    };
    const std::vector<at::ScalarType> types = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16,
                                               at::kChar,  at::kByte,   at::kInt,  at::kLong};
    for (int64_t n : {1, 1000, 1 << 20}) {
      for (auto dtype : types) {
        const std::string tag = std::string(c10::toString(dtype)) + " x" + std::to_string(n);
        for (auto op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kProd, ReduceOp::kAvg}) {
          if (op == ReduceOp::kAvg && !at::isFloatingType(dtype)) continue;
          at::Tensor c = values(n, dtype);
          at::Tensor d = c.to(gpu);
          all_reduce(c, op);
          all_reduce(d, op);
          same(c, d, std::string("all_reduce ") + to_string(op) + " " + tag);
        }
        at::Tensor c = values(n, dtype, 1);
        at::Tensor d = c.to(gpu);
        broadcast(c, 0);
        broadcast(d, 0);
        same(c, d, "broadcast " + tag);
        reduce(c, 0, ReduceOp::kMax);
        reduce(d, 0, ReduceOp::kMax);
        same(c, d, "reduce " + tag);
        // Out-of-place results land in memory NCCL must write: start from a poison value.
        at::Tensor out_c = at::full({n}, 99, at::TensorOptions().dtype(dtype));
        at::Tensor out_d = out_c.to(gpu);
        all_gather_into_tensor(out_c, values(n, dtype, 2));
        all_gather_into_tensor(out_d, values(n, dtype, 2).to(gpu));
        same(out_c, out_d, "all_gather_into_tensor " + tag);
        require(at::equal(out_d.cpu(), values(n, dtype, 2)), "all_gather_into_tensor " + tag + ": not the input");
        std::vector<at::Tensor> list_d = {at::full({n}, 99, at::TensorOptions().dtype(dtype).device(gpu))};
        all_gather(list_d, values(n, dtype, 3).to(gpu));
        require(at::equal(list_d[0].cpu(), values(n, dtype, 3)), "all_gather " + tag);
        at::Tensor rs_d = at::full({n}, 99, at::TensorOptions().dtype(dtype).device(gpu));
        reduce_scatter_tensor(rs_d, values(n, dtype, 4).to(gpu), ReduceOp::kSum);
        at::Tensor rs_c = at::full({n}, 99, at::TensorOptions().dtype(dtype));
        reduce_scatter_tensor(rs_c, values(n, dtype, 4), ReduceOp::kSum);
        same(rs_c, rs_d, "reduce_scatter_tensor " + tag);
      }
    }
    // bool goes through the copying operations.
    at::Tensor flags = (values(1000, at::kLong) > 0).to(gpu);
    broadcast(flags, 0);
    require(at::equal(flags.cpu(), values(1000, at::kLong) > 0), "broadcast bool");
    const std::string bool_sum = testing::usage_error([&] { all_reduce(flags); });
    require(contains(bool_sum, "cannot be reduced"), "all_reduce on bool: " + bool_sum);
    // async_op: the Work completes once the GPU has run it; on the current stream, in order.
    at::Tensor big = at::ones({1 << 22}, at::TensorOptions().dtype(at::kFloat).device(gpu));
    auto work = all_reduce(big, ReduceOp::kSum, nullptr, true);
    big.mul_(3);  // queued after the allreduce on the same stream
    work->wait();
    require(work->is_completed() && work->is_success() && work->exception() == nullptr, "async work state");
    require(at::equal(big.cpu(), at::full({1 << 22}, 3.0f)), "the stream order of an async allreduce");
    // A tensor on another device than the communicator's, or a CPU tensor straight to NCCL: UsageError.
    const std::string on_cpu = testing::usage_error([&] { comm->all_reduce(at::ones({4})); });
    require(contains(on_cpu, "NCCL takes CUDA tensors"), "CPU tensor to the communicator: " + on_cpu);
    // CPU tensors under the "nccl" backend go through chorus's own group, and the object
    // collectives and barrier too.
    at::Tensor host = values(10, at::kFloat);
    all_reduce(host);
    require(at::equal(host, values(10, at::kFloat)), "a CPU tensor under the nccl backend");
    barrier();
    require(all_gather_object("x").size() == 1, "all_gather_object under the nccl backend");
    destroy_process_group();
    require(nccl::default_communicator() == nullptr, "destroy_process_group kept the communicator");
    // A second communicator after the first: setup and teardown leave nothing behind.
    init_process_group("nccl");
    at::Tensor again = values(100, at::kFloat).to(gpu);
    all_reduce(again, ReduceOp::kAvg);
    require(at::equal(again.cpu(), values(100, at::kFloat)), "all_reduce on a second communicator");
    destroy_process_group();
    (void)rank;
    (void)world;
  }, std::chrono::seconds(240));
  EXPECT_EQ(err, "");
}

TEST(Nccl, AbortMakesEveryLaterCallFailWithItsReason) {
  const std::string why = skip_reason();
  if (!why.empty()) GTEST_SKIP() << why;
  const std::string err = testing::run_ranks(1, [](int rank, int world, std::shared_ptr<Store> store) {
    nccl::CommunicatorOptions o;
    o.device = 0;
    o.timeout = std::chrono::seconds(30);
    auto comm = nccl::Communicator::create(*store, "abort-test", rank, world, o);
    at::Tensor t = at::ones({1000}, at::TensorOptions().device(at::Device(at::kCUDA, 0)));
    comm->all_reduce(t);  // works before
    comm->abort("the test aborted it");
    require(contains(comm->broken(), "the test aborted it"), "broken(): " + comm->broken());
    try {
      comm->all_reduce(t);
      throw std::runtime_error("all_reduce after abort did not throw");
    } catch (const PeerError& e) {
      require(contains(e.what(), "the test aborted it") && contains(e.what(), "rank 0 of 1"),
              std::string("the error after abort: ") + e.what());
    }
    comm.reset();  // destroying an aborted communicator neither hangs nor throws
  }, std::chrono::seconds(120));
  EXPECT_EQ(err, "");
}

// Rank 1 is alive but never joins: rank 0's setup ends at its deadline with a TimeoutError that
// names rank 1, and its half-made communicator is aborted (the process then exits normally).
TEST(Nccl, ARankThatNeverJoinsIsATimeoutNamingIt) {
  const std::string why = skip_reason();
  if (!why.empty()) GTEST_SKIP() << why;
  const std::string err = testing::run_ranks(2, [](int rank, int world, std::shared_ptr<Store> store) {
    if (rank == 1) {
      store->wait({"rank0-done"}, std::chrono::seconds(60));  // alive, but no NCCL
      return;
    }
    nccl::CommunicatorOptions o;
    o.device = 0;
    o.timeout = std::chrono::seconds(3);
    const auto start = Clock::now();
    std::string message = "(no TimeoutError)";
    try {
      nccl::Communicator::create(*store, "never-joins", rank, world, o);
    } catch (const TimeoutError& e) {
      message = e.what();
    }
    const double waited = std::chrono::duration<double>(Clock::now() - start).count();
    store->set("rank0-done", "1");
    require(contains(message, "rank 1 did not join") && contains(message, "rank 0 of 2"), message);
    require(waited >= 2.9 && waited < 15, "rank 0 waited " + std::to_string(waited) + " s with a 3 s deadline");
  }, std::chrono::seconds(90));
  EXPECT_EQ(err, "");
}

// NCCL refuses two ranks on one GPU: every rank gets a UsageError with NCCL's reason and the fix,
// within the deadline, and chorus's own backend is named as the way to share a GPU.
TEST(Nccl, TwoRanksOnOneGpuAreRefusedOnEveryRank) {
  const std::string why = skip_reason();
  if (!why.empty()) GTEST_SKIP() << why;
  const std::string err = testing::run_ranks(2, [](int rank, int world, std::shared_ptr<Store> store) {
    nccl::CommunicatorOptions o;
    o.device = 0;
    o.timeout = std::chrono::seconds(60);
    const std::string message = testing::usage_error([&] { nccl::Communicator::create(*store, "one-gpu", rank, world, o); });
    require(contains(message, "Duplicate GPU") && contains(message, "one GPU per rank") &&
                contains(message, "rank " + std::to_string(rank) + " of 2"),
            "rank " + std::to_string(rank) + ": " + message);
  }, std::chrono::seconds(120));
  EXPECT_EQ(err, "");
}

}  // namespace
}  // namespace chorus::dist
