#include "chorus/torch/distributed.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <sstream>

#include "chorus/comm/error.h"
#include "chorus/comm/mpi.h"

namespace chorus::dist {
namespace {

using detail::group_or_default;

std::mutex g_mu;
std::shared_ptr<ProcessGroup> g_default;
bool g_atexit_registered = false;

// A Work that keeps the tensors alive until it is waited on, and runs a completion step (such as
// copying a gathered flat buffer out into a tensor list) in the waiting thread.
class TensorWork final : public Work {
 public:
  TensorWork(std::shared_ptr<Work> inner, std::vector<at::Tensor> keep, std::function<void()> finish = {})
      : inner_(std::move(inner)), keep_(std::move(keep)), finish_(std::move(finish)) {}

  bool is_completed() const override { return inner_->is_completed(); }
  bool is_success() const override { return inner_->is_success(); }
  void wait() override {
    inner_->wait();
    complete();
  }
  void wait(std::chrono::milliseconds timeout) override {
    inner_->wait(timeout);
    complete();
  }
  std::exception_ptr exception() const override { return inner_->exception(); }
  const std::vector<std::string>& objects() const override { return inner_->objects(); }
  std::chrono::nanoseconds run_time() const override { return inner_->run_time(); }

 private:
  void complete() {
    std::call_once(once_, [&] {
      if (finish_) finish_();
      keep_.clear();
    });
  }

  std::shared_ptr<Work> inner_;
  std::vector<at::Tensor> keep_;
  std::function<void()> finish_;
  std::once_flag once_;
};

void check_tensor(const at::Tensor& t, const char* op, const char* name = "tensor") {
  std::string where = std::string("chorus::dist::") + op + ": " + name;
  if (!t.defined()) throw UsageError(where + " is undefined");
  if (t.layout() != at::kStrided) throw UsageError(where + " must be dense (strided); call .to_dense()");
  if (!t.device().is_cpu()) {
    throw UsageError(where + " is on " + t.device().str() +
                     "; chorus collectives take CPU tensors: copy with .cpu() and back with .to(device)");
  }
  if (!t.is_contiguous()) throw UsageError(where + " is not contiguous; call .contiguous() first");
  to_data_type(t.scalar_type());
}

// Bool has no reduction in chorus; it travels as uint8 for the copying collectives.
DataType copy_type(const at::Tensor& t) {
  return t.scalar_type() == at::kBool ? DataType::kUInt8 : to_data_type(t.scalar_type());
}
DataType reduce_type(const at::Tensor& t, const char* op) {
  if (t.scalar_type() == at::kBool) {
    throw UsageError(std::string("chorus::dist::") + op + ": bool tensors cannot be reduced; convert with .to(torch::kUInt8)");
  }
  return to_data_type(t.scalar_type());
}

void check_like(const at::Tensor& a, const at::Tensor& b, const char* op, const std::string& what) {
  if (a.scalar_type() != b.scalar_type() || a.numel() != b.numel()) {
    std::ostringstream out;
    out << "chorus::dist::" << op << ": " << what << " has dtype " << b.scalar_type() << " and " << b.numel()
        << " elements, expected " << a.scalar_type() << " and " << a.numel();
    throw UsageError(out.str());
  }
}

WorkPtr finish(std::shared_ptr<Work> inner, std::vector<at::Tensor> keep, bool async_op,
               std::function<void()> done = {}) {
  auto w = std::make_shared<TensorWork>(std::move(inner), std::move(keep), std::move(done));
  if (!async_op) w->wait();
  return w;
}

void destroy_at_exit() { destroy_process_group(); }

}  // namespace

WorkPtr then(WorkPtr inner, std::function<void()> finish, std::vector<at::Tensor> keep) {
  return std::make_shared<TensorWork>(std::move(inner), std::move(keep), std::move(finish));
}

DataType to_data_type(c10::ScalarType type) {
  switch (type) {
    case at::kFloat: return DataType::kFloat32;
    case at::kDouble: return DataType::kFloat64;
    case at::kHalf: return DataType::kFloat16;
    case at::kBFloat16: return DataType::kBFloat16;
    case at::kChar: return DataType::kInt8;
    case at::kByte: return DataType::kUInt8;
    case at::kBool: return DataType::kUInt8;
    case at::kInt: return DataType::kInt32;
    case at::kLong: return DataType::kInt64;
    default: break;
  }
  std::ostringstream out;
  out << "chorus::dist: dtype " << type
      << " is not supported; use float32, float64, float16, bfloat16, int8, uint8, int32, int64 or bool";
  throw UsageError(out.str());
}

std::string transport_for_backend(const std::string& backend) {
  if (backend == "chorus" || backend == "gloo") return "";
  if (backend == "tcp" || backend == "shm" || backend == "hybrid" || backend == "mpi") return backend;
  const std::string exists =
      "chorus's backends are \"chorus\" (alias \"gloo\": CPU tensors, shared memory within a host and TCP "
      "between hosts), one transport forced: \"tcp\", \"shm\" or \"hybrid\", or \"mpi\" (Open MPI, under mpirun)";
  if (backend == "nccl") {
    throw UsageError("chorus::dist::init_process_group: backend \"nccl\" is not available: chorus has no GPU "
                     "collectives and works on CPU tensors; " + exists);
  }
  throw UsageError("chorus::dist::init_process_group: unknown backend '" + backend + "'; " + exists);
}

void init_process_group(const std::string& backend, const std::string& init_method, int rank, int world_size,
                        InitOptions options) {
  const std::string forced_transport = transport_for_backend(backend);
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_default) {
    throw UsageError("chorus::dist::init_process_group: already initialised; call destroy_process_group() first");
  }
  ProcessGroupOptions o = options.group;
  o.timeout = options.timeout;
  if (forced_transport == "mpi") {
    // As torch.distributed's mpi backend: rank and world size are MPI_COMM_WORLD's; no rendezvous.
    auto pg = connect_mpi_process_group(o);
    if ((rank >= 0 && rank != pg->rank()) || (world_size >= 0 && world_size != pg->size())) {
      const std::string asked = "rank " + std::to_string(rank) + ", world_size " + std::to_string(world_size);
      pg->shutdown();
      throw UsageError("chorus::dist::init_process_group(\"mpi\"): " + asked + " disagree with MPI_COMM_WORLD's "
                       "rank " + std::to_string(pg->rank()) + " of " + std::to_string(pg->size()) +
                       "; with the mpi backend leave them at -1 (MPI decides; init_method is not used)");
    }
    g_default = std::move(pg);
  } else {
    if (!forced_transport.empty()) o.transport = forced_transport;  // else CHORUS_TRANSPORT, read by rendezvous
    g_default = connect_process_group(init_method, rank, world_size, o);
  }
  if (!g_atexit_registered) {
    // Peers that outlive this process learn it left cleanly (goodbye) rather than died.
    std::atexit(destroy_at_exit);
    g_atexit_registered = true;
  }
}

