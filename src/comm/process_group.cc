#include "chorus/comm/process_group.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <thread>

#include "algorithms.h"
#include "chorus/comm/error.h"
#include "chorus/comm/log.h"
#include "chorus/comm/rendezvous.h"
#include "chorus/comm/signals.h"
#include "message.h"
#include "socket.h"
#include "transport.h"

namespace chorus {
namespace {

using net::Clock;

using transport::error_class_of;
using transport::make_error;

class WorkImpl;

// Runs a queued operation in the calling thread when it is next in line and the worker is idle.
class InlineRunner {
 public:
  virtual ~InlineRunner() = default;
  virtual bool run_inline(const WorkImpl* work) = 0;
  // Threads blocked in Work::wait on this group. While there are some, the caller's core is idle
  // and transports may busy-poll; while there are none, the caller computes (DDP's backward) and
  // a polling transport would take the core it needs, so transports sleep instead.
  std::atomic<int> waiters{0};
};

// Counts a thread as blocked in Work::wait for its lifetime.
class WaiterScope {
 public:
  explicit WaiterScope(InlineRunner* runner) : runner_(runner) {
    if (runner_ != nullptr) runner_->waiters.fetch_add(1, std::memory_order_relaxed);
  }
  ~WaiterScope() {
    if (runner_ != nullptr) runner_->waiters.fetch_sub(1, std::memory_order_relaxed);
  }
  WaiterScope(const WaiterScope&) = delete;
  WaiterScope& operator=(const WaiterScope&) = delete;

 private:
  InlineRunner* runner_;
};

class WorkImpl final : public Work {
 public:
  WorkImpl(std::string what, InlineRunner* runner) : what_(std::move(what)), runner_(runner) {}

  bool is_completed() const override { return state_.load(std::memory_order_acquire) != 0; }
  bool is_success() const override { return state_.load(std::memory_order_acquire) == 1; }

  void wait() override {
    if (is_completed()) {
      if (error_) std::rethrow_exception(error_);
      return;
    }
    WaiterScope scope(runner_);
    // A waiter whose operation is next in line runs it itself: no hand-off to the worker and
    // back, which is most of a small collective's latency. Issue order is unchanged.
    if (runner_ != nullptr) runner_->run_inline(this);
    if (!is_completed()) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return is_completed(); });
    }
    if (error_) std::rethrow_exception(error_);
  }

  void wait(std::chrono::milliseconds timeout) override {
    // No inline run here: an inline run lasts as long as the operation, which can exceed `timeout`.
    if (!is_completed()) {
      WaiterScope scope(runner_);
      std::unique_lock<std::mutex> lock(mu_);
      if (!cv_.wait_for(lock, timeout, [&] { return is_completed(); })) {
        throw TimeoutError("chorus: " + what_ + ": Work::wait did not see it complete within " +
                           net::format_duration(timeout) + "; it is still running");
      }
    }
    if (error_) std::rethrow_exception(error_);
  }

  std::exception_ptr exception() const override {
    return is_completed() ? error_ : nullptr;
  }
  const std::vector<std::string>& objects() const override { return objects_; }
  std::chrono::nanoseconds run_time() const override { return is_completed() ? run_time_ : std::chrono::nanoseconds(0); }

  void started() { start_ = Clock::now(); }

  void finish(std::exception_ptr error) {
    run_time_ = start_ == Clock::time_point() ? std::chrono::nanoseconds(0) : Clock::now() - start_;
    {
      std::lock_guard<std::mutex> lock(mu_);
      error_ = std::move(error);
      state_.store(error_ ? 2 : 1, std::memory_order_release);
    }
    cv_.notify_all();
  }

  std::vector<std::string> objects_;

 private:
  std::string what_;
  InlineRunner* runner_;  // the group's; a Work that is still queued implies the group is alive
  std::atomic<int> state_{0};  // 0 running, 1 done, 2 failed
  Clock::time_point start_{};
  std::chrono::nanoseconds run_time_{0};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::exception_ptr error_;
};

