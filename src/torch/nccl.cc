// chorus::dist::nccl with NCCL (built with -DCHORUS_WITH_NCCL=ON; nccl_unavailable.cc otherwise).
// The communicator runs in NCCL's non-blocking mode, so that every wait here (setup, each
// operation, teardown) is a poll with a deadline instead of a call that may never return.
#include "chorus/torch/nccl.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "chorus/comm/error.h"

namespace chorus::dist::nccl {
namespace {

using Clock = std::chrono::steady_clock;

std::string ms_text(std::chrono::milliseconds ms) { return std::to_string(ms.count()) + " ms"; }

void check_cuda(cudaError_t rc, const std::string& what) {
  if (rc != cudaSuccess) throw Error(what + " failed: " + cudaGetErrorString(rc));
}

// Sleeps a little longer each round, from a yield up to 1 ms, so short waits stay short.
void back_off(int round) {
  if (round < 64) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(std::min(1000, 10 * (round - 63))));
  }
}

// chorus::dist's dtype mapping (its UsageError for the others), in NCCL's terms.
ncclDataType_t nccl_type(const at::Tensor& t) {
  switch (to_data_type(t.scalar_type())) {
    case DataType::kFloat32: return ncclFloat32;
    case DataType::kFloat64: return ncclFloat64;
    case DataType::kFloat16: return ncclFloat16;
    case DataType::kBFloat16: return ncclBfloat16;
    case DataType::kInt8: return ncclInt8;
    case DataType::kUInt8: return ncclUint8;
    case DataType::kInt32: return ncclInt32;
    case DataType::kInt64: return ncclInt64;
  }
  throw UsageError("chorus::dist::nccl: a dtype NCCL has no counterpart for");
}

ncclRedOp_t nccl_op(ReduceOp op, const at::Tensor& t, const char* name) {
  if (t.scalar_type() == at::kBool) {
    throw UsageError(std::string("chorus::dist::nccl::") + name +
                     ": bool tensors cannot be reduced; convert with .to(torch::kUInt8)");
  }
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kProd: return ncclProd;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kAvg: return ncclAvg;
  }
  throw UsageError(std::string("chorus::dist::nccl::") + name + ": unknown reduce op");
}

int choose_device(int asked) {
  int count = 0;
  check_cuda(cudaGetDeviceCount(&count), "chorus::dist::nccl: cudaGetDeviceCount");
  if (count == 0) throw UsageError("chorus::dist::nccl: no CUDA device is visible to this process");
  if (asked >= 0) {
    if (asked >= count) {
      throw UsageError("chorus::dist::nccl: device " + std::to_string(asked) + " asked for, but " +
                       std::to_string(count) + " CUDA device(s) are visible");
    }
    return asked;
  }
  if (const char* local = std::getenv("LOCAL_RANK"); local != nullptr && *local != '\0') {
    const int local_rank = std::atoi(local);
    if (local_rank < 0) throw UsageError("chorus::dist::nccl: LOCAL_RANK is " + std::string(local) + "; expected 0 or more");
    return local_rank % count;
  }
  int current = 0;
  check_cuda(cudaGetDevice(&current), "chorus::dist::nccl: cudaGetDevice");
  return current;
}

}  // namespace

// One queued operation's completion, shared by its Work and the communicator's list of pending
// operations: abort() marks those whose event has not fired as cut, because aborting stops NCCL's
// kernels and the event after them then fires although the result is incomplete.
struct Pending {
  cudaEvent_t start = nullptr;
  cudaEvent_t done = nullptr;
  Clock::time_point issued;
  std::atomic<bool> cut{false};
  ~Pending() {
    if (start != nullptr) cudaEventDestroy(start);
    if (done != nullptr) cudaEventDestroy(done);
  }
  bool fired() const { return cudaEventQuery(done) == cudaSuccess; }
};