bool is_initialized() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_default != nullptr;
}

void destroy_process_group() {
  std::shared_ptr<ProcessGroup> pg;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    pg.swap(g_default);
  }
  if (pg) pg->shutdown();
}

ProcessGroup& default_group() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_default) {
    throw UsageError("chorus::dist: the default process group is not initialised; call "
                     "chorus::dist::init_process_group() first");
  }
  return *g_default;
}

int get_rank(ProcessGroup* group) { return group_or_default(group).rank(); }
int get_world_size(ProcessGroup* group) { return group_or_default(group).size(); }
std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks) { return default_group().new_group(ranks); }

WorkPtr all_reduce(const at::Tensor& t, ReduceOp op, ProcessGroup* group, bool async_op) {
  check_tensor(t, "all_reduce");
  auto w = group_or_default(group).allreduce(t.data_ptr(), static_cast<size_t>(t.numel()), reduce_type(t, "all_reduce"), op);
  return finish(std::move(w), {t}, async_op);
}

WorkPtr broadcast(const at::Tensor& t, int src, ProcessGroup* group, bool async_op) {
  check_tensor(t, "broadcast");
  auto w = group_or_default(group).broadcast(t.data_ptr(), static_cast<size_t>(t.numel()), copy_type(t), src);
  return finish(std::move(w), {t}, async_op);
}

WorkPtr reduce(const at::Tensor& t, int dst, ReduceOp op, ProcessGroup* group, bool async_op) {
  check_tensor(t, "reduce");
  auto w = group_or_default(group).reduce(t.data_ptr(), static_cast<size_t>(t.numel()), reduce_type(t, "reduce"), op, dst);
  return finish(std::move(w), {t}, async_op);
}