struct Task {
  std::shared_ptr<WorkImpl> work;
  wire::Call call;
  std::function<void(WorkImpl&, const wire::Call&)> run;
};

}  // namespace

struct ProcessGroup::Impl final : InlineRunner {
  std::shared_ptr<Store> store;
  int rank;
  int size;
  ProcessGroupOptions opts;
  std::unique_ptr<transport::Transport> transport;
  transport::NativeCollectives* native = nullptr;  // transport's own collectives, if it has any
  algo::Scratch scratch;
  algo::Tuning tune;

  std::mutex mu;  // guards the queue, the sequence counters and stopping
  std::condition_variable cv;
  std::deque<Task> queue;
  bool stopping = false;
  bool running = false;  // an operation is executing (on the worker or inline)
  uint64_t seq = 0;
  std::vector<uint64_t> send_seq, recv_seq;
  int next_group_id = 0;
  std::thread worker;
  std::mutex shutdown_mu;

  std::atomic<bool> broken{false};
  std::string broken_msg;  // written by the worker before broken is set
  uint8_t broken_class = transport::kErrOther;

  std::string me() const { return "chorus: rank " + std::to_string(rank); }

  void check_root(int root, const char* op) const {
    if (root < 0 || root >= size) {
      throw UsageError(me() + ": " + op + ": root " + std::to_string(root) + " is not a rank of this group of size " +
                       std::to_string(size));
    }
  }
  void check_buffer(const void* p, size_t count, const char* op) const {
    if (p == nullptr && count > 0) throw UsageError(me() + ": " + op + ": null buffer for " + std::to_string(count) + " elements");
  }

  std::shared_ptr<Work> enqueue(wire::OpType op, DataType dtype, ReduceOp rop, uint64_t count, int64_t arg,
                                std::function<void(WorkImpl&, const wire::Call&)> run, int p2p_peer = -1) {
    std::unique_lock<std::mutex> lock(mu);
    if (stopping) throw UsageError(me() + ": " + wire::op_name(op) + " called on a process group that was shut down");
    wire::Call call;
    call.op = op;
    call.dtype = dtype;
    call.reduce_op = rop;
    call.count = count;
    call.arg = arg;
    if (op == wire::OpType::kSend) {
      call.seq = send_seq[static_cast<size_t>(p2p_peer)]++;
    } else if (op == wire::OpType::kRecv) {
      call.seq = recv_seq[static_cast<size_t>(p2p_peer)]++;
    } else {
      call.seq = seq++;
    }
    auto work = std::make_shared<WorkImpl>("rank " + std::to_string(rank) + ": " + wire::describe(call), this);
    if (broken.load(std::memory_order_acquire)) {
      work->finish(make_error(broken_class, me() + ": " + wire::describe(call) +
                                                " not run: the process group is broken since an earlier "
                                                "operation failed: " + broken_msg));
      return work;
    }
    queue.push_back(Task{work, call, std::move(run)});
    lock.unlock();
    cv.notify_one();
    return work;
  }

  void execute(Task& task) {
    if (broken.load(std::memory_order_acquire)) {
      task.work->finish(make_error(broken_class, me() + ": " + wire::describe(task.call) +
                                                     " not run: the process group is broken since an "
                                                     "earlier operation failed: " + broken_msg));
      return;
    }
    try {
      task.work->started();
      transport->begin(task.call, net::deadline_after(opts.timeout));
      task.run(*task.work, task.call);
      task.work->finish(nullptr);
    } catch (const std::exception& e) {
      uint8_t cls = error_class_of(e);
      broken_msg = e.what();
      broken_class = cls;
      broken.store(true, std::memory_order_release);
      transport->abort(e.what(), cls);
      task.work->finish(std::current_exception());
    }
  }

  bool run_inline(const WorkImpl* work) override {
    std::unique_lock<std::mutex> lock(mu);
    if (running || queue.empty() || queue.front().work.get() != work) return false;
    Task task = std::move(queue.front());
    queue.pop_front();
    running = true;
    lock.unlock();
    execute(task);
    lock.lock();
    running = false;
    lock.unlock();
    // The worker may be waiting for this run to end: to take the next operation, or to stop.
    cv.notify_all();
    return true;
  }

