// Internal: the handshake that opens every chorus connection (store clients and transport pairs
// alike). A challenge-response over the job token: the token is an HMAC-SHA256 key that never
// crosses the wire, and every handshake is bound to two fresh nonces, so a recorded one cannot be
// replayed. See docs/wire-format.md.
//
//   hello     C->S : u32 magic "CHRS" | u16 version | u16 kind | client_nonce[32] | u32 payload_len | payload
//   challenge S->C : u8 2 | server_nonce[32]
//   proof     C->S : HMAC(token, "chorus/2 client" | hello | server_nonce)             (32 bytes)
//   verdict   S->C : u8 status (0 accepted, 1 refused) | u32 reason_len | reason
//                    [| HMAC(token, "chorus/2 server" | hello | server_nonce) when accepted]
//
// The server may answer with a refusal instead of the challenge (bad magic, version or kind, or it
// is giving up), so a client reads either. All integers little-endian. Both sides are byte-fed state
// machines that ask for exactly the bytes of the next message (`want()`): a non-blocking server
// drives many of them from one poll loop, never reads past the handshake, and never allocates more
// than the bounded sizes below for a peer that has not proved itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "socket.h"

namespace chorus::handshake {

constexpr uint32_t kMagic = 0x53524843;  // "CHRS"
constexpr uint16_t kProtocolVersion = 2;
constexpr size_t kNonceBytes = 32;
constexpr size_t kMacBytes = 32;  // HMAC-SHA256
constexpr uint32_t kMaxPayloadBytes = 64 * 1024;
constexpr uint32_t kMaxReasonBytes = 64 * 1024;
constexpr uint8_t kStatusAccepted = 0;
constexpr uint8_t kStatusRefused = 1;
constexpr uint8_t kStatusChallenge = 2;

enum class PeerKind : uint16_t { kStoreClient = 1, kTransport = 2 };

struct Hello {
  uint16_t version = kProtocolVersion;
  PeerKind kind = PeerKind::kStoreClient;
  std::string payload;
};

// Fresh random bytes from OpenSSL's RAND_bytes; throws chorus::Error if it fails. (chorus::random_token,
// the job token launchers hand their workers, is made of these.)
std::string random_bytes(size_t n);
// Constant-time comparison of equal-length strings (false when the lengths differ).
bool equal_secrets(const std::string& a, const std::string& b);

std::string encode_verdict(bool accepted, const std::string& reason);

// The server's half. Usage: feed it what arrives (never more than want() bytes at a time); when
// state() becomes kHello, check hello() and either send refusal(...) or challenge(); when it becomes
// kProof, check proven() (and then whatever else the server wants) and send accept() or refusal().
class Server {
 public:
  enum State { kReadingHello, kHello, kReadingProof, kProof, kBad };
  explicit Server(std::string secret);

  size_t want() const;                   // bytes the next step needs; 0 in kHello, kProof, kBad
  void feed(const char* data, size_t n);  // n <= want()
  State state() const { return state_; }
  const std::string& error() const { return error_; }  // in kBad: what was wrong with the bytes
  const Hello& hello() const { return hello_; }
  // Bytes of a message that has begun to arrive but is not complete (a peer that hangs up now
  // sent a truncated message, not merely no message).
  size_t partial() const { return state_ == kReadingProof ? proof_.size() : state_ == kReadingHello ? buf_.size() : 0; }

  std::string challenge();  // in kHello: the bytes to send; moves to kReadingProof
  bool proven() const;      // in kProof: the client's proof matches this server's secret
  std::string accept() const;  // in kProof after proven(): the accepting verdict with the server's proof
  static std::string refusal(const std::string& reason) { return encode_verdict(false, reason); }

 private:
  std::string secret_;
  State state_ = kReadingHello;
  std::string buf_;          // the message being read
  std::string transcript_;   // hello bytes, then the server nonce
  std::string proof_;
  Hello hello_;
  std::string error_;
};

// The client's half: send hello_bytes(), then feed what arrives; when state() becomes kSendProof,
// send take_proof(); it ends in kAccepted, kRefused (reason()) or kBad (error()).
class Client {
 public:
  enum State { kReadingStatus, kReadingChallenge, kSendProof, kReadingReasonLength, kReadingReason, kReadingMac,
               kAccepted, kRefused, kBad };
  Client(std::string secret, const Hello& hello);

  const std::string& hello_bytes() const { return hello_bytes_; }
  size_t want() const;
  void feed(const char* data, size_t n);  // n <= want()
  std::string take_proof();               // in kSendProof; moves on to reading the verdict
  State state() const { return state_; }
  bool done() const { return state_ == kAccepted || state_ == kRefused || state_ == kBad; }
  const std::string& reason() const { return reason_; }  // kRefused: the server's reason
  const std::string& error() const { return error_; }    // kBad: what was wrong

 private:
  std::string secret_;
  std::string hello_bytes_;
  std::string transcript_;
  State state_ = kReadingStatus;
  std::string buf_;
  uint8_t status_ = 0;
  uint32_t reason_len_ = 0;
  std::string reason_;
  std::string error_;
};

// Blocking client handshake on `fd` before `deadline`. Throws HandshakeError with the server's
// reason if refused (or if the server cannot prove it knows the token), TimeoutError or PeerError
// otherwise. `what` names the server for messages ("the TcpStore server at 10.0.0.1:29500").
void client_handshake(int fd, const std::string& secret, const Hello& hello, net::Deadline deadline,
                      const std::string& what);

// Raises the outcome of a finished client handshake: nothing when accepted, else HandshakeError.
void raise_unless_accepted(const Client& client, const std::string& what);

// After sending a refusal: half-close, so the verdict is followed by a clean end of stream, and let
// the caller read (and drop) what the peer still sends until it closes. Closing a socket with
// unread bytes in its receive buffer sends a reset, which can destroy the verdict in flight before
// the peer reads it; draining first is what makes a refused peer always learn why.
void half_close(int fd);
// Reads and drops what is available; true once the peer has closed (or the socket failed).
bool drain_until_closed(int fd);

}  // namespace chorus::handshake
