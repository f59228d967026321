// Internal: the transport interface the collective algorithms are written against.
//
// A Transport connects one rank to every other rank of its group and moves whole messages
// (wire::Header + payload) between them. Operations are posted (send/recv return a Ticket) and
// progress only inside wait()/wait_all(), which drive every posted send and receive at once, so
// a ring step's send and receive overlap. Messages on one pair arrive in the order they were sent.
//
// Threading: a Transport is used by one thread at a time (the process group's worker thread).
// Errors: wait() throws TimeoutError, PeerError or MismatchError with this rank, the peer and the
// current operation (set by begin()); after a throw the transport is broken and the caller calls
// abort() to tell the peers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "message.h"
#include "socket.h"

namespace chorus {
class Store;
}

namespace chorus::transport {

using Ticket = uint64_t;

// A posted send or receive, as the transports queue them per peer.
struct SendItem {
  Ticket ticket;
  wire::Header header;
  const char* data;
  size_t n;
  size_t off = 0;  // bytes done, over header + data
};

struct RecvItem {
  Ticket ticket;
  wire::Call expect;
  char* data;
  size_t n;
  bool have_header = false;
  size_t got = 0;  // payload bytes received
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "rank 3 (10.0.0.2:41234)": how errors name a peer.
  virtual std::string peer_name(int peer) const = 0;

  // Starts an operation: `call` and `deadline` frame every error until the next begin().
  virtual void begin(const wire::Call& call, net::Deadline deadline) = 0;
  // Posts `header` + n bytes at `data` to `peer`; `data` stays valid until the ticket completes.
  virtual Ticket send(int peer, const wire::Header& header, const void* data, size_t n) = 0;
  // Posts the receive of the next message from `peer`: its header must match `expect` and carry
  // exactly n payload bytes, which land at `data`.
  virtual Ticket recv(int peer, const wire::Call& expect, void* data, size_t n) = 0;
  // Progresses everything posted until `ticket` has completed.
  virtual void wait(Ticket ticket) = 0;
  // Progresses everything posted until nothing is pending.
  virtual void wait_all() = 0;

  // Transports with a collective of their own (shared memory) run it here and return true;
  // the default leaves the operation to the generic algorithms.
  virtual bool native_allreduce(void* buf, size_t count, DataType dtype, ReduceOp op) { return false; }

  // Tells every peer that this rank failed with `reason` (best effort, bounded), then shuts the
  // connections down so peers waiting on this rank fail at once.
  virtual void abort(const std::string& reason, uint8_t error_class) = 0;
  // Says goodbye to every peer and closes: peers that still wait on this rank get a PeerError
  // saying this rank closed its group.
  virtual void close() = 0;
};

// Error classes carried by abort messages, so the peer rethrows the same exception type.
enum ErrorClass : uint8_t {
  kErrOther = 0,
  kErrTimeout = 1,
  kErrPeer = 2,
  kErrMismatch = 3,
  kErrHandshake = 4,
  kErrUsage = 5,
};

struct TcpOptions {
  Store* store = nullptr;       // for exchanging listen addresses (keys under key_prefix)
  std::string key_prefix;       // e.g. "chorus/pg/0"
  std::string group_name;       // checked by both sides of every connection
  int rank = 0;
  int size = 1;
  std::string token;            // job token for the connection handshake
  std::string advertise_host;   // the address peers should connect to ("" = 127.0.0.1)
  net::Deadline deadline;       // for the whole mesh setup
  int socket_buffer_bytes = 0;  // SO_SNDBUF/SO_RCVBUF; 0 = kernel autotuning
  int spin_us = 0;              // busy-poll this long before sleeping in poll()
};

// Builds the full mesh: listens on a kernel-chosen port, publishes it in the store, connects to
// lower ranks and accepts higher ranks, with the token handshake and a check that both sides agree
// on group, world size and ranks. Throws HandshakeError/TimeoutError naming the peer otherwise.
std::unique_ptr<Transport> make_tcp_transport(const TcpOptions& options);

struct ShmOptions {
  Store* store = nullptr;
  std::string key_prefix;
  std::string group_name;
  int rank = 0;
  int size = 1;
  std::string token;
  net::Deadline deadline;
  size_t ring_bytes = 256 << 10;      // per ordered pair of ranks, for point-to-point messages
  size_t collective_bytes = 4 << 20;  // per rank, twice (double-buffered), for native allreduce
  int spin_us = 50;                   // busy-wait this long before sleeping on a futex
};

// Ranks on one host: each maps every rank's segment (created in /dev/shm, unlinked as soon as all
// have mapped it, so nothing is left behind even after SIGKILL). Throws UsageError when the ranks
// are not all on this host (host identity = boot id + hostname + IPC namespace, via the store).
std::unique_ptr<Transport> make_shm_transport(const ShmOptions& options);

// This host's identity for deciding which ranks can share memory.
std::string host_identity();

}  // namespace chorus::transport