  void loop() {
    for (;;) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return (stopping && !running) || (!queue.empty() && !running); });
        if (queue.empty()) return;
        task = std::move(queue.front());
        queue.pop_front();
        running = true;
      }
      execute(task);
      {
        std::lock_guard<std::mutex> lock(mu);
        running = false;
      }
    }
  }
};

namespace {

// Passes every call to `base` and remembers the keys this rank writes, so that a group's setup
// keys can be deleted once no rank needs them (release_setup_keys).
class RecordingStore final : public Store {
 public:
  explicit RecordingStore(Store& base) : base_(base) { set_timeout(base.timeout()); }
  void set(const std::string& key, const std::string& value) override {
    remember(key);
    base_.set(key, value);
  }
  std::string get(const std::string& key) override { return base_.get(key); }
  int64_t add(const std::string& key, int64_t delta) override {
    if (delta != 0) remember(key);
    return base_.add(key, delta);
  }
  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) override {
    remember(key);
    return base_.compare_set(key, expected, desired);
  }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    base_.wait(keys, timeout);
  }
  using Store::wait;
  bool check(const std::vector<std::string>& keys) override { return base_.check(keys); }
  bool delete_key(const std::string& key) override { return base_.delete_key(key); }
  int64_t num_keys() override { return base_.num_keys(); }
  std::string describe() const override { return base_.describe(); }

  std::vector<std::string> written() const {
    std::lock_guard<std::mutex> lock(mu_);
    return {keys_.begin(), keys_.end()};
  }

 private:
  void remember(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    keys_.insert(key);
  }
  Store& base_;
  mutable std::mutex mu_;
  std::set<std::string> keys_;
};

// Deletes the keys that every rank wrote while setting up the group under `prefix`, without
// waiting for the other ranks. Each rank, once its own setup has read everything it needs,
// publishes the list of keys it wrote and then counts itself in. The rank whose count completes
// the group knows that no rank will read a setup key again: it deletes every listed key, the lists
// and the counter. A slow rank therefore still finds every key it waits for.
void release_setup_keys(Store& store, const std::string& prefix, int rank, int size,
                        const std::vector<std::string>& mine) {
  std::string list;
  for (const auto& k : mine) list += k + "\n";
  const std::string lists = prefix + "/written/";
  const std::string count = prefix + "/released";
  store.set(lists + std::to_string(rank), list);
  if (store.add(count, 1) < size) return;
  for (int r = 0; r < size; ++r) {
    const std::string key = lists + std::to_string(r);
    const std::string theirs = store.get(key);
    size_t begin = 0;
    for (size_t end; (end = theirs.find('\n', begin)) != std::string::npos; begin = end + 1) {
      store.delete_key(theirs.substr(begin, end - begin));  // shared counters are listed twice
    }
    store.delete_key(key);
  }
  store.delete_key(count);
}

