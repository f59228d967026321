// ProcessGroup's operations: the collectives, point-to-point send and recv, buffers for repeated
// allreduces, and the object collectives. Each checks its arguments on the calling thread, then
// enqueues a task that runs the algorithm (or the transport's native collective) in issue order;
// the queue and the worker are process_group.cc.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include "chorus/comm/error.h"
#include "process_group_impl.h"

namespace chorus {
namespace {

using detail::WorkImpl;

}  // namespace

using algo::Scratch;
using wire::Call;
using wire::OpType;

std::shared_ptr<Work> ProcessGroup::run_local(std::string what, std::function<void()> fn) {
  if (!fn) throw UsageError(impl_->me() + ": run_local(" + what + "): the function is empty");
  return impl_->enqueue_local(std::move(what), std::move(fn));
}

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
    if (m.size > 1 && m.native != nullptr && m.native->reduce(data, count, dtype, op, root)) return;
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
                     if (m.size > 1 && m.native != nullptr && m.native->allgatherv(in, out, sizes)) return;
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
    if (m.size > 1 && m.native != nullptr && m.native->gather(in, out, bytes, root)) return;
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
    if (m.size > 1 && m.native != nullptr && m.native->scatter(in, out, bytes, root)) return;
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
    if (m.size > 1 && m.native != nullptr && m.native->reduce_scatter(in, out, count, dtype, op)) return;
    algo::reduce_scatter(*m.transport, m.scratch, m.tune, c, in, out, count, dtype, op);
  });
}

std::shared_ptr<Work> ProcessGroup::alltoall(const void* in, void* out, size_t count, DataType dtype) {
  Impl& m = *impl_;
  m.check_buffer(in, count, "alltoall");
  m.check_buffer(out, count, "alltoall");
  const size_t bytes = count * element_size(dtype);
  return m.enqueue(OpType::kAlltoall, dtype, ReduceOp::kSum, count, 0, [&m, in, out, bytes](WorkImpl&, const Call& c) {
    if (m.size > 1 && m.native != nullptr && m.native->alltoall(in, out, bytes)) return;
    algo::alltoall(*m.transport, c, in, out, bytes);
  });
}

