// fashion_mnist: PyTorch's MNIST example network, trained data-parallel on Fashion-MNIST with the
// chorus Accelerator. `fashion_mnist --nproc 2` starts two ranks itself; under chorus run, srun or
// mpirun every process is one rank. Metrics, logs and the state to resume from go to runs/<name>/.
#include <CLI/CLI.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include <iomanip>

#include "chorus/train/accelerator.h"
#include "run_options.h"  // examples/common: the options every example shares
#include "idx.h"
#include "models.h"

struct Job {
  int threads = 1;
  int64_t epochs = 1, batch_size = 64;
  double lr = 0.01, momentum = 0.9;
  std::string data = "/usr/share/datasets/fashion-mnist";
};

void train(const Job& cfg, chorus::train::AcceleratorOptions options) {
  chorus::train::set_num_threads(cfg.threads);
  options.config = {{"lr", cfg.lr}, {"momentum", cfg.momentum}, {"batch_size", cfg.batch_size}, {"epochs", cfg.epochs}};
  chorus::train::Accelerator accelerator(options);  // a restart by `chorus run --max-restarts` resumes by itself

  const fashion_mnist::Split train_split = fashion_mnist::load_split(cfg.data, true);
  const fashion_mnist::Split test_split = fashion_mnist::load_split(cfg.data, false);
  torch::manual_seed(options.seed);  // the same initial weights on every rank
  auto net = std::make_shared<fashion_mnist::Cnn>();
  auto model = accelerator.prepare_model(net);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(cfg.lr).momentum(cfg.momentum));
  auto optimizer = accelerator.prepare_optimizer(sgd);
  auto loader = accelerator.prepare_data_loader(fashion_mnist::Dataset(train_split), cfg.batch_size);
  // Batches of 200: at 1000 one convolution's unfolded input alone is 660 MB of fresh pages, and
  // evaluating the 10000 test items took 10x as long.
  auto test_loader = accelerator.prepare_eval_loader(fashion_mnist::Dataset(test_split), 200);
  torch::manual_seed(options.seed + 1000003 * (accelerator.rank() + 1));  // each rank its own dropout masks

  for (int64_t epoch : accelerator.epochs(cfg.epochs)) {
    model.train();
    for (auto& batch : loader) {
      optimizer.zero_grad();
      accelerator.backward(torch::nll_loss(model(batch.data), batch.target));
      optimizer.step();
    }
    // Exact: every test item is evaluated once, by one rank, and gathered in dataset order.
    torch::NoGradGuard no_grad;
    model.eval();
    std::vector<at::Tensor> results;  // per item: correct (0/1), loss
    for (auto& batch : *test_loader) {
      at::Tensor target = batch.target.to(accelerator.device());
      at::Tensor out = model(batch.data.to(accelerator.device()));
      results.push_back(at::stack({out.argmax(1).eq(target).to(at::kFloat),
                                   torch::nll_loss(out, target, {}, at::Reduction::None)}, 1));
    }
    at::Tensor all = accelerator.gather_for_metrics(at::cat(results), test_split.size()).mean(0);
    accelerator.log({{"test_accuracy", all[0].item<double>()}, {"test_loss", all[1].item<double>()}});
    accelerator.print(std::fixed, std::setprecision(2), "epoch ", epoch + 1, ": test accuracy ",
                      100 * all[0].item<double>(), "%, test loss ", std::setprecision(4), all[1].item<double>());
  }
}

int main(int argc, char** argv) {
  Job cfg;
  examples::RunOptions run;
  run.accelerator.run_name = "fashion_mnist";
  run.accelerator.seed = 1;
  CLI::App app{"Fashion-MNIST, data-parallel with the chorus Accelerator"};
  app.add_option("--data", cfg.data, "directory of the gzipped IDX files")->capture_default_str();
  app.add_option("--epochs", cfg.epochs, "epochs to train")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--batch-size", cfg.batch_size, "batch per rank")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--lr", cfg.lr, "SGD learning rate")->check(CLI::Range(0.0, 1e3))->capture_default_str();
  app.add_option("--threads", cfg.threads, "intra-op threads per rank")->check(CLI::Range(1, 1024));
  app.add_option("--accumulate", run.accelerator.gradient_accumulation_steps, "micro-batches per optimizer step");
  app.add_option("--checkpoint-every", run.accelerator.checkpoint_every, "also save the state every N steps");
  examples::add_run_options(app, run, "seed of the weights, the data order and dropout", "records and state in runs/NAME",
                            /*devices=*/true);
  return examples::parse_and_run(app, argc, argv, "fashion_mnist", run, [&](const auto& o) { train(cfg, o); });
}
