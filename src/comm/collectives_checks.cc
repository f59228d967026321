// The collectives conformance suite's checks (collectives_checks.h).
#include "collectives_checks.h"

#include "chorus/comm/error.h"

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "reduce.h"

namespace chorus::conformance {
namespace {

const DataType kAllTypes[] = {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16,
                              DataType::kInt8,    DataType::kUInt8,   DataType::kInt32,   DataType::kInt64};
const ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax};

// Writes value v (a small integer, or a quotient for avg) as dtype into p[i].
void put(DataType t, void* p, size_t i, double v) {
  switch (t) {
    case DataType::kFloat32: static_cast<float*>(p)[i] = static_cast<float>(v); return;
    case DataType::kFloat64: static_cast<double*>(p)[i] = v; return;
    case DataType::kFloat16: static_cast<uint16_t*>(p)[i] = reduce::float_to_half(static_cast<float>(v)); return;
    case DataType::kBFloat16: static_cast<uint16_t*>(p)[i] = reduce::float_to_bf16(static_cast<float>(v)); return;
    case DataType::kInt8: static_cast<int8_t*>(p)[i] = static_cast<int8_t>(static_cast<int64_t>(v)); return;
    case DataType::kUInt8: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(static_cast<int64_t>(v)); return;
    case DataType::kInt32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(static_cast<int64_t>(v)); return;
    case DataType::kInt64: static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); return;
  }
}

double value(ReduceOp op, int rank, size_t i) {
  if (op == ReduceOp::kProd) return 1.0 + static_cast<double>((static_cast<size_t>(rank) + i) % 2);
  return static_cast<double>((static_cast<size_t>(rank) * 3 + i * 5) % 10);
}

double expected_value(DataType t, ReduceOp op, int world, size_t i) {
  double acc = value(op, 0, i);
  for (int r = 1; r < world; ++r) {
    double v = value(op, r, i);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg: acc += v; break;
      case ReduceOp::kProd: acc *= v; break;
      case ReduceOp::kMin: acc = std::min(acc, v); break;
      case ReduceOp::kMax: acc = std::max(acc, v); break;
    }
  }
  if (op == ReduceOp::kAvg) {
    if (t == DataType::kFloat32 || t == DataType::kFloat16 || t == DataType::kBFloat16) {
      return static_cast<double>(static_cast<float>(acc) / static_cast<float>(world));
    }
    if (t == DataType::kFloat64) return acc / world;
    return std::trunc(acc / world);
  }
  return acc;
}

struct Buf {
  std::vector<char> mem;
  char* p;
  // One element past the start: addresses that are not 16- or 64-byte aligned.
  Buf(size_t count, DataType t) : mem((count + 2) * element_size(t) + 64, 0) {
    p = mem.data() + element_size(t);
  }
};

void expect_equal(const std::string& what, DataType t, const void* got, const void* want, size_t count) {
  const size_t esz = element_size(t);
  for (size_t i = 0; i < count; ++i) {
    if (std::memcmp(static_cast<const char*>(got) + i * esz, static_cast<const char*>(want) + i * esz, esz) != 0) {
      std::ostringstream out;
      out << what << ": element " << i << " of " << count << " differs";
      throw std::runtime_error(out.str());
    }
  }
}

std::string label(const char* op, DataType t, size_t count, const char* extra = "") {
  std::ostringstream out;
  out << op << "(" << to_string(t) << " x " << count << (*extra ? ", " : "") << extra << ")";
  return out.str();
}

std::vector<size_t> sizes_for(int world) {
  std::vector<size_t> s = {0, 1, 7, 33, 1000, 4099};
  if (world > 2) s.push_back(static_cast<size_t>(world - 1));  // fewer elements than ranks
  return s;
}

