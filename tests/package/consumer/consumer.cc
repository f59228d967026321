// Built against chorus by a project of its own (tests/package): on 2 ranks under `chorus run`, one
// DDP backward and a tensor allreduce, checked exactly. Prints "consumer: rank R ok" or exits 1.
#include <torch/nn/modules/linear.h>

#include <cstdio>
#include <exception>

#include "chorus/config.h"
#include "chorus/ddp/ddp.h"
#include "chorus/torch/distributed.h"

int main() {
  try {
    chorus::dist::init_process_group();
    const int rank = chorus::dist::get_rank();
    const int world = chorus::dist::get_world_size();

    // loss = sum(W x) with x = (rank + 1, rank + 1): d loss / dW = x on each rank, so the averaged
    // gradient is the mean of 1..world in every entry.
    auto model = torch::nn::Linear(torch::nn::LinearOptions(2, 1).bias(false));
    chorus::ddp::DistributedDataParallel ddp(model);
    auto x = torch::full({1, 2}, static_cast<float>(rank + 1));
    ddp.forward(x).sum().backward();
    const float want_grad = (world + 1) / 2.0f;
    auto grad = model->weight.grad();
    const bool grad_ok = grad.eq(want_grad).all().item<bool>();

    auto t = torch::full({4}, static_cast<int64_t>(rank + 1), torch::kInt64);
    chorus::dist::all_reduce(t);
    const int64_t want_sum = static_cast<int64_t>(world) * (world + 1) / 2;
    const bool sum_ok = t.eq(want_sum).all().item<bool>();

    std::printf("consumer: rank %d of %d (chorus %s): grad [%g, %g] (want %g), allreduce %lld (want %lld)\n",
                rank, world, CHORUS_VERSION, grad[0][0].item<float>(), grad[0][1].item<float>(), want_grad,
                static_cast<long long>(t[0].item<int64_t>()), static_cast<long long>(want_sum));
    chorus::dist::destroy_process_group();
    if (world < 2 || !grad_ok || !sum_ok) return 1;
    std::printf("consumer: rank %d ok\n", rank);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 1;
  }
}
