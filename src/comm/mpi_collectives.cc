// MpiTransport's native collectives: MPI's non-blocking collectives (MPI_Iallreduce, ...), waited
// for with the operation's deadline, after a check that every rank is in the same call.
//
// What maps: float32, float64, int8, uint8, int32 and int64 with sum, prod, min and max; average is
// MPI's sum divided here (reduce::finish_avg, as every chorus transport divides). float16 and
// bfloat16 have no MPI type: their reductions return false and run as chorus's own algorithms over
// this transport's point-to-point (reduced in float32, as everywhere in chorus); collectives that
// only move bytes take every dtype. Counts above INT_MAX (MPI counts are ints) also return false.
#include <climits>
#include <cstring>

#include "chorus/comm/error.h"
#include "mpi_transport.h"
#include "reduce.h"

namespace chorus::transport::mpi {
namespace {

bool mpi_type(DataType t, MPI_Datatype* out) {
  switch (t) {
    case DataType::kFloat32: *out = MPI_FLOAT; return true;
    case DataType::kFloat64: *out = MPI_DOUBLE; return true;
    case DataType::kInt8: *out = MPI_INT8_T; return true;
    case DataType::kUInt8: *out = MPI_UINT8_T; return true;
    case DataType::kInt32: *out = MPI_INT32_T; return true;
    case DataType::kInt64: *out = MPI_INT64_T; return true;
    case DataType::kFloat16:
    case DataType::kBFloat16: return false;
  }
  return false;
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return MPI_SUM;
    case ReduceOp::kProd: return MPI_PROD;
    case ReduceOp::kMin: return MPI_MIN;
    case ReduceOp::kMax: return MPI_MAX;
  }
  return MPI_SUM;
}

bool fits(size_t n) { return n <= static_cast<size_t>(INT_MAX); }

// The call as the check exchanges it: every field of wire::Call that ranks must agree on.
#pragma pack(push, 1)
struct Signature {
  uint8_t op;
  uint8_t dtype;
  uint8_t reduce_op;
  uint8_t pad[5];
  uint64_t seq;
  uint64_t count;
  int64_t arg;
};
#pragma pack(pop)
static_assert(sizeof(Signature) == 32, "the call check exchanges 32 bytes per rank");

Signature signature_of(const wire::Call& c) {
  Signature s{};
  s.op = static_cast<uint8_t>(c.op);
  s.dtype = static_cast<uint8_t>(c.dtype);
  s.reduce_op = static_cast<uint8_t>(c.reduce_op);
  s.seq = c.seq;
  s.count = c.count;
  s.arg = c.arg;
  return s;
}

}  // namespace

// Checks the call, starts the collective with start(&request), and waits for it with the deadline.
void MpiTransport::run(const char* name, const std::function<int(MPI_Request*)>& start) {
  check_same_call();
  MPI_Request req;
  check(start(&req), name);
  wait_request(&req, name);
}

// MPI's collectives trust their arguments: ranks in different calls, or with different counts,
// would hang, truncate or read each other's bytes. One small allgather of the call first turns that
// into a MismatchError on every rank, naming the first rank that differs.
void MpiTransport::check_same_call() {
  const Signature mine = signature_of(call_);
  sigs_.resize(sizeof(Signature) * static_cast<size_t>(size_));
  MPI_Request req;
  check(MPI_Iallgather(&mine, sizeof(mine), MPI_BYTE, sigs_.data(), sizeof(mine), MPI_BYTE, comm_, &req),
        "the call check (MPI_Iallgather)");
  wait_request(&req, "the call check (an allgather of every rank's call)");
  for (int r = 0; r < size_; ++r) {
    Signature theirs;
    std::memcpy(&theirs, sigs_.data() + static_cast<size_t>(r) * sizeof(Signature), sizeof(theirs));
    if (std::memcmp(&theirs, &mine, sizeof(mine)) == 0) continue;
    wire::Call c;
    c.op = static_cast<wire::OpType>(theirs.op);
    c.dtype = static_cast<DataType>(theirs.dtype);
    c.reduce_op = static_cast<ReduceOp>(theirs.reduce_op);
    c.seq = theirs.seq;
    c.count = theirs.count;
    c.arg = theirs.arg;
    throw MismatchError(wire::mismatch_message(me(), call_, peer_name(r), "called " + wire::describe(c)));
  }
}

bool MpiTransport::allreduce(void* buf, size_t count, DataType dtype, ReduceOp op) {
  MPI_Datatype t;
  if (!mpi_type(dtype, &t) || !fits(count)) return false;
  run("MPI_Iallreduce", [&](MPI_Request* r) {
    return MPI_Iallreduce(MPI_IN_PLACE, buf, static_cast<int>(count), t, mpi_op(op), comm_, r);
  });
  if (op == ReduceOp::kAvg) reduce::finish_avg(dtype, buf, count, size_);
  return true;
}

