// chorus::dist on at::Tensor: every collective at W=1..3 with several dtypes, and the errors for
// tensors chorus cannot take.
#include "chorus/torch/distributed.h"
#include "chorus/torch/nccl.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "chorus/comm/error.h"
#include "chorus/comm/mpi.h"
#include "testing.h"

namespace chorus::dist {
namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

void exercise(int rank, int world) {
  init_process_group();  // env:// as spawn sets it
  require(is_initialized() && get_rank() == rank && get_world_size() == world, "rank/world");
  const double tri = world * (world + 1) / 2.0;  // sum of rank + 1 over ranks

  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kInt, at::kLong, at::kChar, at::kByte}) {
    at::Tensor t = at::full({3, 5}, rank + 1, at::TensorOptions().dtype(dtype));
    all_reduce(t);
    require(at::all(t == at::full({3, 5}, tri, t.options())).item<bool>(), "all_reduce sum");
    at::Tensor m = at::full({7}, rank + 1, at::TensorOptions().dtype(dtype));
    all_reduce(m, ReduceOp::kMax);
    require(at::all(m == world).item<bool>(), "all_reduce max");
  }

  at::Tensor avg = at::arange(10, at::kFloat) * (rank + 1);
  all_reduce(avg, ReduceOp::kAvg);
  require(at::allclose(avg, at::arange(10, at::kFloat) * tri / world), "all_reduce avg");

  at::Tensor b = rank == world - 1 ? at::arange(6, at::kLong) : at::zeros({6}, at::kLong);
  broadcast(b, world - 1);
  require(at::equal(b, at::arange(6, at::kLong)), "broadcast");

  at::Tensor flags = at::full({4}, rank == 0, at::kBool);
  broadcast(flags, 0);
  require(at::all(flags).item<bool>(), "broadcast bool");

  at::Tensor r = at::full({4}, rank + 1.0, at::kDouble);
  reduce(r, 0);
  require(at::all(r == (rank == 0 ? tri : rank + 1.0)).item<bool>(), "reduce");

  std::vector<at::Tensor> parts;
  for (int i = 0; i < world; ++i) parts.push_back(at::empty({2, 2}, at::kFloat));
  all_gather(parts, at::full({2, 2}, static_cast<float>(rank), at::kFloat));
  for (int i = 0; i < world; ++i) require(at::all(parts[static_cast<size_t>(i)] == i).item<bool>(), "all_gather");

  at::Tensor big = at::empty({world * 3}, at::kInt);
  all_gather_into_tensor(big, at::full({3}, rank, at::kInt));
  for (int i = 0; i < world; ++i) require(at::all(big.slice(0, i * 3, i * 3 + 3) == i).item<bool>(), "into_tensor");

  std::vector<at::Tensor> gl;
  if (rank == 0) {
    for (int i = 0; i < world; ++i) gl.push_back(at::empty({5}, at::kLong));
  }
  gather(at::full({5}, rank * 10, at::kLong), rank == 0 ? &gl : nullptr, 0);
  if (rank == 0) {
    for (int i = 0; i < world; ++i) require(at::all(gl[static_cast<size_t>(i)] == i * 10).item<bool>(), "gather");
  }

  std::vector<at::Tensor> sl;
  if (rank == 0) {
    for (int i = 0; i < world; ++i) sl.push_back(at::full({3}, i + 100, at::kFloat));
  }
  at::Tensor got = at::empty({3}, at::kFloat);
  scatter(got, rank == 0 ? &sl : nullptr, 0);
  require(at::all(got == rank + 100).item<bool>(), "scatter");

  std::vector<at::Tensor> rs_in;
  for (int i = 0; i < world; ++i) rs_in.push_back(at::full({4}, i * (rank + 1), at::kFloat));
  at::Tensor rs_out = at::empty({4}, at::kFloat);
  reduce_scatter(rs_out, rs_in);
  require(at::all(rs_out == rank * tri).item<bool>(), "reduce_scatter");

  at::Tensor a_in = at::arange(world * 2, at::kLong) + rank * 100;
  at::Tensor a_out = at::empty({world * 2}, at::kLong);
  all_to_all_single(a_out, a_in);
  for (int i = 0; i < world; ++i) {
    require(at::equal(a_out.slice(0, i * 2, i * 2 + 2), at::arange(rank * 2, rank * 2 + 2, at::kLong) + i * 100),
            "all_to_all_single");
  }

  if (world > 1) {
    at::Tensor s = at::full({8}, rank, at::kFloat);
    at::Tensor in = at::empty({8}, at::kFloat);
    auto w1 = isend(s, (rank + 1) % world, 3);
    auto w2 = irecv(in, (rank + world - 1) % world, 3);
    w1->wait();
    w2->wait();
    require(at::all(in == (rank + world - 1) % world).item<bool>(), "isend/irecv");
  }

  // Async all_reduce: the Work completes, and the tensor holds the result after wait().
  at::Tensor as = at::ones({1000}, at::kFloat);
  auto w = all_reduce(as, ReduceOp::kSum, nullptr, true);
  w->wait();
  require(w->is_success() && at::all(as == world).item<bool>(), "async all_reduce");

  auto objs = all_gather_object("rank" + std::to_string(rank));
  require(objs.size() == static_cast<size_t>(world) && objs.back() == "rank" + std::to_string(world - 1), "objects");
  require(broadcast_object(rank == 0 ? "cfg" : "", 0) == "cfg", "broadcast_object");

  barrier();
  destroy_process_group();
  require(!is_initialized(), "destroy");
}

