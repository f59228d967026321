// chorus::dist on CUDA tensors (staged through pinned host memory, staging.h): every collective at
// W=2 and W=3, all ranks sharing the one GPU, against the same call on CPU tensors, which must give
// bit-identical results. Small pieces (CHORUS_STAGE_CHUNK_BYTES) so that the pipelined path runs
// several pieces per call. Skipped, with one line saying why, where libtorch has no CUDA device.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/torch/distributed.h"
#include "cuda_probe.h"
#include "testing.h"

namespace chorus::dist {
namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

using testing::cuda_unavailable_reason;

// Small integers, exact in every dtype; different on every rank.
at::Tensor values(int64_t n, int rank, at::ScalarType dtype, int salt = 0) {
  auto e = at::arange(n, at::kLong);
  return ((e * 7 + rank * 13 + salt * 5) % 17 - 8).to(dtype);
}

const at::Device kGpu(at::kCUDA, 0);

void same(const at::Tensor& cpu, const at::Tensor& gpu, const std::string& what) {
  require(gpu.is_cuda(), what + ": result left the GPU");
  require(at::equal(cpu, gpu.cpu()), what + ": the CUDA result differs from the CPU path's");
}

// One collective on CPU tensors and on copies of them on the GPU; `run` gets the device and
// returns the result where the collective left it.
void both(const std::string& what, const std::function<at::Tensor(const at::Device&)>& run) {
  at::Tensor on_cpu = run(at::Device(at::kCPU));
  at::Tensor on_gpu = run(kGpu);
  same(on_cpu, on_gpu, what);
}

void exercise(int rank, int world) {
  init_process_group();
  const std::vector<int64_t> sizes = {1, 7, 1000, 100003};  // 100003 x 4 bytes: many 64 KiB pieces
  const std::vector<at::ScalarType> types = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16,
                                             at::kChar,  at::kByte,   at::kInt,  at::kLong};
  for (int64_t n : sizes) {
    for (auto dtype : types) {
      const std::string tag = std::string(c10::toString(dtype)) + " x" + std::to_string(n);
      for (auto op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kProd, ReduceOp::kAvg}) {
        if (op == ReduceOp::kAvg && !at::isFloatingType(dtype)) continue;
        both("all_reduce " + tag, [&](const at::Device& d) {
          at::Tensor t = values(n, rank, dtype).to(d);
          all_reduce(t, op);
          return t;
        });
      }
      both("broadcast " + tag, [&](const at::Device& d) {
        at::Tensor t = values(n, rank, dtype).to(d);
        broadcast(t, world - 1);
        return t;
      });
      both("reduce " + tag, [&](const at::Device& d) {
        at::Tensor t = values(n, rank, dtype).to(d);
        reduce(t, 1 % world);
        return t;
      });
    }
    both("broadcast bool x" + std::to_string(n), [&](const at::Device& d) {
      at::Tensor t = (values(n, rank, at::kLong) > 0).to(d);
      broadcast(t, 0);
      return t;
    });
    both("all_gather x" + std::to_string(n), [&](const at::Device& d) {
      std::vector<at::Tensor> parts;
      for (int i = 0; i < world; ++i) parts.push_back(at::empty({n}, at::TensorOptions().dtype(at::kFloat).device(d)));
      all_gather(parts, values(n, rank, at::kFloat).to(d));
      return at::cat(parts);
    });
    both("all_gather_into_tensor x" + std::to_string(n), [&](const at::Device& d) {
      at::Tensor out = at::empty({world * n}, at::TensorOptions().dtype(at::kHalf).device(d));
      all_gather_into_tensor(out, values(n, rank, at::kHalf).to(d));
      return out;
    });
    both("gather x" + std::to_string(n), [&](const at::Device& d) {
      std::vector<at::Tensor> parts;
      if (rank == 0) {
        for (int i = 0; i < world; ++i) parts.push_back(at::zeros({n}, at::TensorOptions().dtype(at::kLong).device(d)));
      }
      gather(values(n, rank, at::kLong).to(d), rank == 0 ? &parts : nullptr, 0);
      return rank == 0 ? at::cat(parts) : at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(d));
    });
    both("scatter x" + std::to_string(n), [&](const at::Device& d) {
      std::vector<at::Tensor> parts;
      if (rank == world - 1) {
        for (int i = 0; i < world; ++i) parts.push_back(values(n, i, at::kInt, 3).to(d));
      }
      at::Tensor got = at::zeros({n}, at::TensorOptions().dtype(at::kInt).device(d));
      scatter(got, rank == world - 1 ? &parts : nullptr, world - 1);
      return got;
    });
    both("reduce_scatter x" + std::to_string(n), [&](const at::Device& d) {
      std::vector<at::Tensor> in;
      for (int i = 0; i < world; ++i) in.push_back(values(n, rank, at::kBFloat16, i).to(d));
      at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kBFloat16).device(d));
      reduce_scatter(out, in, ReduceOp::kSum);
      return out;
    });
    both("reduce_scatter_tensor x" + std::to_string(n), [&](const at::Device& d) {
      at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kDouble).device(d));
      reduce_scatter_tensor(out, values(world * n, rank, at::kDouble).to(d), ReduceOp::kMax);
      return out;
    });
    both("all_to_all_single x" + std::to_string(n), [&](const at::Device& d) {
      at::Tensor out = at::empty({world * n}, at::TensorOptions().dtype(at::kLong).device(d));
      all_to_all_single(out, values(world * n, rank, at::kLong).to(d));
      return out;
    });
    both("isend/irecv x" + std::to_string(n), [&](const at::Device& d) {
      at::Tensor in = at::zeros({n}, at::TensorOptions().dtype(at::kFloat).device(d));
      auto s = isend(values(n, rank, at::kFloat).to(d), (rank + 1) % world, 5);
      auto r = irecv(in, (rank + world - 1) % world, 5);
      s->wait();
      r->wait();
      return in;
    });
  }

  // Order: the copy to the host waits for work queued on the caller's stream. The fill comes after
  // a long matrix product on the same stream, and the all_reduce is issued without a synchronise.
  {
    at::Tensor a = at::randn({8192, 8192}, at::TensorOptions().device(kGpu));
    at::Tensor t = at::zeros({1 << 18}, at::TensorOptions().device(kGpu));
    at::Tensor busy = a.mm(a).mm(a);
    t.copy_(busy.flatten().narrow(0, 0, 1 << 18).mul(0).add(rank + 1));
    all_reduce(t);
    require(at::all(t.cpu() == world * (world + 1) / 2.0).item<bool>(), "all_reduce after queued kernels");
  }

  // Async: several calls in flight, results right after each wait (on the device too).
  {
    std::vector<at::Tensor> ts;
    std::vector<WorkPtr> ws;
    for (int i = 0; i < 6; ++i) {
      ts.push_back(at::full({50000 + i}, rank + i, at::TensorOptions().dtype(at::kFloat).device(kGpu)));
      ws.push_back(all_reduce(ts.back(), ReduceOp::kSum, nullptr, /*async_op=*/true));
    }
    for (int i = 0; i < 6; ++i) {
      ws[static_cast<size_t>(i)]->wait();
      require(ws[static_cast<size_t>(i)]->is_completed(), "async work completed after wait");
      const double want = world * (world - 1) / 2.0 + world * i;
      require(at::all(ts[static_cast<size_t>(i)].cpu() == want).item<bool>(), "async all_reduce " + std::to_string(i));
    }
  }

  // Tensors on two devices in one call: a clear error, no hang (every rank makes the same mistake).
  {
    at::Tensor out = at::empty({world * 4});
    try {
      all_gather_into_tensor(out, at::ones({4}, at::TensorOptions().device(kGpu)));
      require(false, "no UsageError for tensors on two devices");
    } catch (const UsageError& e) {
      require(std::string(e.what()).find("one device") != std::string::npos, std::string("message: ") + e.what());
    }
  }
  barrier();
  destroy_process_group();
}