void check_allreduce(ProcessGroup& pg, DataType t, ReduceOp op, size_t count) {
  Buf b(count, t), want(count, t);
  for (size_t i = 0; i < count; ++i) {
    put(t, b.p, i, value(op, pg.rank(), i));
    put(t, want.p, i, expected_value(t, op, pg.size(), i));
  }
  pg.allreduce(b.p, count, t, op)->wait();
  expect_equal(label("allreduce", t, count, to_string(op)), t, b.p, want.p, count);
}

void check_reduce(ProcessGroup& pg, DataType t, ReduceOp op, size_t count, int root) {
  Buf b(count, t), want(count, t), mine(count, t);
  for (size_t i = 0; i < count; ++i) {
    put(t, b.p, i, value(op, pg.rank(), i));
    put(t, mine.p, i, value(op, pg.rank(), i));
    put(t, want.p, i, expected_value(t, op, pg.size(), i));
  }
  pg.reduce(b.p, count, t, op, root)->wait();
  expect_equal(label("reduce", t, count), t, b.p, pg.rank() == root ? want.p : mine.p, count);
}

void check_broadcast(ProcessGroup& pg, DataType t, size_t count, int root) {
  Buf b(count, t), want(count, t);
  for (size_t i = 0; i < count; ++i) {
    put(t, want.p, i, value(ReduceOp::kSum, root, i));
    put(t, b.p, i, pg.rank() == root ? value(ReduceOp::kSum, root, i) : 99);
  }
  pg.broadcast(b.p, count, t, root)->wait();
  expect_equal(label("broadcast", t, count), t, b.p, want.p, count);
}

void check_allgather(ProcessGroup& pg, DataType t, size_t count) {
  const size_t n = static_cast<size_t>(pg.size());
  Buf in(count, t), out(count * n, t), want(count * n, t);
  for (size_t i = 0; i < count; ++i) put(t, in.p, i, value(ReduceOp::kSum, pg.rank(), i));
  for (size_t r = 0; r < n; ++r) {
    for (size_t i = 0; i < count; ++i) put(t, want.p, r * count + i, value(ReduceOp::kSum, static_cast<int>(r), i));
  }
  pg.allgather(in.p, out.p, count, t)->wait();
  expect_equal(label("allgather", t, count), t, out.p, want.p, count * n);
}

void check_allgatherv(ProcessGroup& pg, DataType t, size_t base) {
  const size_t n = static_cast<size_t>(pg.size());
  std::vector<size_t> counts(n);
  size_t total = 0;
  for (size_t r = 0; r < n; ++r) total += counts[r] = (base + r * 3) % 11;  // some ranks give 0
  Buf in(counts[static_cast<size_t>(pg.rank())], t), out(total, t), want(total, t);
  for (size_t i = 0; i < counts[static_cast<size_t>(pg.rank())]; ++i) put(t, in.p, i, value(ReduceOp::kSum, pg.rank(), i));
  size_t off = 0;
  for (size_t r = 0; r < n; ++r) {
    for (size_t i = 0; i < counts[r]; ++i) put(t, want.p, off + i, value(ReduceOp::kSum, static_cast<int>(r), i));
    off += counts[r];
  }
  pg.allgatherv(in.p, out.p, counts, t)->wait();
  expect_equal(label("allgatherv", t, total), t, out.p, want.p, total);
}

void check_gather_scatter(ProcessGroup& pg, DataType t, size_t count, int root) {
  const size_t n = static_cast<size_t>(pg.size());
  Buf in(count, t), out(count * n, t), want(count * n, t);
  for (size_t i = 0; i < count; ++i) put(t, in.p, i, value(ReduceOp::kSum, pg.rank(), i));
  for (size_t r = 0; r < n; ++r) {
    for (size_t i = 0; i < count; ++i) put(t, want.p, r * count + i, value(ReduceOp::kSum, static_cast<int>(r), i));
  }
  pg.gather(in.p, out.p, count, t, root)->wait();
  if (pg.rank() == root) expect_equal(label("gather", t, count), t, out.p, want.p, count * n);
  // Scatter it back: rank r gets block r, its own original input.
  Buf back(count, t);
  pg.scatter(want.p, back.p, count, t, root)->wait();
  expect_equal(label("scatter", t, count), t, back.p, in.p, count);
}

