// ProcessGroup: construction (the transport chosen and connected, the setup keys released), the
// worker thread that runs the queue of operations in issue order, shutdown, and subgroups. The
// operations themselves (argument checks, then a task on the queue) are process_group_ops.cc; the
// state both share is process_group_impl.h.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "chorus/comm/error.h"
#include "chorus/comm/log.h"
#include "chorus/comm/rendezvous.h"
#include "chorus/comm/signals.h"
#include "error_class.h"
#include "measured_allreduce.h"
#include "plan.h"
#include "process_group_impl.h"

namespace chorus {
namespace {

using detail::Task;
using detail::WorkImpl;
using transport::error_class_of;
using transport::make_error;

}  // namespace

std::exception_ptr ProcessGroup::Impl::not_run(const std::string& what) const {
  return make_error(broken_class, me() + ": " + what + " not run: the process group is broken since an earlier "
                                                       "operation failed: " + broken_msg);
}

std::shared_ptr<Work> ProcessGroup::Impl::enqueue(wire::OpType op, DataType dtype, ReduceOp rop, uint64_t count,
                                                  int64_t arg, std::function<void(WorkImpl&, const wire::Call&)> run,
                                                  int p2p_peer,
                                                  std::function<transport::Ticket(const wire::Call&)> post) {
  std::unique_lock<std::mutex> lock(mu);
  if (stopping) throw transport::Ranked<UsageError>(me() + ": " + wire::op_name(op) + " called on a process group that was shut down");
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
    work->finish(not_run(wire::describe(call)));
    return work;
  }
  const bool p2p = op == wire::OpType::kSend || op == wire::OpType::kRecv;
  if (!p2p) release_locked();  // a collective runs after the held run: let that go first
  Task task;
  task.work = work;
  task.call = call;
  task.run = std::move(run);
  task.post = std::move(post);
  task.peer = p2p_peer;
  task.held = p2p && holding;
  if (task.held) any_held.store(true, std::memory_order_release);
  queue.push_back(std::move(task));
  lock.unlock();
  cv.notify_one();
  return work;
}

std::shared_ptr<Work> ProcessGroup::Impl::enqueue_p2p(wire::OpType op, DataType dtype, uint64_t count, int64_t tag,
                                                      int peer, std::function<transport::Ticket(const wire::Call&)> post) {
  return enqueue(op, dtype, ReduceOp::kSum, count, tag, nullptr, peer, std::move(post));
}

std::shared_ptr<Work> ProcessGroup::Impl::enqueue_recv_any(DataType dtype, uint64_t count, int64_t tag,
                                                          std::function<void(WorkImpl&, const wire::Call&)> run) {
  std::unique_lock<std::mutex> lock(mu);
  if (stopping) throw transport::Ranked<UsageError>(me() + ": recv called on a process group that was shut down");
  wire::Call call;
  call.op = wire::OpType::kRecv;
  call.dtype = dtype;
  call.count = count;
  call.arg = tag;
  auto work = std::make_shared<WorkImpl>("rank " + std::to_string(rank) + ": recv from any source (tag " +
                                             std::to_string(tag) + ")", this);
  if (broken.load(std::memory_order_acquire)) {
    work->finish(not_run("recv from any source"));
    return work;
  }
  release_locked();  // it runs alone, after any held sends and recvs: let them go first
  Task task;
  task.work = work;
  task.call = call;
  task.run = std::move(run);
  queue.push_back(std::move(task));
  lock.unlock();
  cv.notify_one();
  return work;
}

uint64_t ProcessGroup::Impl::take_recv_seq(int src) {
  std::lock_guard<std::mutex> lock(mu);
  uint64_t later = 0;
  for (auto& t : queue) {
    if (t.call.op == wire::OpType::kRecv && t.peer == src) {
      ++t.call.seq;
      ++later;
    }
  }
  return recv_seq[static_cast<size_t>(src)]++ - later;
}

void ProcessGroup::Impl::release_locked() {
  holding = false;
  if (!any_held.exchange(false, std::memory_order_acq_rel)) return;
  for (auto& t : queue) t.held = false;
}

void ProcessGroup::Impl::release_held(const WorkImpl* work) {
  if (!any_held.load(std::memory_order_acquire)) return;
  {
    std::lock_guard<std::mutex> lock(mu);
    const bool waited_for = work == nullptr || std::any_of(queue.begin(), queue.end(), [&](const Task& t) {
      return t.held && t.work.get() == work;
    });
    if (!waited_for) return;
    release_locked();
  }
  cv.notify_all();
}

