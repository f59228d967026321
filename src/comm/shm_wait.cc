// Waiting in the shared-memory transport (docs/shm.md, "Waiting, failures and timeouts"): spin,
// then sleep on a futex in the waiter's own header (its "doorbell"); whoever changes something a
// peer may wait on rings the peer's doorbell. Before sleeping, a waiter checks its peers: a
// failure they published, a call that differs from this one, a departure, and the one deadlock a
// rank can see (it waits on a ring for a peer that waits at a barrier for it). Every wait ends by
// the operation's deadline with a TimeoutError naming the peers it still waits for.

#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <sstream>

#include "chorus/comm/error.h"
#include "error_class.h"
#include "shm_transport.h"

namespace chorus::transport::shm {

using net::Clock;

namespace {

long futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const timespec* ts) {
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, ts, nullptr, 0);
}

// How long a sleeper waits for its doorbell at most: peers' deaths are noticed by polling.
constexpr auto kMaxSleep = std::chrono::milliseconds(50);

}  // namespace

void ShmTransport::ring(int peer) {
  SegHeader& h = hdr(peer);
  h.doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (h.sleeping.load(std::memory_order_seq_cst) != 0) futex(&h.doorbell, FUTEX_WAKE, INT32_MAX, nullptr);
}

void ShmTransport::ring_all() {
  for (int r = 0; r < o_.size; ++r) {
    if (r != o_.rank && segs_[static_cast<size_t>(r)].hdr != nullptr) ring(r);
  }
}

