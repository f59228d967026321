#include "handshake.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "chorus/comm/error.h"
#include "chorus/comm/random.h"

namespace chorus::handshake {
namespace {

constexpr size_t kHelloHeadBytes = 8;  // magic, version, kind: the same in every protocol version
constexpr const char* kClientLabel = "chorus/2 client";
constexpr const char* kServerLabel = "chorus/2 server";

void put_u16(std::string& out, uint16_t v) {
  out.push_back(static_cast<char>(v & 0xff));
  out.push_back(static_cast<char>(v >> 8));
}
void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint16_t get_u16(const char* p) {
  return static_cast<uint16_t>(static_cast<uint8_t>(p[0]) | (static_cast<uint8_t>(p[1]) << 8));
}
uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

// HMAC-SHA256(secret, label | transcript).
std::string mac(const std::string& secret, const char* label, const std::string& transcript) {
  std::string message = std::string(label) + transcript;
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  // HMAC() wants a non-null key pointer even for an empty key.
  static const unsigned char kEmpty = 0;
  const void* key = secret.empty() ? &kEmpty : static_cast<const void*>(secret.data());
  if (HMAC(EVP_sha256(), key, static_cast<int>(secret.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(), out, &len) == nullptr ||
      len != kMacBytes) {
    throw Error("chorus: HMAC-SHA256 failed in the connection handshake (OpenSSL)");
  }
  return std::string(reinterpret_cast<char*>(out), len);
}

}  // namespace

std::string random_bytes(size_t n) {
  std::string out(n, '\0');
  if (n > 0 && RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(n)) != 1) {
    throw Error("chorus: cannot get random bytes from OpenSSL (RAND_bytes failed)");
  }
  return out;
}

bool equal_secrets(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string encode_verdict(bool accepted, const std::string& reason) {
  std::string out;
  out.push_back(static_cast<char>(accepted ? kStatusAccepted : kStatusRefused));
  const std::string r = reason.substr(0, kMaxReasonBytes);
  put_u32(out, static_cast<uint32_t>(r.size()));
  out += r;
  return out;
}

// ---- Server ------------------------------------------------------------------------------------

Server::Server(std::string secret) : secret_(std::move(secret)) {}

size_t Server::want() const {
  switch (state_) {
    case kReadingHello: {
      if (buf_.size() < kHelloHeadBytes) return kHelloHeadBytes - buf_.size();
      const size_t fixed = kHelloHeadBytes + kNonceBytes + 4;
      if (buf_.size() < fixed) return fixed - buf_.size();
      return fixed + get_u32(buf_.data() + kHelloHeadBytes + kNonceBytes) - buf_.size();
    }
    case kReadingProof: return kMacBytes - proof_.size();
    default: return 0;
  }
}

void Server::feed(const char* data, size_t n) {
  if (state_ == kReadingProof) {
    proof_.append(data, n);
    if (proof_.size() == kMacBytes) state_ = kProof;
    return;
  }
  if (state_ != kReadingHello) return;
  buf_.append(data, n);
  if (buf_.size() >= 4 && get_u32(buf_.data()) != kMagic) {
    error_ = "not a chorus peer (bad magic; is another program connecting to this port?)";
    state_ = kBad;
    return;
  }
  if (buf_.size() < kHelloHeadBytes) return;
  hello_.version = get_u16(buf_.data() + 4);
  hello_.kind = static_cast<PeerKind>(get_u16(buf_.data() + 6));
  if (hello_.version != kProtocolVersion) {
    // The rest of a hello of another version has another layout: stop here and let the caller refuse.
    state_ = kHello;
    return;
  }
  const size_t fixed = kHelloHeadBytes + kNonceBytes + 4;
  if (buf_.size() < fixed) return;
  const uint32_t payload_len = get_u32(buf_.data() + kHelloHeadBytes + kNonceBytes);
  if (payload_len > kMaxPayloadBytes) {
    error_ = "hello payload too long (" + std::to_string(payload_len) + " bytes, limit " +
             std::to_string(kMaxPayloadBytes) + ")";
    state_ = kBad;
    return;
  }
  if (buf_.size() < fixed + payload_len) return;
  hello_.payload = buf_.substr(fixed);
  transcript_ = std::move(buf_);
  buf_.clear();
  state_ = kHello;
}

std::string Server::challenge() {
  const std::string nonce = random_bytes(kNonceBytes);
  transcript_ += nonce;
  state_ = kReadingProof;
  return std::string(1, static_cast<char>(kStatusChallenge)) + nonce;
}

bool Server::proven() const {
  return state_ == kProof && equal_secrets(proof_, mac(secret_, kClientLabel, transcript_));
}

std::string Server::accept() const { return encode_verdict(true, "") + mac(secret_, kServerLabel, transcript_); }

// ---- Client ------------------------------------------------------------------------------------

Client::Client(std::string secret, const Hello& hello) : secret_(std::move(secret)) {
  if (hello.payload.size() > kMaxPayloadBytes) throw UsageError("chorus: handshake payload too long");
  put_u32(hello_bytes_, kMagic);
  put_u16(hello_bytes_, hello.version);
  put_u16(hello_bytes_, static_cast<uint16_t>(hello.kind));
  hello_bytes_ += random_bytes(kNonceBytes);
  put_u32(hello_bytes_, static_cast<uint32_t>(hello.payload.size()));
  hello_bytes_ += hello.payload;
  transcript_ = hello_bytes_;
}

size_t Client::want() const {
  switch (state_) {
    case kReadingStatus: return 1;
    case kReadingChallenge: return kNonceBytes - buf_.size();
    case kReadingReasonLength: return 4 - buf_.size();
    case kReadingReason: return reason_len_ - buf_.size();
    case kReadingMac: return kMacBytes - buf_.size();
    default: return 0;
  }
}

void Client::feed(const char* data, size_t n) {
  if (n == 0 || done() || state_ == kSendProof) return;
  if (state_ == kReadingStatus) {
    status_ = static_cast<uint8_t>(data[0]);
    if (status_ == kStatusChallenge) {
      state_ = transcript_.size() == hello_bytes_.size() ? kReadingChallenge : kBad;
    } else if (status_ == kStatusAccepted || status_ == kStatusRefused) {
      state_ = kReadingReasonLength;
    } else {
      state_ = kBad;
    }
    if (state_ == kBad) error_ = "malformed answer (status " + std::to_string(status_) + ")";
    return;
  }
  buf_.append(data, n);
  if (want() > 0) return;
  switch (state_) {
    case kReadingChallenge:
      transcript_ += buf_;
      state_ = kSendProof;
      break;
    case kReadingReasonLength:
      reason_len_ = get_u32(buf_.data());
      if (reason_len_ > kMaxReasonBytes) {
        error_ = "malformed answer (a reason of " + std::to_string(reason_len_) + " bytes)";
        state_ = kBad;
        break;
      }
      state_ = reason_len_ > 0 ? kReadingReason : status_ == kStatusAccepted ? kReadingMac : kRefused;
      break;
    case kReadingReason:
      reason_ = buf_;
      state_ = status_ == kStatusAccepted ? kReadingMac : kRefused;
      break;
    case kReadingMac:
      // An acceptance is only believed from a server that proves it knows the token too: a stranger
      // listening on the address (another job's store, a stale port) cannot pass for this job's.
      if (transcript_.size() == hello_bytes_.size() ||
          !equal_secrets(buf_, mac(secret_, kServerLabel, transcript_))) {
        error_ = "it accepted this connection without proving it knows the job token: it is not a chorus "
                 "server of this job (another job's process on that address, or a different CHORUS_JOB_TOKEN)";
        state_ = kBad;
        break;
      }
      state_ = kAccepted;
      break;
    default:
      break;
  }
  buf_.clear();
}

std::string Client::take_proof() {
  state_ = kReadingStatus;
  return mac(secret_, kClientLabel, transcript_);
}

void raise_unless_accepted(const Client& client, const std::string& what) {
  if (client.state() == Client::kRefused) throw HandshakeError("refused by " + what + ": " + client.reason());
  if (client.state() == Client::kBad) throw HandshakeError("handshake with " + what + " failed: " + client.error());
}

void client_handshake(int fd, const std::string& secret, const Hello& hello, net::Deadline deadline,
                      const std::string& what) {
  Client client(secret, hello);
  net::IoResult w = net::write_full(fd, client.hello_bytes().data(), client.hello_bytes().size(), deadline);
  // A server that refuses at once may have closed already; its verdict is still readable, so a
  // failed write is reported only if no verdict follows.
  char buf[512];
  while (!client.done()) {
    if (client.state() == Client::kSendProof) {
      const std::string proof = client.take_proof();
      if (w.ok()) w = net::write_full(fd, proof.data(), proof.size(), deadline);
      continue;
    }
    const size_t n = std::min(sizeof(buf), client.want());
    net::IoResult r = net::read_full(fd, buf, n, deadline);
    if (r.code == net::IoResult::kTimeout) {
      throw TimeoutError("handshake with " + what + " timed out waiting for its answer");
    }
    if (!r.ok()) {
      throw PeerError("handshake with " + what + " failed: " + (w.ok() ? r.describe() : w.describe()) +
                      " before it answered (the server closed the connection without a verdict)");
    }
    client.feed(buf, n);
  }
  raise_unless_accepted(client, what);
}

void half_close(int fd) { ::shutdown(fd, SHUT_WR); }

bool drain_until_closed(int fd) {
  char buf[4096];
  for (;;) {
    ssize_t k = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (k > 0) continue;
    if (k == 0) return true;
    if (errno == EINTR) continue;
    return !(errno == EAGAIN || errno == EWOULDBLOCK);
  }
}

}  // namespace chorus::handshake

namespace chorus {

std::string random_token() {
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (char c : handshake::random_bytes(16)) {
    const auto b = static_cast<unsigned char>(c);
    out.push_back(hex[b >> 4]);
    out.push_back(hex[b & 15]);
  }
  return out;
}

}  // namespace chorus