// The transport `options` ask for; "auto" looks at which ranks share a host.
std::unique_ptr<transport::Transport> make_transport(Store* store, const transport::TcpOptions& to,
                                                     const ProcessGroupOptions& options, int size) {
  const std::string mine = options.host_id.empty() ? transport::host_identity() : options.host_id;
  // Spinning on an oversubscribed host takes the core the peer needs.
  const int spin_us = options.spin_us >= 0 ? options.spin_us
                      : static_cast<unsigned>(size) <= std::thread::hardware_concurrency() ? 50 : 0;
  transport::ShmOptions so;
  so.host_id = mine;
  so.group_name = options.group_name;
  so.token = options.token;
  so.deadline = to.deadline;
  so.collective_bytes = options.shm_chunk_bytes;
  so.small_bytes = options.shm_small_bytes;
  so.spin_us = spin_us;
  std::string kind = options.transport;
  if (size == 1) kind = "tcp";  // nothing to connect
  if (kind == "auto") {
    // Every rank says where it is and how much /dev/shm its host has free.
    const auto all = transport::exchange_announcements(*store, to.key_prefix + "/auto", to.rank, size, to.token,
                                                       {mine, std::to_string(transport::shm_free_bytes())},
                                                       to.deadline);
    std::map<std::string, int> per_host;
    std::map<std::string, uint64_t> free_on;
    for (const auto& a : all) {
      ++per_host[a.host];
      free_on[a.host] = std::stoull(a.extra.empty() ? "0" : a.extra);
    }
    bool shared = false;
    std::string short_host;  // a host whose /dev/shm cannot hold its ranks' segments
    for (const auto& [id, n] : per_host) {
      shared = shared || n > 1;
      const uint64_t need = static_cast<uint64_t>(n) * transport::shm_segment_bytes(so, n);
      if (n > 1 && free_on[id] < need) {
        short_host = id;
        if (to.rank == 0) {
          chorus::log(LogLevel::kWarning, "group '" + options.group_name + "': /dev/shm on host " + id + " has " +
                                      std::to_string(free_on[id]) + " bytes free but its " + std::to_string(n) +
                                      " ranks need " + std::to_string(need) +
                                      " for shared memory; using tcp (in a container, raise --shm-size)");
        }
      }
    }
    kind = !short_host.empty() ? "tcp" : per_host.size() == 1 ? "shm" : shared ? "hybrid" : "tcp";
  }
  if (kind == "shm") {
    so.store = store;
    so.key_prefix = to.key_prefix;
    so.rank = to.rank;
    so.size = size;
    return transport::make_shm_transport(so);
  }
  if (kind == "hybrid") {
    transport::HybridOptions ho;
    ho.tcp = to;
    ho.shm = so;
    ho.host_id = mine;
    ho.spin_by_local_size = options.spin_us < 0;  // the ranks that share cores are this host's
    ho.segment_bytes = options.segment_bytes;
    ho.small_allreduce_bytes = options.small_allreduce_bytes;
    return transport::make_hybrid_transport(ho);
  }
  return transport::make_tcp_transport(to);
}

}  // namespace

ProcessGroup::ProcessGroup(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options)
    : impl_(std::make_unique<Impl>()) {
  if (!store) throw UsageError("chorus: ProcessGroup needs a store");
  if (size < 1 || rank < 0 || rank >= size) {
    throw UsageError("chorus: invalid rank " + std::to_string(rank) + " for world size " + std::to_string(size) +
                     "; rank must be in [0, world_size)");
  }
  if (options.transport != "tcp" && options.transport != "shm" && options.transport != "hybrid" &&
      options.transport != "auto") {
    throw UsageError("chorus: unknown transport '" + options.transport + "'; available: tcp, shm, hybrid, auto");
  }
  Impl& m = *impl_;
  m.store = std::move(store);
  m.rank = rank;
  m.size = size;
  m.opts = options;
  m.tune.segment_bytes = std::max<size_t>(options.segment_bytes, 1);
  m.tune.small_allreduce_bytes = options.small_allreduce_bytes;
  m.send_seq.assign(static_cast<size_t>(size), 0);
  m.recv_seq.assign(static_cast<size_t>(size), 0);

  transport::TcpOptions to;
  to.store = m.store.get();
  to.key_prefix = "chorus/pg/" + options.group_name;
  to.group_name = options.group_name;
  to.rank = rank;
  to.size = size;
  to.token = options.token;
  to.advertise_host = options.advertise_host;
  to.deadline = net::deadline_after(options.timeout);
  to.socket_buffer_bytes = options.socket_buffer_bytes;
  to.spin_us = options.spin_us;
  if (to.spin_us < 0) {
    to.spin_us = static_cast<unsigned>(size) <= std::thread::hardware_concurrency() ? 20 : 0;
  }
  try {
    RecordingStore recording(*m.store);
    to.store = &recording;  // the transports read the store during setup only
    m.transport = make_transport(&recording, to, options, size);
    if (size > 1) release_setup_keys(*m.store, to.key_prefix, rank, size, recording.written());
  } catch (const std::exception& e) {
    // Name the rank and group on every setup error (store, connect, handshake, accept).
    const std::string what = e.what();
    const std::string prefix = "chorus: rank " + std::to_string(rank) + ": group '" + options.group_name + "' setup: ";
    const std::string msg = what.rfind("chorus: rank", 0) == 0 ? what : prefix + what;
    std::rethrow_exception(make_error(error_class_of(e), msg));
  }
  m.transport->set_spin_gate(&m.waiters);
  m.native = m.transport->native();
  m.worker = std::thread([this] { impl_->loop(); });
}

