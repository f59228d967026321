// TcpStoreServer, what a connection's bytes mean (docs/store.md): the server's half of the
// handshake and its verdicts, the requests parsed from a connection's input and executed in order,
// a large set received straight into the stored string, the map of keys and values, and the gets
// and waits parked until their keys exist or their time is up. The poll loop that reads and writes
// the bytes is tcp_store_server.cc; the state both share is tcp_store_server.h.
#include <algorithm>
#include <cstring>
#include <unordered_set>

#include "store_internal.h"
#include "tcp_store_server.h"

namespace chorus {
namespace {

using store_protocol::Command;
using store_protocol::get_u32;
using store_protocol::kMaxKeyBytes;
using store_protocol::Parse;
using store_protocol::Request;
using store_protocol::Status;
using store_protocol::value_too_large;
using store_protocol::Writer;

// A set whose value is at least this large is received straight into the string the store keeps,
// so the server holds the value once, not twice (input buffer and stored copy).
constexpr uint32_t kDirectValueBytes = 64 * 1024;
// How long a refused peer has to take its verdict before the server closes the connection.
constexpr std::chrono::milliseconds kLingerTimeout{1000};

}  // namespace

// Handles the complete messages at the front of c.in, one at a time: a client's requests are
// answered in order, so a parked wait or an unsent reply holds back the ones behind it.
void TcpStoreServer::Impl::process(Client& c) {
  try {
    while ((c.phase == Phase::kHello || c.phase == Phase::kServing) && !c.parked && !c.receiving_value &&
           c.skip == 0 && c.out_off == c.out.size() && c.in_off < c.in.size()) {
      const char* p = c.in.data() + c.in_off;
      const size_t n = c.in.size() - c.in_off;
      if (c.phase == Phase::kHello) {
        const size_t take = std::min(n, c.hs->want());
        c.hs->feed(p, take);
        c.in_off += take;
        handshake_step(c);
        continue;
      }
      if (start_large_set(c, p, n)) continue;
      size_t consumed = 0;
      std::string error;
      Request req;
      Parse parse = store_protocol::parse_request(p, n, max_value, &req, &consumed, &error);
      if (parse == Parse::kNeedMore) break;
      if (parse == Parse::kBad) {
        drop_malformed(c, error);
        break;
      }
      c.in_off += consumed;
      execute(c, req);
    }
  } catch (const std::exception& e) {  // std::bad_alloc for a huge value, most likely
    log("dropping " + c.peer + ": " + e.what());
    c.phase = Phase::kDead;
  }
  if (c.in_off == c.in.size()) {
    c.in.clear();
    c.in_off = 0;
  } else if (c.in_off > (1u << 20) && c.in_off > c.in.size() / 2) {
    c.in.erase(0, c.in_off);
    c.in_off = 0;
  }
}

// The server's half of the challenge-response (handshake.h), one step per complete message.
void TcpStoreServer::Impl::handshake_step(Client& c) {
  handshake::Server& hs = *c.hs;
  if (hs.state() == handshake::Server::kBad) {
    malformed.fetch_add(1);
    log("dropping " + c.peer + ": malformed hello: " + hs.error());
    refuse(c, hs.error());
  } else if (hs.state() == handshake::Server::kHello) {
    std::string reason;
    if (hs.hello().version != handshake::kProtocolVersion) {
      reason = "protocol version mismatch: the client speaks version " + std::to_string(hs.hello().version) +
               ", this store speaks version " + std::to_string(handshake::kProtocolVersion) +
               "; run the same chorus build on every host";
    } else if (hs.hello().kind != handshake::PeerKind::kStoreClient) {
      reason = "this port serves a chorus TcpStore, not transport connections; check the address "
               "and port the peer was given";
    }
    if (!reason.empty()) {
      refused.fetch_add(1);
      log("refused " + c.peer + ": " + reason);
      refuse(c, reason);
      return;
    }
    send(c, hs.challenge());
  } else if (hs.state() == handshake::Server::kProof) {
    if (!hs.proven()) {
      const std::string reason =
          "job token mismatch: this store belongs to another job (its proof of the job token did not "
          "match); set CHORUS_JOB_TOKEN to the job's token";
      refused.fetch_add(1);
      log("refused " + c.peer + ": " + reason);
      refuse(c, reason);
      return;
    }
    send(c, hs.accept());
    c.hs.reset();
    c.phase = Phase::kServing;
    c.deadline = net::Deadline::max();
  }
}

// Sends a refusal verdict, then half-closes once it is out and reads until the peer closes (or the
// linger time is up), so the verdict is never destroyed by a reset.
void TcpStoreServer::Impl::refuse(Client& c, const std::string& reason) {
  c.phase = Phase::kClosing;
  c.deadline = net::deadline_after(kLingerTimeout);
  c.in.clear();
  c.in_off = 0;
  send(c, handshake::Server::refusal(reason));
}

// A set with a large value: once its key and value length have arrived, the value is read straight
// into the string the store will keep (or, beyond max_value_bytes, read and dropped after an error
// reply naming the key, the size and the option). Returns false for any other request.
bool TcpStoreServer::Impl::start_large_set(Client& c, const char* p, size_t n) {
  if (n < 5 || static_cast<uint8_t>(p[0]) != uint8_t(Command::kSet)) return false;
  const uint32_t key_len = get_u32(p + 1);
  if (key_len > kMaxKeyBytes || n < 9 + size_t{key_len}) return false;
  const uint32_t value_len = get_u32(p + 5 + key_len);
  const size_t have = n - 9 - key_len;
  const bool too_large = value_len > max_value;
  if (!too_large && (value_len < kDirectValueBytes || have >= value_len)) return false;
  const std::string key(p + 5, key_len);
  c.in_off += 9 + key_len;
  const size_t now = std::min<size_t>(have, value_len);
  if (too_large) {
    send(c, Writer()
                .u8(uint8_t(Status::kError))
                .str(value_too_large(name, key, value_len, max_value, "TcpStoreServerOptions::max_value_bytes"))
                .take());
    c.in_off += now;
    c.skip = value_len - now;
    return true;
  }
  c.value_key = key;
  c.value.resize(value_len);  // allocated once, at its final size
  std::memcpy(&c.value[0], p + 9 + key_len, now);
  c.in_off += now;
  c.value_got = now;
  c.receiving_value = true;
  return true;
}

void TcpStoreServer::Impl::finish_direct_set(Client& c) {
  c.receiving_value = false;
  c.value_got = 0;
  put(c.value_key, std::move(c.value));
  c.value = std::string();
  send(c, Writer().u8(uint8_t(Status::kOk)).take());
  notify(c.value_key);
  runnable.push_back(c.id);  // requests may have queued behind the value
}

// Every write and delete of `data` goes through these two, which keep key_bytes.
const std::string& TcpStoreServer::Impl::put(const std::string& key, std::string value) {
  auto [it, added] = data.try_emplace(key);
  key_bytes += static_cast<int64_t>(value.size()) - static_cast<int64_t>(it->second.size()) +
               (added ? static_cast<int64_t>(key.size()) : 0);
  it->second = std::move(value);
  return it->second;
}

bool TcpStoreServer::Impl::erase(const std::string& key) {
  auto it = data.find(key);
  if (it == data.end()) return false;
  key_bytes -= static_cast<int64_t>(key.size() + it->second.size());
  data.erase(it);
  return true;
}

bool TcpStoreServer::Impl::has_all(const std::vector<std::string>& keys) const {
  for (const auto& k : keys) {
    if (data.count(k) == 0) return false;
  }
  return true;
}

void TcpStoreServer::Impl::execute(Client& c, Request& req) {
  Writer w;
  switch (req.cmd) {
    case Command::kSet:
      put(req.key, std::move(req.value));
      send(c, w.u8(uint8_t(Status::kOk)).take());
      notify(req.key);
      return;
    case Command::kGet: {
      auto it = data.find(req.key);
      if (it != data.end()) {
        send(c, w.u8(uint8_t(Status::kOk)).str(it->second).take());
      } else {
        park(c, Command::kGet, {req.key}, req.number);
      }
      return;
    }
    case Command::kAdd: {
      auto it = data.find(req.key);
      int64_t result = 0;
      std::string error;
      if (!detail::add_to_value(req.key, it == data.end() ? nullptr : &it->second, req.number,
                                &result, &error)) {
        send(c, w.u8(uint8_t(Status::kError)).str(error).take());
        return;
      }
      put(req.key, std::to_string(result));
      send(c, w.u8(uint8_t(Status::kOk)).i64(result).take());
      notify(req.key);
      return;
    }
    case Command::kCompareSet: {
      auto it = data.find(req.key);
      const std::string* now = nullptr;
      if (it == data.end()) {
        if (!req.expected.empty()) now = &req.expected;
      } else if (it->second != req.expected) {
        now = &it->second;
      }
      if (now != nullptr) {
        send(c, w.u8(uint8_t(Status::kOk)).str(*now).take());
        return;
      }
      send(c, w.u8(uint8_t(Status::kOk)).str(put(req.key, std::move(req.value))).take());
      notify(req.key);
      return;
    }
    case Command::kWait:
      if (has_all(req.keys)) {
        send(c, w.u8(uint8_t(Status::kOk)).take());
      } else {
        park(c, Command::kWait, std::move(req.keys), req.number);
      }
      return;
    case Command::kCheck:
      send(c, w.u8(uint8_t(Status::kOk)).u8(has_all(req.keys) ? 1 : 0).take());
      return;
    case Command::kDelete: {
      const bool erased = erase(req.key);
      send(c, w.u8(uint8_t(Status::kOk)).u8(erased ? 1 : 0).take());
      return;
    }
    case Command::kNumKeys:
      send(c, w.u8(uint8_t(Status::kOk)).i64(static_cast<int64_t>(data.size())).take());
      return;
  }
}

// Parks a get or wait until its keys exist or its timeout passes; either way it gets a reply,
// so the client's stream stays in step.
void TcpStoreServer::Impl::park(Client& c, Command cmd, std::vector<std::string> keys, int64_t timeout) {
  if (timeout <= 0) {
    reply_timeout(c, keys);
    return;
  }
  c.parked = true;
  c.parked_cmd = cmd;
  c.parked_keys = std::move(keys);
  c.deadline = net::deadline_after(std::chrono::milliseconds(timeout));
  std::unordered_set<std::string> seen;
  for (const auto& k : c.parked_keys) {
    if (seen.insert(k).second) watchers[k].push_back(c.id);
  }
}

void TcpStoreServer::Impl::unpark(Client& c) {
  std::unordered_set<std::string> seen;
  for (const auto& k : c.parked_keys) {
    if (!seen.insert(k).second) continue;
    auto it = watchers.find(k);
    if (it == watchers.end()) continue;
    auto& ids = it->second;
    ids.erase(std::remove(ids.begin(), ids.end(), c.id), ids.end());
    if (ids.empty()) watchers.erase(it);
  }
  c.parked = false;
  c.parked_keys.clear();
  c.deadline = net::Deadline::max();
  runnable.push_back(c.id);
}

void TcpStoreServer::Impl::reply_timeout(Client& c, const std::vector<std::string>& keys) {
  std::vector<std::string> missing;
  for (const auto& k : keys) {
    if (data.count(k) == 0) missing.push_back(k);
  }
  send(c, Writer().u8(uint8_t(Status::kTimeout)).keys(missing).take());
}

// `key` was written: answer the parked waits that it completes.
void TcpStoreServer::Impl::notify(const std::string& key) {
  auto it = watchers.find(key);
  if (it == watchers.end()) return;
  const std::vector<uint64_t> ids = it->second;  // unpark() edits the list
  for (uint64_t id : ids) {
    auto found = clients.find(id);
    if (found == clients.end()) continue;
    Client& c = *found->second;
    if (!c.parked || !has_all(c.parked_keys)) continue;
    Writer w;
    w.u8(uint8_t(Status::kOk));
    if (c.parked_cmd == Command::kGet) w.str(data.at(c.parked_keys[0]));
    unpark(c);
    if (c.phase == Phase::kServing) send(c, w.take());
  }
}

}  // namespace chorus
