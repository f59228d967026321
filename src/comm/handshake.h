// Internal: the hello message that opens every chorus connection (store clients and transport
// pairs alike), and the server's verdict. See docs/wire-format.md.
//
//   hello   : u32 magic "CHRS" | u16 version | u16 kind | u32 token_len | token | u32 payload_len | payload
//   verdict : u8 status (0 = accepted, 1 = refused) | u32 reason_len | reason
//
// All integers little-endian. Parsing works on a byte buffer so that a non-blocking server can feed
// it partial input; sizes are bounded so a malformed hello can never make the server allocate much.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "socket.h"

namespace chorus::handshake {

constexpr uint32_t kMagic = 0x53524843;  // "CHRS"
constexpr uint16_t kProtocolVersion = 1;
constexpr uint32_t kMaxTokenBytes = 1024;
constexpr uint32_t kMaxPayloadBytes = 64 * 1024;

enum class PeerKind : uint16_t { kStoreClient = 1, kTransport = 2 };

struct Hello {
  uint16_t version = kProtocolVersion;
  PeerKind kind = PeerKind::kStoreClient;
  std::string token;
  std::string payload;
};

std::string encode_hello(const Hello& hello);

enum class Parse { kNeedMore, kOk, kBad };
// Parses a hello from the front of [data, data+n). On kOk sets *hello and *consumed; on kBad sets
// *error to what was wrong (bad magic, oversized token, ...).
Parse parse_hello(const char* data, size_t n, Hello* hello, size_t* consumed, std::string* error);

std::string encode_verdict(bool accepted, const std::string& reason);
Parse parse_verdict(const char* data, size_t n, bool* accepted, std::string* reason, size_t* consumed);

// Constant-time comparison, so a refused client learns nothing from timing.
bool tokens_equal(const std::string& a, const std::string& b);

// Client side, on a blocking socket: sends `hello`, waits for the verdict before `deadline`.
// Throws HandshakeError with the server's reason if refused; TimeoutError / PeerError otherwise.
// `what` names the server for messages ("store at 10.0.0.1:29500").
void client_handshake(int fd, const Hello& hello, net::Deadline deadline, const std::string& what);

// The two halves of client_handshake, for a client that must serve its own listener in between (the
// transport mesh, where every rank is client and server): send_hello only writes, await_verdict waits.
void send_hello(int fd, const Hello& hello, net::Deadline deadline, const std::string& what);
void await_verdict(int fd, net::Deadline deadline, const std::string& what);

// Server side, on a blocking socket: reads a hello before `deadline`. Returns false and sets
// *error when the bytes are not a valid hello or the peer is gone.
bool read_hello(int fd, net::Deadline deadline, Hello* hello, std::string* error);
void send_verdict(int fd, bool accepted, const std::string& reason, net::Deadline deadline);

}  // namespace chorus::handshake