ProcessGroup::~ProcessGroup() { shutdown(); }

void ProcessGroup::shutdown() {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> once(m.shutdown_mu);  // concurrent shutdown() calls join once
  {
    std::lock_guard<std::mutex> lock(m.mu);
    if (m.stopping && !m.worker.joinable()) return;
    m.stopping = true;
  }
  m.cv.notify_all();
  if (m.worker.joinable()) m.worker.join();
  if (m.transport) m.transport->close();
}

int ProcessGroup::rank() const { return impl_->rank; }
int ProcessGroup::size() const { return impl_->size; }
std::string ProcessGroup::transport() const { return impl_->transport->kind(); }
const ProcessGroupOptions& ProcessGroup::options() const { return impl_->opts; }

using algo::Scratch;
using wire::Call;
using wire::OpType;

std::shared_ptr<Work> ProcessGroup::allreduce(void* data, size_t count, DataType dtype, ReduceOp op) {
  Impl& m = *impl_;
  m.check_buffer(data, count, "allreduce");
  element_size(dtype);
  return m.enqueue(OpType::kAllreduce, dtype, op, count, 0, [&m, data, count, dtype, op](WorkImpl&, const Call& c) {
    if (m.size > 1 && m.native != nullptr && m.native->allreduce(data, count, dtype, op)) return;
    algo::allreduce(*m.transport, m.scratch, m.tune, c, data, count, dtype, op);
  });
}

std::shared_ptr<Work> ProcessGroup::broadcast(void* data, size_t count, DataType dtype, int root) {
  Impl& m = *impl_;
  m.check_buffer(data, count, "broadcast");
  m.check_root(root, "broadcast");
  const size_t bytes = count * element_size(dtype);
  return m.enqueue(OpType::kBroadcast, dtype, ReduceOp::kSum, count, root, [&m, data, bytes, root](WorkImpl&, const Call& c) {
    if (m.size > 1 && m.native != nullptr && m.native->broadcast(data, bytes, root)) return;
    algo::broadcast(*m.transport, m.tune, c, data, bytes, root);
  });
}

std::shared_ptr<Work> ProcessGroup::reduce(void* data, size_t count, DataType dtype, ReduceOp op, int root) {
  Impl& m = *impl_;
  m.check_buffer(data, count, "reduce");
  m.check_root(root, "reduce");
  element_size(dtype);
  return m.enqueue(OpType::kReduce, dtype, op, count, root, [&m, data, count, dtype, op, root](WorkImpl&, const Call& c) {
    algo::reduce(*m.transport, m.scratch, c, data, count, dtype, op, root);
  });
}

std::shared_ptr<Work> ProcessGroup::allgather(const void* in, void* out, size_t count, DataType dtype) {
  Impl& m = *impl_;
  m.check_buffer(in, count, "allgather");
  m.check_buffer(out, count, "allgather");
  const size_t bytes = count * element_size(dtype);
  std::vector<size_t> sizes(static_cast<size_t>(m.size), bytes);
  return m.enqueue(OpType::kAllgather, dtype, ReduceOp::kSum, count, 0,
                   [&m, in, out, bytes, sizes = std::move(sizes)](WorkImpl&, const Call& c) {
                     if (m.size > 1 && m.native != nullptr && m.native->allgather(in, out, bytes)) return;
                     algo::allgatherv(*m.transport, c, in, out, sizes);
                   });
}

