// chorus::dist::nccl in a build without NCCL (the default; CI): every entry point says how to get it.
#include "chorus/comm/error.h"
#include "chorus/torch/nccl.h"

namespace chorus::dist::nccl {
namespace {

[[noreturn]] void unavailable(const std::string& what) {
  throw UsageError("chorus::dist::nccl: " + what + ": this chorus was built without NCCL; configure it with "
                   "-DCHORUS_WITH_NCCL=ON against a CUDA build of libtorch (docs/gpu.md), or use chorus's own backend "
                   "(\"chorus\"), which takes CUDA tensors too");
}

}  // namespace

struct Communicator::Impl {};

bool built_with_nccl() { return false; }
std::string version() { return ""; }

Communicator::Communicator(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
Communicator::~Communicator() = default;

std::shared_ptr<Communicator> Communicator::create(ProcessGroup&, CommunicatorOptions) { unavailable("create"); }
std::shared_ptr<Communicator> Communicator::create(Store&, const std::string&, int, int, CommunicatorOptions) {
  unavailable("create");
}
int Communicator::rank() const { unavailable("rank"); }
int Communicator::size() const { unavailable("size"); }
int Communicator::device() const { unavailable("device"); }
std::string Communicator::broken() const { unavailable("broken"); }
void Communicator::abort(const std::string&) { unavailable("abort"); }
WorkPtr Communicator::all_reduce(const at::Tensor&, ReduceOp, bool) { unavailable("all_reduce"); }
WorkPtr Communicator::broadcast(const at::Tensor&, int, bool) { unavailable("broadcast"); }
WorkPtr Communicator::reduce(const at::Tensor&, int, ReduceOp, bool) { unavailable("reduce"); }
WorkPtr Communicator::all_gather_into_tensor(const at::Tensor&, const at::Tensor&, bool) {
  unavailable("all_gather_into_tensor");
}
WorkPtr Communicator::reduce_scatter_tensor(const at::Tensor&, const at::Tensor&, ReduceOp, bool) {
  unavailable("reduce_scatter_tensor");
}

}  // namespace chorus::dist::nccl
