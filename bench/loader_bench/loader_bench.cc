// loader_bench: the chorus side of bench/compare-loader.
//
//   loader_bench read ROOT --size 64 --transform pad-crop --threads 2 --batch-size 64 --epochs 3
//     images/s of a ParallelLoader over make_image_folder(LocalByteSource(ROOT)) with image_decoder
//     (RGB, as torchvision's ImageFolder loader), shuffled (DistributedSampler of one replica,
//     auto_epoch), one JSON line on stdout.
//   chorus run -n 2 --bind-cpu loader_bench train --data ROOT --source folder|memory --steps 30
//     ResNet-18 (1 channel, gray images) trained with the Accelerator; `folder` loads the batches
//     from the image folder with the ParallelLoader, `memory` decodes every item once up front with
//     the same decode function and serves the same batches (same sampler, batch size) from one
//     tensor. The figures are the Accelerator's run records (runs/NAME/summary.json, metrics/).
//
// The transforms (the same on the PyTorch side, see bench/compare-loader):
//   pad-crop:    RandomCrop(S, padding=S/8), RandomHorizontalFlip, ToTensor, Normalize
//   resize-crop: Resize(S*8/7), CenterCrop(S), RandomHorizontalFlip, ToTensor, Normalize
// Normalize: ImageNet's mean and std for RGB; Fashion-MNIST's (0.286, 0.353) for gray.
#include <CLI/CLI.hpp>
#include <sys/resource.h>
#include <torch/data/datasets/base.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>

#include "chorus/data/image_folder.h"
#include "chorus/data/image_tensor.h"
#include "chorus/data/loader.h"
#include "chorus/data/sampler.h"
#include "chorus/models/resnet.h"
#include "chorus/train/accelerator.h"

namespace data = chorus::data;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Peak resident set of this process (getrusage: kilobytes on Linux), in MB.
double peak_rss_mb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

data::ImagePipeline make_pipeline(const std::string& transform, int64_t size, data::ImageMode mode) {
  const bool gray = mode == data::ImageMode::kGray;
  std::vector<float> mean = gray ? std::vector<float>{0.286f} : std::vector<float>{0.485f, 0.456f, 0.406f};
  std::vector<float> stddev = gray ? std::vector<float>{0.353f} : std::vector<float>{0.229f, 0.224f, 0.225f};
  data::ImagePipeline p;
  if (transform == "pad-crop") {
    const int64_t pad = size / 8;
    p.random_crop(size, size, {{pad, pad, pad, pad}});
  } else if (transform == "resize-crop") {
    p.resize(size * 8 / 7).center_crop(size);
  } else {
    throw chorus::UsageError("loader_bench: unknown --transform " + transform + " (pad-crop or resize-crop)");
  }
  return p.random_horizontal_flip().normalise(std::move(mean), std::move(stddev));
}

data::ImageMode parse_mode(const std::string& name) {
  if (name == "rgb") return data::ImageMode::kRGB;
  if (name == "gray") return data::ImageMode::kGray;
  throw chorus::UsageError("loader_bench: unknown --mode " + name + " (rgb or gray)");
}

struct ReadJob {
  std::string root;
  std::string transform = "pad-crop";
  std::string mode = "rgb";
  int64_t size = 28;
  int64_t epochs = 1;
  size_t batch_size = 64;
  int threads = 2;
  size_t prefetch_batches = 2;
  uint64_t seed = 0;
};