struct Communicator::Impl {
  ncclComm_t comm = nullptr;
  int rank = 0;
  int size = 1;
  int device = 0;
  std::chrono::milliseconds timeout{300000};
  // Serialises calls into NCCL on this communicator (recursive: an error inside a call aborts).
  // In non-blocking mode no NCCL call blocks, so it is held briefly; comm is nullptr once aborted
  // or destroyed, and read and written only under it.
  mutable std::recursive_mutex mu;
  std::mutex broken_mu;      // guards broken_why
  std::string broken_why;    // set once, by abort() or at destruction
  std::atomic<bool> aborted{false};
  uint64_t sequence = 0;     // operations issued, for messages (under mu)
  std::vector<std::shared_ptr<Pending>> pending;  // issued, not yet seen complete (under mu)

  std::string who() const {
    return "rank " + std::to_string(rank) + " of " + std::to_string(size) + " (NCCL, cuda:" + std::to_string(device) + ")";
  }

  // NCCL's text for rc and its last error message (ncclGetLastError does not read its argument).
  static std::string nccl_error(ncclResult_t rc) {
    std::string text = ncclGetErrorString(rc);
    const char* last = ncclGetLastError(nullptr);
    if (last != nullptr && *last != '\0') text += ": " + std::string(last);
    return text;
  }

  std::string broken() {
    std::lock_guard<std::mutex> lock(broken_mu);
    return broken_why;
  }

