// chorus._C: the "chorus" backend of torch.distributed (docs/python.md). A c10d::ProcessGroup (the
// libtorch 1.13 interface) over chorus::ProcessGroup: PyTorch hands the backend its store, the rank,
// the world size and the timeout; chorus connects its own transports through that store (shared
// memory within a host, TCP or hybrid across hosts, as chorus chooses) and runs every operation on
// its queue. Each operation's Future completes on a completion thread in issue order, so DDP's hooks
// chain on it and the gradient allreduce overlaps backward. Links libtorch and chorus_comm only.
//
// Operations: allreduce, allreduce_coalesced, broadcast, reduce, allgather, _allgather_base,
// allgather_coalesced, gather, scatter, reduce_scatter, _reduce_scatter_base, alltoall and
// alltoall_base (split sizes too), send, recv, recvAnysource, barrier, on CPU tensors. SUM, AVG,
// PRODUCT, MIN and MAX run as chorus's reductions; BAND, BOR and BXOR (integers and bool) gather every
// rank's tensor and fold it locally. Not supported, with an error that says so: PREMUL_SUM, CUDA tensors.
#include <pybind11/chrono.h>
#include <torch/version.h>
#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

#include <ATen/ATen.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "chorus/comm/error.h"
#include "chorus/comm/process_group.h"
#include "chorus/comm/random.h"
#include "chorus/comm/store.h"
#include "chorus/comm/tcp_store.h"
#include "torch_glue.h"

namespace chorus::python {
namespace {

using detail::authenticated_store;
using detail::advertise_host;
using detail::bitwise;
using detail::check_tensor;
using detail::ChorusWork;
using detail::Completions;
using detail::data_type;
using detail::reduce_op;
using detail::single;
using detail::TorchStore;

// The one place where libtorch versions differ for a backend: 1.13 takes a c10d::ProcessGroup
// subclass; 2.x takes a c10d::Backend subclass (its ProcessGroup holds a backend per device, and
// Python registers ours with devices=["cpu"]: python/chorus/__init__.py). The operations' virtual
// signatures are the same in both. CI builds and tests 1.13 (Debian's python3-torch); the 2.x side
// passed backend_test.py once, on PyTorch 2.11 (docs/python.md; CMake: CHORUS_PYTHON_TORCH2).
#if TORCH_VERSION_MAJOR >= 2
using BackendBase = ::c10d::Backend;
#else
using BackendBase = ::c10d::ProcessGroup;
#endif

class ProcessGroupChorus final : public BackendBase {
 public:
  ProcessGroupChorus(const c10::intrusive_ptr<::c10d::Store>& store, int rank, int size,
                     std::chrono::milliseconds timeout)
      : BackendBase(rank, size) {
    std::shared_ptr<Store> chorus_store = std::make_shared<TorchStore>(store);
    std::string toward_store;
    ProcessGroupOptions o;
    o.timeout = timeout;
    // The job token authenticates chorus's own connections: chorus run's (CHORUS_JOB_TOKEN), else
    // one rank 0 makes and shares through PyTorch's store, which is then its only protection.
    const char* token = std::getenv("CHORUS_JOB_TOKEN");
    if (token != nullptr && *token != '\0') {
      o.token = token;
      chorus_store = authenticated_store(chorus_store, rank, o.token, timeout, &toward_store);
    } else {
      const std::string key = "chorus/python/token";
      if (rank == 0) chorus_store->set(key, random_token());
      chorus_store->wait({key}, timeout);
      o.token = chorus_store->get(key);
    }
    if (const char* t = std::getenv("CHORUS_TRANSPORT"); t != nullptr && *t != '\0') o.transport = t;
    o.advertise_host = advertise_host(toward_store);
    pg_ = std::make_unique<chorus::ProcessGroup>(chorus_store, rank, size, o);
    completer_ = std::thread([c = completions_] { c->loop(); });
  }

  ~ProcessGroupChorus() override {
    completions_->stop();
    if (completer_.joinable()) {
      // Python drops the group holding the GIL; the completion thread may need it to release the
      // last tensors of an operation (a tensor with a Python object frees it under the GIL).
      // Joining with the GIL held deadlocked (about once in 200 groups); release it for the join.
      if (Py_IsInitialized() && PyGILState_Check()) {
        pybind11::gil_scoped_release no_gil;
        completer_.join();
      } else {
        completer_.join();
      }
    }
    pg_->shutdown();
  }