int run_read(const ReadJob& job) {
  at::set_num_threads(1);  // as PyTorch's DataLoader workers; the stack runs on a decode thread
  const auto mode = parse_mode(job.mode);
  const auto listed = Clock::now();
  auto dataset = data::make_image_folder(std::make_shared<data::LocalByteSource>(job.root),
                                         data::image_decoder(make_pipeline(job.transform, job.size, mode), mode,
                                                             job.seed));
  const double list_seconds = seconds_since(listed);

  data::DistributedSamplerOptions so;
  so.num_replicas = 1;
  so.rank = 0;
  so.seed = job.seed;
  so.auto_epoch = true;
  data::LoaderOptions lo;
  lo.batch_size = job.batch_size;
  lo.threads = job.threads;
  lo.prefetch_batches = job.prefetch_batches;

  int64_t images = 0, batches = 0;
  double first_batch_seconds = -1;
  std::vector<int64_t> shape;
  const auto start = Clock::now();
  {
    data::ParallelLoader loader(dataset, data::DistributedSampler(static_cast<int64_t>(dataset.size()), so), lo);
    for (int64_t e = 0; e < job.epochs; ++e) {
      for (auto& batch : loader) {
        if (first_batch_seconds < 0) first_batch_seconds = seconds_since(start);
        if (shape.empty()) shape = batch.data.sizes().vec();
        if (batch.data.sizes().slice(1) != c10::IntArrayRef(shape).slice(1) || batch.target.size(0) != batch.data.size(0)) {
          throw chorus::Error("loader_bench: batch " + std::to_string(batches) + " has another shape");
        }
        images += batch.data.size(0);
        ++batches;
      }
    }
  }
  const double seconds = seconds_since(start);
  const int64_t expected = static_cast<int64_t>(dataset.size()) * job.epochs;
  if (images != expected) {
    throw chorus::Error("loader_bench: read " + std::to_string(images) + " images, expected " +
                        std::to_string(expected));
  }
  nlohmann::json out = {{"mode", "read"},
                        {"root", job.root},
                        {"transform", job.transform},
                        {"image_mode", job.mode},
                        {"size", job.size},
                        {"threads", job.threads},
                        {"batch_size", job.batch_size},
                        {"prefetch_batches", job.prefetch_batches},
                        {"epochs", job.epochs},
                        {"dataset_size", dataset.size()},
                        {"classes", dataset.classes().size()},
                        {"images", images},
                        {"batches", batches},
                        {"batch_shape", shape},
                        {"list_seconds", list_seconds},
                        {"first_batch_seconds", first_batch_seconds},
                        {"seconds", seconds},
                        {"images_per_s", seconds > 0 ? static_cast<double>(images) / seconds : 0.0},
                        {"peak_rss_mb", peak_rss_mb()}};
  std::cout << out.dump() << std::endl;
  return 0;
}

struct TrainJob {
  std::string data;
  std::string source = "folder";
  int64_t steps = 30;
  int64_t batch_size = 32;
  int64_t image_size = 64;
  int loader_threads = 2;
  int threads = 1;
  double lr = 0.01;
};

// Decoded items held in memory, served as batches by index (a torch batch dataset for the
// Accelerator's prepare_data_loader): the same samples and targets as the image folder's loader.
class MemoryBatches : public torch::data::datasets::BatchDataset<MemoryBatches, torch::data::Example<>> {
 public:
  MemoryBatches(at::Tensor data, at::Tensor targets)
      : data_(std::move(data).contiguous()), targets_(std::move(targets).contiguous()) {}
  // The rows copied into a new batch (data_ is contiguous: one memcpy per item).
  torch::data::Example<> get_batch(c10::ArrayRef<size_t> indices) override {
    auto sizes = data_.sizes().vec();
    sizes[0] = static_cast<int64_t>(indices.size());
    at::Tensor data = at::empty(sizes, data_.options());
    at::Tensor targets = at::empty({sizes[0]}, targets_.options());
    const size_t row = static_cast<size_t>(data_[0].numel()) * sizeof(float);
    for (size_t i = 0; i < indices.size(); ++i) {
      std::memcpy(static_cast<char*>(data.data_ptr()) + i * row,
                  static_cast<const char*>(data_.data_ptr()) + indices[i] * row, row);
      targets.data_ptr<int64_t>()[i] = targets_.data_ptr<int64_t>()[indices[i]];
    }
    return {data, targets};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(data_.size(0)); }