  void abort(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(broken_mu);
      if (!broken_why.empty()) return;
      broken_why = why;
    }
    aborted = true;  // a poll loop holding mu sees this and lets go
    std::lock_guard<std::recursive_mutex> lock(mu);
    // Before the kernels are stopped: what has not finished by now is cut short.
    for (const auto& p : pending) {
      if (!p->fired()) p->cut = true;
    }
    pending.clear();
    // ncclCommAbort stops the communicator's kernels and proxy threads; it does not wait for the
    // peers. It frees the communicator, so no other call may be in NCCL on it meanwhile.
    if (comm != nullptr) ncclCommAbort(comm);
    comm = nullptr;
  }

  void throw_if_broken(const std::string& op) {
    std::string why = broken();
    if (!why.empty()) {
      throw PeerError("chorus::dist::nccl: " + op + " on " + who() + ": the communicator was aborted: " + why +
                      "; make a new one (destroy_process_group and init_process_group again)");
    }
  }

  // NCCL's asynchronous state (ncclInProgress while a non-blocking call is being taken). Under mu.
  ncclResult_t async_state() {
    if (comm == nullptr) return ncclInvalidUsage;  // only after abort or destruction: callers check broken first
    ncclResult_t state = ncclSuccess;
    const ncclResult_t rc = ncclCommGetAsyncError(comm, &state);
    return rc != ncclSuccess ? rc : state;
  }

  // In non-blocking mode a call may return ncclInProgress: poll until NCCL has taken it, with the
  // deadline. An error or a timeout aborts the communicator. Under mu.
  void settle(ncclResult_t rc, const std::string& op, Clock::time_point deadline, std::chrono::milliseconds limit) {
    for (int round = 0; rc == ncclInProgress; ++round) {
      if (aborted) throw_if_broken(op);
      if (Clock::now() > deadline) {
        abort(op + " did not complete within " + ms_text(limit));
        throw TimeoutError("chorus::dist::nccl: " + op + " on " + who() + " did not complete within " +
                           ms_text(limit) + ": a peer has not joined or stopped answering; check that every "
                           "rank made the same calls in the same order and is alive");
      }
      back_off(round);
      if (aborted || comm == nullptr) throw_if_broken(op);
      rc = async_state();
    }
    if (rc != ncclSuccess) fail(rc, op);
  }

  [[noreturn]] void fail(ncclResult_t rc, const std::string& op) {
    const std::string text = nccl_error(rc);
    abort(op + ": " + text);
    const std::string where = "chorus::dist::nccl: " + op + " on " + who() + " failed: " + text;
    switch (rc) {
      case ncclInvalidArgument:
      case ncclInvalidUsage:
        throw UsageError(where + "; NCCL needs one GPU per rank, the same calls on every rank, and tensors on "
                                 "the communicator's device");
      case ncclRemoteError:
        throw PeerError(where + " (a peer failed or left)");
      case ncclSystemError:
        throw PeerError(where + " (a system call or the network failed)");
      default:
        throw Error(where);
    }
  }

  // Waits on the host until `p` has completed on the GPU, watching NCCL's asynchronous error.
  // Past the communicator's deadline (from when the operation was issued) the communicator is
  // aborted; past a caller's shorter `limit` only this wait ends (TimeoutError), and the
  // operation goes on, as Work::wait(timeout) promises.
  void wait_for(Pending& p, const std::string& op, const std::chrono::milliseconds* limit) {
    const auto own_deadline = p.issued + timeout;
    const auto deadline = limit != nullptr ? std::min(own_deadline, Clock::now() + *limit) : own_deadline;
    for (int round = 0;; ++round) {
      if (p.cut) throw_if_broken(op);
      const cudaError_t q = cudaEventQuery(p.done);
      if (q == cudaSuccess) {
        if (p.cut) throw_if_broken(op);
        return;
      }
      if (q != cudaErrorNotReady) check_cuda(q, "chorus::dist::nccl: " + op + " on " + who() + ": cudaEventQuery");
      throw_if_broken(op);
      {
        std::lock_guard<std::recursive_mutex> lock(mu);
        if (!aborted) {
          const ncclResult_t state = async_state();
          if (state != ncclSuccess && state != ncclInProgress) fail(state, op);
        }
      }
      const auto now = Clock::now();
      if (now > deadline) {
        if (now > own_deadline) {
          abort(op + " did not finish within " + ms_text(timeout));
          throw TimeoutError("chorus::dist::nccl: " + op + " on " + who() + " did not finish within " +
                             ms_text(timeout) + ": a peer did not make the matching call, or died, or the GPU "
                             "is busy with long work queued before it; the communicator was aborted");
        }
        throw TimeoutError("chorus::dist::nccl: " + op + " on " + who() + " has not finished after waiting " +
                           ms_text(*limit) + "; it goes on (wait again, or abort)");
      }
      back_off(round);
    }
  }

  // Ends the communicator: waits for pending operations (with the deadline), then finalises
  // (polled, at most 10 s: finalising needs the peers to be quiescent too) and destroys it; aborts
  // instead when any of that fails. Nothing throws: it runs in a destructor.
  void finalize() {
    std::vector<std::shared_ptr<Pending>> left;
    {
      std::lock_guard<std::recursive_mutex> lock(mu);
      if (comm == nullptr) return;
      left = pending;
    }
    try {
      for (const auto& p : left) wait_for(*p, "an operation pending at destruction", nullptr);
      std::lock_guard<std::recursive_mutex> lock(mu);
      if (comm == nullptr) return;
      const auto limit = std::min(timeout, std::chrono::milliseconds(10000));
      settle(ncclCommFinalize(comm), "finalize", Clock::now() + limit, limit);
      ncclCommDestroy(comm);
      comm = nullptr;
      pending.clear();
    } catch (const Error&) {
      abort("destroyed while broken");  // no-op if already aborted
      return;
    }
    std::lock_guard<std::mutex> b(broken_mu);
    if (broken_why.empty()) broken_why = "the communicator was destroyed";
  }
};