WorkPtr all_gather_into_tensor(const at::Tensor& output, const at::Tensor& input, ProcessGroup* group, bool async_op) {
  ProcessGroup& pg = group_or_default(group);
  check_tensor(input, "all_gather_into_tensor", "input");
  check_tensor(output, "all_gather_into_tensor", "output");
  if (output.numel() != input.numel() * pg.size() || output.scalar_type() != input.scalar_type()) {
    throw UsageError("chorus::dist::all_gather_into_tensor: output must have world_size x input's elements (" +
                     std::to_string(input.numel() * pg.size()) + ") and input's dtype");
  }
  auto w = pg.allgather(input.data_ptr(), output.data_ptr(), static_cast<size_t>(input.numel()), copy_type(input));
  return finish(std::move(w), {output, input}, async_op);
}

WorkPtr all_gather(std::vector<at::Tensor>& tensor_list, const at::Tensor& tensor, ProcessGroup* group, bool async_op) {
  ProcessGroup& pg = group_or_default(group);
  check_tensor(tensor, "all_gather");
  if (tensor_list.size() != static_cast<size_t>(pg.size())) {
    throw UsageError("chorus::dist::all_gather: tensor_list has " + std::to_string(tensor_list.size()) +
                     " tensors; it needs one per rank (" + std::to_string(pg.size()) + ")");
  }
  for (size_t i = 0; i < tensor_list.size(); ++i) {
    check_tensor(tensor_list[i], "all_gather", "tensor_list entry");
    check_like(tensor, tensor_list[i], "all_gather", "tensor_list[" + std::to_string(i) + "]");
  }
  at::Tensor flat = at::empty({pg.size() * tensor.numel()}, tensor.options());
  auto w = pg.allgather(tensor.data_ptr(), flat.data_ptr(), static_cast<size_t>(tensor.numel()), copy_type(tensor));
  std::vector<at::Tensor> outs = tensor_list;  // shallow handles to the same storage
  return finish(std::move(w), {flat, tensor}, async_op, [flat, outs]() mutable {
    auto blocks = flat.chunk(static_cast<int64_t>(outs.size()));
    for (size_t i = 0; i < outs.size(); ++i) outs[i].view({-1}).copy_(blocks[i]);
  });
}

WorkPtr gather(const at::Tensor& tensor, std::vector<at::Tensor>* gather_list, int dst, ProcessGroup* group,
               bool async_op) {
  ProcessGroup& pg = group_or_default(group);
  check_tensor(tensor, "gather");
  at::Tensor flat;
  std::vector<at::Tensor> outs;
  if (pg.rank() == dst) {
    if (gather_list == nullptr || gather_list->size() != static_cast<size_t>(pg.size())) {
      throw UsageError("chorus::dist::gather: on the destination rank gather_list must hold one tensor per rank (" +
                       std::to_string(pg.size()) + ")");
    }
    for (auto& t : *gather_list) {
      check_tensor(t, "gather", "gather_list entry");
      check_like(tensor, t, "gather", "a gather_list entry");
    }
    outs = *gather_list;
    flat = at::empty({pg.size() * tensor.numel()}, tensor.options());
  }
  auto w = pg.gather(tensor.data_ptr(), flat.defined() ? flat.data_ptr() : nullptr,
                     static_cast<size_t>(tensor.numel()), copy_type(tensor), dst);
  return finish(std::move(w), {tensor}, async_op, [flat, outs]() mutable {
    if (!flat.defined()) return;
    auto blocks = flat.chunk(static_cast<int64_t>(outs.size()));
    for (size_t i = 0; i < outs.size(); ++i) outs[i].view({-1}).copy_(blocks[i]);
  });
}

WorkPtr scatter(const at::Tensor& tensor, const std::vector<at::Tensor>* scatter_list, int src, ProcessGroup* group,
                bool async_op) {
  ProcessGroup& pg = group_or_default(group);
  check_tensor(tensor, "scatter");
  at::Tensor flat;
  if (pg.rank() == src) {
    if (scatter_list == nullptr || scatter_list->size() != static_cast<size_t>(pg.size())) {
      throw UsageError("chorus::dist::scatter: on the source rank scatter_list must hold one tensor per rank (" +
                       std::to_string(pg.size()) + ")");
    }
    for (const auto& t : *scatter_list) check_like(tensor, t, "scatter", "a scatter_list entry");
    std::vector<at::Tensor> flat_parts;
    for (const auto& t : *scatter_list) flat_parts.push_back(t.reshape({-1}));
    flat = at::cat(flat_parts).contiguous();
  }
  auto w = pg.scatter(flat.defined() ? flat.data_ptr() : nullptr, tensor.data_ptr(),
                      static_cast<size_t>(tensor.numel()), copy_type(tensor), src);
  std::vector<at::Tensor> keep = {tensor};
  if (flat.defined()) keep.push_back(flat);
  return finish(std::move(w), std::move(keep), async_op);
}