std::shared_ptr<Work> ProcessGroup::allgatherv(const void* in, void* out, const std::vector<size_t>& counts,
                                               DataType dtype) {
  Impl& m = *impl_;
  if (counts.size() != static_cast<size_t>(m.size)) {
    throw UsageError(m.me() + ": allgatherv: counts has " + std::to_string(counts.size()) +
                     " entries; it needs one per rank (" + std::to_string(m.size) + ")");
  }
  const size_t esz = element_size(dtype);
  size_t total = 0;
  std::vector<size_t> sizes;
  for (size_t n : counts) {
    sizes.push_back(n * esz);
    total += n;
  }
  m.check_buffer(in, counts[static_cast<size_t>(m.rank)], "allgatherv");
  m.check_buffer(out, total, "allgatherv");
  return m.enqueue(OpType::kAllgather, dtype, ReduceOp::kSum, total, 1,
                   [&m, in, out, sizes = std::move(sizes)](WorkImpl&, const Call& c) {
                     algo::allgatherv(*m.transport, c, in, out, sizes);
                   });
}

std::shared_ptr<Work> ProcessGroup::gather(const void* in, void* out, size_t count, DataType dtype, int root) {
  Impl& m = *impl_;
  m.check_root(root, "gather");
  m.check_buffer(in, count, "gather");
  if (m.rank == root) m.check_buffer(out, count, "gather");
  const size_t bytes = count * element_size(dtype);
  return m.enqueue(OpType::kGather, dtype, ReduceOp::kSum, count, root, [&m, in, out, bytes, root](WorkImpl&, const Call& c) {
    algo::gather(*m.transport, c, in, out, bytes, root);
  });
}

std::shared_ptr<Work> ProcessGroup::scatter(const void* in, void* out, size_t count, DataType dtype, int root) {
  Impl& m = *impl_;
  m.check_root(root, "scatter");
  m.check_buffer(out, count, "scatter");
  if (m.rank == root) m.check_buffer(in, count, "scatter");
  const size_t bytes = count * element_size(dtype);
  return m.enqueue(OpType::kScatter, dtype, ReduceOp::kSum, count, root, [&m, in, out, bytes, root](WorkImpl&, const Call& c) {
    algo::scatter(*m.transport, c, in, out, bytes, root);
  });
}

std::shared_ptr<Work> ProcessGroup::reduce_scatter(const void* in, void* out, size_t count, DataType dtype,
                                                   ReduceOp op) {
  Impl& m = *impl_;
  m.check_buffer(in, count, "reduce_scatter");
  m.check_buffer(out, count, "reduce_scatter");
  element_size(dtype);
  return m.enqueue(OpType::kReduceScatter, dtype, op, count, 0, [&m, in, out, count, dtype, op](WorkImpl&, const Call& c) {
    algo::reduce_scatter(*m.transport, m.scratch, m.tune, c, in, out, count, dtype, op);
  });
}

std::shared_ptr<Work> ProcessGroup::alltoall(const void* in, void* out, size_t count, DataType dtype) {
  Impl& m = *impl_;
  m.check_buffer(in, count, "alltoall");
  m.check_buffer(out, count, "alltoall");
  const size_t bytes = count * element_size(dtype);
  return m.enqueue(OpType::kAlltoall, dtype, ReduceOp::kSum, count, 0, [&m, in, out, bytes](WorkImpl&, const Call& c) {
    algo::alltoall(*m.transport, c, in, out, bytes);
  });
}

std::shared_ptr<Work> ProcessGroup::barrier() {
  Impl& m = *impl_;
  return m.enqueue(OpType::kBarrier, DataType::kUInt8, ReduceOp::kSum, 0, 0, [&m](WorkImpl&, const Call& c) {
    algo::barrier(*m.transport, c);
  });
}