void check_reduce_scatter(ProcessGroup& pg, DataType t, ReduceOp op, size_t count) {
  const size_t n = static_cast<size_t>(pg.size());
  Buf in(count * n, t), out(count, t), want(count, t);
  for (size_t i = 0; i < count * n; ++i) put(t, in.p, i, value(op, pg.rank(), i));
  for (size_t i = 0; i < count; ++i) {
    put(t, want.p, i, expected_value(t, op, pg.size(), static_cast<size_t>(pg.rank()) * count + i));
  }
  pg.reduce_scatter(in.p, out.p, count, t, op)->wait();
  expect_equal(label("reduce_scatter", t, count, to_string(op)), t, out.p, want.p, count);
}

void check_alltoall(ProcessGroup& pg, DataType t, size_t count) {
  const size_t n = static_cast<size_t>(pg.size());
  Buf in(count * n, t), out(count * n, t), want(count * n, t);
  // Block j of rank r holds r * 10 + j (mod small range) + i.
  for (size_t j = 0; j < n; ++j) {
    for (size_t i = 0; i < count; ++i) {
      put(t, in.p, j * count + i, static_cast<double>((static_cast<size_t>(pg.rank()) * 10 + j + i) % 100));
      put(t, want.p, j * count + i, static_cast<double>((j * 10 + static_cast<size_t>(pg.rank()) + i) % 100));
    }
  }
  pg.alltoall(in.p, out.p, count, t)->wait();
  expect_equal(label("alltoall", t, count), t, out.p, want.p, count * n);
}

// Names in /dev/shm that belong to this process (chorus-<pidns>-<pid>-...).
std::vector<std::string> my_shm_names() {
  std::vector<std::string> out;
  const std::string tag = "-" + std::to_string(::getpid()) + "-";
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n.rfind("chorus-", 0) == 0 && n.find(tag) != std::string::npos) out.push_back(n);
    }
    ::closedir(d);
  }
  return out;
}

}  // namespace

void every_collective(ProcessGroup& pg_ref) {
  ProcessGroup* pg = &pg_ref;
  const int world = pg->size();
  for (DataType t : kAllTypes) {
    for (size_t count : sizes_for(world)) {
      for (ReduceOp op : kAllOps) {
        check_allreduce(*pg, t, op, count);
        if (count <= 33) check_reduce_scatter(*pg, t, op, count);
      }
      check_reduce(*pg, t, ReduceOp::kSum, count, world - 1);
      check_reduce(*pg, t, ReduceOp::kMax, count, 0);
      check_broadcast(*pg, t, count, 0);
      check_broadcast(*pg, t, count, world / 2);
      check_allgather(*pg, t, count);
      check_gather_scatter(*pg, t, count, world - 1);
      check_alltoall(*pg, t, std::min<size_t>(count, 40));
    }
    check_allgatherv(*pg, t, 4);
  }
  pg->barrier()->wait();
}

void every_allreduce(ProcessGroup& pg) {
  const size_t w = static_cast<size_t>(pg.size());
  std::vector<size_t> sizes = sizes_for(pg.size());
  for (size_t s : {w, w + 1, 2 * w + 1, size_t{65537}}) sizes.push_back(s);
  for (DataType t : kAllTypes) {
    for (size_t count : sizes) {
      for (ReduceOp op : kAllOps) check_allreduce(pg, t, op, count);
    }
  }
  pg.barrier()->wait();
}

void every_broadcast(ProcessGroup& pg) {
  for (int root = 0; root < pg.size(); ++root) {
    for (DataType t : {DataType::kUInt8, DataType::kFloat32, DataType::kFloat64}) {
      for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{97}, size_t{1000}, size_t{100003}}) {
        check_broadcast(pg, t, count, root);
      }
    }
  }
  pg.barrier()->wait();
}