  const std::string getBackendName() const override { return "chorus"; }

  c10::intrusive_ptr<::c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                            const ::c10d::AllreduceOptions& opts) override {
    const at::Tensor& t = single(tensors, "allreduce");
    if (bitwise(opts.reduceOp)) return bitwise_reduce(::c10d::OpType::ALLREDUCE, t, opts.reduceOp, -1, "allreduce");
    const DataType dt = data_type(t, "allreduce", true);
    const ReduceOp op = reduce_op(opts.reduceOp, "allreduce");
    return submit(::c10d::OpType::ALLREDUCE, {t},
                  {pg_->allreduce(t.data_ptr(), static_cast<size_t>(t.numel()), dt, op)});
  }

  c10::intrusive_ptr<::c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                      const ::c10d::AllreduceCoalescedOptions& opts) override {
    std::vector<std::shared_ptr<Work>> works;
    const ReduceOp op = reduce_op(opts.reduceOp, "allreduce_coalesced");
    for (auto& t : tensors) {
      check_tensor(t, "allreduce_coalesced");
      works.push_back(pg_->allreduce(t.data_ptr(), static_cast<size_t>(t.numel()),
                                     data_type(t, "allreduce_coalesced", true), op));
    }
    return submit(::c10d::OpType::ALLREDUCE_COALESCED, tensors, std::move(works));
  }

