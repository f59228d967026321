// gpu_resnet: ResNet-18 (torchvision's architecture, chorus::models) training steps on a GPU with
// synthetic ImageNet-sized batches, as plain libtorch (--mode plain: no DDP, one process) or under
// chorus's DistributedDataParallel (--mode ddp, every rank of `chorus run -n W`, ranks may share
// the GPU). bench/gpu-resnet runs it beside PyTorch's DDP (gpu_resnet_torch.py) and prints ratios.
// Prints one JSON line on rank 0: median step time and samples/s over the timed steps.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <vector>

#include "chorus/ddp/ddp.h"
#include "chorus/models/resnet.h"
#include "chorus/torch/distributed.h"

int main(int argc, char** argv) {
  std::string mode = "ddp";
  int64_t batch = 64, image = 224, warmup = 10, steps = 50;
  int depth = 18;
  CLI::App app{"ResNet training steps on a GPU (ResNet-18 unless --depth says otherwise): plain libtorch or chorus DDP"};
  app.add_option("--depth", depth, "ResNet depth (torchvision's 18, 34, 50, 101, 152)")
      ->check(CLI::IsMember({18, 34, 50, 101, 152}));
  app.add_option("--mode", mode, "plain or ddp")->check(CLI::IsMember({"plain", "ddp"}));
  app.add_option("--batch-size", batch, "images per rank and step");
  app.add_option("--image-size", image, "height and width");
  app.add_option("--warmup", warmup, "untimed steps first");
  app.add_option("--steps", steps, "timed steps");
  CLI11_PARSE(app, argc, argv);
  try {
    if (!torch::cuda::is_available()) throw std::runtime_error("no CUDA device");
    at::globalContext().setBenchmarkCuDNN(true);  // as torch.backends.cudnn.benchmark on the Python side
    int rank = 0, world = 1;
    if (mode == "ddp") {
      chorus::dist::init_process_group();
      rank = chorus::dist::get_rank();
      world = chorus::dist::get_world_size();
    }
    const torch::Device device(torch::kCUDA, 0);
    torch::manual_seed(0);
    chorus::models::ResNetOptions arch;
    arch.depth = depth;
    chorus::models::ResNet net(arch);
    net->to(device);
    std::unique_ptr<chorus::ddp::DistributedDataParallel<chorus::models::ResNetImpl>> ddp;
    if (mode == "ddp") ddp = std::make_unique<chorus::ddp::DistributedDataParallel<chorus::models::ResNetImpl>>(net.ptr());
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    const auto x = torch::randn({batch, 3, image, image}, torch::TensorOptions().device(device));
    const auto y = torch::randint(1000, {batch}, torch::TensorOptions().dtype(torch::kLong).device(device));
    std::vector<double> ms;
    for (int64_t s = 0; s < warmup + steps; ++s) {
      const auto t0 = std::chrono::steady_clock::now();
      sgd.zero_grad();
      auto out = ddp ? ddp->forward(x) : net->forward(x);
      torch::nn::functional::cross_entropy(out, y).backward();
      sgd.step();
      torch::cuda::synchronize();
      if (s >= warmup) ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    const double median = ms[ms.size() / 2];
    if (rank == 0) {
      std::cout << nlohmann::json{{"impl", "chorus"}, {"mode", mode}, {"depth", depth}, {"world", world}, {"batch", batch},
                                  {"image", image}, {"steps", steps}, {"step_ms", median},
                                  {"samples_per_s", 1000.0 * batch * world / median}}.dump()
                << std::endl;
    }
    if (mode == "ddp") chorus::dist::destroy_process_group();
  } catch (const std::exception& e) {
    std::cerr << "gpu_resnet: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
