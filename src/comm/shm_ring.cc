// The shared-memory byte ring and its inbox (shm_ring.h; docs/shm.md, "Rings").

#include "shm_ring.h"

#include <cstring>

#include "chorus/comm/check.h"

namespace chorus::transport::shm {

void RingSender::write(uint64_t pos, const char* src, size_t n) {
  const size_t at = pos % ring_.bytes, first = std::min(n, ring_.bytes - at);
  std::memcpy(ring_.data + at, src, first);
  std::memcpy(ring_.data, src + first, n - first);
}

size_t RingSender::send_some(SendItem& item) {
  const size_t total = sizeof(wire::Header) + item.n;
  const uint64_t head = ring_.ctl->head.v.load(std::memory_order_relaxed);
  const uint64_t tail = ring_.ctl->tail.v.load(std::memory_order_acquire);
  // More unread bytes than the ring holds would make `free` wrap and the write overrun it.
  CHORUS_CHECK(head - tail <= ring_.bytes, "send ring holds more than its size");
  const size_t free = ring_.bytes - static_cast<size_t>(head - tail);
  const size_t k = std::min(free, total - item.off);
  if (k == 0) return 0;
  size_t w = 0;
  if (item.off < sizeof(wire::Header)) {
    const size_t hk = std::min(k, sizeof(wire::Header) - item.off);
    write(head, reinterpret_cast<const char*>(&item.header) + item.off, hk);
    w += hk;
  }
  if (w < k) write(head + w, item.data + (item.off + w - sizeof(wire::Header)), k - w);
  ring_.ctl->head.v.store(head + k, std::memory_order_release);
  item.off += k;
  return k;
}

size_t RingReceiver::in_ring(uint64_t tail) const {
  const uint64_t head = ring_.ctl->head.v.load(std::memory_order_acquire);
  const size_t k = static_cast<size_t>(head - tail);
  CHORUS_CHECK(k <= ring_.bytes, "receive ring holds more than its size");
  return k;
}

void RingReceiver::read(uint64_t pos, char* dst, size_t n) const {
  const size_t at = pos % ring_.bytes, first = std::min(n, ring_.bytes - at);
  std::memcpy(dst, ring_.data + at, first);
  std::memcpy(dst + first, ring_.data, n - first);
}

void RingReceiver::take(uint64_t& tail, char* dst, size_t n) {
  const size_t buffered = std::min(n, this->buffered());
  if (buffered > 0) std::memcpy(dst, inbox_.data() + inbox_pos_, buffered);  // an empty inbox's data() may be null
  inbox_pos_ += buffered;
  if (inbox_pos_ == inbox_.size()) {
    inbox_.clear();
    inbox_pos_ = 0;
  }
  if (n > buffered) {
    read(tail, dst + buffered, n - buffered);
    tail += n - buffered;
  }
}

bool RingReceiver::peek_header(wire::Header* h) const {
  const uint64_t tail = ring_.ctl->tail.v.load(std::memory_order_relaxed);
  const size_t from_inbox = std::min(sizeof(*h), buffered());
  if (from_inbox + in_ring(tail) < sizeof(*h)) return false;
  char* dst = reinterpret_cast<char*>(h);
  if (from_inbox > 0) std::memcpy(dst, inbox_.data() + inbox_pos_, from_inbox);
  if (from_inbox < sizeof(*h)) read(tail, dst + from_inbox, sizeof(*h) - from_inbox);
  return true;
}

bool RingReceiver::read_ahead() {
  const uint64_t tail = ring_.ctl->tail.v.load(std::memory_order_relaxed);
  const size_t k = in_ring(tail);
  if (k == 0) return false;
  const size_t old = inbox_.size();
  inbox_.resize(old + k);
  read(tail, inbox_.data() + old, k);
  ring_.ctl->tail.v.store(tail + k, std::memory_order_release);
  return true;
}

}  // namespace chorus::transport::shm
