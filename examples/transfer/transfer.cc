// transfer: a ResNet-18 trained data-parallel on an image folder (a directory or s3://bucket/prefix)
// with the chorus Accelerator; with --init and --freeze-backbone, transfer learning from a saved
// network. Seed 004's experiment, without downloadable weights (run under `chorus run -n 2`):
//
//   chorus data render-fashion-mnist data/fmnist --format png
//   transfer --data data/fmnist --classes T-shirt_top,Trouser,Pullover,Dress,Coat --save backbone.pt
//   transfer --data data/fmnist --classes Sandal,Shirt,Sneaker,Bag,Ankle_boot --shots 50
//            --init backbone.pt --freeze-backbone --run-name finetune
//   transfer --data data/fmnist --classes Sandal,Shirt,Sneaker,Bag,Ankle_boot --shots 50 --run-name scratch
//
// DATA holds train/ and test/ ImageFolder trees; the accuracy on test/ is exact (every item once).
#include <CLI/CLI.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include <iomanip>
#include <map>

#include "chorus/data/image_folder.h"
#include "chorus/data/image_tensor.h"
#include "chorus/data/s3_source.h"
#include "chorus/models/resnet.h"
#include "chorus/models/state_dict.h"
#include "chorus/models/transfer.h"
#include "chorus/train/accelerator.h"
#include "run_options.h"  // examples/common: the options every example shares

struct Job {
  std::string data;                  // DATA/train and DATA/test
  std::vector<std::string> classes;  // class folders, in label order (empty: all)
  int64_t shots = 0;                 // train on the first N images of each class (0: all)
  std::string init, save;            // network weights to start from / to write at the end
  bool freeze_backbone = false;
  int64_t epochs = 3, batch_size = 32, image_size = 28;
  double lr = 0.05, backbone_lr = 0.005;
  int threads = 1, loader_threads = 2;
};

// The first `shots` items of every class, in dataset order.
chorus::data::ImageDataset first_per_class(const chorus::data::ImageDataset& all, int64_t shots) {
  std::map<int64_t, int64_t> taken;
  std::vector<size_t> keep;
  for (size_t i = 0; i < all.size(); ++i) {
    if (taken[all.sample(i).label]++ < shots) keep.push_back(i);
  }
  return all.subset(keep);
}