  c10::intrusive_ptr<::c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                            const ::c10d::BroadcastOptions& opts) override {
    const at::Tensor& t = single(tensors, "broadcast");
    return submit(::c10d::OpType::BROADCAST, {t},
                  {pg_->broadcast(t.data_ptr(), static_cast<size_t>(t.numel()), data_type(t, "broadcast", false),
                                  static_cast<int>(opts.rootRank))});
  }

  c10::intrusive_ptr<::c10d::Work> reduce(std::vector<at::Tensor>& tensors, const ::c10d::ReduceOptions& opts) override {
    const at::Tensor& t = single(tensors, "reduce");
    if (bitwise(opts.reduceOp)) {
      return bitwise_reduce(::c10d::OpType::REDUCE, t, opts.reduceOp, static_cast<int>(opts.rootRank), "reduce");
    }
    return submit(::c10d::OpType::REDUCE, {t},
                  {pg_->reduce(t.data_ptr(), static_cast<size_t>(t.numel()), data_type(t, "reduce", true),
                               reduce_op(opts.reduceOp, "reduce"), static_cast<int>(opts.rootRank))});
  }

  c10::intrusive_ptr<::c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                            std::vector<at::Tensor>& inputs,
                                            const ::c10d::AllgatherOptions&) override {
    const at::Tensor& in = single(inputs, "allgather");
    if (outputs.size() != 1 || outputs[0].size() != static_cast<size_t>(getSize())) {
      throw UsageError("chorus backend: allgather: the output list must hold one tensor per rank (" +
                       std::to_string(getSize()) + ")");
    }
    for (const auto& o : outputs[0]) {
      if (o.numel() != in.numel() || o.scalar_type() != in.scalar_type()) {
        throw UsageError("chorus backend: allgather: every output tensor must match the input's size and dtype");
      }
    }
    at::Tensor flat = at::empty({getSize() * in.numel()}, in.options());
    std::vector<at::Tensor> outs = outputs[0];
    auto w = pg_->allgather(in.data_ptr(), flat.data_ptr(), static_cast<size_t>(in.numel()), data_type(in, "allgather", false));
    return submit(::c10d::OpType::ALLGATHER, outs, {w}, {in, flat}, [flat, outs]() mutable {
      auto blocks = flat.chunk(static_cast<int64_t>(outs.size()));
      for (size_t i = 0; i < outs.size(); ++i) outs[i].view({-1}).copy_(blocks[i]);
    });
  }

  c10::intrusive_ptr<::c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                  const ::c10d::AllgatherOptions&) override {
    check_tensor(input, "_allgather_base");
    check_tensor(output, "_allgather_base");
    if (output.numel() != input.numel() * getSize() || output.scalar_type() != input.scalar_type()) {
      throw UsageError("chorus backend: all_gather_into_tensor: the output must hold world_size x the input");
    }
    return submit(::c10d::OpType::_ALLGATHER_BASE, {output},
                  {pg_->allgather(input.data_ptr(), output.data_ptr(), static_cast<size_t>(input.numel()),
                                  data_type(input, "all_gather_into_tensor", false))},
                  {input});
  }

  c10::intrusive_ptr<::c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                         std::vector<at::Tensor>& inputs, const ::c10d::GatherOptions& opts) override {
    const at::Tensor& in = single(inputs, "gather");
    const int root = static_cast<int>(opts.rootRank);
    at::Tensor flat;
    std::vector<at::Tensor> outs;
    if (getRank() == root) {
      if (outputs.size() != 1 || outputs[0].size() != static_cast<size_t>(getSize())) {
        throw UsageError("chorus backend: gather: on the root the output list must hold one tensor per rank");
      }
      outs = outputs[0];
      flat = at::empty({getSize() * in.numel()}, in.options());
    }
    auto w = pg_->gather(in.data_ptr(), flat.defined() ? flat.data_ptr() : nullptr, static_cast<size_t>(in.numel()),
                         data_type(in, "gather", false), root);
    return submit(::c10d::OpType::GATHER, outs, {w}, {in, flat}, [flat, outs]() mutable {
      if (!flat.defined()) return;
      auto blocks = flat.chunk(static_cast<int64_t>(outs.size()));
      for (size_t i = 0; i < outs.size(); ++i) outs[i].view({-1}).copy_(blocks[i]);
    });
  }

  c10::intrusive_ptr<::c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                          std::vector<std::vector<at::Tensor>>& inputs,
                                          const ::c10d::ScatterOptions& opts) override {
    const at::Tensor& out = single(outputs, "scatter");
    const int root = static_cast<int>(opts.rootRank);
    at::Tensor flat;
    if (getRank() == root) {
      if (inputs.size() != 1 || inputs[0].size() != static_cast<size_t>(getSize())) {
        throw UsageError("chorus backend: scatter: on the root the input list must hold one tensor per rank");
      }
      std::vector<at::Tensor> parts;
      for (const auto& t : inputs[0]) parts.push_back(t.reshape({-1}));
      flat = at::cat(parts).contiguous();
    }
    return submit(::c10d::OpType::SCATTER, {out},
                  {pg_->scatter(flat.defined() ? flat.data_ptr() : nullptr, out.data_ptr(),
                                static_cast<size_t>(out.numel()), data_type(out, "scatter", false), root)},
                  {flat});
  }

  c10::intrusive_ptr<::c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                 std::vector<std::vector<at::Tensor>>& inputs,
                                                 const ::c10d::ReduceScatterOptions& opts) override {
    const at::Tensor& out = single(outputs, "reduce_scatter");
    if (inputs.size() != 1 || inputs[0].size() != static_cast<size_t>(getSize())) {
      throw UsageError("chorus backend: reduce_scatter: the input list must hold one tensor per rank");
    }
    std::vector<at::Tensor> parts;
    for (const auto& t : inputs[0]) parts.push_back(t.reshape({-1}));
    at::Tensor flat = at::cat(parts).contiguous();
    return submit(::c10d::OpType::REDUCE_SCATTER, {out},
                  {pg_->reduce_scatter(flat.data_ptr(), out.data_ptr(), static_cast<size_t>(out.numel()),
                                       data_type(out, "reduce_scatter", true), reduce_op(opts.reduceOp, "reduce_scatter"))},
                  {flat});
  }

  c10::intrusive_ptr<::c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                       const ::c10d::ReduceScatterOptions& opts) override {
    check_tensor(input, "_reduce_scatter_base");
    check_tensor(output, "_reduce_scatter_base");
    if (input.numel() != output.numel() * getSize() || input.scalar_type() != output.scalar_type()) {
      throw UsageError("chorus backend: reduce_scatter_tensor: the input must hold world_size x the output");
    }
    return submit(::c10d::OpType::_REDUCE_SCATTER_BASE, {output},
                  {pg_->reduce_scatter(input.data_ptr(), output.data_ptr(), static_cast<size_t>(output.numel()),
                                       data_type(output, "reduce_scatter_tensor", true),
                                       reduce_op(opts.reduceOp, "reduce_scatter_tensor"))},
                  {input});
  }

  c10::intrusive_ptr<::c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                                std::vector<int64_t>& output_split_sizes,
                                                std::vector<int64_t>& input_split_sizes,
                                                const ::c10d::AllToAllOptions&) override {
    check_tensor(input, "alltoall_base");
    check_tensor(output, "alltoall_base");
    if (input.scalar_type() != output.scalar_type()) {
      throw UsageError("chorus backend: all_to_all_single: input and output must have the same dtype");
    }
    if (output_split_sizes.empty() && input_split_sizes.empty()) {
      if (input.numel() != output.numel() || input.dim() == 0 || input.size(0) % getSize() != 0) {
        throw UsageError("chorus backend: all_to_all_single: without split sizes, input and output must have the same "
                         "size, with a first dimension divisible by the world size (" + std::to_string(getSize()) + ")");
      }
      return submit(::c10d::OpType::ALLTOALL_BASE, {output},
                    {pg_->alltoall(input.data_ptr(), output.data_ptr(), static_cast<size_t>(input.numel() / getSize()),
                                   data_type(input, "all_to_all_single", false))},
                    {input});
    }
    std::vector<at::Tensor> sends = rows(input, input_split_sizes, "input");
    std::vector<at::Tensor> recvs = rows(output, output_split_sizes, "output");
    return alltoall_uneven(::c10d::OpType::ALLTOALL_BASE, {output}, sends, recvs, {input}, "all_to_all_single");
  }

  c10::intrusive_ptr<::c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                           const ::c10d::AllToAllOptions&) override {
    if (outputs.size() != static_cast<size_t>(getSize()) || inputs.size() != static_cast<size_t>(getSize())) {
      throw UsageError("chorus backend: all_to_all: the input and output lists must hold one tensor per rank (" +
                       std::to_string(getSize()) + ")");
    }
    std::vector<at::Tensor> sends, recvs;
    for (auto& t : inputs) {
      check_tensor(t, "all_to_all");
      sends.push_back(t.view({-1}));
    }
    for (auto& t : outputs) {
      check_tensor(t, "all_to_all");
      recvs.push_back(t.view({-1}));
    }
    return alltoall_uneven(::c10d::OpType::ALLTOALL, outputs, sends, recvs, inputs, "all_to_all");
  }

  // output_lists[r][i] receives rank r's inputs[i] (one list per rank, as PyTorch documents).
  c10::intrusive_ptr<::c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& output_lists,
                                                      std::vector<at::Tensor>& inputs,
                                                      const ::c10d::AllgatherOptions&) override {
    const auto world = static_cast<size_t>(getSize());
    if (output_lists.size() != world) {
      throw UsageError("chorus backend: all_gather_coalesced: the output must hold one list per rank (" +
                       std::to_string(world) + "), got " + std::to_string(output_lists.size()));
    }
    for (const auto& list : output_lists) {
      if (list.size() != inputs.size()) {
        throw UsageError("chorus backend: all_gather_coalesced: every output list must hold one tensor per input (" +
                         std::to_string(inputs.size()) + ")");
      }
      for (size_t i = 0; i < inputs.size(); ++i) {
        check_tensor(list[i], "all_gather_coalesced");
        if (list[i].numel() != inputs[i].numel() || list[i].scalar_type() != inputs[i].scalar_type()) {
          throw UsageError("chorus backend: all_gather_coalesced: output tensor " + std::to_string(i) +
                           " must match input " + std::to_string(i) + "'s size and dtype");
        }
      }
    }
    std::vector<std::shared_ptr<Work>> works;
    std::vector<at::Tensor> keep, flats, outs;
    for (const auto& in : inputs) {
      check_tensor(in, "all_gather_coalesced");
      at::Tensor flat = at::empty({getSize(), in.numel()}, in.options());
      works.push_back(pg_->allgather(in.data_ptr(), flat.data_ptr(), static_cast<size_t>(in.numel()),
                                     data_type(in, "all_gather_coalesced", false)));
      keep.push_back(in);
      flats.push_back(flat);
    }
    for (const auto& list : output_lists) outs.insert(outs.end(), list.begin(), list.end());
    const size_t n = inputs.size();
    return submit(::c10d::OpType::ALLGATHER_COALESCED, outs, std::move(works), keep, [flats, outs, n, world]() mutable {
      for (size_t r = 0; r < world; ++r) {
        for (size_t i = 0; i < n; ++i) outs[r * n + i].view({-1}).copy_(flats[i][static_cast<int64_t>(r)]);
      }
    });
  }

  c10::intrusive_ptr<::c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    const at::Tensor& t = single(tensors, "send");
    const DataType dt = data_type(t, "send", false);
    completions_->hold(pg_.get());
    return submit(::c10d::OpType::SEND, {t}, {pg_->send(t.data_ptr(), static_cast<size_t>(t.numel()), dt, dst, tag)},
                  {}, {}, /*p2p=*/true);
  }

  c10::intrusive_ptr<::c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    const at::Tensor& t = single(tensors, "recv");
    const DataType dt = data_type(t, "recv", false);
    completions_->hold(pg_.get());
    return submit(::c10d::OpType::RECV, {t}, {pg_->recv(t.data_ptr(), static_cast<size_t>(t.numel()), dt, src, tag)},
                  {}, {}, /*p2p=*/true);
  }

  // Runs alone in issue order (held sends and recvs go first); the source comes back through the
  // Work's sourceRank().
  c10::intrusive_ptr<::c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    const at::Tensor& t = single(tensors, "recv");
    const DataType dt = data_type(t, "recv", false);
    auto inner = pg_->recv_any(t.data_ptr(), static_cast<size_t>(t.numel()), dt, tag);
    auto work = submit(::c10d::OpType::RECVANYSOURCE, {t}, {inner});
    static_cast<ChorusWork*>(work.get())->set_source_of(std::move(inner));
    return work;
  }

  c10::intrusive_ptr<::c10d::Work> barrier(const ::c10d::BarrierOptions&) override {
    return submit(::c10d::OpType::BARRIER, {}, {pg_->barrier()});
  }

 private:
  // `t`'s rows split by `splits` (one count per rank; empty: equal parts), as flat views.
  std::vector<at::Tensor> rows(const at::Tensor& t, const std::vector<int64_t>& splits, const char* which) const {
    const int64_t world = getSize();
    const int64_t n = t.dim() == 0 ? 1 : t.size(0);
    const int64_t row = n == 0 ? 0 : t.numel() / n;
    std::vector<int64_t> parts = splits;
    if (parts.empty()) {
      if (n % world != 0) {
        throw UsageError(std::string("chorus backend: all_to_all_single: the ") + which + "'s first dimension (" +
                         std::to_string(n) + ") is not divisible by the world size (" + std::to_string(world) +
                         "); pass its split sizes");
      }
      parts.assign(static_cast<size_t>(world), n / world);
    }
    int64_t total = 0;
    for (int64_t p : parts) total += p;
    if (parts.size() != static_cast<size_t>(world) || total != n) {
      throw UsageError(std::string("chorus backend: all_to_all_single: the ") + which + " split sizes must be " +
                       std::to_string(world) + " counts that add up to its first dimension (" + std::to_string(n) + ")");
    }
    std::vector<at::Tensor> out;
    at::Tensor flat = t.view({-1});
    int64_t offset = 0;
    for (int64_t p : parts) {
      out.push_back(flat.narrow(0, offset * row, p * row));
      offset += p;
    }
    return out;
  }

  // An all-to-all of pieces of any size, over chorus's even one: every piece is padded to the
  // largest piece any rank sends (one allreduce(MAX) of a number first), and each received piece
  // is copied out of its padded block once the exchange is done.
  c10::intrusive_ptr<::c10d::Work> alltoall_uneven(::c10d::OpType type, std::vector<at::Tensor> outputs,
                                                  const std::vector<at::Tensor>& sends,
                                                  const std::vector<at::Tensor>& recvs, std::vector<at::Tensor> keep,
                                                  const char* name) {
    const at::ScalarType dtype = sends.front().scalar_type();
    for (const auto& t : sends) {
      if (t.scalar_type() != dtype) throw UsageError(std::string("chorus backend: ") + name + ": every tensor must have one dtype");
    }
    for (const auto& t : recvs) {
      if (t.scalar_type() != dtype) throw UsageError(std::string("chorus backend: ") + name + ": every tensor must have one dtype");
    }
    const DataType dt = data_type(sends.front(), name, false);
    int64_t largest = 0;
    for (const auto& t : sends) largest = std::max<int64_t>(largest, t.numel());
    pg_->allreduce(&largest, 1, DataType::kInt64, ReduceOp::kMax)->wait();
    const int64_t world = getSize();
    at::Tensor in = at::zeros({world, largest}, sends.front().options());
    at::Tensor out = at::empty({world, largest}, sends.front().options());
    for (int64_t j = 0; j < world; ++j) in[j].narrow(0, 0, sends[static_cast<size_t>(j)].numel()).copy_(sends[static_cast<size_t>(j)]);
    for (int64_t j = 0; j < world; ++j) {
      if (recvs[static_cast<size_t>(j)].numel() > largest) {
        throw UsageError(std::string("chorus backend: ") + name + ": rank " + std::to_string(getRank()) + " expects " +
                         std::to_string(recvs[static_cast<size_t>(j)].numel()) + " elements from rank " +
                         std::to_string(j) + ", more than any rank sends (" + std::to_string(largest) +
                         "); the split sizes disagree between ranks");
      }
    }
    keep.push_back(in);
    std::vector<std::shared_ptr<Work>> works;
    if (largest > 0) works.push_back(pg_->alltoall(in.data_ptr(), out.data_ptr(), static_cast<size_t>(largest), dt));
    return submit(type, std::move(outputs), std::move(works), std::move(keep), [out, recvs]() mutable {
      for (size_t j = 0; j < recvs.size(); ++j) recvs[j].copy_(out[static_cast<int64_t>(j)].narrow(0, 0, recvs[j].numel()));
    });
  }

  // BAND, BOR, BXOR: chorus's reductions are arithmetic, so every rank's tensor is gathered and
  // folded with the bitwise operation here (W times an allreduce's bytes; these ops serve flags and
  // masks). `root` < 0: every rank gets the result; else only the root.
  c10::intrusive_ptr<::c10d::Work> bitwise_reduce(::c10d::OpType type, const at::Tensor& t,
                                                 const ::c10d::ReduceOp& op, int root, const char* name) {
    if (at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type())) {
      throw UsageError(std::string("chorus backend: ") + name + ": BAND, BOR and BXOR take integer or bool tensors, not " +
                       c10::toString(t.scalar_type()));
    }
    at::Tensor flat = at::empty({getSize(), t.numel()}, t.options());
    auto w = pg_->allgather(t.data_ptr(), flat.data_ptr(), static_cast<size_t>(t.numel()), data_type(t, name, false));
    const auto kind = op.op_;
    const bool mine = root < 0 || root == getRank();
    at::Tensor target = t;
    return submit(type, {t}, {w}, {flat}, [flat, target, kind, mine]() mutable {
      if (!mine) return;
      at::Tensor acc = flat[0].clone();
      for (int64_t r = 1; r < flat.size(0); ++r) {
        if (kind == ::c10d::ReduceOp::BAND) {
          acc.bitwise_and_(flat[r]);
        } else if (kind == ::c10d::ReduceOp::BOR) {
          acc.bitwise_or_(flat[r]);
        } else {
          acc.bitwise_xor_(flat[r]);
        }
      }
      target.view({-1}).copy_(acc);
    });
  }

  // Errors from argument checks surface as RuntimeError in Python with chorus's message.
  c10::intrusive_ptr<::c10d::Work> submit(::c10d::OpType type, std::vector<at::Tensor> outputs,
                                         std::vector<std::shared_ptr<Work>> inner, std::vector<at::Tensor> keep = {},
                                         std::function<void()> finish = {}, bool p2p = false) {
    if (!p2p) completions_->release();  // chorus released its queue when this operation was queued
    auto work = c10::make_intrusive<ChorusWork>(type, std::move(outputs), completions_);
    completions_->push(std::make_shared<Completions::Pending>(
        Completions::Pending{work, std::move(inner), std::move(keep), std::move(finish), p2p}));
    return work;
  }

  std::unique_ptr<chorus::ProcessGroup> pg_;
  std::shared_ptr<Completions> completions_ = std::make_shared<Completions>();
  std::thread completer_;
};

c10::intrusive_ptr<BackendBase> create(const c10::intrusive_ptr<::c10d::Store>& store, int rank, int size,
                                                std::chrono::milliseconds timeout) {
  try {
    return c10::make_intrusive<ProcessGroupChorus>(store, rank, size, timeout);
  } catch (const std::exception& e) {
    throw std::runtime_error(e.what());  // RuntimeError in Python, chorus's message
  }
}

}  // namespace
}  // namespace chorus::python

PYBIND11_MODULE(_C, m) {
  m.doc() = "chorus's torch.distributed backend (docs/python.md)";
  m.def("create_process_group", &chorus::python::create, pybind11::arg("store"), pybind11::arg("rank"),
        pybind11::arg("world_size"), pybind11::arg("timeout"),
        "The backend's constructor, as torch.distributed.Backend.register_backend calls it",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
