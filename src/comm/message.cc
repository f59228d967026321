#include "message.h"

#include <sstream>

namespace chorus::wire {

const char* op_name(OpType op) {
  switch (op) {
    case OpType::kNone: return "none";
    case OpType::kAllreduce: return "allreduce";
    case OpType::kBroadcast: return "broadcast";
    case OpType::kReduce: return "reduce";
    case OpType::kAllgather: return "allgather";
    case OpType::kGather: return "gather";
    case OpType::kScatter: return "scatter";
    case OpType::kReduceScatter: return "reduce_scatter";
    case OpType::kAlltoall: return "alltoall";
    case OpType::kBarrier: return "barrier";
    case OpType::kSend: return "send";
    case OpType::kRecv: return "recv";
    case OpType::kAllgatherObject: return "all_gather_object";
    case OpType::kBroadcastObject: return "broadcast_object";
    case OpType::kAllocateBuffer: return "allocate_buffer";
    case OpType::kGatherObject: return "gather_object";
    case OpType::kScatterObject: return "scatter_object";
    case OpType::kNewGroup: return "new_group";
  }
  return "unknown-op";
}

Header make_header(const Call& call, uint64_t payload) {
  Header h;
  h.op = call.op;
  h.dtype = static_cast<uint8_t>(call.dtype);
  h.reduce_op = static_cast<uint8_t>(call.reduce_op);
  h.seq = call.seq;
  h.count = call.count;
  h.arg = call.arg;
  h.payload = payload;
  return h;
}

bool same_call(const Header& h, const Call& c) {
  // A send matches a recv; every other op must match itself.
  OpType want = c.op == OpType::kRecv ? OpType::kSend : c.op;
  return h.op == want && h.seq == c.seq && h.dtype == static_cast<uint8_t>(c.dtype) &&
         h.reduce_op == static_cast<uint8_t>(c.reduce_op) && h.count == c.count && h.arg == c.arg;
}

namespace {

bool has_reduce_op(OpType op) {
  return op == OpType::kAllreduce || op == OpType::kReduce || op == OpType::kReduceScatter;
}
bool has_root(OpType op) {
  return op == OpType::kBroadcast || op == OpType::kReduce || op == OpType::kGather ||
         op == OpType::kScatter || op == OpType::kBroadcastObject || op == OpType::kGatherObject ||
         op == OpType::kScatterObject;
}

std::string describe_fields(OpType op, uint64_t seq, uint8_t dtype, uint8_t reduce_op, uint64_t count,
                            int64_t arg) {
  std::ostringstream out;
  out << op_name(op) << " #" << seq << " (";
  if (op == OpType::kSend || op == OpType::kRecv) out << "tag " << arg << ", ";
  out << (dtype < kNumDataTypes ? to_string(static_cast<DataType>(dtype)) : "bad-dtype") << " x "
      << count;
  if (has_reduce_op(op)) {
    out << ", " << (reduce_op < kNumReduceOps ? to_string(static_cast<ReduceOp>(reduce_op)) : "bad-op");
  }
  if (has_root(op)) out << ", root " << arg;
  if (op == OpType::kAllreduce && arg == kKeptTunedCheckArg) {
    out << "; the first of its size under allreduce_algorithm \"tuned\" (CHORUS_ALLREDUCE_ALGORITHM): the "
           "check that every rank runs tuned with the same decisions kept by keep_tuned_allreduce, or none";
  }
  out << ")";
  if (op == OpType::kAllreduce && arg == kSharedCoresArg) {
    out << ", the group's first allreduce under allreduce_algorithm \"auto\" (CHORUS_ALLREDUCE_ALGORITHM), which "
           "first gathers every rank's machine and CPUs for the plan: every rank of the group must run \"auto\"";
  }
  return out.str();
}

}  // namespace

std::string describe(const Call& c) {
  return describe_fields(c.op, c.seq, static_cast<uint8_t>(c.dtype), static_cast<uint8_t>(c.reduce_op),
                         c.count, c.arg);
}

std::string describe(const Header& h) {
  return describe_fields(h.op, h.seq, h.dtype, h.reduce_op, h.count, h.arg);
}

std::string mismatch_message(const std::string& who, const Call& mine, const std::string& peer,
                             const std::string& theirs) {
  return who + ": collective mismatch: this rank called " + describe(mine) + " but " + peer + " " + theirs +
         "; every rank must call the same collectives and point-to-point operations in the same order with the "
         "same dtype, count, op and root";
}

}  // namespace chorus::wire