void ShmTransport::wait_until(const std::function<bool()>& done, const char* what) {
  if (aborted_ || closed_) throw Ranked<PeerError>(prefix() + ": the transport is closed");
  for (;;) {
    if (pump() && done()) return;
    if (done()) return;
    // Busy-wait only while the spin gate allows it (a thread waits for this work, its core idle).
    const bool may_spin = gate_ == nullptr || gate_->load(std::memory_order_relaxed) > 0;
    const auto spin_until = Clock::now() + std::chrono::microseconds(may_spin ? o_.spin_us : 0);
    bool moved = false;
    while (Clock::now() < spin_until) {
      if (pump() || done()) {
        moved = true;
        break;
      }
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
    if (moved) continue;
    check_peers();
    if (Clock::now() >= deadline_) fail_timeout(what);
    sleep_until_rung(done);
  }
}

// Sleeps until a peer rings this rank's doorbell, the deadline, or kMaxSleep.
void ShmTransport::sleep_until_rung(const std::function<bool()>& done) {
  SegHeader& h = my_hdr();
  h.sleeping.store(1, std::memory_order_seq_cst);
  const uint32_t bell = h.doorbell.load(std::memory_order_seq_cst);
  if (!pump() && !done()) {  // re-check after announcing the sleep: no wake-up is lost
    const auto left = std::min<Clock::duration>(deadline_ - Clock::now(), kMaxSleep);
    if (left > Clock::duration::zero()) {
      timespec ts{0, static_cast<long>(std::chrono::duration_cast<std::chrono::nanoseconds>(left).count())};
      futex(&h.doorbell, FUTEX_WAIT, bell, &ts);
    }
  }
  h.sleeping.store(0, std::memory_order_relaxed);
}

void ShmTransport::barrier(const char* what) {
  ++stage_;
  SegHeader& h = my_hdr();
  h.stage.store(stage_, std::memory_order_release);
  ring_all();
  in_barrier_ = true;
  h.in_barrier.store(1, std::memory_order_release);
  struct Reset {
    bool& flag;
    std::atomic<uint32_t>& shared;
    ~Reset() {
      flag = false;
      shared.store(0, std::memory_order_release);
    }
  } reset{in_barrier_, h.in_barrier};
  wait_until([&] {
    for (int p = 0; p < o_.size; ++p) {
      if (hdr(p).stage.load(std::memory_order_acquire) < stage_) return false;
    }
    return true;
  }, what);
}

// Throws MismatchError when `peer` has published a different call for this call's sequence
// number (it publishes in begin(), before it can reach any barrier of the call).
// `strict`: the peer has reached this call's first barrier, so it must be in a collective with
// this call's sequence number; otherwise only a published call for it is compared.
void ShmTransport::check_same_call(int peer, bool strict) const {
  if (call_.op == wire::OpType::kSend || call_.op == wire::OpType::kRecv) return;
  const SegHeader& h = hdr(peer);
  const Desc& d = h.desc[call_.seq % kDescHistory];
  // A seqlock read: the peer may be rewriting this slot for a later call while it is read.
  uint64_t seen = 0;
  wire::Call theirs;
  for (;;) {
    seen = d.seq_plus_one.load(std::memory_order_acquire);
    theirs = d.call;
    std::atomic_thread_fence(std::memory_order_acquire);
    if (d.seq_plus_one.load(std::memory_order_relaxed) == seen) break;
  }
  if (seen == call_.seq + 1) {
    if (wire::same_call(wire::make_header(theirs, 0), call_)) {
      if (strict) check_same_buffer(peer, d);
      return;
    }
  } else if (!strict) {
    return;
  } else {
    // It is in another collective: the latest it published names it.
    uint64_t latest = 0;
    for (const Desc& e : h.desc) {
      const uint64_t v = e.seq_plus_one.load(std::memory_order_acquire);
      if (v > latest) {
        latest = v;
        theirs = e.call;
      }
    }
    if (latest == 0) theirs = wire::Call{};
  }
  throw MismatchError(wire::mismatch_message(me(), call_, peer_name(peer), "called " + wire::describe(theirs)));
}

// Past the first barrier, the peer's descriptor for this call is final: an allreduce on a shared
// buffer must use the same buffer and offset on every rank (each rank reads the others' copies),
// and either every rank's memory is shared or none is.
void ShmTransport::check_same_buffer(int peer, const Desc& d) const {
  const Desc& m = my_hdr().desc[call_.seq % kDescHistory];
  const uint64_t mr = m.region.load(std::memory_order_relaxed), mo = m.offset.load(std::memory_order_relaxed);
  const uint64_t tr = d.region.load(std::memory_order_relaxed), to = d.offset.load(std::memory_order_relaxed);
  if (mr == tr && mo == to) return;
  auto where = [](uint64_t r, uint64_t o) {
    return r == 0 ? std::string("ordinary memory")
                  : "shared buffer #" + std::to_string(r - 1) + " at byte " + std::to_string(o);
  };
  throw Ranked<MismatchError>(me() + ": " + wire::describe(call_) + ": this rank's data is in " + where(mr, mo) + " but " +
                      peer_name(peer) + "'s is in " + where(tr, to) +
                      "; buffers from ProcessGroup::allocate_buffer must be used the same way on every rank "
                      "(the same buffer and range everywhere, or none)");
}

void ShmTransport::check_agreement() const {
  for (int p = 0; p < o_.size; ++p) {
    if (p != o_.rank) check_same_call(p, /*strict=*/true);
  }
}

// The operation `peer` is in now (its last begin()).
wire::Call ShmTransport::current_call(int peer) const {
  const CurrentCall& cur = hdr(peer).current;
  for (int tries = 0; tries < 1000; ++tries) {
    const uint64_t v = cur.version.load(std::memory_order_acquire);
    wire::Call c = cur.call;
    std::atomic_thread_fence(std::memory_order_acquire);
    if (v % 2 == 0 && cur.version.load(std::memory_order_relaxed) == v) return c;
  }
  return wire::Call{};
}

// Whether `peer`'s process has exited (its pidfd is readable; without pidfds, kill(pid, 0)).
bool ShmTransport::gone(int peer) const {
  const int fd = pidfds_[static_cast<size_t>(peer)];
  if (fd >= 0) {
    pollfd pfd{fd, POLLIN, 0};
    return ::poll(&pfd, 1, 0) > 0;
  }
  return ::kill(hdr(peer).pid, 0) != 0 && errno == ESRCH;
}

// Whether this rank still needs something from `peer` to finish what it is waiting for.
bool ShmTransport::waiting_on(int peer) const {
  return !recvs_[static_cast<size_t>(peer)].empty() || !sends_[static_cast<size_t>(peer)].empty() ||
         (in_barrier_ && hdr(peer).stage.load(std::memory_order_acquire) < stage_);
}

// Peers' failures, departures and disagreements, checked whenever this rank is about to sleep.
void ShmTransport::check_peers() {
  for (int p = 0; p < o_.size; ++p) {
    if (p != o_.rank) check_peer_state(p);
  }
}

void ShmTransport::check_peer_state(int p) {
  const SegHeader& h = hdr(p);
  const uint32_t st = h.state.load(std::memory_order_acquire);
  if (st == kAborted) {
    throw_error(h.error_class, prefix() + ": failed because " + peer_name(p) + " failed: " + h.message);
  }
  check_same_call(p, /*strict=*/false);
  if (probing_[static_cast<size_t>(p)] != 0) {
    // probe_any passes over a candidate that closed its group or cannot send now; one that died
    // fails it, as a dead peer fails any operation that waits on it.
    if (st != kClosed && gone(p)) {
      throw Ranked<PeerError>(prefix() + " from any source: peer " + peer_name(p) + " died (its process is gone) [after " +
                      net::format_duration(Clock::now() - start_) + "]");
    }
    return;
  }
  if (!waiting_on(p)) return;  // a peer that finished and left owes this rank nothing
  // This rank waits on a ring for `p` while `p` waits at a native collective's barrier for this
  // rank: neither can move, whatever happens next. (A barrier needs every rank.)
  if (!in_barrier_ && h.in_barrier.load(std::memory_order_acquire) != 0 &&
      h.stage.load(std::memory_order_acquire) > stage_) {
    pump();  // take what it wrote before it got there
    if (waiting_on(p)) {
      throw MismatchError(wire::mismatch_message(
          me(), call_, peer_name(p),
          "is in " + wire::describe(current_call(p)) + ", waiting for this rank at a shared-memory barrier"));
    }
  }
  const bool dead = gone(p);
  if (st != kClosed && !dead) return;
  // It left: take what it wrote before it went, and fail only if that is not enough.
  pump();
  if (!waiting_on(p)) return;
  if (st == kClosed) {
    throw Ranked<PeerError>(prefix() + ": peer " + peer_name(p) + " has closed its process group (it finished or "
                    "destroyed the group) but this operation still needs it");
  }
  throw Ranked<PeerError>(prefix() + ": peer " + peer_name(p) + " died (its process is gone) [after " +
                  net::format_duration(Clock::now() - start_) + "]");
}

void ShmTransport::fail_timeout(const char* what) {
  std::ostringstream out;
  out << prefix() << ": timed out after " << net::format_duration(Clock::now() - start_) << " waiting for";
  const char* sep = " ";
  for (int p = 0; p < o_.size; ++p) {
    if (p == o_.rank) continue;
    const bool waiting = !recvs_[static_cast<size_t>(p)].empty() || !sends_[static_cast<size_t>(p)].empty() ||
                         hdr(p).stage.load() < stage_ || probing_[static_cast<size_t>(p)] != 0;
    if (waiting) {
      const wire::Call theirs = current_call(p);
      out << sep << peer_name(p)
          << (theirs.op == wire::OpType::kNone ? std::string(", which has run no operation yet")
                                               : ", whose latest operation is " + wire::describe(theirs));
      sep = "; ";
    }
  }
  out << " (" << what << "). The peer may be stuck or slower, or may be calling a different collective; "
         "if it is legitimately slow, raise the timeout in the group's Options";
  throw TimeoutError(out.str());
}

}  // namespace chorus::transport::shm