void large_buffers(ProcessGroup& pg_ref) {
  ProcessGroup* pg = &pg_ref;
  const int w = pg->size();
  for (size_t count : {size_t{65536}, size_t{(1 << 20) + 3}}) {
    check_allreduce(*pg, DataType::kFloat32, ReduceOp::kSum, count);
    check_allreduce(*pg, DataType::kBFloat16, ReduceOp::kAvg, count);
    check_broadcast(*pg, DataType::kFloat32, count, w - 1);
  }
  check_reduce_scatter(*pg, DataType::kFloat32, ReduceOp::kSum, 300000);
  check_allgather(*pg, DataType::kInt32, 300000);
}

void point_to_point_objects_subgroups(ProcessGroup& pg_ref) {
  ProcessGroup* pg = &pg_ref;
  const int rank = pg->rank(), w = pg->size();
  // Ring of sends with tags, both directions queued before waiting.
  if (w > 1) {
    const int next = (rank + 1) % w, prev = (rank - 1 + w) % w;
    std::vector<int32_t> out(100), in(100, -1);
    for (int i = 0; i < 100; ++i) out[static_cast<size_t>(i)] = rank * 1000 + i;
    auto s = pg->send(out.data(), out.size(), DataType::kInt32, next, 7);
    auto r = pg->recv(in.data(), in.size(), DataType::kInt32, prev, 7);
    s->wait();
    r->wait();
    for (int i = 0; i < 100; ++i) {
      if (in[static_cast<size_t>(i)] != prev * 1000 + i) throw std::runtime_error("recv got wrong data");
    }
  }
  // Large sends posted before the receives on both sides: each rank's send blocks until the
  // peer reads, so the transport must buffer incoming bytes while it sends.
  if (w > 1) {
    const int next = (rank + 1) % w, prev = (rank - 1 + w) % w;
    std::vector<int64_t> out(2 << 20, rank), in(2 << 20, -1);  // 16 MiB each way
    pg->send(out.data(), out.size(), DataType::kInt64, next, 1)->wait();
    pg->recv(in.data(), in.size(), DataType::kInt64, prev, 1)->wait();
    if (in.front() != prev || in.back() != prev) throw std::runtime_error("send-send exchange gave wrong data");
  }
  // Batches (hold_p2p): every rank posts its recvs before its sends, a small message from the
  // previous rank and a large one from the next, then waits on its last send first. Run one at a
  // time, each rank's first recv would wait on a peer that is itself waiting in its first recv.
  // Released three ways: by that wait, by release_p2p, and by the next collective.
  if (w > 1) {
    const int next = (rank + 1) % w, prev = (rank - 1 + w) % w;
    for (int how = 0; how < 3; ++how) {
      std::vector<int32_t> small_out(10, rank + 100 * how), small_in(10, -1);
      std::vector<int64_t> big_out(1 << 20, rank + 100 * how), big_in(1 << 20, -1);  // 8 MiB
      pg->hold_p2p();
      auto r1 = pg->recv(small_in.data(), small_in.size(), DataType::kInt32, prev, 3);
      auto r2 = pg->recv(big_in.data(), big_in.size(), DataType::kInt64, next, 4);
      // A slow caller (Python between two calls): without the hold the recvs would start alone.
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      auto s1 = pg->send(small_out.data(), small_out.size(), DataType::kInt32, next, 3);
      auto s2 = pg->send(big_out.data(), big_out.size(), DataType::kInt64, prev, 4);
      if (how == 1) pg->release_p2p();
      if (how == 2) {
        int64_t one = 1;
        pg->allreduce(&one, 1, DataType::kInt64)->wait();
        if (one != w) throw std::runtime_error("allreduce after a held batch gave " + std::to_string(one));
      }
      s2->wait();
      r2->wait();
      s1->wait();
      r1->wait();
      if (small_in.front() != prev + 100 * how || small_in.back() != prev + 100 * how ||
          big_in.front() != next + 100 * how || big_in.back() != next + 100 * how) {
        throw std::runtime_error("a held batch of sends and recvs gave wrong data (round " + std::to_string(how) + ")");
      }
    }
  }
  // recv_any. First rank 1 alone sends a tag-9 message and then a tag-5 one; rank 0 issues a recv
  // from any source and, before it has run, a recv from rank 1, which must take the second message
  // (the recv from any source took its sequence number once it knew the sender). Then every other
  // rank sends rank 0 one tag-10 message, which w - 1 recvs from any source take in any order (a
  // tag-10 message that arrives during the first part is passed over: its tag differs).
  // MPI's transport refuses it when called, and the group goes on.
  if (w > 1 && pg->transport() == "mpi") {
    int32_t x = 0;
    bool refused = false;
    try {
      pg->recv_any(&x, 1, DataType::kInt32, 9);
    } catch (const UsageError&) {
      refused = true;
    }
    if (!refused) throw std::runtime_error("recv_any over MPI was not refused");
  } else if (w > 1) {
    if (rank == 1) {
      std::vector<int32_t> first(5, 901), second(3, 501);
      pg->send(first.data(), first.size(), DataType::kInt32, 0, 9)->wait();
      pg->send(second.data(), second.size(), DataType::kInt32, 0, 5)->wait();
    } else if (rank == 0) {
      std::vector<int32_t> first(5, -1), second(3, -1);
      auto any = pg->recv_any(first.data(), first.size(), DataType::kInt32, 9);
      auto from_1 = pg->recv(second.data(), second.size(), DataType::kInt32, 1, 5);
      any->wait();
      from_1->wait();
      if (any->source() != 1 || first != std::vector<int32_t>(5, 901) || second != std::vector<int32_t>(3, 501)) {
        throw std::runtime_error("recv_any then recv from rank 1: source " + std::to_string(any->source()) +
                                 ", data " + std::to_string(first[0]) + " and " + std::to_string(second[0]));
      }
    }
    if (rank != 0) {
      std::vector<int32_t> out(7, 100 * rank);
      pg->send(out.data(), out.size(), DataType::kInt32, 0, 10)->wait();
    } else {
      std::vector<bool> seen(static_cast<size_t>(w), false);
      for (int i = 1; i < w; ++i) {
        std::vector<int32_t> in(7, -1);
        auto any = pg->recv_any(in.data(), in.size(), DataType::kInt32, 10);
        any->wait();
        const int src = any->source();
        if (src < 1 || src >= w || seen[static_cast<size_t>(src)] || in != std::vector<int32_t>(7, 100 * src)) {
          throw std::runtime_error("recv_any #" + std::to_string(i) + ": source " + std::to_string(src) + ", data " +
                                   std::to_string(in[0]));
        }
        seen[static_cast<size_t>(src)] = true;
      }
    }
    // A rank whose message was taken goes on to the next collective at once: while rank 0 still
    // waits for the others, it is there (at a shared-memory barrier, or sending its part), which
    // must not fail the recvs from any source that other ranks can still satisfy.
    int64_t one = 1;
    pg->allreduce(&one, 1, DataType::kInt64)->wait();
    if (one != w) throw std::runtime_error("allreduce after recvs from any source gave " + std::to_string(one));
  }
  // Objects: rank i contributes i copies of 'a' + i (rank 0 an empty string).
  auto w1 = pg->all_gather_object(std::string(static_cast<size_t>(rank), static_cast<char>('a' + rank)));
  w1->wait();
  if (w1->objects().size() != static_cast<size_t>(w)) throw std::runtime_error("all_gather_object: wrong count");
  for (int i = 0; i < w; ++i) {
    if (w1->objects()[static_cast<size_t>(i)] != std::string(static_cast<size_t>(i), static_cast<char>('a' + i))) {
      throw std::runtime_error("all_gather_object: wrong object from rank " + std::to_string(i));
    }
  }
  auto w2 = pg->broadcast_object(rank == w - 1 ? std::string("hello from the root\0x", 21) : "", w - 1);
  w2->wait();
  if (w2->objects().at(0) != std::string("hello from the root\0x", 21)) throw std::runtime_error("broadcast_object");
  // Sub-group of the even ranks, run a collective in it, then one in the parent again.
  std::vector<int> evens;
  for (int i = 0; i < w; i += 2) evens.push_back(i);
  auto sub = pg->new_group(evens);
  if ((rank % 2 == 0) != (sub != nullptr)) throw std::runtime_error("new_group membership wrong");
  if (sub) {
    if (sub->rank() != rank / 2 || sub->size() != static_cast<int>(evens.size())) throw std::runtime_error("sub rank");
    int64_t v = rank;
    sub->allreduce(&v, 1, DataType::kInt64)->wait();
    int64_t want = 0;
    for (int e : evens) want += e;
    if (v != want) throw std::runtime_error("sub-group allreduce wrong");
  }
  int64_t all = 1;
  pg->allreduce(&all, 1, DataType::kInt64)->wait();
  if (all != w) throw std::runtime_error("parent allreduce after sub-group wrong");
}