class TorchDistributed : public ::testing::TestWithParam<int> {};

TEST_P(TorchDistributed, EveryCollectiveOnTensors) {
  EXPECT_EQ(testing::run_ranks(GetParam(), [](int rank, int world, std::shared_ptr<Store>) { exercise(rank, world); },
                               std::chrono::seconds(90)),
            "");
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, TorchDistributed, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

// An async all_gather into a tensor list is complete only once the list holds the result: a caller
// that polls is_completed() and then reads the list, without wait(), reads the gathered values.
TEST(TorchDistributedAsync, PollingAnAllGatherSeesTheFinalList) {
  EXPECT_EQ(testing::run_ranks(3, [](int rank, int world, std::shared_ptr<Store>) {
    init_process_group();
    for (int round = 0; round < 50; ++round) {
      std::vector<at::Tensor> parts;
      for (int i = 0; i < world; ++i) parts.push_back(at::full({1000}, -1.0f));
      auto work = all_gather(parts, at::full({1000}, static_cast<float>(rank * 100 + round)), nullptr, true);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (!work->is_completed()) {
        if (std::chrono::steady_clock::now() > deadline) throw std::runtime_error("all_gather never completed");
        std::this_thread::yield();
      }
      if (!work->is_success()) throw std::runtime_error("all_gather failed");
      for (int i = 0; i < world; ++i) {
        if (!at::equal(parts[i], at::full({1000}, static_cast<float>(i * 100 + round)))) {
          throw std::runtime_error("round " + std::to_string(round) + ": block " + std::to_string(i) +
                                   " is not rank " + std::to_string(i) + "'s after is_completed()");
        }
      }
    }
    destroy_process_group();
  }), "");
}

TEST(TorchDistributedErrors, TensorsChorusCannotTakeGetClearErrors) {
  std::string err = testing::run_ranks(1, [](int, int, std::shared_ptr<Store>) {
    init_process_group();
    auto expect_usage = [](auto&& f, const std::string& needle) {
      try {
        f();
      } catch (const UsageError& e) {
        if (std::string(e.what()).find(needle) == std::string::npos) {
          throw std::runtime_error(std::string("message lacks '") + needle + "': " + e.what());
        }
        return;
      }
      throw std::runtime_error("no UsageError for " + needle);
    };
    at::Tensor t = at::ones({4, 4});
    expect_usage([&] { all_reduce(t.t()); }, ".contiguous()");
    expect_usage([&] { all_reduce(at::Tensor()); }, "undefined");
    expect_usage([&] { all_reduce(at::ones({2}, at::kComplexFloat)); }, "not supported");
    expect_usage([&] { all_reduce(at::ones({2}, at::kBool)); }, "cannot be reduced");
    std::vector<at::Tensor> wrong(3, at::ones({4, 4}));
    expect_usage([&] { all_gather(wrong, t); }, "one per rank");
    destroy_process_group();
    expect_usage([&] { all_reduce(t); }, "init_process_group");
    // With NCCL built in, "nccl" runs on a GPU (nccl_test); without, it says how to get it.
    if (!nccl::built_with_nccl()) expect_usage([&] { init_process_group("nccl"); }, "-DCHORUS_WITH_NCCL=ON");
    // With MPI built in, "mpi" runs under mpirun (mpi_collectives_test); without, it says how to get it.
    if (!mpi_available()) expect_usage([&] { init_process_group("mpi"); }, "install Open MPI");
    expect_usage([&] { init_process_group("glo"); }, "unknown backend 'glo'");
    // torch.distributed's CPU backend name runs on chorus's own transports.
    init_process_group("gloo");
    all_reduce(t);
    destroy_process_group();
  }, std::chrono::seconds(30));
  EXPECT_EQ(err, "");
}

TEST(TorchDistributedErrors, BackendNamesMapToTransports) {
  EXPECT_EQ(transport_for_backend("chorus"), "");
  EXPECT_EQ(transport_for_backend("gloo"), "");
  EXPECT_EQ(transport_for_backend("tcp"), "tcp");
  EXPECT_EQ(transport_for_backend("shm"), "shm");
  EXPECT_EQ(transport_for_backend("hybrid"), "hybrid");
  EXPECT_EQ(transport_for_backend("mpi"), "mpi");
  EXPECT_EQ(nccl::built_with_nccl(), [] {
    try {
      return transport_for_backend("nccl") == "";
    } catch (const UsageError&) {
      return false;
    }
  }());
  for (const char* name : {"ucc", ""}) {
    try {
      transport_for_backend(name);
      ADD_FAILURE() << "no UsageError for backend '" << name << "'";
    } catch (const UsageError& e) {
      // Every refusal names what exists.
      EXPECT_NE(std::string(e.what()).find("\"gloo\""), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("\"tcp\""), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace chorus::dist