namespace {

// A queued operation: complete once the event recorded after it on the stream has fired (and
// failed if an abort cut it short).
class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<Communicator::Impl> owner, std::string op, std::shared_ptr<Pending> pending,
           std::vector<at::Tensor> keep)
      : owner_(std::move(owner)), op_(std::move(op)), pending_(std::move(pending)), keep_(std::move(keep)) {}

  bool is_completed() const override { return exception() != nullptr || pending_->cut || pending_->fired(); }
  bool is_success() const override { return !pending_->cut && exception() == nullptr && pending_->fired(); }
  void wait() override { wait_for(nullptr); }
  void wait(std::chrono::milliseconds timeout) override { wait_for(&timeout); }
  std::exception_ptr exception() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }
  const std::vector<std::string>& objects() const override { return none_; }
  std::chrono::nanoseconds run_time() const override {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, pending_->start, pending_->done) != cudaSuccess) return std::chrono::nanoseconds(0);
    return std::chrono::nanoseconds(static_cast<int64_t>(ms * 1e6));
  }

 private:
  void wait_for(const std::chrono::milliseconds* limit) {
    if (auto e = exception()) std::rethrow_exception(e);
    try {
      owner_->wait_for(*pending_, op_, limit);
    } catch (const TimeoutError&) {
      // A caller's own shorter limit leaves the operation going; the communicator's deadline broke it.
      if (!owner_->broken().empty()) record(std::current_exception());
      throw;
    } catch (...) {
      record(std::current_exception());
      throw;
    }
    std::lock_guard<std::mutex> lock(mu_);
    keep_.clear();
  }
  void record(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_) error_ = std::move(e);
  }

  std::shared_ptr<Communicator::Impl> owner_;
  std::string op_;
  std::shared_ptr<Pending> pending_;
  mutable std::mutex mu_;  // error_, keep_
  std::vector<at::Tensor> keep_;
  std::exception_ptr error_;
  const std::vector<std::string> none_;
};

// Joins the communicator: ncclCommInitRankConfig in non-blocking mode, polled with the deadline.
// `missing` names the ranks that have not joined yet (for the timeout's message).
ncclComm_t join(Communicator::Impl& c, const ncclUniqueId& id, const std::function<std::string()>& missing) {
  // NCCL takes the current device; the caller's is restored after.
  c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(c.device));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const auto deadline = Clock::now() + c.timeout;
  ncclResult_t rc = ncclCommInitRankConfig(&c.comm, c.size, id, c.rank, &config);
  if (rc != ncclSuccess && rc != ncclInProgress) {
    const std::string text = Communicator::Impl::nccl_error(rc);
    if (c.comm != nullptr) ncclCommAbort(c.comm);
    c.comm = nullptr;
    throw Error("chorus::dist::nccl: ncclCommInitRankConfig on " + c.who() + " failed: " + text);
  }
  for (int round = 0; rc == ncclInProgress; ++round) {
    if (Clock::now() > deadline) {
      ncclCommAbort(c.comm);
      c.comm = nullptr;
      const std::string who_missing = missing ? missing() : std::string();
      throw TimeoutError("chorus::dist::nccl: setting up the communicator on " + c.who() + " did not complete within " +
                         ms_text(c.timeout) + ": " + (who_missing.empty() ? std::string("a peer did not join") : who_missing) +
                         "; every rank must create the communicator (init_process_group(\"nccl\")) with its own GPU");
    }
    back_off(round);
    ncclResult_t state = ncclSuccess;
    const ncclResult_t got = ncclCommGetAsyncError(c.comm, &state);
    rc = got != ncclSuccess ? got : state;
  }
  if (rc != ncclSuccess) {
    const std::string text = Communicator::Impl::nccl_error(rc);
    ncclCommAbort(c.comm);
    c.comm = nullptr;
    std::string fix = "; NCCL needs one GPU per rank: give each rank its own device (CommunicatorOptions::device, "
                      "or LOCAL_RANK), or use chorus's own backend (\"chorus\"), which lets ranks share a GPU";
    if (rc == ncclInvalidUsage || rc == ncclInvalidArgument) {
      throw UsageError("chorus::dist::nccl: setting up the communicator on " + c.who() + " failed: " + text + fix);
    }
    throw Error("chorus::dist::nccl: setting up the communicator on " + c.who() + " failed: " + text);
  }
  return c.comm;
}

