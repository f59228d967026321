// The two models of the Fashion-MNIST job. Parameter names match the PyTorch modules they copy, so
// a checkpoint's model.pt loads into those with load_state_dict.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/functional.h>

#include <memory>
#include <stdexcept>
#include <string>

namespace fashion_mnist {

// What DistributedDataParallel wraps: images [N, 1, 28, 28] to log-probabilities [N, 10].
struct Classifier : torch::nn::Module {
  virtual at::Tensor forward(at::Tensor x) = 0;
};

// Net of pytorch/examples mnist/main.py.
struct Cnn : Classifier {
  Cnn()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).stride(1)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).stride(1)))),
        dropout1(register_module("dropout1", torch::nn::Dropout(0.25))),
        dropout2(register_module("dropout2", torch::nn::Dropout(0.5))),
        fc1(register_module("fc1", torch::nn::Linear(9216, 128))),
        fc2(register_module("fc2", torch::nn::Linear(128, 10))) {}

  at::Tensor forward(at::Tensor x) override {
    namespace F = torch::nn::functional;
    x = torch::relu(conv1(x));
    x = torch::relu(conv2(x));
    x = F::max_pool2d(x, F::MaxPool2dFuncOptions(2));
    x = dropout1(x);
    x = torch::flatten(x, 1);
    x = torch::relu(fc1(x));
    x = dropout2(x);
    return torch::log_softmax(fc2(x), 1);
  }

  torch::nn::Conv2d conv1, conv2;
  torch::nn::Dropout dropout1, dropout2;
  torch::nn::Linear fc1, fc2;
};

// 784-512-512-10 with ReLU.
struct Mlp : Classifier {
  Mlp()
      : fc1(register_module("fc1", torch::nn::Linear(784, 512))),
        fc2(register_module("fc2", torch::nn::Linear(512, 512))),
        fc3(register_module("fc3", torch::nn::Linear(512, 10))) {}

  at::Tensor forward(at::Tensor x) override {
    x = torch::flatten(x, 1);
    x = torch::relu(fc1(x));
    x = torch::relu(fc2(x));
    return torch::log_softmax(fc3(x), 1);
  }

  torch::nn::Linear fc1, fc2, fc3;
};

inline std::shared_ptr<Classifier> make_model(const std::string& name) {
  if (name == "cnn") return std::make_shared<Cnn>();
  if (name == "mlp") return std::make_shared<Mlp>();
  throw std::invalid_argument("unknown model '" + name + "' (cnn or mlp)");
}

}  // namespace fashion_mnist