std::vector<Task> ProcessGroup::Impl::take_next() {
  std::vector<Task> run;
  if (!front_runnable()) return run;
  const auto is_p2p = [](const Task& t) { return static_cast<bool>(t.post); };
  run.push_back(std::move(queue.front()));
  queue.pop_front();
  if (!is_p2p(run.front())) return run;
  while (front_runnable() && is_p2p(queue.front())) {
    run.push_back(std::move(queue.front()));
    queue.pop_front();
  }
  return run;
}

void ProcessGroup::Impl::execute_all(std::vector<Task>& tasks) {
  if (tasks.size() == 1 && !tasks.front().post) {
    execute(tasks.front());
  } else {
    execute_p2p(tasks);
  }
}

void ProcessGroup::Impl::execute_p2p(std::vector<Task>& run) {
  if (broken.load(std::memory_order_acquire)) {
    for (auto& t : run) {
      t.work->finish(not_run(wire::describe(t.call)));
    }
    return;
  }
  try {
    for (auto& t : run) t.work->started();
    // One deadline for the run; the transport names the first operation in its errors, and every
    // message carries its own call, so a mismatch still names the pair that disagrees.
    transport->begin(run.front().call, net::deadline_after(opts.timeout));
    for (auto& t : run) t.post(t.call);
    transport->wait_all();
    for (auto& t : run) t.work->finish(nullptr);
  } catch (const std::exception& e) {
    break_group(e);
    for (auto& t : run) t.work->finish(std::current_exception());
  }
}

std::shared_ptr<Work> ProcessGroup::Impl::enqueue_local(std::string what, std::function<void()> fn) {
  std::unique_lock<std::mutex> lock(mu);
  if (stopping) throw transport::Ranked<UsageError>(me() + ": " + what + " called on a process group that was shut down");
  auto work = std::make_shared<WorkImpl>("rank " + std::to_string(rank) + ": " + what, this);
  if (broken.load(std::memory_order_acquire)) {
    work->finish(not_run(what));
    return work;
  }
  release_locked();  // it runs after any held sends and recvs: let them go first
  Task task;
  task.work = work;
  task.call.op = wire::OpType::kBarrier;  // not sent: local tasks never reach the transport
  task.run = [fn = std::move(fn)](WorkImpl&, const wire::Call&) { fn(); };
  task.local = true;
  queue.push_back(std::move(task));
  lock.unlock();
  cv.notify_one();
  return work;
}

void ProcessGroup::Impl::break_group(const std::exception& e) {
  const uint8_t cls = error_class_of(e);
  broken_msg = e.what();
  broken_class = cls;
  broken.store(true, std::memory_order_release);
  transport->abort(e.what(), cls);
}

void ProcessGroup::Impl::execute(Task& task) {
  if (task.local && broken.load(std::memory_order_acquire)) {
    task.work->finish(not_run("a local step"));
    return;
  }
  if (broken.load(std::memory_order_acquire)) {
    task.work->finish(not_run(wire::describe(task.call)));
    return;
  }
  try {
    task.work->started();
    if (!task.local) transport->begin(task.call, net::deadline_after(opts.timeout));
    task.run(*task.work, task.call);
    task.work->finish(nullptr);
  } catch (const std::exception& e) {
    break_group(e);
    task.work->finish(std::current_exception());
  }
}

bool ProcessGroup::Impl::run_inline(const WorkImpl* work) {
  std::unique_lock<std::mutex> lock(mu);
  if (running || !front_runnable()) return false;
  // The waited-for operation must be next: the front task, or one of the run of sends and recvs
  // that starts there (they run together).
  bool next = false;
  for (const auto& t : queue) {
    if (t.work.get() == work) {
      next = true;
      break;
    }
    if (!t.post || t.held || !queue.front().post) break;
  }
  if (!next) return false;
  std::vector<Task> tasks = take_next();
  running = true;
  lock.unlock();
  execute_all(tasks);
  lock.lock();
  running = false;
  lock.unlock();
  // The worker may be waiting for this run to end: to take the next operation, or to stop.
  cv.notify_all();
  return true;
}

void ProcessGroup::Impl::loop() {
  for (;;) {
    std::vector<Task> tasks;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return (stopping && !running) || (front_runnable() && !running); });
      if (stopping && !running) release_locked();  // shutdown finishes held work too
      if (queue.empty()) return;
      tasks = take_next();
      running = true;
    }
    execute_all(tasks);
    {
      std::lock_guard<std::mutex> lock(mu);
      running = false;
    }
  }
}

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

