// The shared-memory transport: setup, point-to-point messages, abort and close (shm_transport.h
// lists where its other parts live; docs/shm.md describes the design).
//
// Every rank owns one segment, mapped read-write by all ranks of the group (shm_segment.h). Rings
// carry the same messages as TCP (wire::Header + payload), so every generic algorithm and the
// mismatch checks work unchanged; a ring is single-producer (the owner) single-consumer.

#include "shm_transport.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <new>
#include <thread>

#include "chorus/comm/error.h"
#include "chorus/comm/hash.h"
#include "chorus/comm/store.h"
#include "error_class.h"

namespace chorus::transport {
namespace shm {

using net::Clock;
using net::Deadline;

void ShmTransport::setup() {
  const int n = o_.size;
  sweep_stale_segments();
  name_ = new_segment_name(o_.rank);
  int fd = create_segment(name_, layout_.seg_bytes, me());
  named_ = true;
  segs_.resize(static_cast<size_t>(n));
  segs_[static_cast<size_t>(o_.rank)] = map_segment(fd, layout_.seg_bytes, me());
  SegHeader* h = new (me_hdr()) SegHeader();
  h->rank = o_.rank;
  h->size = n;
  h->pid = ::getpid();
  h->token_hash = fnv1a64(o_.token);
  h->ring_bytes = layout_.ring_bytes;
  h->collective_bytes = layout_.chunk;
  h->small_bytes = o_.small_bytes;
  h->magic = kSegMagic;

  map_peers(*h);
  pidfds_.assign(static_cast<size_t>(n), -1);
  for (int r = 0; r < n; ++r) {
    if (r != o_.rank) pidfds_[static_cast<size_t>(r)] = static_cast<int>(::syscall(SYS_pidfd_open, hdr(r).pid, 0));
  }
  wait_until_all_mapped();
  // Everyone has mapped everyone: the names can go, so nothing outlives the processes.
  ::shm_unlink(name_.c_str());
  named_ = false;
  recvs_.resize(static_cast<size_t>(n));
  probing_.assign(static_cast<size_t>(n), 0);
  sends_.resize(static_cast<size_t>(n));
  senders_.resize(static_cast<size_t>(n));
  receivers_.resize(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    if (r == o_.rank) continue;
    senders_[static_cast<size_t>(r)] = RingSender(segs_[static_cast<size_t>(o_.rank)].ring(layout_, r));
    receivers_[static_cast<size_t>(r)] = RingReceiver(segs_[static_cast<size_t>(r)].ring(layout_, o_.rank));
  }
}

// Announces this rank's segment and host, then maps every peer's segment and checks that it
// belongs to this job and configuration.
void ShmTransport::map_peers(const SegHeader& mine) {
  const int n = o_.size;
  const std::string host = o_.host_id.empty() ? host_identity() : o_.host_id;
  const auto all = exchange_announcements(*o_.store, o_.key_prefix + "/shm", o_.rank, n, o_.token, {host, name_},
                                          o_.deadline);
  for (int r = 0; r < n; ++r) {
    if (r == o_.rank) continue;
    const std::string& their_host = all[static_cast<size_t>(r)].host;
    const std::string& their_name = all[static_cast<size_t>(r)].extra;
    if (their_host != host) {
      throw Ranked<UsageError>(me() + ": transport 'shm' needs every rank on one host, but rank " +
                       std::to_string(global_rank(r)) + " is on another (" + their_host + " vs " + host +
                       "); use transport 'hybrid' or 'auto'");
    }
    int pfd = ::shm_open(their_name.c_str(), O_RDWR | O_CLOEXEC, 0600);
    if (pfd < 0) {
      throw Ranked<Error>(me() + ": cannot open rank " + std::to_string(r) + "'s shared memory " + their_name + ": " +
                  std::strerror(errno));
    }
    segs_[static_cast<size_t>(r)] = map_segment(pfd, layout_.seg_bytes, me());
    const SegHeader& ph = hdr(r);
    if (ph.magic != kSegMagic || ph.token_hash != mine.token_hash || ph.size != n ||
        ph.ring_bytes != mine.ring_bytes || ph.collective_bytes != mine.collective_bytes ||
        ph.small_bytes != o_.small_bytes) {
      throw Ranked<HandshakeError>(me() + ": rank " + std::to_string(r) + "'s shared memory belongs to another job or "
                           "configuration (job token, world size or shared-memory sizes differ: every rank needs the same "
                           "shm_chunk_bytes and shm_small_bytes)");
    }
  }
}

// Counts the ranks that have mapped everyone in the store, failing early when a peer dies.
void ShmTransport::wait_until_all_mapped() {
  const int n = o_.size;
  const std::string count = o_.key_prefix + "/shm/mapped";
  o_.store->add(count, 1);
  while (o_.store->add(count, 0) < n) {
    if (Clock::now() > o_.deadline) throw Ranked<TimeoutError>(me() + ": shared-memory setup timed out waiting for the other ranks to map");
    for (int r = 0; r < n; ++r) {
      if (r == o_.rank) continue;
      const SegHeader& ph = hdr(r);
      const uint32_t st = ph.state.load(std::memory_order_acquire);
      if (!gone(r) && st == kLive) continue;
      // A peer that saw the last rank map has finished setup and may already have failed in its
      // first operation: then setup is complete here too, and that operation reports the failure.
      if (o_.store->add(count, 0) >= n) break;
      if (st == kAborted) {
        throw_error(ph.error_class, me() + ": " + peer_name(r) + " failed during shared-memory setup: " + ph.message);
      }
      throw Ranked<PeerError>(me() + ": " + peer_name(r) + " failed or exited during shared-memory setup");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

std::string ShmTransport::peer_name(int peer) const {
  const SegHeader* h = segs_[static_cast<size_t>(peer)].hdr;
  return "rank " + std::to_string(global_rank(peer)) + " (pid " + std::to_string(h ? h->pid : -1) + ", shared memory)";
}

// The rank in the whole group (different from the shared-memory rank inside a hybrid group).
int ShmTransport::global_rank(int local) const {
  return o_.global_ranks.empty() ? local : o_.global_ranks.at(static_cast<size_t>(local));
}

int ShmTransport::check_peer(int peer) const {
  if (peer < 0 || peer >= o_.size || peer == o_.rank) {
    throw Ranked<UsageError>(me() + ": invalid peer rank " + std::to_string(peer));
  }
  return peer;
}

void ShmTransport::begin(const wire::Call& call, Deadline deadline) {
  call_ = call;
  start_ = Clock::now();
  deadline_ = deadline;
  CurrentCall& cur = my_hdr().current;
  const uint64_t v = cur.version.load(std::memory_order_relaxed);
  cur.version.store(v + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  cur.call = call;
  cur.version.store(v + 2, std::memory_order_release);
  if (call.op != wire::OpType::kSend && call.op != wire::OpType::kRecv) {
    Desc& d = my_hdr().desc[call.seq % kDescHistory];
    d.call = call;
    d.region.store(0, std::memory_order_relaxed);
    d.offset.store(0, std::memory_order_relaxed);
    d.seq_plus_one.store(call.seq + 1, std::memory_order_release);
  }
}

void ShmTransport::publish_buffer(uint64_t region_plus_one, uint64_t offset) {
  Desc& d = my_hdr().desc[call_.seq % kDescHistory];
  d.offset.store(offset, std::memory_order_relaxed);
  d.region.store(region_plus_one, std::memory_order_release);
}

Ticket ShmTransport::send(int peer, const wire::Header& header, const void* data, size_t n) {
  Ticket t = next_++;
  sends_[static_cast<size_t>(check_peer(peer))].push_back(SendItem{t, header, static_cast<const char*>(data), n});
  pending_.insert(t);
  return t;
}

Ticket ShmTransport::recv(int peer, const wire::Call& expect, void* data, size_t n) {
  Ticket t = next_++;
  recvs_[static_cast<size_t>(check_peer(peer))].push_back(RecvItem{t, expect, static_cast<char*>(data), n});
  pending_.insert(t);
  return t;
}

// Peeks at the next message in each candidate's ring; wait_until sleeps on this rank's doorbell
// meanwhile and checks the peers: a candidate that dies fails the probe (check_peer_state). One that
// closed its group, whose next message is another one, or that waits for this rank at a native
// collective's barrier cannot send it: when no candidate is left that can, the probe fails.
bool ShmTransport::waits_at_barrier_ahead(int peer) const {
  const SegHeader& theirs = hdr(peer);
  return theirs.in_barrier.load(std::memory_order_acquire) != 0 && theirs.stage.load(std::memory_order_acquire) > stage_;
}

int ShmTransport::probe_any(const std::vector<int>& peers, int64_t tag) {
  probing_.assign(static_cast<size_t>(o_.size), 0);
  for (int p : peers) probing_[static_cast<size_t>(check_peer(p))] = 1;
  struct Clear {
    std::vector<char>& v;
    ~Clear() { v.assign(v.size(), 0); }
  } clear{probing_};
  int found = -1;
  // Called on every spin of the wait: the reasons are put into words only when they are thrown.
  const auto arrived = [&] {
    bool can_still_send = false;
    for (int p : peers) {
      wire::Header h;
      if (receivers_[static_cast<size_t>(p)].peek_header(&h)) {
        if (h.magic != wire::kMessageMagic) throw Ranked<PeerError>(prefix() + ": corrupt message from " + peer_name(p) + " (bad magic)");
        if (h.op == wire::OpType::kSend && h.arg == tag) {
          found = p;
          return true;
        }
        continue;  // its next message is another one
      }
      const SegHeader& theirs = hdr(p);
      if (theirs.state.load(std::memory_order_acquire) == kClosed || waits_at_barrier_ahead(p)) continue;
      can_still_send = true;
    }
    if (can_still_send) return false;
    std::string blocked;  // candidates whose next message is another one, or that wait for this rank
    for (int p : peers) {
      wire::Header h;
      if (receivers_[static_cast<size_t>(p)].peek_header(&h)) {
        blocked += "; " + peer_name(p) + "'s next message is " + wire::describe(h);
      } else if (waits_at_barrier_ahead(p)) {
        blocked += "; " + peer_name(p) + " is in " + wire::describe(current_call(p)) + ", waiting for this rank";
      }
    }
    throw Ranked<MismatchError>(prefix() + " from any source: no rank it could come from can send a message with tag " +
                        std::to_string(tag) + " (the others closed their group)" + blocked +
                        "; every recv from any source needs a matching send");
  };
  wait_until(arrived, "a message from any source");
  return found;
}

void ShmTransport::wait(Ticket t) {
  wait_until([&] { return pending_.count(t) == 0; }, "its next message");
}

void ShmTransport::wait_all() {
  wait_until([&] { return pending_.empty(); }, "its next message");
}

bool ShmTransport::pump_send(int peer) {
  auto& q = sends_[static_cast<size_t>(peer)];
  RingSender& ring_to_peer = senders_[static_cast<size_t>(peer)];
  bool progressed = false;
  while (!q.empty()) {
    SendItem& s = q.front();
    if (ring_to_peer.send_some(s) == 0) break;
    progressed = true;
    ring(peer);
    if (s.off < sizeof(wire::Header) + s.n) continue;
    pending_.erase(s.ticket);
    q.pop_front();
  }
  return progressed;
}

bool ShmTransport::pump_recv(int peer) {
  auto& q = recvs_[static_cast<size_t>(peer)];
  RingReceiver& ring_from_peer = receivers_[static_cast<size_t>(peer)];
  bool progressed = false;
  while (!q.empty()) {
    RecvItem& r = q.front();
    const auto check = [&](const wire::Header& h) {
      if (h.magic != wire::kMessageMagic) {
        throw Ranked<PeerError>(prefix() + ": corrupt message from " + peer_name(peer) + " (bad magic)");
      }
      if (!wire::same_call(h, r.expect)) {
        throw MismatchError(wire::mismatch_message(me(), r.expect, peer_name(peer), "called " + wire::describe(h)));
      }
      if (h.payload != r.n) {
        throw Ranked<MismatchError>(prefix() + ": " + peer_name(peer) + " sent " + std::to_string(h.payload) +
                            " bytes where this rank expected " + std::to_string(r.n));
      }
    };
    const RingReceiver::Progress p = ring_from_peer.receive_some(r, check);
    if (p.freed) ring(peer);
    progressed |= p.moved;
    if (!r.have_header || r.got < r.n) break;
    pending_.erase(r.ticket);
    q.pop_front();
  }
  return progressed;
}

bool ShmTransport::pump() {
  bool progressed = false;
  bool sending = false;
  for (int p = 0; p < o_.size; ++p) {
    if (p == o_.rank) continue;
    if (!sends_[static_cast<size_t>(p)].empty()) progressed |= pump_send(p);
    sending = sending || !sends_[static_cast<size_t>(p)].empty();
    if (!recvs_[static_cast<size_t>(p)].empty()) progressed |= pump_recv(p);
  }
  // A rank blocked sending empties the rings written to it (RingReceiver::read_ahead), so that a
  // peer blocked sending to it moves on too.
  if (sending) {
    for (int p = 0; p < o_.size; ++p) {
      if (p != o_.rank && recvs_[static_cast<size_t>(p)].empty() && receivers_[static_cast<size_t>(p)].read_ahead()) {
        ring(p);
        progressed = true;
      }
    }
  }
  return progressed;
}

void ShmTransport::abort(const std::string& reason, uint8_t error_class) {
  if (closed_) return;
  SegHeader* h = me_hdr();
  if (h == nullptr) return;
  size_t k = std::min(reason.size(), sizeof(h->message) - 1);
  std::memcpy(h->message, reason.data(), k);
  h->message[k] = '\0';
  h->error_class = error_class;
  h->state.store(kAborted, std::memory_order_release);
  ring_all();
  aborted_ = true;
  pending_.clear();
  for (auto& q : sends_) q.clear();
  for (auto& q : recvs_) q.clear();
}

void ShmTransport::close() {
  if (closed_) return;
  closed_ = true;
  if (named_) ::shm_unlink(name_.c_str());
  if (SegHeader* h = me_hdr(); h != nullptr && !aborted_) {
    h->state.store(kClosed, std::memory_order_release);
    ring_all();
  }
  for (int fd : pidfds_) {
    if (fd >= 0) ::close(fd);
  }
  pidfds_.clear();
}

}  // namespace shm

std::unique_ptr<ShmTransportApi> make_shm_transport(const ShmOptions& options) {
  if (options.store == nullptr) throw UsageError("make_shm_transport: a store is required");
  auto t = std::make_unique<shm::ShmTransport>(options);
  t->setup();
  return t;
}

}  // namespace chorus::transport
