// Internal: the header every transport message starts with. See docs/wire-format.md.
//
// Every collective message names the operation, its sequence number, dtype, element count and
// argument (root, tag or reduce op), so that ranks that disagree about the call they are in get a
// MismatchError describing both calls instead of reading each other's bytes.
#pragma once

#include <cstdint>
#include <string>

#include "chorus/comm/types.h"

namespace chorus::wire {

constexpr uint32_t kMessageMagic = 0x534d4843;  // "CHMS"

enum class Kind : uint8_t {
  kData = 0,     // a payload belonging to one operation
  kAbort = 1,    // the sender failed; the payload is its error text
  kGoodbye = 2,  // the sender closed its group cleanly; nothing follows
};

enum class OpType : uint8_t {
  kNone = 0,
  kAllreduce,
  kBroadcast,
  kReduce,
  kAllgather,
  kGather,
  kScatter,
  kReduceScatter,
  kAlltoall,
  kBarrier,
  kSend,  // point-to-point: a send on one side matches a recv on the other
  kRecv,
  kAllgatherObject,
  kBroadcastObject,
  kAllocateBuffer,  // ProcessGroup::allocate_buffer: count = bytes
  kGatherObject,
  kScatterObject,
  kNewGroup,  // ProcessGroup::new_group on a transport that makes its sub-groups (MPI): count = members
};
const char* op_name(OpType op);

#pragma pack(push, 1)
struct Header {
  uint32_t magic = kMessageMagic;
  Kind kind = Kind::kData;
  OpType op = OpType::kNone;
  uint8_t dtype = 0;
  uint8_t reduce_op = 0;
  uint64_t seq = 0;      // the operation's sequence number in its group (per pair for send/recv)
  uint64_t count = 0;    // the call's element count as the sender called it
  int64_t arg = 0;       // root for rooted collectives, tag for send/recv
  uint64_t payload = 0;  // bytes that follow this header
};
#pragma pack(pop)
static_assert(sizeof(Header) == 40, "wire header must stay 40 bytes");

// What a receiver expects of the call fields of a header (payload length is checked separately).
struct Call {
  OpType op = OpType::kNone;
  uint64_t seq = 0;
  DataType dtype = DataType::kUInt8;
  ReduceOp reduce_op = ReduceOp::kSum;
  uint64_t count = 0;
  int64_t arg = 0;
};

// Call::arg of the small allreduce with which "tuned" checks, at the first call of each size class,
// that every rank kept the same decision for it (ProcessGroup::keep_tuned_allreduce), or none: a
// rank that does not run "tuned" meets it as a mismatch that names the option.
constexpr int64_t kKeptTunedCheckArg = 0x6b657074;  // "kept"
// Call::arg of the allgather with which allreduce "auto" learns, at a group's first allreduce, how
// many ranks share each machine's cores (algo::learn_shared_cores; the call's other fields are the
// allreduce's): a rank that does not run "auto" meets it as a mismatch that names the option.
constexpr int64_t kSharedCoresArg = 0x636f7265;  // "core"
// Call::arg of the barrier before each timed trial of allreduce "tuned" (zero-byte messages under
// the trial call's other fields): the ranks start a trial together, so that its time is the
// algorithm's own and not a tail of skew the previous trial left (algo::MeasuredAllreduce).
constexpr int64_t kTunedTrialStartArg = 0x73746172;  // "star"

Header make_header(const Call& call, uint64_t payload);
bool same_call(const Header& h, const Call& c);
// "allreduce #12 (float32 x 1000, sum)", "broadcast #3 (float32 x 10, root 0)", "send #0 (tag 7, uint8 x 5)".
std::string describe(const Call& call);
std::string describe(const Header& h);

// The one wording of a collective mismatch, for every transport: "<who>: collective mismatch: this
// rank called <mine> but <peer> <theirs>; <fix>". `theirs` says what the peer did ("called
// allreduce #3 (...)", "is in barrier #4, waiting for this rank at a shared-memory barrier").
std::string mismatch_message(const std::string& who, const Call& mine, const std::string& peer,
                             const std::string& theirs);

}  // namespace chorus::wire
