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

namespace chorus::python {
namespace {

std::string bytes_to_string(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> string_to_bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

// PyTorch's store (TCPStore, FileStore, a PrefixStore of either) as chorus's Store.
class TorchStore final : public Store {
 public:
  explicit TorchStore(c10::intrusive_ptr<::c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::string& value) override { store_->set(key, string_to_bytes(value)); }
  std::string get(const std::string& key) override { return bytes_to_string(store_->get(key)); }
  int64_t add(const std::string& key, int64_t delta) override { return store_->add(key, delta); }
  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) override {
    return bytes_to_string(store_->compareSet(key, string_to_bytes(expected), string_to_bytes(desired)));
  }
  // Polls check() instead of calling PyTorch's wait(): chorus waits in short slices (to notice a
  // disagreeing or missing rank early), and a TCPStore wait that times out stays registered on the
  // server, whose later "stop waiting" then answers another request of this client: PyTorch's
  // "Stop_waiting response is expected", or a read that never returns. A check leaves nothing
  // behind.
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto pause = std::chrono::microseconds(200);
    while (!store_->check(keys)) {
      if (std::chrono::steady_clock::now() >= deadline) {
        std::string names;
        for (const auto& k : keys) names += (names.empty() ? "" : ", ") + k;
        throw TimeoutError("chorus backend: waited " + std::to_string(timeout.count()) + " ms for " + names +
                           " in PyTorch's store");
      }
      std::this_thread::sleep_for(std::min<std::chrono::microseconds>(
          pause, std::chrono::duration_cast<std::chrono::microseconds>(deadline - std::chrono::steady_clock::now()) +
                     std::chrono::microseconds(1)));
      pause = std::min(pause * 2, std::chrono::microseconds(10000));
    }
  }
  bool check(const std::vector<std::string>& keys) override { return store_->check(keys); }
  bool delete_key(const std::string& key) override {
    try {
      return store_->deleteKey(key);
    } catch (const std::exception&) {
      return false;  // FileStore in 1.13 cannot delete; the keys then stay (a few bytes per group)
    }
  }
  int64_t num_keys() override { return store_->getNumKeys(); }
  std::string describe() const override { return "PyTorch's store (the one init_process_group made)"; }

 private:
  c10::intrusive_ptr<::c10d::Store> store_;
};

DataType data_type(const at::Tensor& t, const char* op, bool reduces) {
  switch (t.scalar_type()) {
    case at::kFloat: return DataType::kFloat32;
    case at::kDouble: return DataType::kFloat64;
    case at::kHalf: return DataType::kFloat16;
    case at::kBFloat16: return DataType::kBFloat16;
    case at::kChar: return DataType::kInt8;
    case at::kByte: return DataType::kUInt8;
    case at::kInt: return DataType::kInt32;
    case at::kLong: return DataType::kInt64;
    case at::kBool:
      if (!reduces) return DataType::kUInt8;
      throw UsageError(std::string("chorus backend: ") + op + ": bool tensors cannot be reduced by chorus yet; "
                       "convert with .to(torch.uint8) (MAX/MIN as OR/AND)");
    default: break;
  }
  throw UsageError(std::string("chorus backend: ") + op + ": dtype " + c10::toString(t.scalar_type()) +
                   " is not supported; use float32/64, float16, bfloat16, int8, uint8, int32, int64 or bool");
}

ReduceOp reduce_op(const ::c10d::ReduceOp& op, const char* name) {
  switch (op.op_) {
    case ::c10d::ReduceOp::SUM: return ReduceOp::kSum;
    case ::c10d::ReduceOp::AVG: return ReduceOp::kAvg;
    case ::c10d::ReduceOp::PRODUCT: return ReduceOp::kProd;
    case ::c10d::ReduceOp::MIN: return ReduceOp::kMin;
    case ::c10d::ReduceOp::MAX: return ReduceOp::kMax;
    default: break;
  }
  throw UsageError(std::string("chorus backend: ") + name +
                   ": this reduce op is not supported here; SUM, AVG, PRODUCT, MIN and MAX are everywhere, and "
                   "BAND, BOR and BXOR in all_reduce and reduce (PREMUL_SUM is NCCL's alone)");
}

bool bitwise(const ::c10d::ReduceOp& op) {
  return op.op_ == ::c10d::ReduceOp::BAND || op.op_ == ::c10d::ReduceOp::BOR || op.op_ == ::c10d::ReduceOp::BXOR;
}

void check_tensor(const at::Tensor& t, const char* op) {
  if (!t.defined()) throw UsageError(std::string("chorus backend: ") + op + ": undefined tensor");
  if (t.layout() != at::kStrided) throw UsageError(std::string("chorus backend: ") + op + ": sparse tensors are not supported; call .to_dense()");
  if (!t.device().is_cpu()) {
    throw UsageError(std::string("chorus backend: ") + op + ": tensor on " + t.device().str() +
                     "; chorus's Python backend takes CPU tensors so far (the C++ API stages CUDA tensors: "
                     "docs/gpu.md); copy with .cpu()");
  }
  if (!t.is_contiguous()) throw UsageError(std::string("chorus backend: ") + op + ": tensor is not contiguous; call .contiguous()");
}

const at::Tensor& single(const std::vector<at::Tensor>& tensors, const char* op) {
  if (tensors.size() != 1) {
    throw UsageError(std::string("chorus backend: ") + op + ": takes one tensor per call (got " +
                     std::to_string(tensors.size()) + "), as gloo does for CPU tensors");
  }
  check_tensor(tensors[0], op);
  return tensors[0];
}

class ChorusWork;

// The Futures of one group, completed in issue order (the order chorus runs the operations in):
// by the group's completion thread, or by a thread blocked in Work.wait on the operation at the
// front, which then completes it itself (chorus's own Work::wait runs a next-in-line operation in
// the waiting thread), saving the hand-offs between threads that a small synchronous call would
// otherwise pay. Shared by the group and its Works, so that neither outlives it.
class Completions {
 public:
  struct Pending {
    c10::intrusive_ptr<ChorusWork> work;
    std::vector<std::shared_ptr<Work>> inner;
    std::vector<at::Tensor> keep;
    std::function<void()> finish;
    bool p2p = false;  // a send or recv: may be held (hold())
  };