class CudaCollectives : public ::testing::TestWithParam<int> {};

TEST_P(CudaCollectives, EqualToTheCpuPath) {
  const std::string why = cuda_unavailable_reason();
  if (!why.empty()) GTEST_SKIP() << why;
  ::setenv("CHORUS_STAGE_CHUNK_BYTES", "65536", 1);
  const std::string err = testing::run_ranks(GetParam(), [](int rank, int world, std::shared_ptr<Store>) {
    exercise(rank, world);
  }, std::chrono::seconds(240));
  ::unsetenv("CHORUS_STAGE_CHUNK_BYTES");
  EXPECT_EQ(err, "");
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CudaCollectives, ::testing::Values(2, 3),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

// One rank: the collectives that change nothing at world size 1 return at once, tensor untouched.
TEST(CudaCollectivesSingle, WorldSizeOneLeavesTheTensor) {
  const std::string why = cuda_unavailable_reason();
  if (!why.empty()) GTEST_SKIP() << why;
  EXPECT_EQ(testing::run_ranks(1, [](int, int, std::shared_ptr<Store>) {
    init_process_group();
    at::Tensor t = at::arange(10, at::TensorOptions().dtype(at::kFloat).device(kGpu));
    all_reduce(t, ReduceOp::kAvg);
    broadcast(t, 0);
    require(at::equal(t.cpu(), at::arange(10, at::kFloat)), "unchanged at W=1");
    destroy_process_group();
  }, std::chrono::seconds(60)), "");
}

}  // namespace
}  // namespace chorus::dist