// options.tcp_connections (or CHORUS_TCP_CONNECTIONS in its "auto"'s place): lazy or the full mesh.
bool lazy_connections(const ProcessGroupOptions& options, int size) {
  std::string name = options.tcp_connections;
  const char* env = std::getenv("CHORUS_TCP_CONNECTIONS");
  const bool from_env = name == "auto" && env != nullptr && *env != '\0';
  if (from_env) name = env;
  if (name == "auto") return plan::lazy_connections_by_default(size);
  if (name == "lazy" || name == "eager") return name == "lazy";
  throw UsageError(std::string("chorus: unknown tcp_connections '") + printable(name) + "'" +
                   (from_env ? " in CHORUS_TCP_CONNECTIONS" : "") + "; available: auto, eager, lazy");
}

// CHORUS_LINK_LATENCY_US or CHORUS_LINK_GBIT, the link "auto" plans for when the options leave it
// at 0: 0 when unset or empty, else a finite number above 0 (anything else is a UsageError naming
// the variable, the value and what it means).
double link_figure_from_env(const char* name, const char* meaning) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return 0;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(env, &end);
  while (end != nullptr && (*end == ' ' || *end == '\t')) ++end;
  if (end == env || *end != '\0' || errno != 0 || !std::isfinite(v) || v <= 0) {
    throw UsageError(std::string("chorus: ") + name + "='" + printable(env) + "' is not a positive number; it is " +
                     meaning + " (unset it for chorus's measured default; docs/algorithms.md, \"Telling the plan the link\")");
  }
  return v;
}

// CHORUS_HYBRID_ALLREDUCE (auto, hierarchical, flat): how the hybrid transport's allreduce crosses
// hosts; for benchmarks and tests.
plan::Hierarchy hierarchy_from_env() {
  plan::Hierarchy h = plan::Hierarchy::kAuto;
  const char* env = std::getenv("CHORUS_HYBRID_ALLREDUCE");
  if (env != nullptr && *env != '\0' && !plan::parse_hierarchy(env, &h)) {
    throw UsageError(std::string("chorus: unknown hybrid allreduce '") + printable(env) +
                     "' in CHORUS_HYBRID_ALLREDUCE; available: auto, hierarchical, flat");
  }
  return h;
}

// The transport `kind` (from options.transport); kAuto looks at which ranks share a host.
// `measured`: the group's MeasuredAllreduce when its allreduce is "tuned" (the hybrid's rails share it).
std::unique_ptr<transport::Transport> make_transport(Store* store, const transport::TcpOptions& to,
                                                     const ProcessGroupOptions& options, TransportKind kind, int size,
                                                     std::shared_ptr<algo::MeasuredAllreduce> measured) {
  const std::string mine = options.host_id.empty() ? transport::host_identity() : options.host_id;
  transport::ShmOptions so;
  so.host_id = mine;
  so.group_name = options.group_name;
  so.token = options.token;
  so.deadline = to.deadline;
  so.collective_bytes = options.shm_chunk_bytes;
  so.small_bytes = options.shm_small_bytes;
  so.spin_us = options.spin_us >= 0 ? options.spin_us
                                    : plan::default_spin_us(TransportKind::kShm, size, std::thread::hardware_concurrency());
  if (size == 1) kind = TransportKind::kTcp;  // nothing to connect
  if (kind == TransportKind::kAuto) {
    // Every rank says where it is and how much /dev/shm its host has free.
    const auto all = transport::exchange_announcements(*store, to.key_prefix + "/auto", to.rank, size, to.token,
                                                       {mine, std::to_string(transport::shm_free_bytes())},
                                                       to.deadline);
    std::vector<std::pair<std::string, uint64_t>> hosts;
    for (const auto& a : all) hosts.emplace_back(a.host, std::stoull(a.extra.empty() ? "0" : a.extra));
    const plan::AutoTransport choice =
        plan::choose_auto_transport(hosts, [&](int n) { return static_cast<uint64_t>(n) * transport::shm_segment_bytes(so, n); });
    if (!choice.short_host.empty() && to.rank == 0) {
      chorus::log(LogLevel::kWarning, "group '" + options.group_name + "': /dev/shm on host " + choice.short_host +
                                          " has " + std::to_string(choice.short_free) + " bytes free but its " +
                                          std::to_string(choice.short_ranks) + " ranks need " +
                                          std::to_string(choice.short_need) +
                                          " for shared memory; using tcp (in a container, raise --shm-size)");
    }
    kind = choice.kind;
  }
  if (kind == TransportKind::kShm) {
    so.store = store;
    so.key_prefix = to.key_prefix;
    so.rank = to.rank;
    so.size = size;
    return transport::make_shm_transport(so);
  }
  if (kind == TransportKind::kHybrid) {
    transport::HybridOptions ho;
    ho.tcp = to;
    ho.shm = so;
    ho.host_id = mine;
    ho.spin_by_local_size = options.spin_us < 0;  // the ranks that share cores are this host's
    ho.segment_bytes = options.segment_bytes;
    const algo::Tuning tune = detail::tuning_for(options, TransportKind::kTcp);  // across hosts: TCP
    ho.allreduce = tune.allreduce;
    ho.link = tune.link;
    ho.measured = std::move(measured);
    ho.hierarchy = hierarchy_from_env();
    return transport::make_hybrid_transport(ho);
  }
  return transport::make_tcp_transport(to);
}

}  // namespace

