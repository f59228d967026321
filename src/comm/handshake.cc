#include "handshake.h"

#include <cstring>

#include "chorus/comm/error.h"

namespace chorus::handshake {
namespace {

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

}  // namespace

std::string encode_hello(const Hello& hello) {
  std::string out;
  out.reserve(16 + hello.token.size() + hello.payload.size());
  put_u32(out, kMagic);
  put_u16(out, hello.version);
  put_u16(out, static_cast<uint16_t>(hello.kind));
  put_u32(out, static_cast<uint32_t>(hello.token.size()));
  out += hello.token;
  put_u32(out, static_cast<uint32_t>(hello.payload.size()));
  out += hello.payload;
  return out;
}

Parse parse_hello(const char* data, size_t n, Hello* hello, size_t* consumed, std::string* error) {
  if (n >= 4 && get_u32(data) != kMagic) {
    *error = "not a chorus peer (bad magic; is another program connecting to this port?)";
    return Parse::kBad;
  }
  if (n < 12) return Parse::kNeedMore;
  uint16_t version = get_u16(data + 4);
  uint16_t kind = get_u16(data + 6);
  uint32_t token_len = get_u32(data + 8);
  if (token_len > kMaxTokenBytes) {
    *error = "job token too long (" + std::to_string(token_len) + " bytes)";
    return Parse::kBad;
  }
  if (kind != static_cast<uint16_t>(PeerKind::kStoreClient) &&
      kind != static_cast<uint16_t>(PeerKind::kTransport)) {
    *error = "unknown connection kind " + std::to_string(kind);
    return Parse::kBad;
  }
  size_t off = 12 + token_len;
  if (n < off + 4) return Parse::kNeedMore;
  uint32_t payload_len = get_u32(data + off);
  if (payload_len > kMaxPayloadBytes) {
    *error = "hello payload too long (" + std::to_string(payload_len) + " bytes)";
    return Parse::kBad;
  }
  off += 4;
  if (n < off + payload_len) return Parse::kNeedMore;
  hello->version = version;
  hello->kind = static_cast<PeerKind>(kind);
  hello->token.assign(data + 12, token_len);
  hello->payload.assign(data + off, payload_len);
  *consumed = off + payload_len;
  return Parse::kOk;
}

std::string encode_verdict(bool accepted, const std::string& reason) {
  std::string out;
  out.push_back(accepted ? 0 : 1);
  put_u32(out, static_cast<uint32_t>(reason.size()));
  out += reason;
  return out;
}

Parse parse_verdict(const char* data, size_t n, bool* accepted, std::string* reason, size_t* consumed) {
  if (n < 5) return Parse::kNeedMore;
  uint32_t len = get_u32(data + 1);
  if (len > kMaxPayloadBytes) return Parse::kBad;
  if (n < 5 + len) return Parse::kNeedMore;
  *accepted = data[0] == 0;
  reason->assign(data + 5, len);
  *consumed = 5 + len;
  return Parse::kOk;
}

bool tokens_equal(const std::string& a, const std::string& b) {
  // Compare over the longer length so timing does not reveal a matching prefix.
  size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

void client_handshake(int fd, const Hello& hello, net::Deadline deadline, const std::string& what) {
  send_hello(fd, hello, deadline, what);
  await_verdict(fd, deadline, what);
}

void send_hello(int fd, const Hello& hello, net::Deadline deadline, const std::string& what) {
  std::string msg = encode_hello(hello);
  net::IoResult w = net::write_full(fd, msg.data(), msg.size(), deadline);
  if (!w.ok()) {
    throw PeerError("handshake with " + what + " failed while sending: " + w.describe());
  }
}

void await_verdict(int fd, net::Deadline deadline, const std::string& what) {
  char head[5];
  net::IoResult r = net::read_full(fd, head, sizeof(head), deadline);
  if (r.code == net::IoResult::kTimeout) {
    throw TimeoutError("handshake with " + what + " timed out waiting for its answer");
  }
  if (!r.ok()) {
    throw PeerError("handshake with " + what + " failed: " + r.describe() +
                    " (the server may have refused this connection)");
  }
  uint32_t len = get_u32(head + 1);
  if (len > kMaxPayloadBytes) throw PeerError("handshake with " + what + ": malformed answer");
  std::string reason(len, '\0');
  if (len > 0) {
    r = net::read_full(fd, reason.data(), len, deadline);
    if (!r.ok()) throw PeerError("handshake with " + what + " failed: " + r.describe());
  }
  if (head[0] != 0) {
    throw HandshakeError("refused by " + what + ": " + reason);
  }
}

bool read_hello(int fd, net::Deadline deadline, Hello* hello, std::string* error) {
  std::string buf;
  char chunk[512];
  for (;;) {
    size_t consumed = 0;
    Parse p = parse_hello(buf.data(), buf.size(), hello, &consumed, error);
    if (p == Parse::kOk) return true;
    if (p == Parse::kBad) return false;
    // Read only what is already there or arrives before the deadline; never past the hello.
    size_t want = 12;
    if (buf.size() >= 12) {
      uint32_t token_len = get_u32(buf.data() + 8);
      want = 12 + token_len + 4;
      if (buf.size() >= want) want += get_u32(buf.data() + 12 + token_len);
    }
    size_t n = std::min(sizeof(chunk), want - buf.size());
    net::IoResult r = net::read_full(fd, chunk, n, deadline);
    if (!r.ok()) {
      *error = "while reading hello: " + r.describe();
      return false;
    }
    buf.append(chunk, n);
  }
}

void send_verdict(int fd, bool accepted, const std::string& reason, net::Deadline deadline) {
  std::string msg = encode_verdict(accepted, reason);
  net::write_full(fd, msg.data(), msg.size(), deadline);
}

}  // namespace chorus::handshake