 private:
  at::Tensor data_, targets_;
};

// Every item decoded once (epoch 0) through the dataset's own decode function, stacked.
MemoryBatches decode_all(const data::ImageDataset& dataset) {
  std::vector<at::Tensor> xs, ys;
  xs.reserve(dataset.size());
  ys.reserve(dataset.size());
  for (size_t i = 0; i < dataset.size(); ++i) {
    auto item = dataset.get(i, 0);
    xs.push_back(std::move(item.data));
    ys.push_back(std::move(item.target));
  }
  return MemoryBatches(at::stack(xs), at::stack(ys));
}

template <typename Loader, typename Model, typename Optimizer>
void train_steps(chorus::train::Accelerator& accelerator, Loader& loader, Model& model, Optimizer& optimizer,
                 int64_t epochs) {
  for (int64_t epoch : accelerator.epochs(epochs)) {
    (void)epoch;
    model.train();
    for (auto& batch : loader) {
      optimizer.zero_grad();
      accelerator.backward(torch::cross_entropy_loss(model(batch.data), batch.target));
      optimizer.step();
    }
  }
}

void run_train(const TrainJob& job, chorus::train::AcceleratorOptions options) {
  if (job.source != "folder" && job.source != "memory") {
    throw chorus::UsageError("loader_bench: unknown --source " + job.source + " (folder or memory)");
  }
  chorus::train::set_num_threads(job.threads);
  const auto mode = data::ImageMode::kGray;
  auto dataset = data::make_image_folder(std::make_shared<data::LocalByteSource>(job.data),
                                         data::image_decoder(make_pipeline("pad-crop", job.image_size, mode), mode,
                                                             options.seed));
  // Before the Accelerator, so that the decoding stays out of its training time.
  std::unique_ptr<MemoryBatches> memory;
  if (job.source == "memory") memory = std::make_unique<MemoryBatches>(decode_all(dataset));

  options.max_steps = job.steps;
  options.config = {{"source", job.source}, {"data", job.data}, {"steps", job.steps},
                    {"batch_size", job.batch_size}, {"image_size", job.image_size},
                    {"loader_threads", job.loader_threads}, {"threads", job.threads}, {"lr", job.lr}};
  chorus::train::Accelerator accelerator(options);
  const int64_t per_rank = (static_cast<int64_t>(dataset.size()) + accelerator.world_size() - 1) / accelerator.world_size();
  const int64_t batches_per_epoch = (per_rank + job.batch_size - 1) / job.batch_size;
  const int64_t epochs = (job.steps + batches_per_epoch - 1) / batches_per_epoch;
  accelerator.print("loader_bench train: ", job.source, ", ", dataset.size(), " images of ", job.image_size,
                    " px, batch ", job.batch_size, " per rank, ", job.steps, " steps (", epochs, " epoch(s))");

  torch::manual_seed(options.seed);  // the same initial weights on every rank and for both sources
  chorus::models::ResNetOptions arch;
  arch.depth = 18;
  arch.in_channels = 1;
  arch.num_classes = static_cast<int64_t>(dataset.classes().size());
  chorus::models::ResNet net(arch);
  auto model = accelerator.prepare_model(net.ptr());
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(job.lr).momentum(0.9));
  auto optimizer = accelerator.prepare_optimizer(sgd);
  if (memory) {
    auto loader = accelerator.prepare_data_loader(std::move(*memory),
                                                  torch::data::DataLoaderOptions(static_cast<size_t>(job.batch_size)));
    memory.reset();
    train_steps(accelerator, loader, model, optimizer, epochs);
  } else {
    data::LoaderOptions lo;
    lo.batch_size = static_cast<size_t>(job.batch_size);
    lo.threads = job.loader_threads;
    auto loader = accelerator.prepare_data_loader(dataset, lo);
    train_steps(accelerator, loader, model, optimizer, epochs);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"chorus's side of bench/compare-loader: image folder read speed, and training from a folder or memory"};
  app.require_subcommand(1);

  ReadJob r;
  auto* read_cmd = app.add_subcommand("read", "images/s of the ParallelLoader over an image folder; one JSON line");
  read_cmd->add_option("root", r.root, "ImageFolder root (ROOT/<class>/<files>)")->required();
  read_cmd->add_option("--size", r.size, "output size S (crop)")->check(CLI::PositiveNumber)->capture_default_str();
  read_cmd->add_option("--transform", r.transform, "pad-crop or resize-crop (see the file's header)")
      ->check(CLI::IsMember({"pad-crop", "resize-crop"}))
      ->capture_default_str();
  read_cmd->add_option("--mode", r.mode, "decode to rgb (torchvision ImageFolder's loader) or gray")
      ->check(CLI::IsMember({"rgb", "gray"}))
      ->capture_default_str();
  read_cmd->add_option("--threads", r.threads, "decode threads")->check(CLI::Range(1, 256))->capture_default_str();
  read_cmd->add_option("--batch-size", r.batch_size, "batch size")->check(CLI::PositiveNumber)->capture_default_str();
  read_cmd->add_option("--epochs", r.epochs, "passes over the tree")->check(CLI::PositiveNumber)->capture_default_str();
  read_cmd->add_option("--prefetch", r.prefetch_batches, "LoaderOptions::prefetch_batches")->capture_default_str();
  read_cmd->add_option("--seed", r.seed, "shuffle and augmentation seed")->capture_default_str();

  TrainJob t;
  chorus::train::AcceleratorOptions o;
  o.run_name = "loader_bench";
  o.seed = 1;
  o.overwrite = true;
  o.checkpoint_each_epoch = false;
  o.log_every = 10;
  int nproc = 0;
  auto* train_cmd = app.add_subcommand("train", "ResNet-18 with the Accelerator from an image folder or from memory");
  train_cmd->add_option("--data", t.data, "ImageFolder root of gray images")->required();
  train_cmd->add_option("--source", t.source, "folder (ParallelLoader) or memory (decoded once up front)")
      ->check(CLI::IsMember({"folder", "memory"}))
      ->capture_default_str();
  train_cmd->add_option("--steps", t.steps, "optimizer steps")->check(CLI::PositiveNumber)->capture_default_str();
  train_cmd->add_option("--batch-size", t.batch_size, "batch per rank")->check(CLI::PositiveNumber)->capture_default_str();
  train_cmd->add_option("--image-size", t.image_size, "crop size (the images' size)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  train_cmd->add_option("--loader-threads", t.loader_threads, "decode threads per rank (folder)")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  train_cmd->add_option("--threads", t.threads, "intra-op threads per rank")->check(CLI::Range(1, 1024))->capture_default_str();
  train_cmd->add_option("--lr", t.lr, "SGD learning rate (momentum 0.9)")->capture_default_str();
  train_cmd->add_option("--seed", o.seed, "weights, data order and augmentation")->capture_default_str();
  train_cmd->add_option("--project-dir", o.project_dir, "run records in PROJECT_DIR/RUN_NAME")->capture_default_str();
  train_cmd->add_option("--run-name", o.run_name, "run records in PROJECT_DIR/RUN_NAME")->capture_default_str();
  train_cmd->add_option("--nproc", nproc, "start this many local ranks (when no launcher started this process)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (read_cmd->parsed()) {
    try {
      return run_read(r);
    } catch (const c10::Error& e) {
      std::cerr << "loader_bench: error: " << e.what_without_backtrace() << std::endl;
      return 1;
    } catch (const std::exception& e) {
      std::cerr << "loader_bench: error: " << e.what() << std::endl;
      return dynamic_cast<const chorus::UsageError*>(&e) ? 2 : 1;
    }
  }
  return chorus::train::run_job("loader_bench", nproc, [&] { run_train(t, o); });
}
