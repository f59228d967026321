// multilabel: multi-label image classification from a CSV dataset with the chorus Accelerator
// (seed 000's job: chest X-rays with several 0/1 findings per image and a patient column; one
// process per device, a grouped train/validation split, BCE-with-logits, the exact ROC AUC of
// every class over the whole validation set each epoch, the best network saved by rank 0).
// Here each image holds two Fashion-MNIST items side by side and its labels are their classes:
//
//   chorus data render-fashion-mnist-pairs data/pairs --count 6000
//   chorus run -n 2 multilabel --data data/pairs
//
// DATA (a directory or s3://bucket/prefix) holds the CSV (path, one 0/1 column per class, patient)
// and the images; no patient has images on both sides of the split.
#include <CLI/CLI.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include <fstream>
#include <iomanip>
#include <set>

#include "chorus/data/csv_dataset.h"
#include "chorus/data/image_tensor.h"
#include "chorus/data/metrics.h"
#include "chorus/data/s3_source.h"
#include "chorus/models/resnet.h"
#include "chorus/models/state_dict.h"
#include "chorus/train/accelerator.h"
#include "run_options.h"  // examples/common: the options every example shares

struct Job {
  std::string data, csv = "pairs.csv";
  std::vector<std::string> labels = {"T-shirt_top", "Trouser", "Pullover", "Dress", "Coat",
                                     "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle_boot"};
  std::string group = "patient";
  double val_fraction = 0.2, lr = 0.05;
  int64_t epochs = 5, batch_size = 32, depth = 18;
  int threads = 1, loader_threads = 2;
  std::string scores_out;  // rank 0 writes the last epoch's validation scores and labels here
};

// The patients (groups) of a dataset.
std::set<std::string> groups_of(const chorus::data::ImageDataset& d) {
  std::set<std::string> groups;
  for (size_t i = 0; i < d.size(); ++i) groups.insert(d.sample(i).group);
  return groups;
}

