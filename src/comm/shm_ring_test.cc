// The shared-memory ring and its inbox in one process: a producer and a consumer thread on heap
// memory, wrap-around at sizes that do not divide the ring, read-ahead, and the invariant checks.

#include "shm_ring.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "chorus/comm/error.h"

namespace chorus::transport::shm {
namespace {

// A ring on the heap, laid out as in a segment: the counters, then the data.
class HeapRing {
 public:
  explicit HeapRing(size_t bytes) : ctl_(std::make_unique<RingCtl>()), data_(bytes, '\0') {}
  RingView view() { return RingView{ctl_.get(), data_.data(), data_.size()}; }
  RingCtl& ctl() { return *ctl_; }

 private:
  std::unique_ptr<RingCtl> ctl_;
  std::vector<char> data_;
};

wire::Call call_for(uint64_t i, size_t n) {
  wire::Call c;
  c.op = wire::OpType::kSend;
  c.seq = i;
  c.count = n;
  c.arg = static_cast<int64_t>(i % 7);
  return c;
}

// Message i's payload: n bytes that differ between messages and positions.
std::vector<char> payload_for(uint64_t i, size_t n) {
  std::vector<char> p(n);
  for (size_t k = 0; k < n; ++k) p[k] = static_cast<char>((i * 131 + k * 7 + (k >> 8)) & 0xff);
  return p;
}

// The header check a transport does: the call the receiver expects and the length it posted.
struct ExpectCall {
  const RecvItem& item;
  void operator()(const wire::Header& h) const {
    if (h.magic != wire::kMessageMagic) throw PeerError("bad magic");
    if (!wire::same_call(h, item.expect)) throw MismatchError("other call: " + wire::describe(item.expect));
    if (h.payload != item.n) throw MismatchError("other length");
  }
};

// Sizes from 0 to several times the ring, most of them not multiples of anything in particular.
std::vector<size_t> message_sizes(size_t count, size_t ring_bytes, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<size_t> small(0, 100), large(0, 5 * ring_bytes);
  std::vector<size_t> sizes(count);
  for (size_t i = 0; i < count; ++i) sizes[i] = i % 3 == 0 ? large(gen) : small(gen);
  sizes[0] = 0;
  return sizes;
}

TEST(ShmRing, ProducerAndConsumerThreadsMoveEveryByteInOrder) {
  for (size_t ring_bytes : {size_t{64}, size_t{1000}, size_t{4096}}) {
    SCOPED_TRACE("ring of " + std::to_string(ring_bytes) + " bytes");
    HeapRing ring(ring_bytes);
    const std::vector<size_t> sizes = message_sizes(400, ring_bytes, static_cast<unsigned>(ring_bytes));
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    std::atomic<bool> abandon{false};

    std::thread producer([&] {
      RingSender sender(ring.view());
      for (uint64_t i = 0; i < sizes.size(); ++i) {
        const std::vector<char> p = payload_for(i, sizes[i]);
        SendItem item{i + 1, wire::make_header(call_for(i, sizes[i]), sizes[i]), p.data(), p.size()};
        while (item.off < sizeof(wire::Header) + item.n) {
          if (abandon.load() || std::chrono::steady_clock::now() > give_up) return;
          if (sender.send_some(item) == 0) std::this_thread::yield();
        }
      }
    });
    // The producer stops and is joined however this scope ends (an ASSERT returns early).
    struct Join {
      std::thread& t;
      std::atomic<bool>& abandon;
      ~Join() {
        abandon.store(true);
        t.join();
      }
    } join{producer, abandon};

    size_t received = 0;
    RingReceiver receiver(ring.view());
    for (uint64_t i = 0; i < sizes.size() && std::chrono::steady_clock::now() < give_up; ++i) {
      std::vector<char> got(sizes[i], '\x5a');
      RecvItem item{i + 1, call_for(i, sizes[i]), got.data(), got.size()};
      while (!(item.have_header && item.got == item.n) && std::chrono::steady_clock::now() < give_up) {
        if (!receiver.receive_some(item, ExpectCall{item}).moved) std::this_thread::yield();
      }
      ASSERT_TRUE(item.have_header && item.got == item.n) << "message " << i << " of " << sizes[i] << " bytes";
      ASSERT_EQ(got, payload_for(i, sizes[i])) << "message " << i << " of " << sizes[i] << " bytes";
      ++received;
    }
    EXPECT_EQ(received, sizes.size());
    EXPECT_EQ(ring.ctl().head.v.load(), ring.ctl().tail.v.load()) << "the consumer read everything written";
    EXPECT_EQ(receiver.buffered(), 0u);
  }
}

TEST(ShmRing, ReadAheadFreesTheRingAndKeepsTheStream) {
  // One thread, in the order that would deadlock two ranks sending to each other: the producer
  // fills the ring, the consumer (itself busy sending) moves it into its inbox, the producer goes
  // on, and the messages then arrive whole and in order from inbox and ring together.
  HeapRing ring(256);
  RingSender sender(ring.view());
  RingReceiver receiver(ring.view());
  const std::vector<size_t> sizes = {100, 0, 300, 17, 255, 256, 1};
  std::vector<std::vector<char>> payloads;
  std::vector<SendItem> items;
  for (uint64_t i = 0; i < sizes.size(); ++i) payloads.push_back(payload_for(i, sizes[i]));
  for (uint64_t i = 0; i < sizes.size(); ++i) {
    items.push_back(SendItem{i + 1, wire::make_header(call_for(i, sizes[i]), sizes[i]), payloads[i].data(), sizes[i]});
  }
  size_t rounds = 0;
  for (SendItem& item : items) {
    while (item.off < sizeof(wire::Header) + item.n) {
      if (sender.send_some(item) == 0) {
        ASSERT_TRUE(receiver.read_ahead()) << "a full ring has something to read ahead";
        ++rounds;
      }
      ASSERT_LT(rounds, 1000u);
    }
  }
  EXPECT_GT(rounds, 3u) << "the messages needed the inbox several times";
  EXPECT_GT(receiver.buffered(), 0u);
  for (uint64_t i = 0; i < sizes.size(); ++i) {
    std::vector<char> got(sizes[i]);
    RecvItem item{i + 1, call_for(i, sizes[i]), got.data(), got.size()};
    while (!(item.have_header && item.got == item.n)) {
      ASSERT_TRUE(receiver.receive_some(item, ExpectCall{item}).moved) << "message " << i << " is all there";
    }
    EXPECT_EQ(got, payloads[i]) << "message " << i;
  }
  EXPECT_EQ(receiver.buffered(), 0u);
  EXPECT_FALSE(receiver.read_ahead()) << "nothing is left in the ring";
}

TEST(ShmRing, ReceiveReportsWhetherItFreedRingSpace) {
  HeapRing ring(512);
  RingSender sender(ring.view());
  RingReceiver receiver(ring.view());
  const std::vector<char> p = payload_for(3, 40);
  SendItem item{1, wire::make_header(call_for(3, 40), 40), p.data(), p.size()};
  ASSERT_EQ(sender.send_some(item), sizeof(wire::Header) + 40);
  ASSERT_TRUE(receiver.read_ahead());
  std::vector<char> got(40);
  RecvItem r{1, call_for(3, 40), got.data(), got.size()};
  const RingReceiver::Progress from_inbox = receiver.receive_some(r, ExpectCall{r});
  EXPECT_TRUE(from_inbox.moved);
  EXPECT_FALSE(from_inbox.freed) << "bytes from the inbox free nothing in the ring: no doorbell is needed";
  EXPECT_EQ(got, p);

  SendItem again{2, wire::make_header(call_for(4, 40), 40), p.data(), p.size()};
  ASSERT_EQ(sender.send_some(again), sizeof(wire::Header) + 40);
  RecvItem r2{2, call_for(4, 40), got.data(), got.size()};
  const RingReceiver::Progress from_ring = receiver.receive_some(r2, ExpectCall{r2});
  EXPECT_TRUE(from_ring.moved);
  EXPECT_TRUE(from_ring.freed);
}

TEST(ShmRing, TheHeaderCheckSeesTheHeaderBeforeAnyPayloadByte) {
  HeapRing ring(512);
  RingSender sender(ring.view());
  RingReceiver receiver(ring.view());
  const std::vector<char> p = payload_for(9, 30);
  SendItem item{1, wire::make_header(call_for(9, 30), 30), p.data(), p.size()};
  ASSERT_GT(sender.send_some(item), 0u);
  std::vector<char> got(30, '\x11');
  RecvItem r{1, call_for(8, 30), got.data(), got.size()};  // expects another call
  EXPECT_THROW(receiver.receive_some(r, ExpectCall{r}), MismatchError);
  EXPECT_EQ(got, std::vector<char>(30, '\x11')) << "no payload byte lands for a rejected header";
}

TEST(ShmRing, CountersThatClaimMoreThanTheRingAreAnErrorNotAnOverrun) {
  HeapRing ring(128);
  ring.ctl().head.v.store(1000);
  ring.ctl().tail.v.store(100);  // 900 bytes unread in a ring of 128: a corrupted counter
  RingReceiver receiver(ring.view());
  EXPECT_THROW(receiver.read_ahead(), Error);
  RingSender sender(ring.view());
  const std::vector<char> p(10);
  SendItem item{1, wire::make_header(call_for(0, 10), 10), p.data(), p.size()};
  EXPECT_THROW(sender.send_some(item), Error);
}

}  // namespace
}  // namespace chorus::transport::shm