std::string id_bytes(const ncclUniqueId& id) { return std::string(id.internal, sizeof(id.internal)); }

ncclUniqueId id_from(const std::string& bytes, const std::string& where) {
  ncclUniqueId id;
  if (bytes.size() != sizeof(id.internal)) {
    throw MismatchError("chorus::dist::nccl: " + where + ": the unique id has " + std::to_string(bytes.size()) +
                        " bytes, expected " + std::to_string(sizeof(id.internal)) +
                        " (ranks built against different NCCL versions?)");
  }
  std::memcpy(id.internal, bytes.data(), bytes.size());
  return id;
}

void check_tensor(const Communicator::Impl& c, const at::Tensor& t, const char* op, const char* name = "tensor") {
  const std::string where = std::string("chorus::dist::nccl::") + op + ": " + name;
  if (!t.defined()) throw UsageError(where + " is undefined");
  if (!t.is_cuda()) {
    throw UsageError(where + " is on " + t.device().str() + "; NCCL takes CUDA tensors: move it with .to(torch::Device(\"cuda:" +
                     std::to_string(c.device) + "\")) or use chorus's own backend for CPU tensors");
  }
  if (t.device().index() != c.device) {
    throw UsageError(where + " is on " + t.device().str() + " but this rank's communicator is on cuda:" +
                     std::to_string(c.device));
  }
  if (t.layout() != at::kStrided || !t.is_contiguous()) throw UsageError(where + " must be dense and contiguous; call .contiguous()");
}

}  // namespace

bool built_with_nccl() { return true; }

std::string version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "";
  // NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z from 2.9 on.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

Communicator::Communicator(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

Communicator::~Communicator() {
  if (impl_) impl_->finalize();
}

std::shared_ptr<Communicator> Communicator::create(ProcessGroup& group, CommunicatorOptions options) {
  auto impl = std::make_shared<Impl>();
  impl->rank = group.rank();
  impl->size = group.size();
  impl->timeout = options.timeout;
  impl->device = choose_device(options.device);
  // Rank 0 sends the id, or why it has none (so that the others fail at once, not at the deadline).
  const std::string kFailed = "failed:";
  std::string mine;
  if (impl->rank == 0) {
    ncclUniqueId id;
    ncclResult_t rc = ncclGetUniqueId(&id);
    mine = rc == ncclSuccess ? id_bytes(id) : kFailed + Impl::nccl_error(rc);
  }
  auto shared = group.broadcast_object(mine, 0);
  shared->wait();
  const std::string& got = shared->objects().at(0);
  if (got.size() != NCCL_UNIQUE_ID_BYTES && got.compare(0, kFailed.size(), kFailed) == 0) {
    throw Error("chorus::dist::nccl: ncclGetUniqueId on rank 0 failed: " + got.substr(kFailed.size()) +
                (impl->rank == 0 ? "" : " (reported to rank " + std::to_string(impl->rank) + ")"));
  }
  const ncclUniqueId id = id_from(got, "rank " + std::to_string(impl->rank));
  join(*impl, id, {});
  return std::shared_ptr<Communicator>(new Communicator(std::move(impl)));
}

std::shared_ptr<Communicator> Communicator::create(Store& store, const std::string& key, int rank, int size,
                                                   CommunicatorOptions options) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw UsageError("chorus::dist::nccl::Communicator::create: rank " + std::to_string(rank) + " of " +
                     std::to_string(size) + " is out of range");
  }
  auto impl = std::make_shared<Impl>();
  impl->rank = rank;
  impl->size = size;
  impl->timeout = options.timeout;
  impl->device = choose_device(options.device);
  const std::string id_key = key + "/id";
  if (rank == 0) {
    ncclUniqueId id;
    ncclResult_t rc = ncclGetUniqueId(&id);
    if (rc != ncclSuccess) throw Error("chorus::dist::nccl: ncclGetUniqueId on rank 0 failed: " + Impl::nccl_error(rc));
    store.set(id_key, id_bytes(id));
  }
  try {
    store.wait({id_key}, options.timeout);
  } catch (const TimeoutError& e) {
    throw TimeoutError("chorus::dist::nccl: rank " + std::to_string(rank) + " of " + std::to_string(size) +
                       " waited " + ms_text(options.timeout) + " for rank 0's NCCL unique id under '" + id_key +
                       "' in " + store.describe() + ": rank 0 has not created its communicator (" + e.what() + ")");
  }
  const ncclUniqueId id = id_from(store.get(id_key), "rank " + std::to_string(rank));
  store.set(key + "/joined/" + std::to_string(rank), "1");
  auto missing = [&store, &key, size]() {
    std::vector<int> absent;
    for (int r = 0; r < size; ++r) {
      try {
        if (!store.check({key + "/joined/" + std::to_string(r)})) absent.push_back(r);
      } catch (const Error&) {
        return std::string();
      }
    }
    if (absent.empty()) return std::string("every rank joined, but one stopped answering");
    std::string text = absent.size() == 1 ? "rank " : "ranks ";
    for (size_t i = 0; i < absent.size(); ++i) text += (i ? ", " : "") + std::to_string(absent[i]);
    return text + " did not join";
  };
  join(*impl, id, missing);
  return std::shared_ptr<Communicator>(new Communicator(std::move(impl)));
}