bool MpiTransport::reduce(void* buf, size_t count, DataType dtype, ReduceOp op, int root) {
  MPI_Datatype t;
  if (!mpi_type(dtype, &t) || !fits(count)) return false;
  const bool at_root = rank_ == root;
  // The root reduces in place; the others' buffers are only read.
  run("MPI_Ireduce", [&](MPI_Request* r) {
    return MPI_Ireduce(at_root ? MPI_IN_PLACE : buf, at_root ? buf : nullptr, static_cast<int>(count), t, mpi_op(op),
                       root, comm_, r);
  });
  if (at_root && op == ReduceOp::kAvg) reduce::finish_avg(dtype, buf, count, size_);
  return true;
}

bool MpiTransport::reduce_scatter(const void* in, void* out, size_t count, DataType dtype, ReduceOp op) {
  MPI_Datatype t;
  if (!mpi_type(dtype, &t) || !fits(count)) return false;
  const size_t bytes = count * element_size(dtype);
  const char* i = static_cast<const char*>(in);
  const char* o = static_cast<const char*>(out);
  if (bytes > 0 && o < i + bytes * static_cast<size_t>(size_) && i < o + bytes) return false;  // overlapping
  run("MPI_Ireduce_scatter_block", [&](MPI_Request* r) {
    return MPI_Ireduce_scatter_block(in, out, static_cast<int>(count), t, mpi_op(op), comm_, r);
  });
  if (op == ReduceOp::kAvg) reduce::finish_avg(dtype, out, count, size_);
  return true;
}

bool MpiTransport::broadcast(void* buf, size_t bytes, int root) {
  if (!fits(bytes)) return false;
  run("MPI_Ibcast", [&](MPI_Request* r) {
    return MPI_Ibcast(buf, static_cast<int>(bytes), MPI_BYTE, root, comm_, r);
  });
  return true;
}

bool MpiTransport::allgather(const void* in, void* out, size_t bytes) {
  if (!fits(bytes * static_cast<size_t>(size_))) return false;
  const int n = static_cast<int>(bytes);
  const bool in_place = in == static_cast<const char*>(out) + static_cast<size_t>(rank_) * bytes;
  run("MPI_Iallgather", [&](MPI_Request* r) {
    return MPI_Iallgather(in_place ? MPI_IN_PLACE : in, n, MPI_BYTE, out, n, MPI_BYTE, comm_, r);
  });
  return true;
}

bool MpiTransport::allgatherv(const void* in, void* out, const std::vector<size_t>& sizes) {
  std::vector<int> counts, displs;
  size_t off = 0;
  for (size_t n : sizes) {
    counts.push_back(static_cast<int>(n));
    displs.push_back(static_cast<int>(off));
    off += n;
  }
  if (!fits(off)) return false;
  run("MPI_Iallgatherv", [&](MPI_Request* r) {
    return MPI_Iallgatherv(in, counts[static_cast<size_t>(rank_)], MPI_BYTE, out, counts.data(), displs.data(),
                           MPI_BYTE, comm_, r);
  });
  return true;
}

// gather and scatter: the root's own block may already sit in place in its buffer of all blocks.
bool MpiTransport::gather(const void* in, void* out, size_t bytes, int root) {
  if (!fits(bytes * static_cast<size_t>(size_))) return false;
  const int n = static_cast<int>(bytes);
  const bool in_place = rank_ == root && in == static_cast<const char*>(out) + static_cast<size_t>(root) * bytes;
  run("MPI_Igather", [&](MPI_Request* r) {
    return MPI_Igather(in_place ? MPI_IN_PLACE : in, n, MPI_BYTE, out, n, MPI_BYTE, root, comm_, r);
  });
  return true;
}

bool MpiTransport::scatter(const void* in, void* out, size_t bytes, int root) {
  if (!fits(bytes * static_cast<size_t>(size_))) return false;
  const int n = static_cast<int>(bytes);
  const bool in_place = rank_ == root && out == static_cast<const char*>(in) + static_cast<size_t>(root) * bytes;
  run("MPI_Iscatter", [&](MPI_Request* r) {
    return MPI_Iscatter(in, n, MPI_BYTE, in_place ? MPI_IN_PLACE : out, n, MPI_BYTE, root, comm_, r);
  });
  return true;
}

bool MpiTransport::alltoall(const void* in, void* out, size_t bytes) {
  if (!fits(bytes * static_cast<size_t>(size_))) return false;
  const int n = static_cast<int>(bytes);
  run("MPI_Ialltoall", [&](MPI_Request* r) { return MPI_Ialltoall(in, n, MPI_BYTE, out, n, MPI_BYTE, comm_, r); });
  return true;
}

bool MpiTransport::barrier() {
  check_same_call();  // its allgather is itself a barrier
  return true;
}

}  // namespace chorus::transport::mpi