algo::Tuning detail::tuning_for(const ProcessGroupOptions& options, TransportKind kind) {
  algo::Tuning t;
  t.segment_bytes = std::max<size_t>(options.segment_bytes, 1);
  std::string name = options.allreduce_algorithm;
  const char* env = std::getenv("CHORUS_ALLREDUCE_ALGORITHM");
  const bool from_env = name == "auto" && env != nullptr && *env != '\0';
  if (from_env) name = env;
  if (!parse_allreduce_algorithm(name, &t.allreduce)) {
    throw UsageError(std::string("chorus: unknown allreduce algorithm '") + printable(name) + "'" +
                     (from_env ? " in CHORUS_ALLREDUCE_ALGORITHM" : "") +
                     "; available: auto, ring, recursive_doubling, rabenseifner, tuned");
  }
  if (const char* b = std::getenv("CHORUS_BROADCAST_ALGORITHM"); b != nullptr && *b != '\0') {
    if (!plan::parse_broadcast_shape(b, &t.broadcast)) {
      throw UsageError(std::string("chorus: unknown broadcast algorithm '") + printable(b) +
                       "' in CHORUS_BROADCAST_ALGORITHM; available: auto, binomial, chain");
    }
  }
  if (options.link_latency_us < 0 || options.link_gbit_per_s < 0) {
    throw UsageError("chorus: link_latency_us and link_gbit_per_s must be 0 (measured default) or positive");
  }
  const double latency_us = options.link_latency_us > 0
                                ? options.link_latency_us
                                : link_figure_from_env("CHORUS_LINK_LATENCY_US", "one message's latency in microseconds, e.g. 20");
  const double gbit_per_s = options.link_gbit_per_s > 0
                                ? options.link_gbit_per_s
                                : link_figure_from_env("CHORUS_LINK_GBIT", "the link's bandwidth in Gbit/s, e.g. 10 for 10 GbE");
  t.link = plan::default_link_model(kind, latency_us, gbit_per_s);
  return t;
}


ProcessGroup::ProcessGroup(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options)
    : impl_(std::make_unique<Impl>()) {
  if (!store) throw UsageError("chorus: ProcessGroup needs a store");
  if (size < 1 || rank < 0 || rank >= size) {
    throw UsageError("chorus: invalid rank " + std::to_string(rank) + " for world size " + std::to_string(size) +
                     "; rank must be in [0, world_size)");
  }
  TransportKind kind = TransportKind::kAuto;
  if (!parse_transport(options.transport, &kind) || kind == TransportKind::kMpi) {
    throw UsageError("chorus: unknown transport '" + options.transport + "'; available: tcp, shm, hybrid, auto (for mpi, connect_mpi_process_group in "
                     "chorus/comm/mpi.h, or init_process_group(\"mpi\"))");
  }
  // A bad algorithm name fails here, before setup.
  if (detail::tuning_for(options, TransportKind::kTcp).allreduce == AllreduceAlgorithm::kTuned) {
    impl_->measured = std::make_shared<algo::MeasuredAllreduce>(rank == 0);
  }
  lazy_connections(options, size);                   // and so does a bad tcp_connections
  hierarchy_from_env();                              // or CHORUS_HYBRID_ALLREDUCE
  Impl& m = *impl_;
  m.store = std::move(store);
  m.opts = options;

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
  to.lazy_connections = lazy_connections(options, size);
  to.spin_us = options.spin_us >= 0 ? options.spin_us
                                    : plan::default_spin_us(TransportKind::kTcp, size, std::thread::hardware_concurrency());
  std::unique_ptr<transport::Transport> t;
  try {
    RecordingStore recording(*m.store);
    to.store = &recording;  // the transports read the store during setup only
    t = make_transport(&recording, to, options, kind, size, m.measured);
    if (size > 1) release_setup_keys(*m.store, to.key_prefix, rank, size, recording.written());
  } catch (const std::exception& e) {
    // Name the rank and group on every setup error (store, connect, handshake, accept) that does
    // not name this rank already.
    if (transport::names_rank(e)) throw;
    const std::string prefix = "chorus: rank " + std::to_string(rank) + ": group '" + options.group_name + "' setup: ";
    std::rethrow_exception(make_error(error_class_of(e), prefix + e.what()));
  }
  m.start(this, std::move(t));
}