void train(const Job& job, chorus::train::AcceleratorOptions options) {
  chorus::train::set_num_threads(job.threads);
  options.config = {{"lr", job.lr}, {"batch_size", job.batch_size}, {"epochs", job.epochs}, {"depth", job.depth},
                    {"val_fraction", job.val_fraction}, {"data", job.data}, {"csv", job.csv}};
  chorus::train::Accelerator accelerator(options);

  // One CSV, read twice: augmented images to train on, plain ones to validate. The split depends
  // only on the samples and the seed, so both reads split alike, on every rank.
  namespace data = chorus::data;
  const auto augment = data::ImagePipeline().random_horizontal_flip().normalise({0.286f}, {0.353f});
  const auto plain = data::ImagePipeline().normalise({0.286f}, {0.353f});
  data::CsvDatasetOptions columns;
  columns.label_columns = job.labels;
  columns.group_column = job.group;
  auto source = data::open_source(job.data);
  auto read = [&](const data::ImagePipeline& pipeline) {
    auto all = data::make_csv_dataset(source, job.csv, data::image_decoder(pipeline, data::ImageMode::kGray, options.seed),
                                      columns);
    return data::grouped_split(all, job.val_fraction, options.seed);
  };
  const auto train_set = read(augment).train;
  const auto val_set = read(plain).val;
  const auto train_groups = groups_of(train_set);
  const auto val_groups = groups_of(val_set);
  int64_t shared = 0;
  for (const auto& g : val_groups) shared += train_groups.count(g);
  accelerator.print("labels ", job.labels.size(), "; train ", train_set.size(), " images of ", train_groups.size(),
                    " patients, validation ", val_set.size(), " of ", val_groups.size(), ", shared patients ", shared);

  torch::manual_seed(options.seed);  // the same initial weights on every rank
  chorus::models::ResNetOptions arch;
  arch.depth = job.depth;
  arch.in_channels = 1;
  arch.num_classes = static_cast<int64_t>(job.labels.size());
  chorus::models::ResNet net(arch);
  auto model = accelerator.prepare_model(net.ptr());
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(job.lr).momentum(0.9));
  auto optimizer = accelerator.prepare_optimizer(sgd);
  data::LoaderOptions batches;
  batches.batch_size = static_cast<size_t>(job.batch_size);
  batches.threads = job.loader_threads;
  auto loader = accelerator.prepare_data_loader(train_set, batches);
  batches.batch_size = 200;
  auto val_loader = accelerator.prepare_eval_loader(val_set, batches);

  const auto val_size = static_cast<int64_t>(val_set.size());
  double best = -1;
  for (int64_t epoch : accelerator.epochs(job.epochs)) {
    model.train();
    for (auto& batch : loader) {
      optimizer.zero_grad();
      accelerator.backward(torch::binary_cross_entropy_with_logits(model(batch.data), batch.target));
      optimizer.step();
    }
    // Validation: this rank's block of the set, every item once across ranks (no padding).
    torch::NoGradGuard no_grad;
    model.eval();
    std::vector<at::Tensor> scores, targets;
    for (auto& batch : val_loader) {
      scores.push_back(torch::sigmoid(model(batch.data)));
      targets.push_back(batch.target);
    }
    const auto classes = static_cast<int64_t>(job.labels.size());
    auto rows = [&](const std::vector<at::Tensor>& parts) { return parts.empty() ? at::zeros({0, classes}) : at::cat(parts); };
    const auto all_scores = accelerator.gather_for_metrics(rows(scores), val_size);
    const auto all_targets = accelerator.gather_for_metrics(rows(targets), val_size);
    const auto auc = data::multilabel_roc_auc(all_scores, all_targets);
    const double loss = torch::binary_cross_entropy(all_scores, all_targets).item<double>();
    nlohmann::json record = {{"val_mean_auc", auc.mean}, {"val_loss", loss}};
    std::ostringstream line;
    line << std::fixed << std::setprecision(3);
    for (size_t k = 0; k < job.labels.size(); ++k) {
      record["val_auc_" + job.labels[k]] = auc.per_class[k];
      line << (k ? ", " : "") << job.labels[k] << " " << auc.per_class[k];
    }
    accelerator.log(record);
    accelerator.print(std::fixed, std::setprecision(4), "epoch ", epoch + 1, ": validation loss ", loss,
                      ", mean AUC ", auc.mean, " (", line.str(), ")");
    if (accelerator.is_main_process() && auc.mean > best) {  // rank 0 keeps the best network
      best = auc.mean;
      chorus::models::save_state_dict(*net, accelerator.run_dir() + "/best.pt");
    }
    if (accelerator.is_main_process() && !job.scores_out.empty()) {
      std::ofstream out(job.scores_out);
      out << std::setprecision(9);
      for (int64_t i = 0; i < val_size; ++i) {
        for (int64_t k = 0; k < all_scores.size(1); ++k) out << (k ? "," : "") << all_scores[i][k].item<float>();
        for (int64_t k = 0; k < all_targets.size(1); ++k) out << "," << all_targets[i][k].item<float>();
        out << "\n";
      }
    }
  }
}

int main(int argc, char** argv) {
  Job job;
  examples::RunOptions run;
  run.accelerator.run_name = "multilabel";
  run.accelerator.seed = 1;
  CLI::App app{"Multi-label image classification from a CSV dataset, data-parallel with the chorus Accelerator"};
  app.add_option("--data", job.data, "directory or s3://bucket/prefix holding the CSV and the images")->required();
  app.add_option("--csv", job.csv, "the CSV, relative to DATA")->capture_default_str();
  app.add_option("--labels", job.labels, "the 0/1 label columns, in output order")->delimiter(',');
  app.add_option("--group", job.group, "the group column (patients): no group on both sides of the split")
      ->capture_default_str();
  app.add_option("--val-fraction", job.val_fraction, "share of the images to validate on")
      ->check(CLI::Range(0.01, 0.99))
      ->capture_default_str();
  app.add_option("--epochs", job.epochs, "epochs")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--batch-size", job.batch_size, "batch per rank")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--depth", job.depth, "ResNet depth")->check(CLI::IsMember({18, 34, 50}))->capture_default_str();
  app.add_option("--lr", job.lr, "SGD learning rate")->capture_default_str();
  app.add_option("--threads", job.threads, "intra-op threads per rank")->check(CLI::Range(1, 1024));
  app.add_option("--loader-threads", job.loader_threads, "decode threads per rank")->check(CLI::Range(1, 256));
  app.add_option("--scores-out", job.scores_out, "write the validation scores and labels here (rank 0, CSV)");
  examples::add_run_options(app, run, "seed of the weights, the split, the data order and the augmentation",
                            "records, state and best.pt in runs/NAME", /*devices=*/false);
  return examples::parse_and_run(app, argc, argv, "multilabel", run, [&](const auto& o) { train(job, o); });
}