  // Point-to-point batches (chorus::ProcessGroup::hold_p2p): sends and recvs issued after hold()
  // wait in the group's queue, and this thread does not wait on them either, until release():
  // on a wait, poll or future of any of this group's Works, on its next collective, or at stop.
  // Then the run of them starts together, so ranks that each post their recvs first (PyTorch's
  // batch_isend_irecv) do not wait on each other.
  void hold(chorus::ProcessGroup* pg) {
    std::lock_guard<std::mutex> lock(mu_);
    held_ = true;
    held_group_ = pg;
    pg->hold_p2p();
  }
  void release() {
    if (!held_.load(std::memory_order_acquire)) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!held_) return;
      held_ = false;
      if (held_group_ != nullptr) held_group_->release_p2p();
    }
    cv_.notify_all();
  }

  void push(std::shared_ptr<Pending> p) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.push_back(std::move(p));
    }
    cv_.notify_one();
  }

  // Completes the operation of `work` in this thread if it is at the front; false if it is not.
  bool run_if_front(const ChorusWork* work) {
    std::shared_ptr<Pending> p;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (pending_.empty() || pending_.front()->work.get() != work) return false;
      p = std::move(pending_.front());
      pending_.pop_front();
    }
    complete(*p);
    return true;
  }

  // The completion thread: waits for the front operation without claiming it, then completes it
  // unless a waiter did meanwhile.
  void loop() {
    for (;;) {
      std::shared_ptr<Pending> p;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || (!pending_.empty() && !(held_ && pending_.front()->p2p)); });
        if (pending_.empty()) return;
        p = pending_.front();
      }
      try {
        for (auto& w : p->inner) w->wait();
      } catch (...) {
        // complete() meets the same error again and reports it
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (pending_.empty() || pending_.front() != p) continue;  // a waiter completed it
        pending_.pop_front();
      }
      complete(*p);
    }
  }

  void stop() {
    release();
    {
      std::lock_guard<std::mutex> lock(mu_);
      held_group_ = nullptr;  // Works may outlive the group; hold() is not called after stop
      stopping_ = true;
    }
    cv_.notify_all();
  }

 private:
  static void complete(Pending& p);

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Pending>> pending_;
  bool stopping_ = false;
  std::atomic<bool> held_{false};
  chorus::ProcessGroup* held_group_ = nullptr;  // the group hold() was called for (set again by each call)
};