void ProcessGroup::Impl::start(ProcessGroup* pg, std::unique_ptr<transport::Transport> t) {
  transport = std::move(t);
  rank = transport->rank();
  size = transport->size();
  TransportKind kind = TransportKind::kTcp;
  parse_transport(transport->kind(), &kind);
  tune = detail::tuning_for(opts, kind);
  if (tune.allreduce == AllreduceAlgorithm::kAuto) tune.cores = std::make_shared<algo::SharedCores>();
  if (tune.allreduce == AllreduceAlgorithm::kTuned) {
    if (!measured) measured = std::make_shared<algo::MeasuredAllreduce>(rank == 0);
    tune.measured = measured;
  }
  send_seq.assign(static_cast<size_t>(size), 0);
  recv_seq.assign(static_cast<size_t>(size), 0);
  transport->set_spin_gate(&waiters);
  native = transport->native();
  worker = std::thread([pg] { pg->impl_->loop(); });
}

std::shared_ptr<ProcessGroup> ProcessGroup::Impl::adopt(std::unique_ptr<transport::Transport> t,
                                                        std::shared_ptr<Store> store, ProcessGroupOptions options) {
  std::shared_ptr<ProcessGroup> pg(new ProcessGroup());
  pg->impl_ = std::make_unique<Impl>();
  pg->impl_->store = std::move(store);
  pg->impl_->opts = std::move(options);
  pg->impl_->start(pg.get(), std::move(t));
  return pg;
}

ProcessGroup::~ProcessGroup() { shutdown(); }

void ProcessGroup::hold_p2p() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->holding = true;
}

void ProcessGroup::release_p2p() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->release_locked();
  }
  impl_->cv.notify_all();
}

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
std::vector<TunedAllreduce> ProcessGroup::tuned_allreduce() const {
  return impl_->measured ? impl_->measured->decided() : std::vector<TunedAllreduce>{};
}
void ProcessGroup::keep_tuned_allreduce(const std::vector<TunedAllreduce>& decisions) {
  if (impl_->measured) {
    impl_->measured->keep(decisions);
  } else {
    algo::MeasuredAllreduce(false).keep(decisions);  // the same checks, with nothing to keep them for
  }
}

using algo::Scratch;
using wire::Call;
using wire::OpType;

std::shared_ptr<ProcessGroup> ProcessGroup::new_group(const std::vector<int>& ranks) {
  return new_group(ranks, impl_->opts);
}

std::shared_ptr<ProcessGroup> ProcessGroup::new_group(const std::vector<int>& ranks, ProcessGroupOptions options) {
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
  ProcessGroupOptions o = std::move(options);
  o.transport = m.opts.transport;
  o.host_id = m.opts.host_id;
  o.token = m.opts.token;
  o.advertise_host = m.opts.advertise_host;
  o.group_name = m.opts.group_name + "/" + std::to_string(id);
  if (m.transport->makes_subgroups()) {
    // A collective over this group, in order with its other operations; non-members take part.
    auto sub = std::make_shared<std::unique_ptr<transport::Transport>>();
    m.enqueue(OpType::kNewGroup, DataType::kInt32, ReduceOp::kSum, ranks.size(), 0,
              [&m, sub, ranks, name = o.group_name](WorkImpl&, const Call&) {
                *sub = m.transport->subgroup(ranks, name);
              })->wait();
    if (!*sub) return nullptr;
    return Impl::adopt(std::move(*sub), m.store, o);
  }
  if (my_index < 0) return nullptr;
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
