// DDP over the MPI backend matches the same job over TCP. Run under mpirun (ctest: 2 and 3 ranks):
// every rank trains a small network with DistributedDataParallel for a few steps over
// init_process_group("mpi"), then again from the same start over "tcp" (env:// from Open MPI's
// variables, a fixed test token), and the two sets of parameters must agree within 1e-6.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>

#include "chorus/ddp/ddp.h"
#include "chorus/torch/distributed.h"

namespace chorus {
namespace {

constexpr int kSteps = 6;
constexpr int kPerRank = 8;

std::map<std::string, torch::Tensor> train(const std::string& backend, const std::string& init_method) {
  dist::init_process_group(backend, init_method);
  const int rank = dist::get_rank(), world = dist::get_world_size();
  if (dist::default_group().transport() != backend) {
    throw std::runtime_error("transport " + dist::default_group().transport() + ", not " + backend);
  }
  torch::manual_seed(7 + rank);  // different starts: DDP's broadcast from rank 0 must make them equal
  torch::nn::Sequential net(torch::nn::Linear(20, 33), torch::nn::ReLU(), torch::nn::Linear(33, 17), torch::nn::ReLU(),
                            torch::nn::Linear(17, 4));
  ddp::Options o;
  o.first_bucket_mb = 0.001;  // several small buckets
  o.bucket_cap_mb = 0.002;
  ddp::DistributedDataParallel model(net, o);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int step = 0; step < kSteps; ++step) {
    auto gen = at::detail::createCPUGenerator(100 + step * 31 + rank);
    auto x = at::randn({kPerRank, 20}, gen);
    auto y = at::randint(0, 4, {kPerRank}, gen);
    opt.zero_grad();
    torch::nn::functional::cross_entropy(model.forward(x), y).backward();
    opt.step();
  }
  std::map<std::string, torch::Tensor> params;
  for (const auto& p : net->named_parameters()) params[p.key()] = p.value().detach().clone();
  // Every rank holds the same model (compared here over the group itself).
  for (auto& [name, t] : params) {
    auto mx = t.clone(), mn = t.clone();
    dist::all_reduce(mx, ReduceOp::kMax);
    dist::all_reduce(mn, ReduceOp::kMin);
    if (!torch::equal(mx, mn)) throw std::runtime_error(backend + ": ranks hold different " + name);
  }
  (void)world;
  dist::destroy_process_group();
  return params;
}

TEST(DdpOverMpi, MatchesTheSameJobOverTcp) {
  const auto over_mpi = train("mpi", "");
  const auto over_tcp = train("tcp", "env://?token=chorus-ddp-mpi-test");
  ASSERT_EQ(over_mpi.size(), over_tcp.size());
  for (const auto& [name, t] : over_mpi) {
    const double diff = (t - over_tcp.at(name)).abs().max().item<double>();
    EXPECT_LE(diff, 1e-6) << name;
  }
}

}  // namespace
}  // namespace chorus
