// Internal: the single-producer single-consumer byte ring that carries point-to-point messages
// between two ranks on one host (docs/shm.md, "Rings").
//
// A ring is a RingCtl (two counters on cache lines of their own) followed by `bytes` of data. The
// producer owns `head` (bytes ever written), the consumer owns `tail` (bytes ever read); each
// publishes its counter with a release store after copying, and reads the other's with an acquire
// load, so the bytes between tail and head are always fully written. Both counters only grow;
// position p lives at data[p % bytes]. Nothing here sleeps or wakes anyone: the transport rings
// the peer's doorbell after a call that moved something.
//
// Messages are the transports' frames (wire::Header + payload). A RingSender writes the part of a
// SendItem that fits; a RingReceiver reads the next message into a RecvItem, first from its inbox
// (bytes it moved out of the ring early, see read_ahead) and then from the ring. One thread (or
// process) uses each end; the two ends may live in different processes or threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "message.h"
#include "transport.h"

namespace chorus::transport::shm {

struct alignas(64) Padded64 {
  std::atomic<uint64_t> v{0};
};

struct RingCtl {
  Padded64 head;  // bytes written by the producer
  Padded64 tail;  // bytes read by the consumer
};

// A ring as mapped in this process: its counters and its data.
struct RingView {
  RingCtl* ctl = nullptr;
  char* data = nullptr;
  size_t bytes = 0;
};

// The producer's end of a ring.
class RingSender {
 public:
  explicit RingSender(RingView ring = {}) : ring_(ring) {}
  // Writes the next bytes of `item` (its header, then its payload) that fit, advances item.off
  // and publishes them. Returns the bytes written: 0 when the ring is full.
  size_t send_some(SendItem& item);

 private:
  void write(uint64_t pos, const char* src, size_t n);
  RingView ring_;
};

// The consumer's end of a ring, with the inbox of bytes read ahead of a posted receive.
class RingReceiver {
 public:
  explicit RingReceiver(RingView ring = {}) : ring_(ring) {}

  // What a receive_some() call did.
  struct Progress {
    bool moved = false;  // consumed bytes (from the inbox or the ring)
    bool freed = false;  // consumed bytes of the ring: the producer may have room now
  };

  // Reads the next part of the message `item` expects. The header comes first, whole: `check`
  // sees it and throws to reject it (a mismatch, a wrong size); then payload bytes as they come.
  // The message is complete when item.got == item.n.
  template <typename CheckHeader>
  Progress receive_some(RecvItem& item, const CheckHeader& check);

  // Moves everything the producer has written out of the ring into the inbox, so that a producer
  // blocked on a full ring moves on while this end's owner is itself blocked sending (two ranks
  // that send to each other before receiving would otherwise deadlock). Returns whether it moved
  // anything.
  bool read_ahead();

  size_t buffered() const { return inbox_.size() - inbox_pos_; }

  // Copies the next message's header to *h without taking it; false while it has not all arrived.
  bool peek_header(wire::Header* h) const;

 private:
  size_t in_ring(uint64_t tail) const;
  // Copies n bytes of the stream to dst: first from the inbox, then from the ring at `tail`.
  void take(uint64_t& tail, char* dst, size_t n);
  void read(uint64_t pos, char* dst, size_t n) const;

  RingView ring_;
  std::vector<char> inbox_;
  size_t inbox_pos_ = 0;
};

template <typename CheckHeader>
RingReceiver::Progress RingReceiver::receive_some(RecvItem& item, const CheckHeader& check) {
  Progress p;
  uint64_t tail = ring_.ctl->tail.v.load(std::memory_order_relaxed);
  const uint64_t tail_before = tail;
  size_t avail = in_ring(tail) + buffered();
  if (!item.have_header) {
    if (avail < sizeof(wire::Header)) return p;
    wire::Header h;
    take(tail, reinterpret_cast<char*>(&h), sizeof(h));
    check(h);
    avail -= sizeof(h);
    item.have_header = true;
    p.moved = true;
  }
  const size_t k = std::min(avail, item.n - item.got);
  if (k > 0) {
    take(tail, item.data + item.got, k);
    item.got += k;
    p.moved = true;
  }
  if (tail != tail_before) {
    ring_.ctl->tail.v.store(tail, std::memory_order_release);
    p.freed = true;
  }
  return p;
}

}  // namespace chorus::transport::shm