int Communicator::rank() const { return impl_->rank; }
int Communicator::size() const { return impl_->size; }
int Communicator::device() const { return impl_->device; }
std::string Communicator::broken() const { return impl_->broken(); }
void Communicator::abort(const std::string& why) { impl_->abort(why.empty() ? "aborted by the caller" : why); }

namespace {

// Queues `enqueue` on the current stream of the communicator's device, brackets it with events, and
// returns its Work (waited on here unless async_op).
// The Work keeps `owner` alive (not the communicator: the Communicator's destructor ends that).
WorkPtr issue(const std::shared_ptr<Communicator::Impl>& owner, const std::string& name, std::vector<at::Tensor> keep,
              bool async_op, const std::function<ncclResult_t(cudaStream_t)>& enqueue) {
  Communicator::Impl& c = *owner;
  std::shared_ptr<NcclWork> work;
  {
    std::lock_guard<std::recursive_mutex> lock(c.mu);
    const std::string op = name + " #" + std::to_string(++c.sequence);
    c.throw_if_broken(op);
    if (c.comm == nullptr) throw PeerError("chorus::dist::nccl: " + op + " on " + c.who() + ": the communicator is gone");
    c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(c.device));  // the caller's device comes back
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(c.device));
    const cudaStream_t stream = current.stream();
    auto pending = std::make_shared<Pending>();
    check_cuda(cudaEventCreate(&pending->start), "chorus::dist::nccl: cudaEventCreate");
    check_cuda(cudaEventCreate(&pending->done), "chorus::dist::nccl: cudaEventCreate");
    // A tensor made on another stream must not be reused by the caching allocator while NCCL
    // still reads or writes it on this one, also when the Work is dropped without a wait.
    for (const auto& t : keep) c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), current);
    work = std::make_shared<NcclWork>(owner, op, pending, std::move(keep));
    check_cuda(cudaEventRecord(pending->start, stream), "chorus::dist::nccl: cudaEventRecord");
    pending->issued = Clock::now();
    c.settle(enqueue(stream), op, pending->issued + c.timeout, c.timeout);
    check_cuda(cudaEventRecord(pending->done, stream), "chorus::dist::nccl: cudaEventRecord");
    // Forget the operations seen complete; keep this one until it is.
    std::vector<std::shared_ptr<Pending>> still;
    for (auto& p : c.pending) {
      if (!p->fired()) still.push_back(std::move(p));
    }
    still.push_back(std::move(pending));
    c.pending.swap(still);
  }
  if (!async_op) work->wait();
  return work;
}

}  // namespace


