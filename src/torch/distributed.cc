#include "chorus/torch/distributed.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <sstream>

#include "chorus/comm/error.h"
#include "chorus/comm/mpi.h"
#include "chorus/torch/nccl.h"
#include "staging.h"

namespace chorus::dist {
namespace {

using detail::group_or_default;

std::mutex g_mu;
std::shared_ptr<ProcessGroup> g_default;
std::shared_ptr<nccl::Communicator> g_nccl;  // init_process_group("nccl"): the default group's
bool g_atexit_registered = false;

// A Work that keeps the tensors alive until it is waited on, and runs a completion step (such as
// copying a gathered flat buffer out into a tensor list) in the waiting thread.
class TensorWork final : public Work {
 public:
  TensorWork(std::shared_ptr<Work> inner, std::vector<at::Tensor> keep, std::function<void()> finish = {})
      : inner_(std::move(inner)), keep_(std::move(keep)), finish_(std::move(finish)) {}

  // Complete once the completion step has run too (run here, by whoever asks first, once the inner
  // operation succeeded), so that a caller polling is_completed() then reads the final tensors.
  bool is_completed() const override {
    if (!inner_->is_completed()) return false;
    if (inner_->is_success()) complete();
    return true;
  }
  bool is_success() const override { return is_completed() && inner_->is_success(); }
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
  void complete() const {
    std::call_once(once_, [&] {
      if (finish_) finish_();
      keep_.clear();
    });
  }

