// Fuzz target: the 40-byte header every transport message starts with (src/comm/message.h,
// docs/wire-format.md), read as TcpTransport's and ShmTransport's receivers read it: magic, kind,
// then for data the call compared with this rank's own call (MismatchError text from both
// descriptions), for an abort the error class and text turned into the exception a peer rethrows.
// Input: header (40 bytes) | this rank's call (5 bytes: op, dtype, reduce op, seq, count) | payload.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

#include "chorus/comm/error.h"
#include "comm/error_class.h"
#include "comm/message.h"

namespace wire = chorus::wire;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < sizeof(wire::Header) + 5) return 0;
  wire::Header h;
  std::memcpy(&h, data, sizeof(h));
  const uint8_t* call_bytes = data + sizeof(h);
  const char* payload = reinterpret_cast<const char*>(call_bytes + 5);
  const size_t payload_bytes = size - sizeof(h) - 5;

  // This rank's call: always a valid one, as the transports build it.
  wire::Call call;
  call.op = static_cast<wire::OpType>(1 + call_bytes[0] % 16);
  call.dtype = static_cast<chorus::DataType>(call_bytes[1] % chorus::kNumDataTypes);
  call.reduce_op = static_cast<chorus::ReduceOp>(call_bytes[2] % chorus::kNumReduceOps);
  call.seq = call_bytes[3];
  call.count = call_bytes[4];
  if (wire::same_call(wire::make_header(call, 0), call) == (call.op == wire::OpType::kRecv)) std::abort();

  if (h.magic != wire::kMessageMagic) return 0;  // "corrupt message header (bad magic)"
  if (h.kind == wire::Kind::kAbort) {
    // The text is read up to 1 MiB of what the header claims, as TcpTransport::handle_control does.
    const std::string text(payload, std::min<uint64_t>({h.payload, uint64_t{1} << 20, payload_bytes}));
    const std::exception_ptr e =
        chorus::transport::make_error(static_cast<uint8_t>(h.arg), "failed because rank 1 failed: " + text);
    try {
      std::rethrow_exception(e);
    } catch (const chorus::Error& err) {
      // what() is a C string: the text shows up to its first NUL.
      if (std::string(err.what()).find(text.c_str()) == std::string::npos) std::abort();
    }
    return 0;
  }
  if (h.kind != wire::Kind::kData) return 0;  // goodbye, or a kind this build does not know
  const std::string theirs = wire::describe(h);
  const std::string mine = wire::describe(call);
  if (theirs.empty() || mine.empty()) std::abort();
  if (wire::same_call(h, call) && h.op != wire::OpType::kSend && theirs != mine) std::abort();
  return 0;
}