// The Work PyTorch sees: done when its Future is. The Future completes, in issue order, with the
// output tensors or with chorus's error (Completions).
class ChorusWork final : public ::c10d::Work {
 public:
  ChorusWork(::c10d::OpType type, std::vector<at::Tensor> outputs, std::shared_ptr<Completions> completions)
      : ::c10d::Work(-1, type),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))),
        completions_(std::move(completions)) {}

  bool isCompleted() override {
    completions_->release();  // a poll loop on a held send would otherwise spin forever
    return future_->completed();
  }
  bool isSuccess() const override { return future_->completed() && !future_->hasError(); }
  std::exception_ptr exception() const override { return future_->hasError() ? future_->exception_ptr() : nullptr; }
  std::vector<at::Tensor> result() override { return outputs_; }
  bool wait(std::chrono::milliseconds timeout) override {
    completions_->release();
    if (timeout == kNoTimeout) {
      if (!future_->completed()) completions_->run_if_front(this);
      future_->wait();
    } else {
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      while (!future_->completed()) {
        if (std::chrono::steady_clock::now() > deadline) {
          throw std::runtime_error("chorus backend: Work.wait timed out after " + std::to_string(timeout.count()) +
                                   " ms (the operation goes on; its own deadline is the group's timeout)");
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
    if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
    return true;
  }
  void synchronize() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    completions_->release();
    return future_;
  }

  // recvAnysource: the rank it received from, once done (dist.recv without src returns it).
  int sourceRank() const override {
    if (!source_of_) return ::c10d::Work::sourceRank();  // throws: not a recv from any source
    if (!future_->completed() || future_->hasError()) {
      throw std::runtime_error("chorus backend: the source of a recv from any source is known once it completed");
    }
    return source_of_->source();
  }
  void set_source_of(std::shared_ptr<chorus::Work> recv_any) { source_of_ = std::move(recv_any); }

  void complete(std::exception_ptr error) {
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
  }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::shared_ptr<Completions> completions_;
  std::shared_ptr<chorus::Work> source_of_;
};

void Completions::complete(Pending& p) {
  std::exception_ptr error;
  try {
    for (auto& w : p.inner) w->wait();
    if (p.finish) p.finish();
  } catch (const std::exception& e) {
    error = std::make_exception_ptr(std::runtime_error(e.what()));
  } catch (...) {
    error = std::current_exception();
  }
  p.keep.clear();
  p.work->complete(error);
}

// Under `chorus run` (its store's address and the job token in the environment), chorus's setup
// (addresses, shared-memory names) goes through the launcher's own store, which authenticates every
// client with the token, instead of PyTorch's unauthenticated one. PyTorch's store carries only a
// random name for this group's keys there, drawn by rank 0: a new one for every group and attempt.
// Elsewhere: PyTorch's store, as given.
std::shared_ptr<Store> authenticated_store(const std::shared_ptr<Store>& torch_store, int rank,
                                           const std::string& token, std::chrono::milliseconds timeout,
                                           std::string* local_address) {
  const char* host = std::getenv("CHORUS_STORE_ADDR");
  const char* port = std::getenv("CHORUS_STORE_PORT");
  if (host == nullptr || *host == '\0' || port == nullptr || *port == '\0') return torch_store;
  const std::string key = "chorus/python/group";
  if (rank == 0) torch_store->set(key, random_token().substr(0, 16));
  torch_store->wait({key}, timeout);
  TcpStoreOptions so;
  so.host = host;
  try {
    so.port = std::stoi(port);
  } catch (const std::exception&) {
    throw UsageError(std::string("chorus backend: CHORUS_STORE_PORT='") + port + "' is not a port number");
  }
  so.token = token;
  so.timeout = timeout;
  auto client = std::make_shared<TcpStore>(so);
  *local_address = client->local_address();  // the interface that reaches the launcher's store
  return std::make_shared<PrefixStore>("python/" + torch_store->get(key) + "/", client);
}

// The address of the interface this host would use to reach `host` (a UDP socket "connected" to
// it sends nothing); "" if it does not resolve.
std::string address_toward(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), "9", &hints, &found) != 0 || found == nullptr) return "";
  std::string out;
  const int fd = ::socket(found->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_storage local{};
  socklen_t len = sizeof(local);
  if (fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
    char text[INET6_ADDRSTRLEN] = {};
    const void* a = local.ss_family == AF_INET6 ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
                                                : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr);
    if (::inet_ntop(local.ss_family, a, text, sizeof(text)) != nullptr) out = text;
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(found);
  return out;
}

// The address peers reach this rank's TCP transport by: CHORUS_ADVERTISE_HOST when set; else the
// interface that reaches chorus run's store; else the one that reaches MASTER_ADDR (env://); else
// chorus's default (loopback: one host).
std::string advertise_host(const std::string& toward_store) {
  if (const char* a = std::getenv("CHORUS_ADVERTISE_HOST"); a != nullptr && *a != '\0') return a;
  if (!toward_store.empty()) return toward_store;
  if (const char* m = std::getenv("MASTER_ADDR"); m != nullptr && *m != '\0') return address_toward(m);
  return "";
}

// The one place where libtorch versions differ for a backend: 1.13 takes a c10d::ProcessGroup
// subclass; 2.x takes a c10d::Backend subclass (its ProcessGroup holds a backend per device, and
// Python registers ours with devices=["cpu"]: python/chorus/__init__.py). The operations' virtual
// signatures are the same in both. Only 1.13 is built and tested here (Debian's python3-torch); the
// 2.x side is written to its headers but has never been compiled (CMake: CHORUS_PYTHON_TORCH2).
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