std::shared_ptr<Work> ProcessGroup::send(const void* data, size_t count, DataType dtype, int dst, int tag) {
  Impl& m = *impl_;
  m.check_buffer(data, count, "send");
  if (dst < 0 || dst >= m.size || dst == m.rank) {
    throw UsageError(m.me() + ": send: destination " + std::to_string(dst) + " must be another rank of this group of size " +
                     std::to_string(m.size));
  }
  const size_t bytes = count * element_size(dtype);
  return m.enqueue(OpType::kSend, dtype, ReduceOp::kSum, count, tag,
                   [&m, data, bytes, dst](WorkImpl&, const Call& c) {
                     m.transport->send(dst, wire::make_header(c, bytes), data, bytes);
                     m.transport->wait_all();
                   }, dst);
}

std::shared_ptr<Work> ProcessGroup::recv(void* data, size_t count, DataType dtype, int src, int tag) {
  Impl& m = *impl_;
  m.check_buffer(data, count, "recv");
  if (src < 0 || src >= m.size || src == m.rank) {
    throw UsageError(m.me() + ": recv: source " + std::to_string(src) + " must be another rank of this group of size " +
                     std::to_string(m.size));
  }
  const size_t bytes = count * element_size(dtype);
  return m.enqueue(OpType::kRecv, dtype, ReduceOp::kSum, count, tag,
                   [&m, data, bytes, src](WorkImpl&, const Call& c) {
                     m.transport->wait(m.transport->recv(src, c, data, bytes));
                   }, src);
}

namespace {

class SharedBuffer final : public Buffer {
 public:
  explicit SharedBuffer(std::shared_ptr<transport::SharedRegion> r) : r_(std::move(r)) {}
  void* data() override { return r_->data(); }
  size_t size() const override { return r_->size(); }
  bool shared() const override { return true; }

 private:
  std::shared_ptr<transport::SharedRegion> r_;
};

class HeapBuffer final : public Buffer {
 public:
  explicit HeapBuffer(size_t bytes) : bytes_(bytes), p_(std::aligned_alloc(64, std::max<size_t>(64, (bytes + 63) / 64 * 64))) {
    if (p_ == nullptr) throw std::bad_alloc();
    std::memset(p_, 0, bytes_);
  }
  ~HeapBuffer() override { std::free(p_); }
  void* data() override { return p_; }
  size_t size() const override { return bytes_; }
  bool shared() const override { return false; }

 private:
  size_t bytes_;
  void* p_;
};

}  // namespace

std::shared_ptr<Buffer> ProcessGroup::allocate_buffer(size_t bytes) {
  Impl& m = *impl_;
  auto region = std::make_shared<std::shared_ptr<transport::SharedRegion>>();
  auto work = m.enqueue(OpType::kAllocateBuffer, DataType::kUInt8, ReduceOp::kSum, bytes, 0,
                        [&m, region, bytes](WorkImpl&, const Call&) {
    if (m.size > 1 && m.native != nullptr) *region = m.native->allocate_shared(bytes);
  });
  work->wait();
  if (*region) return std::make_shared<SharedBuffer>(std::move(*region));
  return std::make_shared<HeapBuffer>(bytes);
}

// The object collectives send from buffers of their own. They live in state the task owns, not on
// the stack: after a failure the transport may still finish a message in flight from them.
struct ObjectState {
  std::string object;
  int64_t length = 0;
  std::vector<int64_t> lengths;
  std::string all;
};