  std::shared_ptr<Work> inner_;
  mutable std::vector<at::Tensor> keep_;
  std::function<void()> finish_;
  mutable std::once_flag once_;
};

void check_tensor(const at::Tensor& t, const char* op, const char* name = "tensor") {
  std::string where = std::string("chorus::dist::") + op + ": " + name;
  if (!t.defined()) throw UsageError(where + " is undefined");
  if (t.layout() != at::kStrided) throw UsageError(where + " must be dense (strided); call .to_dense()");
  if (!t.device().is_cpu() && !t.device().is_cuda()) {
    throw UsageError(where + " is on " + t.device().str() +
                     "; chorus collectives take CPU and CUDA tensors: copy with .cpu() and back with .to(device)");
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

// The NCCL communicator that serves CUDA tensors of `group` (the default group under
// init_process_group("nccl")); nullptr: they are staged through the host (staging.h).
std::shared_ptr<nccl::Communicator> nccl_for(ProcessGroup* group) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_nccl || (group != nullptr && group != g_default.get())) return nullptr;
  return g_nccl;
}

// Device tensors (staging.h). Every tensor of one call must be on the same device.
c10::Device device_of(const char* op, std::initializer_list<const at::Tensor*> tensors) {
  const at::Tensor* first = nullptr;
  for (const at::Tensor* t : tensors) {
    if (t == nullptr || !t->defined()) continue;
    if (first == nullptr) {
      first = t;
    } else if (t->device() != first->device()) {
      throw UsageError(std::string("chorus::dist::") + op + ": tensors on " + first->device().str() + " and " +
                       t->device().str() + " in one call; put them on one device");
    }
  }
  return first != nullptr ? first->device() : c10::Device(at::kCPU);
}

// An in-place collective on a device tensor in pieces (staging::pieces): each piece's copy to the
// host, its collective and its copy back are queued in that order, so one piece's copies overlap
// another's transfer. `sends(rank)` / `receives(rank)`: whether this rank's data goes out / comes back.
WorkPtr staged_in_place(ProcessGroup& pg, const char* op, const at::Tensor& t, bool sends, bool receives,
                        const std::function<std::shared_ptr<Work>(void* data, size_t count)>& issue, bool async_op) {
  staging::Call call(pg, t.device(), op);
  at::Tensor host = call.host_like(t);
  at::Tensor flat = t.view({-1});
  const auto parts = staging::pieces(t.numel(), t.element_size(), staging::chunk_bytes());
  std::vector<std::shared_ptr<c10::Event>> copied;
  if (sends) {
    for (const auto& [off, n] : parts) copied.push_back(call.copy_to_host(flat.narrow(0, off, n), host.narrow(0, off, n)));
  }
  for (size_t k = 0; k < parts.size(); ++k) {
    const auto [off, n] = parts[k];
    if (sends) call.wait_copy(copied[k]);
    call.add(issue(static_cast<char*>(host.data_ptr()) + off * t.element_size(), static_cast<size_t>(n)));
    if (receives) call.copy_to_device(host.narrow(0, off, n), flat.narrow(0, off, n));
  }
  return call.finish({t, host}, async_op);
}

// A collective that reads `in` and writes `out` (either may be undefined on a rank that does not
// take part in that direction), whole: `issue` gets their host copies' pointers.
WorkPtr staged_whole(ProcessGroup& pg, const char* op, const at::Tensor& in, const at::Tensor& out,
                     const std::function<std::shared_ptr<Work>(const void* in, void* out)>& issue, bool async_op,
                     std::function<void()> done = {}) {
  staging::Call call(pg, device_of(op, {&in, &out}), op);
  at::Tensor host_in = in.defined() ? call.host_like(in) : at::Tensor();
  at::Tensor host_out = out.defined() ? call.host_like(out) : at::Tensor();
  if (in.defined()) call.wait_copy(call.copy_to_host(in, host_in));
  call.add(issue(in.defined() ? host_in.data_ptr() : nullptr, out.defined() ? host_out.data_ptr() : nullptr));
  if (out.defined()) call.copy_to_device(host_out, out);
  std::vector<at::Tensor> keep;
  for (const auto& t : {in, out, host_in, host_out}) {
    if (t.defined()) keep.push_back(t);
  }
  return call.finish(std::move(keep), async_op, std::move(done));
}

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
  TransportKind forced = TransportKind::kAuto;
  if (parse_transport(backend, &forced) && forced != TransportKind::kAuto) return backend;
  const std::string exists =
      "chorus's backends are \"chorus\" (alias \"gloo\": CPU and CUDA tensors, shared memory within a host and "
      "TCP between hosts), one transport forced: \"tcp\", \"shm\" or \"hybrid\", or \"mpi\" (Open MPI, under mpirun)";
  if (backend == "nccl") {
    if (nccl::built_with_nccl()) return "";  // chorus's group for the host side, NCCL for CUDA tensors
    throw UsageError("chorus::dist::init_process_group: backend \"nccl\" is not available: this chorus was built "
                     "without NCCL (configure with -DCHORUS_WITH_NCCL=ON against a CUDA libtorch, docs/gpu.md); "
                     "chorus's backends take CUDA tensors too, staged through pinned host memory; " + exists);
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
  if (backend == "nccl") {
    // Every rank has its group now; the communicator's unique id travels over it.
    try {
      nccl::CommunicatorOptions no;
      no.timeout = options.timeout;
      g_nccl = nccl::Communicator::create(*g_default, no);
    } catch (...) {
      g_default->shutdown();
      g_default.reset();
      throw;
    }
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
  std::shared_ptr<nccl::Communicator> comm;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    pg.swap(g_default);
    comm.swap(g_nccl);
  }
  comm.reset();  // finalises the NCCL communicator (its pending operations first)
  if (pg) pg->shutdown();
}

std::shared_ptr<nccl::Communicator> nccl::default_communicator() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_nccl;
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
  if (staging::on_device(t)) {
    if (auto comm = nccl_for(group)) return comm->all_reduce(t, op, async_op);
    ProcessGroup& pg = group_or_default(group);
    const DataType type = reduce_type(t, "all_reduce");
    if (pg.size() == 1) return finish(pg.run_local("all_reduce at world size 1", [] {}), {}, async_op);
    return staged_in_place(pg, "all_reduce", t, true, true, [&pg, type, op](void* data, size_t n) {
      return pg.allreduce(data, n, type, op);
    }, async_op);
  }
  auto w = group_or_default(group).allreduce(t.data_ptr(), static_cast<size_t>(t.numel()), reduce_type(t, "all_reduce"), op);
  return finish(std::move(w), {t}, async_op);
}

WorkPtr broadcast(const at::Tensor& t, int src, ProcessGroup* group, bool async_op) {
  check_tensor(t, "broadcast");
  if (staging::on_device(t)) {
    if (auto comm = nccl_for(group)) return comm->broadcast(t, src, async_op);
    ProcessGroup& pg = group_or_default(group);
    const DataType type = copy_type(t);
    if (pg.size() == 1) return finish(pg.run_local("broadcast at world size 1", [] {}), {}, async_op);
    const bool root = pg.rank() == src;
    return staged_in_place(pg, "broadcast", t, root, !root, [&pg, type, src](void* data, size_t n) {
      return pg.broadcast(data, n, type, src);
    }, async_op);
  }
  auto w = group_or_default(group).broadcast(t.data_ptr(), static_cast<size_t>(t.numel()), copy_type(t), src);
  return finish(std::move(w), {t}, async_op);
}

WorkPtr reduce(const at::Tensor& t, int dst, ReduceOp op, ProcessGroup* group, bool async_op) {
  check_tensor(t, "reduce");
  if (staging::on_device(t)) {
    if (auto comm = nccl_for(group)) return comm->reduce(t, dst, op, async_op);
    ProcessGroup& pg = group_or_default(group);
    const DataType type = reduce_type(t, "reduce");
    if (pg.size() == 1) return finish(pg.run_local("reduce at world size 1", [] {}), {}, async_op);
    return staged_in_place(pg, "reduce", t, true, pg.rank() == dst, [&pg, type, op, dst](void* data, size_t n) {
      return pg.reduce(data, n, type, op, dst);
    }, async_op);
  }
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
  const DataType type = copy_type(input);
  const auto count = static_cast<size_t>(input.numel());
  if (staging::on_device(input) || staging::on_device(output)) {
    if (auto comm = nccl_for(group); comm && staging::on_device(input) && staging::on_device(output)) {
      return comm->all_gather_into_tensor(output, input, async_op);
    }
    return staged_whole(pg, "all_gather_into_tensor", input, output, [&pg, type, count](const void* in, void* out) {
      return pg.allgather(in, out, count, type);
    }, async_op);
  }
  auto w = pg.allgather(input.data_ptr(), output.data_ptr(), count, type);
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
  std::vector<at::Tensor> outs = tensor_list;  // shallow handles to the same storage
  auto unpack = [flat, outs]() mutable {
    auto blocks = flat.chunk(static_cast<int64_t>(outs.size()));
    for (size_t i = 0; i < outs.size(); ++i) outs[i].view({-1}).copy_(blocks[i]);
  };
  const DataType type = copy_type(tensor);
  const auto count = static_cast<size_t>(tensor.numel());
  if (staging::on_device(tensor)) {
    if (auto comm = nccl_for(group)) {
      return finish(comm->all_gather_into_tensor(flat, tensor, true), {flat, tensor}, async_op, unpack);
    }
    return staged_whole(pg, "all_gather", tensor, flat, [&pg, type, count](const void* in, void* out) {
      return pg.allgather(in, out, count, type);
    }, async_op, unpack);
  }
  auto w = pg.allgather(tensor.data_ptr(), flat.data_ptr(), count, type);
  return finish(std::move(w), {flat, tensor}, async_op, unpack);
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
  auto unpack = [flat, outs]() mutable {
    if (!flat.defined()) return;
    auto blocks = flat.chunk(static_cast<int64_t>(outs.size()));
    for (size_t i = 0; i < outs.size(); ++i) outs[i].view({-1}).copy_(blocks[i]);
  };
  const DataType type = copy_type(tensor);
  const auto count = static_cast<size_t>(tensor.numel());
  if (staging::on_device(tensor)) {
    return staged_whole(pg, "gather", tensor, flat, [&pg, type, count, dst](const void* in, void* out) {
      return pg.gather(in, out, count, type, dst);
    }, async_op, unpack);
  }
  auto w = pg.gather(tensor.data_ptr(), flat.defined() ? flat.data_ptr() : nullptr, count, type, dst);
  return finish(std::move(w), {tensor}, async_op, unpack);
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
  const DataType type = copy_type(tensor);
  const auto count = static_cast<size_t>(tensor.numel());
  if (staging::on_device(tensor)) {
    if (flat.defined() && flat.device() != tensor.device()) flat = flat.to(tensor.device());
    return staged_whole(pg, "scatter", flat, tensor, [&pg, type, count, src](const void* in, void* out) {
      return pg.scatter(in, out, count, type, src);
    }, async_op);
  }
  auto w = pg.scatter(flat.defined() ? flat.data_ptr() : nullptr, tensor.data_ptr(), count, type, src);
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
  const DataType type = reduce_type(output, "reduce_scatter_tensor");
  const auto count = static_cast<size_t>(output.numel());
  if (staging::on_device(input) || staging::on_device(output)) {
    if (auto comm = nccl_for(group); comm && staging::on_device(input) && staging::on_device(output)) {
      return comm->reduce_scatter_tensor(output, input, op, async_op);
    }
    return staged_whole(pg, "reduce_scatter_tensor", input, output, [&pg, type, count, op](const void* in, void* out) {
      return pg.reduce_scatter(in, out, count, type, op);
    }, async_op);
  }
  auto w = pg.reduce_scatter(input.data_ptr(), output.data_ptr(), count, type, op);
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
  const DataType type = copy_type(input);
  const auto count = static_cast<size_t>(input.numel() / pg.size());
  if (staging::on_device(input) || staging::on_device(output)) {
    return staged_whole(pg, "all_to_all_single", input, output, [&pg, type, count](const void* in, void* out) {
      return pg.alltoall(in, out, count, type);
    }, async_op);
  }
  auto w = pg.alltoall(input.data_ptr(), output.data_ptr(), count, type);
  return finish(std::move(w), {output, input}, async_op);
}

WorkPtr barrier(ProcessGroup* group, bool async_op) {
  return finish(group_or_default(group).barrier(), {}, async_op);
}

WorkPtr isend(const at::Tensor& t, int dst, int tag, ProcessGroup* group) {
  check_tensor(t, "send");
  if (staging::on_device(t)) {
    ProcessGroup& pg = group_or_default(group);
    const DataType type = copy_type(t);
    const auto count = static_cast<size_t>(t.numel());
    return staged_whole(pg, "send", t, at::Tensor(), [&pg, type, count, dst, tag](const void* in, void*) {
      return pg.send(in, count, type, dst, tag);
    }, true);
  }
  auto w = group_or_default(group).send(t.data_ptr(), static_cast<size_t>(t.numel()), copy_type(t), dst, tag);
  return finish(std::move(w), {t}, true);
}

WorkPtr irecv(const at::Tensor& t, int src, int tag, ProcessGroup* group) {
  check_tensor(t, "recv");
  if (staging::on_device(t)) {
    ProcessGroup& pg = group_or_default(group);
    const DataType type = copy_type(t);
    const auto count = static_cast<size_t>(t.numel());
    return staged_whole(pg, "recv", at::Tensor(), t, [&pg, type, count, src, tag](const void*, void* out) {
      return pg.recv(out, count, type, src, tag);
    }, true);
  }
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