std::shared_ptr<Work> ProcessGroup::barrier() {
  Impl& m = *impl_;
  return m.enqueue(OpType::kBarrier, DataType::kUInt8, ReduceOp::kSum, 0, 0, [&m](WorkImpl&, const Call& c) {
    if (m.size > 1 && m.native != nullptr && m.native->barrier()) return;
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
  return m.enqueue_p2p(OpType::kSend, dtype, count, tag, dst, [&m, data, bytes, dst](const Call& c) {
    return m.transport->send(dst, wire::make_header(c, bytes), data, bytes);
  });
}

std::shared_ptr<Work> ProcessGroup::recv(void* data, size_t count, DataType dtype, int src, int tag) {
  Impl& m = *impl_;
  m.check_buffer(data, count, "recv");
  if (src < 0 || src >= m.size || src == m.rank) {
    throw UsageError(m.me() + ": recv: source " + std::to_string(src) + " must be another rank of this group of size " +
                     std::to_string(m.size));
  }
  const size_t bytes = count * element_size(dtype);
  return m.enqueue_p2p(OpType::kRecv, dtype, count, tag, src, [&m, data, bytes, src](const Call& c) {
    return m.transport->recv(src, c, data, bytes);
  });
}

std::shared_ptr<Work> ProcessGroup::recv_any(void* data, size_t count, DataType dtype, int tag) {
  Impl& m = *impl_;
  m.check_buffer(data, count, "recv");
  if (m.size < 2) throw UsageError(m.me() + ": recv from any source in a group of one rank: no other rank can send");
  if (!m.transport->can_probe()) {
    throw UsageError(m.me() + ": recv from any source is not available over the " + m.transport->kind() +
                     " transport (it cannot look at a message before taking it); name the sender, or use the tcp, "
                     "shm or hybrid transport");
  }
  const size_t bytes = count * element_size(dtype);
  return m.enqueue_recv_any(dtype, count, tag, [&m, data, bytes, tag](detail::WorkImpl& work, const Call& c) {
    std::vector<int> others;
    for (int r = 0; r < m.size; ++r) {
      if (r != m.rank) others.push_back(r);
    }
    const int src = m.transport->probe_any(others, tag);
    Call numbered = c;
    numbered.seq = m.take_recv_seq(src);
    m.transport->wait(m.transport->recv(src, numbered, data, bytes));
    work.set_source(src);
  });
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

namespace {

std::shared_ptr<ObjectState> holding(std::string object) {
  auto st = std::make_shared<ObjectState>();
  st->object = std::move(object);
  return st;
}

// The call of an object collective's first step, which exchanges lengths (int64 each).
Call lengths_call(const Call& c, uint64_t count) {
  Call sc = c;
  sc.dtype = DataType::kInt64;
  sc.count = count;
  return sc;
}

std::vector<size_t> to_sizes(const std::vector<int64_t>& lengths) {
  return std::vector<size_t>(lengths.begin(), lengths.end());
}

// Cuts `all` into blocks of `sizes` bytes, back to back.
std::vector<std::string> split_objects(const std::string& all, const std::vector<size_t>& sizes) {
  std::vector<std::string> out;
  out.reserve(sizes.size());
  size_t off = 0;
  for (size_t n : sizes) {
    out.push_back(all.substr(off, n));
    off += n;
  }
  return out;
}

}  // namespace

std::shared_ptr<Work> ProcessGroup::all_gather_object(std::string object) {
  Impl& m = *impl_;
  auto st = holding(std::move(object));
  return m.enqueue(OpType::kAllgatherObject, DataType::kUInt8, ReduceOp::kSum, 0, 0,
                   [&m, st](WorkImpl& w, const Call& c) {
    const size_t n = static_cast<size_t>(m.size);
    // First the sizes (int64 each), then the bytes back to back.
    st->lengths.assign(n, 0);
    st->length = static_cast<int64_t>(st->object.size());
    algo::allgatherv(*m.transport, lengths_call(c, n), &st->length, st->lengths.data(),
                     std::vector<size_t>(n, sizeof(int64_t)));
    const std::vector<size_t> sizes = to_sizes(st->lengths);
    size_t total = 0;
    for (size_t b : sizes) total += b;
    st->all.assign(total, '\0');
    Call dc = c;
    dc.count = total;
    algo::allgatherv(*m.transport, dc, st->object.data(), st->all.data(), sizes);
    w.objects_ = split_objects(st->all, sizes);
  });
}

std::shared_ptr<Work> ProcessGroup::broadcast_object(std::string object, int root) {
  Impl& m = *impl_;
  m.check_root(root, "broadcast_object");
  auto st = holding(std::move(object));
  return m.enqueue(OpType::kBroadcastObject, DataType::kUInt8, ReduceOp::kSum, 0, root,
                   [&m, st, root](WorkImpl& w, const Call& c) {
    st->length = static_cast<int64_t>(st->object.size());
    algo::broadcast(*m.transport, m.tune, lengths_call(c, 1), &st->length, sizeof(st->length), root);
    if (m.rank != root) st->object.assign(static_cast<size_t>(st->length), '\0');
    Call dc = c;
    dc.count = static_cast<uint64_t>(st->length);
    algo::broadcast(*m.transport, m.tune, dc, st->object.data(), st->object.size(), root);
    w.objects_.assign(1, st->object);
  });
}

std::shared_ptr<Work> ProcessGroup::gather_object(std::string object, int root) {
  Impl& m = *impl_;
  m.check_root(root, "gather_object");
  auto st = holding(std::move(object));
  return m.enqueue(OpType::kGatherObject, DataType::kUInt8, ReduceOp::kSum, 0, root,
                   [&m, st, root](WorkImpl& w, const Call& c) {
    const size_t n = static_cast<size_t>(m.size);
    // Root learns every rank's length, then receives the bytes into one buffer.
    st->length = static_cast<int64_t>(st->object.size());
    st->lengths.assign(n, 0);
    algo::gather(*m.transport, lengths_call(c, 1), &st->length, st->lengths.data(), sizeof(int64_t), root);
    std::vector<size_t> sizes(n, 0);
    if (m.rank == root) {
      sizes = to_sizes(st->lengths);
    } else {
      sizes[static_cast<size_t>(m.rank)] = st->object.size();
    }
    size_t total = 0;
    if (m.rank == root) {
      for (size_t b : sizes) total += b;
    }
    st->all.assign(total, '\0');
    algo::gatherv(*m.transport, c, st->object.data(), st->all.data(), sizes, root);
    w.objects_.clear();
    if (m.rank == root) w.objects_ = split_objects(st->all, sizes);
  });
}

std::shared_ptr<Work> ProcessGroup::scatter_object(std::vector<std::string> objects, int root) {
  Impl& m = *impl_;
  m.check_root(root, "scatter_object");
  auto st = std::make_shared<ObjectState>();
  const size_t n = static_cast<size_t>(m.size);
  if (m.rank == root) {
    if (objects.size() != n) {
      throw UsageError(m.me() + ": scatter_object: the root's objects has " + std::to_string(objects.size()) +
                       " entries; it needs one per rank (" + std::to_string(m.size) + ")");
    }
    for (const std::string& o : objects) {
      st->lengths.push_back(static_cast<int64_t>(o.size()));
      st->all += o;
    }
  }
  return m.enqueue(OpType::kScatterObject, DataType::kUInt8, ReduceOp::kSum, 0, root,
                   [&m, st, n, root](WorkImpl& w, const Call& c) {
    // Every rank learns its own length from root, then receives its bytes.
    algo::scatter(*m.transport, lengths_call(c, 1), st->lengths.data(), &st->length, sizeof(int64_t), root);
    std::vector<size_t> sizes(n, 0);
    if (m.rank == root) {
      sizes = to_sizes(st->lengths);
    } else {
      sizes[static_cast<size_t>(m.rank)] = static_cast<size_t>(st->length);
    }
    st->object.assign(sizes[static_cast<size_t>(m.rank)], '\0');
    algo::scatterv(*m.transport, c, st->all.data(), st->object.data(), sizes, root);
    w.objects_.assign(1, st->object);
  });
}

}  // namespace chorus