void allocated_buffers(std::shared_ptr<ProcessGroup> pg) {
  const int rank = pg->rank(), w = pg->size();
  const size_t count = 70001;  // not a multiple of anything: uneven slices
  auto a = pg->allocate_buffer(count * 8 + 13);
  auto b = pg->allocate_buffer(1000 * 4);
  const bool want_shared = pg->transport() == "shm";
  if (a->shared() != want_shared || b->shared() != want_shared) throw std::runtime_error("shared() is wrong");
  if (a->size() < count * 8 + 13 || reinterpret_cast<uintptr_t>(a->data()) % 64 != 0) {
    throw std::runtime_error("allocate_buffer: too small or misaligned");
  }
  for (size_t i = 0; i < a->size(); ++i) {
    if (static_cast<char*>(a->data())[i] != 0) throw std::runtime_error("allocate_buffer: not zero-filled");
  }
  if (!my_shm_names().empty()) throw std::runtime_error("a shared buffer's name is left in /dev/shm: " + my_shm_names()[0]);
  // Whole buffer and a range at the same offset on every rank, every dtype, every op.
  for (DataType t : kAllTypes) {
    for (ReduceOp op : kAllOps) {
      for (size_t offset : {size_t{0}, size_t{3}}) {
        const size_t n = offset == 0 ? count : 999;
        char* p = static_cast<char*>(a->data()) + offset * element_size(t);
        Buf want(n, t);
        for (size_t i = 0; i < n; ++i) {
          put(t, p, i, value(op, rank, i));
          put(t, want.p, i, expected_value(t, op, w, i));
        }
        pg->allreduce(p, n, t, op)->wait();
        expect_equal(label("allreduce in an allocated buffer", t, n, to_string(op)), t, p, want.p, n);
      }
    }
  }
  // Used again and again, alternating two buffers, as DDP does with its buckets.
  for (int round = 0; round < 20; ++round) {
    for (auto* buf : {a.get(), b.get()}) {
      const size_t n = buf->size() / 4;
      int32_t* v = static_cast<int32_t*>(buf->data());
      for (size_t i = 0; i < n; ++i) v[i] = rank + round + static_cast<int32_t>(i % 7);
      pg->allreduce(v, n, DataType::kInt32)->wait();
      for (size_t i = 0; i < n; ++i) {
        const int32_t want = w * (round + static_cast<int32_t>(i % 7)) + w * (w - 1) / 2;
        if (v[i] != want) throw std::runtime_error("round " + std::to_string(round) + ": element " + std::to_string(i));
      }
    }
  }
  pg->shutdown();
  pg.reset();
  std::memset(a->data(), 7, a->size());  // still mapped after the group is gone
  if (static_cast<char*>(a->data())[a->size() - 1] != 7) throw std::runtime_error("buffer after the group");
}

}  // namespace chorus::conformance
