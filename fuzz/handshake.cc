// Fuzz target: both halves of the connection handshake (src/comm/handshake.h), byte-fed as the
// store server's poll loop and client_handshake() feed them: never more than want() bytes at a
// time. The first input byte picks the side and how the rest is cut into reads; the rest is what
// the peer sends. The server's challenge nonce is random, so a proof never matches: what is fuzzed
// is the framing, the bounds and the state machine, not HMAC.
//
// Checked besides the sanitizers: a side still reading always wants at least one byte (or the
// server's poll loop would stop reading and the peer would hang), and the bytes a side reads
// never exceed its bounds.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "chorus/comm/error.h"
#include "comm/handshake.h"

namespace hs = chorus::handshake;

namespace {

const std::string kToken = "fuzz-job-token";

void fuzz_server(const char* p, size_t n, size_t chunk) {
  hs::Server server(kToken);
  size_t off = 0, read = 0;
  while (true) {
    const hs::Server::State st = server.state();
    if (st == hs::Server::kHello) {
      if (server.hello().version != hs::kProtocolVersion) return;  // the server refuses
      if (server.hello().payload.size() > hs::kMaxPayloadBytes) std::abort();
      (void)server.challenge();
      continue;
    }
    if (st == hs::Server::kProof) {
      if (server.proven()) std::abort();  // nobody here knows a proof for a random nonce
      (void)hs::Server::refusal("job token mismatch");
      return;
    }
    if (st == hs::Server::kBad) {
      if (server.error().empty()) std::abort();
      return;
    }
    const size_t want = server.want();
    if (want == 0) std::abort();
    if (off == n) return;  // the peer stopped sending: a timeout or a hang-up in the server
    const size_t take = std::min({want, n - off, chunk});
    server.feed(p + off, take);
    off += take;
    read += take;
    if (read > 8 + hs::kNonceBytes + 4 + hs::kMaxPayloadBytes + hs::kMacBytes) std::abort();
  }
}

void fuzz_client(const char* p, size_t n, size_t chunk) {
  hs::Hello hello;
  hello.kind = hs::PeerKind::kTransport;
  hello.payload = "group=default\nworld_size=2\nfrom=1\nto=0";
  hs::Client client(kToken, hello);
  size_t off = 0;
  while (!client.done()) {
    if (client.state() == hs::Client::kSendProof) {
      (void)client.take_proof();
      continue;
    }
    const size_t want = client.want();
    if (want == 0) std::abort();
    if (off == n) return;  // client_handshake() raises PeerError here (the server closed)
    const size_t take = std::min({want, n - off, chunk});
    client.feed(p + off, take);
    off += take;
  }
  if (client.state() == hs::Client::kAccepted) std::abort();  // a stranger cannot prove the token
  if (client.state() == hs::Client::kRefused && client.reason().size() > hs::kMaxReasonBytes) std::abort();
  try {
    hs::raise_unless_accepted(client, "the fuzzed server");
  } catch (const chorus::HandshakeError&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  // Reads of 1, 2, 3, 7 bytes or of whatever want() says.
  static const size_t kChunks[8] = {1, 2, 3, 7, SIZE_MAX, SIZE_MAX, SIZE_MAX, SIZE_MAX};
  const size_t chunk = kChunks[(mode >> 1) & 7];
  const char* p = reinterpret_cast<const char*>(data + 1);
  if (mode & 1) {
    fuzz_client(p, size - 1, chunk);
  } else {
    fuzz_server(p, size - 1, chunk);
  }
  return 0;
}