std::shared_ptr<Work> ProcessGroup::all_gather_object(std::string object) {
  Impl& m = *impl_;
  auto st = std::make_shared<ObjectState>();
  st->object = std::move(object);
  return m.enqueue(OpType::kAllgatherObject, DataType::kUInt8, ReduceOp::kSum, 0, 0,
                   [&m, st](WorkImpl& w, const Call& c) {
    const size_t n = static_cast<size_t>(m.size);
    // First the sizes (int64 each), then the bytes back to back.
    st->lengths.assign(n, 0);
    st->length = static_cast<int64_t>(st->object.size());
    Call sc = c;
    sc.dtype = DataType::kInt64;
    sc.count = n;
    algo::allgatherv(*m.transport, sc, &st->length, st->lengths.data(), std::vector<size_t>(n, sizeof(int64_t)));
    std::vector<size_t> sizes(n);
    size_t total = 0;
    for (size_t i = 0; i < n; ++i) {
      sizes[i] = static_cast<size_t>(st->lengths[i]);
      total += sizes[i];
    }
    st->all.assign(total, '\0');
    Call dc = c;
    dc.count = total;
    algo::allgatherv(*m.transport, dc, st->object.data(), st->all.data(), sizes);
    w.objects_.clear();
    size_t off = 0;
    for (size_t i = 0; i < n; ++i) {
      w.objects_.push_back(st->all.substr(off, sizes[i]));
      off += sizes[i];
    }
  });
}

std::shared_ptr<Work> ProcessGroup::broadcast_object(std::string object, int root) {
  Impl& m = *impl_;
  m.check_root(root, "broadcast_object");
  auto st = std::make_shared<ObjectState>();
  st->object = std::move(object);
  return m.enqueue(OpType::kBroadcastObject, DataType::kUInt8, ReduceOp::kSum, 0, root,
                   [&m, st, root](WorkImpl& w, const Call& c) {
    st->length = static_cast<int64_t>(st->object.size());
    Call sc = c;
    sc.dtype = DataType::kInt64;
    sc.count = 1;
    algo::broadcast(*m.transport, m.tune, sc, &st->length, sizeof(st->length), root);
    if (m.rank != root) st->object.assign(static_cast<size_t>(st->length), '\0');
    Call dc = c;
    dc.count = static_cast<uint64_t>(st->length);
    algo::broadcast(*m.transport, m.tune, dc, st->object.data(), st->object.size(), root);
    w.objects_.assign(1, st->object);
  });
}

std::shared_ptr<ProcessGroup> ProcessGroup::new_group(const std::vector<int>& ranks) {
  Impl& m = *impl_;
  std::set<int> unique(ranks.begin(), ranks.end());
  if (ranks.empty() || unique.size() != ranks.size() || *unique.begin() < 0 || *unique.rbegin() >= m.size) {
    throw UsageError(m.me() + ": new_group: ranks must be distinct members of this group [0, " +
                     std::to_string(m.size) + ") and not empty");
  }
  int id;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    id = m.next_group_id++;
  }
  int my_index = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] == m.rank) my_index = static_cast<int>(i);
  }
  if (my_index < 0) return nullptr;
  ProcessGroupOptions o = m.opts;
  o.group_name = m.opts.group_name + "/" + std::to_string(id);
  return std::make_shared<ProcessGroup>(m.store, my_index, static_cast<int>(ranks.size()), o);
}

std::shared_ptr<ProcessGroup> connect_process_group(const std::string& init_method, int rank, int world_size,
                                                    ProcessGroupOptions options) {
  RendezvousOptions ro;
  ro.timeout = options.timeout;
  Rendezvous rv = rendezvous(init_method, rank, world_size, ro);
  // Make sure uncaught exceptions reach chorus run's report (signals.cc also installs it when the
  // program starts, for exceptions thrown before any chorus call).
  if (!rv.error_file.empty()) install_error_file_handler(rv.error_file.c_str(), rv.rank);
  // A launcher that restarts a job gives each attempt its own key space in the shared store, so a
  // new attempt never reads the addresses an earlier one published.
  if (!rv.store_prefix.empty()) rv.store = std::make_shared<PrefixStore>(rv.store_prefix, rv.store);
  // CHORUS_TRANSPORT replaces the automatic choice; a transport the caller named stays.
  if (options.transport == "auto" && !rv.transport.empty()) options.transport = rv.transport;
  if (options.token.empty()) options.token = rv.token;
  if (options.advertise_host.empty()) options.advertise_host = rv.local_address;
  return std::make_shared<ProcessGroup>(rv.store, rv.rank, rv.world_size, options);
}

}  // namespace chorus