WorkPtr reduce_scatter_tensor(const at::Tensor& output, const at::Tensor& input, ReduceOp op, ProcessGroup* group,
                              bool async_op) {
  ProcessGroup& pg = group_or_default(group);
  check_tensor(input, "reduce_scatter_tensor", "input");
  check_tensor(output, "reduce_scatter_tensor", "output");
  if (input.numel() != output.numel() * pg.size() || output.scalar_type() != input.scalar_type()) {
    throw UsageError("chorus::dist::reduce_scatter_tensor: input must have world_size x output's elements (" +
                     std::to_string(output.numel() * pg.size()) + ") and output's dtype");
  }
  auto w = pg.reduce_scatter(input.data_ptr(), output.data_ptr(), static_cast<size_t>(output.numel()),
                             reduce_type(output, "reduce_scatter_tensor"), op);
  return finish(std::move(w), {output, input}, async_op);
}

WorkPtr reduce_scatter(const at::Tensor& output, const std::vector<at::Tensor>& input_list, ReduceOp op,
                       ProcessGroup* group, bool async_op) {
  ProcessGroup& pg = group_or_default(group);
  check_tensor(output, "reduce_scatter", "output");
  if (input_list.size() != static_cast<size_t>(pg.size())) {
    throw UsageError("chorus::dist::reduce_scatter: input_list must hold one tensor per rank (" +
                     std::to_string(pg.size()) + ")");
  }
  std::vector<at::Tensor> parts;
  for (const auto& t : input_list) {
    check_like(output, t, "reduce_scatter", "an input_list entry");
    parts.push_back(t.reshape({-1}));
  }
  at::Tensor flat = at::cat(parts).contiguous();
  return reduce_scatter_tensor(output, flat, op, &pg, async_op);
}

WorkPtr all_to_all_single(const at::Tensor& output, const at::Tensor& input, ProcessGroup* group, bool async_op) {
  ProcessGroup& pg = group_or_default(group);
  check_tensor(input, "all_to_all_single", "input");
  check_tensor(output, "all_to_all_single", "output");
  check_like(input, output, "all_to_all_single", "output");
  if (input.numel() % pg.size() != 0) {
    throw UsageError("chorus::dist::all_to_all_single: input's " + std::to_string(input.numel()) +
                     " elements do not split evenly over " + std::to_string(pg.size()) + " ranks");
  }
  if (input.data_ptr() == output.data_ptr()) {
    throw UsageError("chorus::dist::all_to_all_single: input and output must not share memory");
  }
  auto w = pg.alltoall(input.data_ptr(), output.data_ptr(), static_cast<size_t>(input.numel() / pg.size()),
                       copy_type(input));
  return finish(std::move(w), {output, input}, async_op);
}

WorkPtr barrier(ProcessGroup* group, bool async_op) {
  return finish(group_or_default(group).barrier(), {}, async_op);
}

WorkPtr isend(const at::Tensor& t, int dst, int tag, ProcessGroup* group) {
  check_tensor(t, "send");
  auto w = group_or_default(group).send(t.data_ptr(), static_cast<size_t>(t.numel()), copy_type(t), dst, tag);
  return finish(std::move(w), {t}, true);
}

WorkPtr irecv(const at::Tensor& t, int src, int tag, ProcessGroup* group) {
  check_tensor(t, "recv");
  auto w = group_or_default(group).recv(t.data_ptr(), static_cast<size_t>(t.numel()), copy_type(t), src, tag);
  return finish(std::move(w), {t}, true);
}

WorkPtr send(const at::Tensor& t, int dst, int tag, ProcessGroup* group) {
  auto w = isend(t, dst, tag, group);
  w->wait();
  return w;
}

WorkPtr recv(const at::Tensor& t, int src, int tag, ProcessGroup* group) {
  auto w = irecv(t, src, tag, group);
  w->wait();
  return w;
}

std::vector<std::string> all_gather_object(const std::string& object, ProcessGroup* group) {
  auto w = group_or_default(group).all_gather_object(object);
  w->wait();
  return w->objects();
}

std::string broadcast_object(const std::string& object, int src, ProcessGroup* group) {
  auto w = group_or_default(group).broadcast_object(object, src);
  w->wait();
  return w->objects().at(0);
}

}  // namespace chorus::dist