void train(const Job& job, chorus::train::AcceleratorOptions options) {
  chorus::train::set_num_threads(job.threads);
  options.config = {{"lr", job.lr}, {"backbone_lr", job.backbone_lr}, {"batch_size", job.batch_size},
                    {"epochs", job.epochs}, {"shots", job.shots}, {"init", job.init},
                    {"freeze_backbone", job.freeze_backbone}, {"data", job.data}};
  chorus::train::Accelerator accelerator(options);

  // Gray images, Fashion-MNIST's mean and deviation; a padded random crop and a flip to train.
  namespace data = chorus::data;
  const int64_t size = job.image_size;
  const auto augment = data::ImagePipeline()
                           .random_crop(size, size, {{size / 8, size / 8, size / 8, size / 8}})
                           .random_horizontal_flip()
                           .normalise({0.286f}, {0.353f});
  const auto plain = data::ImagePipeline().center_crop(size).normalise({0.286f}, {0.353f});
  data::ImageFolderOptions folders;
  folders.classes = job.classes;
  auto train_set = data::make_image_folder(data::open_source(job.data + "/train"),
                                           data::image_decoder(augment, data::ImageMode::kGray, options.seed), folders);
  auto test_set = data::make_image_folder(data::open_source(job.data + "/test"),
                                          data::image_decoder(plain, data::ImageMode::kGray), folders);
  if (job.shots > 0) train_set = first_per_class(train_set, job.shots);
  accelerator.print("classes ", train_set.classes().size(), ", train images ", train_set.size(), ", test images ",
                    test_set.size());

  torch::manual_seed(options.seed);  // the same initial weights on every rank
  chorus::models::ResNetOptions arch;
  arch.depth = 18;
  arch.in_channels = 1;
  arch.num_classes = static_cast<int64_t>(train_set.classes().size());
  chorus::models::ResNet net(arch);
  if (!job.init.empty()) {
    // Every weight but the head, whose classes differ: it stays freshly initialised.
    chorus::models::StateDict weights;
    for (auto& [key, value] : chorus::models::read_state_dict(job.init)) {
      if (key.rfind("fc.", 0) != 0) weights.emplace_back(key, value);
    }
    chorus::models::load_state_dict(*net, weights, {/*strict=*/false});
  }
  if (job.freeze_backbone) chorus::models::freeze_backbone(*net);  // before DDP wraps it
  auto model = accelerator.prepare_model(net.ptr());
  torch::optim::SGD sgd(chorus::models::backbone_and_head_groups(*net, torch::optim::SGDOptions(job.lr).momentum(0.9),
                                                                 job.backbone_lr),
                        torch::optim::SGDOptions(job.lr).momentum(0.9));
  auto optimizer = accelerator.prepare_optimizer(sgd);
  data::LoaderOptions batches;
  batches.batch_size = static_cast<size_t>(job.batch_size);
  batches.threads = job.loader_threads;
  auto loader = accelerator.prepare_data_loader(train_set, batches);
  batches.batch_size = 200;
  auto test_loader = accelerator.prepare_eval_loader(test_set, batches);

  for (int64_t epoch : accelerator.epochs(job.epochs)) {
    model.train();
    for (auto& batch : loader) {
      optimizer.zero_grad();
      accelerator.backward(torch::cross_entropy_loss(model(batch.data), batch.target));
      optimizer.step();
    }
    torch::NoGradGuard no_grad;
    model.eval();
    std::vector<at::Tensor> correct;  // per test item, 0 or 1
    for (auto& batch : test_loader) {
      at::Tensor out = model(batch.data.to(accelerator.device()));
      correct.push_back(out.argmax(1).eq(batch.target.to(accelerator.device())).to(at::kFloat));
    }
    const double accuracy =
        accelerator.gather_for_metrics(at::cat(correct), static_cast<int64_t>(test_set.size())).mean().item<double>();
    accelerator.log({{"test_accuracy", accuracy}});
    accelerator.print(std::fixed, std::setprecision(2), "epoch ", epoch + 1, ": test accuracy ", 100 * accuracy, "%");
  }
  if (!job.save.empty() && accelerator.is_main_process()) chorus::models::save_state_dict(*net, job.save);
}

int main(int argc, char** argv) {
  Job job;
  examples::RunOptions run;
  run.accelerator.run_name = "transfer";
  run.accelerator.seed = 1;
  CLI::App app{"ResNet-18 on an image folder, data-parallel with the chorus Accelerator; transfer learning"};
  app.add_option("--data", job.data, "directory or s3://bucket/prefix holding train/ and test/")->required();
  app.add_option("--classes", job.classes, "class folders to use, in label order (default: all)")->delimiter(',');
  app.add_option("--shots", job.shots, "train on the first N images of each class (0: all)");
  app.add_option("--init", job.init, "start from these weights (a state dict; the head is not loaded)");
  app.add_flag("--freeze-backbone", job.freeze_backbone, "train the head only (backbone weights and BatchNorm fixed)");
  app.add_option("--save", job.save, "write the trained network's state dict here (rank 0)");
  app.add_option("--epochs", job.epochs, "epochs")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--batch-size", job.batch_size, "batch per rank")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--image-size", job.image_size, "crop size (the images' size)")->check(CLI::PositiveNumber);
  app.add_option("--lr", job.lr, "SGD learning rate of the head")->capture_default_str();
  app.add_option("--backbone-lr", job.backbone_lr, "SGD learning rate of the backbone")->capture_default_str();
  app.add_option("--threads", job.threads, "intra-op threads per rank")->check(CLI::Range(1, 1024));
  app.add_option("--loader-threads", job.loader_threads, "decode threads per rank")->check(CLI::Range(1, 256));
  examples::add_run_options(app, run, "seed of the weights, the data order and the augmentation",
                            "records and state in runs/NAME", /*devices=*/true);
  return examples::parse_and_run(app, argc, argv, "transfer", run, [&](const auto& o) { train(job, o); });
}