WorkPtr Communicator::all_reduce(const at::Tensor& t, ReduceOp op, bool async_op) {
  check_tensor(*impl_, t, "all_reduce");
  const ncclDataType_t type = nccl_type(t);
  const ncclRedOp_t rop = nccl_op(op, t, "all_reduce");
  Impl& c = *impl_;
  return issue(impl_, "all_reduce", {t}, async_op, [&](cudaStream_t s) {
    return ncclAllReduce(t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()), type, rop, c.comm, s);
  });
}

WorkPtr Communicator::broadcast(const at::Tensor& t, int root, bool async_op) {
  check_tensor(*impl_, t, "broadcast");
  if (root < 0 || root >= impl_->size) throw UsageError("chorus::dist::nccl::broadcast: root " + std::to_string(root) + " is out of range");
  const ncclDataType_t type = nccl_type(t);
  Impl& c = *impl_;
  return issue(impl_, "broadcast", {t}, async_op, [&](cudaStream_t s) {
    return ncclBroadcast(t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()), type, root, c.comm, s);
  });
}

WorkPtr Communicator::reduce(const at::Tensor& t, int root, ReduceOp op, bool async_op) {
  check_tensor(*impl_, t, "reduce");
  if (root < 0 || root >= impl_->size) throw UsageError("chorus::dist::nccl::reduce: root " + std::to_string(root) + " is out of range");
  const ncclDataType_t type = nccl_type(t);
  const ncclRedOp_t rop = nccl_op(op, t, "reduce");
  Impl& c = *impl_;
  // NCCL writes recvbuff on root only; in place, the other ranks' tensors are left as they were
  // (NCCL reads sendbuff there and does not write it).
  return issue(impl_, "reduce", {t}, async_op, [&](cudaStream_t s) {
    return ncclReduce(t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()), type, rop, root, c.comm, s);
  });
}

WorkPtr Communicator::all_gather_into_tensor(const at::Tensor& output, const at::Tensor& input, bool async_op) {
  check_tensor(*impl_, input, "all_gather_into_tensor", "input");
  check_tensor(*impl_, output, "all_gather_into_tensor", "output");
  if (output.numel() != input.numel() * impl_->size || output.scalar_type() != input.scalar_type()) {
    throw UsageError("chorus::dist::nccl::all_gather_into_tensor: output must have world_size x input's elements (" +
                     std::to_string(input.numel() * impl_->size) + ") and input's dtype");
  }
  const ncclDataType_t type = nccl_type(input);
  Impl& c = *impl_;
  return issue(impl_, "all_gather_into_tensor", {output, input}, async_op, [&](cudaStream_t s) {
    return ncclAllGather(input.data_ptr(), output.data_ptr(), static_cast<size_t>(input.numel()), type, c.comm, s);
  });
}

WorkPtr Communicator::reduce_scatter_tensor(const at::Tensor& output, const at::Tensor& input, ReduceOp op,
                                            bool async_op) {
  check_tensor(*impl_, input, "reduce_scatter_tensor", "input");
  check_tensor(*impl_, output, "reduce_scatter_tensor", "output");
  if (input.numel() != output.numel() * impl_->size || output.scalar_type() != input.scalar_type()) {
    throw UsageError("chorus::dist::nccl::reduce_scatter_tensor: input must have world_size x output's elements (" +
                     std::to_string(output.numel() * impl_->size) + ") and output's dtype");
  }
  const ncclDataType_t type = nccl_type(input);
  const ncclRedOp_t rop = nccl_op(op, input, "reduce_scatter_tensor");
  Impl& c = *impl_;
  return issue(impl_, "reduce_scatter_tensor", {output, input}, async_op, [&](cudaStream_t s) {
    return ncclReduceScatter(input.data_ptr(), output.data_ptr(), static_cast<size_t>(output.numel()), type, rop,
                             c.comm, s);
  });
}

}  // namespace chorus::dist::nccl
