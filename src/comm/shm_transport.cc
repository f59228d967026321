// Shared-memory transport for ranks on one host. See docs/shm.md.
//
// Every rank owns one segment, mapped read-write by all ranks of the group:
//   [Header][ring to rank 0]...[ring to rank n-1][collective area: 2 halves]
// - Rings carry the same messages as TCP (wire::Header + payload), so every generic algorithm
//   and the mismatch checks work unchanged; a ring is single-producer (the owner) single-consumer.
// - allreduce (ShmCollectives) uses the collective areas: each rank copies its chunk into its own area,
//   reduces its slice straight out of every rank's area, and all copy the reduced slices back.
//   Two barriers per chunk; the areas alternate halves so a chunk's copy-in never races the
//   previous chunk's copy-out.
// - Waiting spins for spin_us, then sleeps on a futex in the waiter's own header ("doorbell");
//   whoever changes something a peer may wait on rings the peer's doorbell.
// - Shared buffers (allocate_shared): one more segment per rank per buffer, mapped by every rank.
//   An allreduce on one reduces each rank's slice straight out of the peers' buffers and writes
//   the result into all of them: two barriers and no staging copies.

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <dirent.h>
#include <fstream>
#include <random>
#include <signal.h>
#include <sstream>
#include <thread>
#include <unordered_set>
#include <vector>

#include "chorus/comm/check.h"
#include "chorus/comm/error.h"
#include "chorus/comm/log.h"
#include "chorus/comm/hash.h"
#include "chorus/comm/store.h"
#include "plan.h"
#include "reduce.h"
#include "transport.h"

namespace chorus::transport {
namespace {

using net::Clock;
using net::Deadline;

constexpr uint32_t kSegMagic = 0x4d534843;  // "CHSM"
constexpr int kDescHistory = 8;

enum State : uint32_t { kLive = 0, kAborted = 1, kClosed = 2 };

struct alignas(64) Padded64 {
  std::atomic<uint64_t> v{0};
};

struct Desc {
  std::atomic<uint64_t> seq_plus_one{0};  // 0 = empty
  wire::Call call;
  // An allreduce on a shared buffer: its id + 1 and the byte offset in it (0, 0 for other memory).
  // Written in begin() and by allreduce, before the call's first barrier.
  std::atomic<uint64_t> region{0};
  std::atomic<uint64_t> offset{0};
};

// The operation a rank is in now, point-to-point included, for messages and deadlock detection.
// A seqlock: `version` is odd while the owner rewrites `call`.
struct CurrentCall {
  std::atomic<uint64_t> version{0};
  wire::Call call;
};

struct SegHeader {
  uint32_t magic;
  int32_t rank;
  int32_t size;
  int32_t pid;
  uint64_t token_hash;
  uint64_t ring_bytes;
  uint64_t collective_bytes;
  uint64_t small_bytes;
  alignas(64) std::atomic<uint32_t> state;
  uint8_t error_class;
  char message[2048];
  alignas(64) std::atomic<uint32_t> doorbell;  // futex word: bumped whenever a peer may proceed
  alignas(64) std::atomic<uint32_t> sleeping;
  alignas(64) std::atomic<uint64_t> stage;     // native allreduce barrier counter
  Desc desc[kDescHistory];                     // the collectives this rank is in, by seq
  CurrentCall current;
  alignas(64) std::atomic<uint32_t> in_barrier;  // 1 while it waits at a native collective's barrier
};

struct RingCtl {
  Padded64 head;  // bytes written by the producer (the segment's owner)
  Padded64 tail;  // bytes read by the consumer
};

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

long futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const timespec* ts) {
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, ts, nullptr, 0);
}

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// The inode of one of this process's namespaces ("pid", "ipc"), or 0.
unsigned long namespace_id(const char* kind) {
  struct stat st {};
  return ::stat((std::string("/proc/self/ns/") + kind).c_str(), &st) == 0 ? static_cast<unsigned long>(st.st_ino) : 0;
}

// Removes segments left in /dev/shm by chorus processes that no longer exist (killed during setup).
// Names are chorus-<PID namespace>-<pid>-...: only names of this PID namespace are judged, since a
// pid from another namespace (a container sharing /dev/shm) means nothing here.
void sweep_stale_segments() {
  DIR* d = ::opendir("/dev/shm");
  if (d == nullptr) return;
  const unsigned long mine = namespace_id("pid");
  while (dirent* e = ::readdir(d)) {
    unsigned long ns = 0;
    int pid = 0;
    if (std::sscanf(e->d_name, "chorus-%lu-%d-", &ns, &pid) == 2 && ns == mine && pid > 0 && ::kill(pid, 0) != 0 &&
        errno == ESRCH) {
      ::shm_unlink((std::string("/") + e->d_name).c_str());
    }
  }
  ::closedir(d);
}

struct Segment {
  void* base = nullptr;
  size_t bytes = 0;
  SegHeader* hdr = nullptr;
  Segment() = default;
  Segment(Segment&& o) noexcept : base(o.base), bytes(o.bytes), hdr(o.hdr) {
    o.base = nullptr;
    o.hdr = nullptr;
  }
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment() {
    if (base != nullptr) ::munmap(base, bytes);
  }
};

// Where things are in a segment: [header][ring to each rank][collective area: 2 halves].
struct Layout {
  size_t ring_bytes, chunk, rings_off, ring_stride, coll_off, seg_bytes;
};

Layout layout(const ShmOptions& o, int size) {
  Layout l{};
  l.ring_bytes = align_up(std::max<size_t>(o.ring_bytes, 4096), 64);
  l.chunk = align_up(std::max<size_t>(o.collective_bytes, 4096), 64);
  l.rings_off = align_up(sizeof(SegHeader), 4096);
  l.ring_stride = align_up(sizeof(RingCtl) + l.ring_bytes, 64);
  l.coll_off = align_up(l.rings_off + l.ring_stride * static_cast<size_t>(size), 4096);
  l.seg_bytes = l.coll_off + 2 * l.chunk;
  return l;
}

// One shared buffer: every rank's copy, mapped here. Unmapped when the last user lets go.
class Region final : public SharedRegion {
 public:
  Region(uint64_t id, size_t bytes, int rank, int size) : id_(id), bytes_(bytes), rank_(rank), bases_(size, nullptr) {}
  ~Region() override {
    for (void* b : bases_) {
      if (b != nullptr) ::munmap(b, bytes_);
    }
  }
  void* data() override { return bases_[static_cast<size_t>(rank_)]; }
  size_t size() const override { return bytes_; }
  uint64_t id() const { return id_; }
  char* base(int r) const { return static_cast<char*>(bases_[static_cast<size_t>(r)]); }
  void set_base(int r, void* b) { bases_[static_cast<size_t>(r)] = b; }

 private:
  uint64_t id_;
  size_t bytes_;
  int rank_;
  std::vector<void*> bases_;
};

class ShmTransport final : public ShmTransportApi, public ShmCollectives {
 public:
  ShmTransport(const ShmOptions& o) : o_(o) {}

  ~ShmTransport() override { close(); }

  void setup() {
    const int n = o_.size;
    const Layout l = layout(o_, n);
    ring_bytes_ = l.ring_bytes;
    coll_half_ = l.chunk;
    rings_off_ = l.rings_off;
    ring_stride_ = l.ring_stride;
    coll_off_ = l.coll_off;
    seg_bytes_ = l.seg_bytes;

    sweep_stale_segments();
    // Create mine: the pid in the name lets a later job sweep it if this process dies in setup;
    // a random nonce keeps two groups of one process (or two namespaces' pids) apart.
    name_ = "/chorus-" + std::to_string(namespace_id("pid")) + "-" + std::to_string(::getpid()) + "-" +
            std::to_string(std::random_device{}() & 0xffffffu) + "-" + std::to_string(o_.rank);
    int fd = ::shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) throw Error(me() + ": cannot create shared memory " + name_ + ": " + std::strerror(errno));
    named_ = true;
    // Reserve the pages now: on a full /dev/shm (containers often give it 64 MB) a sparse segment
    // would fail later with SIGBUS on first touch instead of with this error.
    const int err = ::posix_fallocate(fd, 0, static_cast<off_t>(seg_bytes_));
    if (err != 0) {
      ::close(fd);
      throw UsageError(me() + ": cannot reserve " + std::to_string(seg_bytes_) + " bytes of shared memory for " +
                       name_ + ": " + std::strerror(err) +
                       (err == ENOSPC ? std::string(" (/dev/shm is full or too small: each rank needs about this "
                                                    "much; in a container raise --shm-size, or use transport 'tcp')")
                                      : std::string()));
    }
    segs_.resize(static_cast<size_t>(n));
    map(segs_[static_cast<size_t>(o_.rank)], fd);
    SegHeader* h = segs_[static_cast<size_t>(o_.rank)].hdr;
    new (h) SegHeader();
    h->rank = o_.rank;
    h->size = n;
    h->pid = ::getpid();
    h->token_hash = fnv1a64(o_.token);
    h->ring_bytes = ring_bytes_;
    h->collective_bytes = coll_half_;
    h->small_bytes = o_.small_bytes;
    h->magic = kSegMagic;

    const std::string mine = o_.host_id.empty() ? host_identity() : o_.host_id;
    const auto all = exchange_announcements(*o_.store, o_.key_prefix + "/shm", o_.rank, n, o_.token, {mine, name_},
                                            o_.deadline);
    for (int r = 0; r < n; ++r) {
      if (r == o_.rank) continue;
      const std::string& host = all[static_cast<size_t>(r)].host;
      const std::string& peer_name = all[static_cast<size_t>(r)].extra;
      if (host != mine) {
        throw UsageError(me() + ": transport 'shm' needs every rank on one host, but rank " + std::to_string(global(r)) +
                         " is on another (" + host + " vs " + mine + "); use transport 'hybrid' or 'auto'");
      }
      int pfd = ::shm_open(peer_name.c_str(), O_RDWR | O_CLOEXEC, 0600);
      if (pfd < 0) throw Error(me() + ": cannot open rank " + std::to_string(r) + "'s shared memory " + peer_name + ": " + std::strerror(errno));
      map(segs_[static_cast<size_t>(r)], pfd);
      SegHeader* ph = segs_[static_cast<size_t>(r)].hdr;
      if (ph->magic != kSegMagic || ph->token_hash != h->token_hash || ph->size != n ||
          ph->ring_bytes != ring_bytes_ || ph->collective_bytes != coll_half_ || ph->small_bytes != o_.small_bytes) {
        throw HandshakeError(me() + ": rank " + std::to_string(r) + "'s shared memory belongs to another job or "
                             "configuration (job token, world size or shared-memory sizes differ: every rank needs the same "
                             "shm_chunk_bytes and shm_small_bytes)");
      }
    }
    pidfds_.assign(static_cast<size_t>(n), -1);
    for (int r = 0; r < n; ++r) {
      if (r != o_.rank) pidfds_[static_cast<size_t>(r)] = static_cast<int>(::syscall(SYS_pidfd_open, segs_[static_cast<size_t>(r)].hdr->pid, 0));
    }
    // Everyone has mapped everyone: the names can go, so nothing outlives the processes.
    const std::string count = o_.key_prefix + "/shm/mapped";
    o_.store->add(count, 1);
    while (o_.store->add(count, 0) < n) {
      if (Clock::now() > o_.deadline) throw TimeoutError(me() + ": shared-memory setup timed out waiting for the other ranks to map");
      for (int r = 0; r < n; ++r) {
        if (r == o_.rank) continue;
        SegHeader* ph = segs_[static_cast<size_t>(r)].hdr;
        const uint32_t st = ph->state.load(std::memory_order_acquire);
        if (!gone(r) && st == kLive) continue;
        // A peer that saw the last rank map has finished setup and may already have failed in its
        // first operation: then setup is complete here too, and that operation reports the failure.
        if (o_.store->add(count, 0) >= n) break;
        if (st == kAborted) {
          throw_error(ph->error_class, me() + ": " + peer_name(r) + " failed during shared-memory setup: " + ph->message);
        }
        throw PeerError(me() + ": " + peer_name(r) + " failed or exited during shared-memory setup");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ::shm_unlink(name_.c_str());
    named_ = false;
    recvs_.resize(static_cast<size_t>(n));
    sends_.resize(static_cast<size_t>(n));
    inbox_.resize(static_cast<size_t>(n));
    inbox_pos_.assign(static_cast<size_t>(n), 0);
  }

  std::string kind() const override { return "shm"; }
  void set_spin_gate(const std::atomic<int>* gate) override { gate_ = gate; }
  int rank() const override { return o_.rank; }
  int size() const override { return o_.size; }
  std::string peer_name(int peer) const override {
    const SegHeader* h = segs_[static_cast<size_t>(peer)].hdr;
    return "rank " + std::to_string(global(peer)) + " (pid " + std::to_string(h ? h->pid : -1) + ", shared memory)";
  }

  void begin(const wire::Call& call, Deadline deadline) override {
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

  Ticket send(int peer, const wire::Header& header, const void* data, size_t n) override {
    Ticket t = next_++;
    sends_[static_cast<size_t>(check_peer(peer))].push_back(SendItem{t, header, static_cast<const char*>(data), n});
    pending_.insert(t);
    return t;
  }

  Ticket recv(int peer, const wire::Call& expect, void* data, size_t n) override {
    Ticket t = next_++;
    recvs_[static_cast<size_t>(check_peer(peer))].push_back(RecvItem{t, expect, static_cast<char*>(data), n});
    pending_.insert(t);
    return t;
  }

  void wait(Ticket t) override {
    wait_until([&] { return pending_.count(t) == 0; }, "its next message");
  }
  void wait_all() override {
    wait_until([&] { return pending_.empty(); }, "its next message");
  }

  ShmCollectives* native() override { return this; }

  bool allreduce(void* buf, size_t count, DataType dtype, ReduceOp op) override {
    const size_t bytes = count * element_size(dtype);
    std::shared_ptr<Region> region;
    size_t offset = 0;
    if (bytes > 0) region = find_region(buf, bytes, &offset);
    if (region) {
      // Published before the first barrier, so that check_agreement() sees it: ranks that disagree
      // about where their buffers live fail instead of reading each other's memory.
      Desc& d = my_hdr().desc[call_.seq % kDescHistory];
      d.offset.store(offset, std::memory_order_relaxed);
      d.region.store(region->id() + 1, std::memory_order_release);
      allreduce_shared(*region, offset, count, dtype, op);
    } else {
      allreduce_with(buf, count, dtype, op, nullptr);
    }
    return true;
  }

  std::shared_ptr<SharedRegion> allocate_shared(size_t bytes) override {
    const int n = o_.size;
    const size_t len = align_up(std::max<size_t>(bytes, 1), 4096);
    const uint64_t id = next_region_++;
    // This rank's copy: a segment of its own, reserved now (a full /dev/shm must not surface later
    // as SIGBUS). A failure is not an error yet: every rank learns every rank's outcome, and all
    // fall back to ordinary memory together.
    struct Record {
      char ok;
      char text[255];
    };
    Record mine{};
    std::vector<Record> records(static_cast<size_t>(n));
    const std::string name = name_ + "-buffer" + std::to_string(id);
    int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    int err = fd < 0 ? errno : ::posix_fallocate(fd, 0, static_cast<off_t>(len));
    void* base = MAP_FAILED;
    if (err == 0) {
      base = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (base == MAP_FAILED) err = errno;
    }
    if (fd >= 0) ::close(fd);
    // The name goes when every rank has mapped the copy, or at once if this operation fails.
    struct Unlink {
      std::string name;
      bool armed;
      ~Unlink() {
        if (armed) ::shm_unlink(name.c_str());
      }
    } unlink_on_exit{name, fd >= 0};
    if (err == 0) {
      mine.ok = 1;
      std::snprintf(mine.text, sizeof(mine.text), "%s", name.c_str());
    } else {
      std::snprintf(mine.text, sizeof(mine.text), "cannot reserve %zu bytes of shared memory: %s", len,
                    std::strerror(err));
    }
    auto region = std::make_shared<Region>(id, len, o_.rank, n);
    if (base != MAP_FAILED) region->set_base(o_.rank, base);
    allgather(&mine, records.data(), sizeof(Record));
    std::string failed;
    for (int r = 0; r < n && failed.empty(); ++r) {
      if (!records[static_cast<size_t>(r)].ok) {
        records[static_cast<size_t>(r)].text[sizeof(Record::text) - 1] = '\0';
        failed = "rank " + std::to_string(global(r)) + ": " + records[static_cast<size_t>(r)].text;
      }
    }
    if (!failed.empty()) {
      if (o_.rank == 0) {
        chorus::log(LogLevel::kWarning, me() + ": a shared buffer of " + std::to_string(len) + " bytes is not available (" +
                                    failed + "); using ordinary memory, whose allreduce copies through the staging areas");
      }
      return nullptr;
    }
    for (int r = 0; r < n; ++r) {
      if (r == o_.rank) continue;
      Record& rec = records[static_cast<size_t>(r)];
      rec.text[sizeof(rec.text) - 1] = '\0';
      int pfd = ::shm_open(rec.text, O_RDWR | O_CLOEXEC, 0600);
      void* pb = pfd < 0 ? MAP_FAILED : ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, pfd, 0);
      const int e = errno;
      if (pfd >= 0) ::close(pfd);
      if (pb == MAP_FAILED) {
        throw Error(me() + ": cannot map " + peer_name(r) + "'s shared buffer " + rec.text + ": " + std::strerror(e));
      }
      region->set_base(r, pb);
    }
    // Every rank has mapped every copy: the names can go, so nothing outlives the processes.
    barrier("to map the shared buffers");
    regions_.erase(std::remove_if(regions_.begin(), regions_.end(), [](const auto& w) { return w.expired(); }),
                   regions_.end());
    regions_.push_back(region);
    return region;
  }

  bool broadcast(void* buf, size_t bytes, int root) override {
    // Per chunk: the root publishes it in its area, one barrier, the others copy it out.
    char* data = static_cast<char*>(buf);
    for_each_chunk(bytes, coll_half_, [&](size_t done, size_t len, char* mine, int half) {
      if (o_.rank == root) std::memcpy(mine, data + done, len);
      barrier("to publish the root's data");
      if (done == 0) check_agreement();
      if (o_.rank != root) std::memcpy(data + done, area(root, half), len);
    });
    return true;
  }

  bool allgather(const void* in, void* out, size_t bytes) override {
    // Per chunk of every rank's block: each publishes its piece, one barrier, all copy all pieces.
    const char* src = static_cast<const char*>(in);
    char* dst = static_cast<char*>(out);
    char* own = dst + static_cast<size_t>(o_.rank) * bytes;
    if (own != src) std::memmove(own, src, bytes);  // in place when `in` is this rank's block of `out`
    for_each_chunk(bytes, coll_half_, [&](size_t done, size_t len, char* mine, int half) {
      std::memcpy(mine, own + done, len);
      barrier("to publish its block");
      if (done == 0) check_agreement();
      for (int k = 0; k < o_.size; ++k) {
        if (k != o_.rank) std::memcpy(dst + static_cast<size_t>(k) * bytes + done, area(k, half), len);
      }
    });
    return true;
  }

  void allreduce_through_leader(void* buf, size_t count, DataType dtype, ReduceOp op, const SliceHook& between) override {
    const int n = o_.size;
    const size_t esz = element_size(dtype);
    const size_t chunk_elems = std::max<size_t>(1, coll_half_ / esz);
    for_each_chunk(count, chunk_elems, [&](size_t done, size_t len, char* mine, int half) {
      char* chunk = static_cast<char*>(buf) + done * esz;
      std::memcpy(mine, chunk, len * esz);
      barrier("to copy in its part of the buffer");
      if (done == 0) check_agreement();
      if (o_.rank == 0) {  // only rank 0 reads the areas until the next barrier
        for (int k = 1; k < n; ++k) reduce::reduce_into(dtype, op, chunk, area(k, half), len);
        between(chunk, len);
        std::memcpy(mine, chunk, len * esz);
      }
      barrier("to receive the result from its host's leader");
      if (o_.rank != 0) std::memcpy(chunk, area(0, half), len * esz);
    });
  }

  void allreduce_with(void* buf, size_t count, DataType dtype, ReduceOp op, const SliceHook& between) override {
    const int n = o_.size;
    const size_t esz = element_size(dtype);
    char* user = static_cast<char*>(buf);
    if (count * esz <= std::min(o_.small_bytes, coll_half_)) {
      // Small: one barrier. Every rank publishes its whole buffer and reduces all of them, in
      // rank order, so every rank computes the same bits.
      const int half = next_half();
      char* mine = area(o_.rank, half);
      std::memcpy(mine, user, count * esz);
      barrier("to copy in its buffer");
      check_agreement();
      std::memcpy(user, area(0, half), count * esz);
      for (int k = 1; k < n; ++k) reduce::reduce_into(dtype, op, user, area(k, half), count);
      if (between) between(user, count);
      if (op == ReduceOp::kAvg) reduce::finish_avg(dtype, user, count, n);
      return;
    }
    // Large, per chunk (reduce-scatter, then allgather, through the areas): every rank copies
    // the other ranks' slices of its chunk into its area; reduces its own slice in place in its
    // buffer, reading the peers' copies of it, and publishes the result in its area; then copies
    // the other ranks' results out. Each rank moves 2(n-1)/n of the chunk across cores and never
    // copies its own slice in or out.
    const size_t chunk_elems = std::max<size_t>(1, coll_half_ / esz);
    for_each_chunk(count, chunk_elems, [&](size_t done, size_t len, char* mine, int half) {
      char* chunk = user + done * esz;
      for (int k = 0; k < n; ++k) {
        const plan::Range sk = plan::split(len, n, k);
        if (k != o_.rank) std::memcpy(mine + sk.offset * esz, chunk + sk.offset * esz, sk.count * esz);
      }
      barrier("to copy in its part of the buffer");
      if (done == 0) check_agreement();
      const plan::Range s = plan::split(len, n, o_.rank);
      char* acc = chunk + s.offset * esz;
      for (int k = 0; k < n; ++k) {
        if (k != o_.rank) reduce::reduce_into(dtype, op, acc, area(k, half) + s.offset * esz, s.count);
      }
      if (between) between(acc, s.count);
      if (op == ReduceOp::kAvg) reduce::finish_avg(dtype, acc, s.count, n);
      std::memcpy(mine + s.offset * esz, acc, s.count * esz);
      barrier("to reduce its slice");
      for (int k = 0; k < n; ++k) {
        const plan::Range sk = plan::split(len, n, k);
        if (k != o_.rank) std::memcpy(chunk + sk.offset * esz, area(k, half) + sk.offset * esz, sk.count * esz);
      }
    });
  }

  // The shared buffer holding [buf, buf + bytes) on this rank, and the offset of buf in it.
  std::shared_ptr<Region> find_region(const void* buf, size_t bytes, size_t* offset) const {
    const char* p = static_cast<const char*>(buf);
    for (const auto& w : regions_) {
      auto r = w.lock();
      if (!r) continue;
      const char* b = r->base(o_.rank);
      if (p >= b && p + bytes <= b + r->size()) {
        *offset = static_cast<size_t>(p - b);
        return r;
      }
    }
    return nullptr;
  }

  // Allreduce of a range that lives at the same offset of a shared buffer on every rank: each rank
  // reduces its slice out of every rank's copy and writes the result into all of them.
  void allreduce_shared(const Region& region, size_t offset, size_t count, DataType dtype, ReduceOp op) {
    const int n = o_.size;
    const size_t esz = element_size(dtype);
    barrier("to have its buffer ready");
    check_agreement();
    const plan::Range s = plan::split(count, n, o_.rank);
    const size_t at = offset + s.offset * esz;
    char* acc = region.base(o_.rank) + at;
    if (n == 2 && dtype == DataType::kFloat32 && (op == ReduceOp::kSum || op == ReduceOp::kAvg)) {
      // DDP's case: read both copies once, write both once.
      reduce::sum_pair_f32(reinterpret_cast<float*>(acc), reinterpret_cast<float*>(region.base(1 - o_.rank) + at),
                           s.count, op == ReduceOp::kAvg);
      barrier("to write its reduced slice into every rank's buffer");
      return;
    }
    // Every slice is reduced once, in the same order of ranks, and copied: all ranks get the same bits.
    for (int k = 0; k < n; ++k) {
      if (k != o_.rank) reduce::reduce_into(dtype, op, acc, region.base(k) + at, s.count);
    }
    if (op == ReduceOp::kAvg) reduce::finish_avg(dtype, acc, s.count, n);
    for (int k = 0; k < n; ++k) {
      if (k != o_.rank) std::memcpy(region.base(k) + at, acc, s.count * esz);
    }
    barrier("to write its reduced slice into every rank's buffer");
  }

  void abort(const std::string& reason, uint8_t error_class) override {
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

  void close() override {
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

 private:
  void map(Segment& s, int fd) {
    void* p = ::mmap(nullptr, seg_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int err = errno;
    ::close(fd);
    if (p == MAP_FAILED) throw Error(me() + ": mmap of shared memory failed: " + std::strerror(err));
    s.base = p;
    s.bytes = seg_bytes_;
    s.hdr = static_cast<SegHeader*>(p);
  }

  std::string me() const { return "chorus: rank " + std::to_string(global(o_.rank)); }
  // The rank in the whole group (different from the shared-memory rank inside a hybrid group).
  int global(int local) const {
    return o_.global_ranks.empty() ? local : o_.global_ranks.at(static_cast<size_t>(local));
  }
  std::string prefix() const { return me() + ": " + wire::describe(call_); }
  SegHeader* me_hdr() const { return segs_.empty() ? nullptr : segs_[static_cast<size_t>(o_.rank)].hdr; }
  // This rank's header once setup has mapped it (every operation runs after setup).
  SegHeader& my_hdr() const { return *segs_[static_cast<size_t>(o_.rank)].hdr; }
  int check_peer(int peer) const {
    if (peer < 0 || peer >= o_.size || peer == o_.rank) {
      throw UsageError(me() + ": invalid peer rank " + std::to_string(peer));
    }
    return peer;
  }

  RingCtl* ring_ctl(int owner, int to) const {
    return reinterpret_cast<RingCtl*>(static_cast<char*>(segs_[static_cast<size_t>(owner)].base) + rings_off_ +
                                      ring_stride_ * static_cast<size_t>(to));
  }
  char* ring_data(int owner, int to) const { return reinterpret_cast<char*>(ring_ctl(owner, to)) + sizeof(RingCtl); }
  char* area(int owner, int half) const {
    return static_cast<char*>(segs_[static_cast<size_t>(owner)].base) + coll_off_ + coll_half_ * static_cast<size_t>(half);
  }

  void ring(int peer) {
    SegHeader* h = segs_[static_cast<size_t>(peer)].hdr;
    h->doorbell.fetch_add(1, std::memory_order_seq_cst);
    if (h->sleeping.load(std::memory_order_seq_cst) != 0) futex(&h->doorbell, FUTEX_WAKE, INT32_MAX, nullptr);
  }
  void ring_all() {
    for (int r = 0; r < o_.size; ++r) {
      if (r != o_.rank && segs_[static_cast<size_t>(r)].hdr != nullptr) ring(r);
    }
  }

  // Copies between a ring and memory, wrapping at the ring's end.
  void ring_write(int to, uint64_t pos, const char* src, size_t n) {
    char* base = ring_data(o_.rank, to);
    size_t at = pos % ring_bytes_, first = std::min(n, ring_bytes_ - at);
    std::memcpy(base + at, src, first);
    std::memcpy(base, src + first, n - first);
  }
  void ring_read(int from, uint64_t pos, char* dst, size_t n) const {
    const char* base = ring_data(from, o_.rank);
    size_t at = pos % ring_bytes_, first = std::min(n, ring_bytes_ - at);
    std::memcpy(dst, base + at, first);
    std::memcpy(dst + first, base, n - first);
  }

  bool pump_send(int peer) {
    auto& q = sends_[static_cast<size_t>(peer)];
    bool progressed = false;
    RingCtl* c = ring_ctl(o_.rank, peer);
    while (!q.empty()) {
      SendItem& s = q.front();
      const size_t total = sizeof(wire::Header) + s.n;
      uint64_t head = c->head.v.load(std::memory_order_relaxed);
      uint64_t tail = c->tail.v.load(std::memory_order_acquire);
      // More unread bytes than the ring holds would make `free` wrap and the write overrun it.
      CHORUS_CHECK(head - tail <= ring_bytes_, "send ring holds more than its size");
      size_t free = ring_bytes_ - static_cast<size_t>(head - tail);
      if (free == 0) break;
      size_t k = std::min(free, total - s.off);
      size_t w = 0;
      if (s.off < sizeof(wire::Header)) {
        size_t hk = std::min(k, sizeof(wire::Header) - s.off);
        ring_write(peer, head, reinterpret_cast<const char*>(&s.header) + s.off, hk);
        w += hk;
      }
      if (w < k) {
        size_t data_off = s.off + w - sizeof(wire::Header);
        ring_write(peer, head + w, s.data + data_off, k - w);
      }
      c->head.v.store(head + k, std::memory_order_release);
      s.off += k;
      progressed = true;
      ring(peer);
      if (s.off == total) {
        pending_.erase(s.ticket);
        q.pop_front();
      }
    }
    return progressed;
  }

  // Takes n bytes of the stream from `peer`: first what read_ahead() buffered, then the ring.
  void take(int peer, uint64_t& tail, char* dst, size_t n) {
    auto& inbox = inbox_[static_cast<size_t>(peer)];
    size_t& pos = inbox_pos_[static_cast<size_t>(peer)];
    const size_t buffered = std::min(n, inbox.size() - pos);
    if (buffered > 0) std::memcpy(dst, inbox.data() + pos, buffered);  // an empty inbox's data() may be null
    pos += buffered;
    if (pos == inbox.size()) {
      inbox.clear();
      pos = 0;
    }
    if (n > buffered) {
      ring_read(peer, tail, dst + buffered, n - buffered);
      tail += n - buffered;
    }
  }

  bool pump_recv(int peer) {
    auto& q = recvs_[static_cast<size_t>(peer)];
    bool progressed = false;
    RingCtl* c = ring_ctl(peer, o_.rank);
    while (!q.empty()) {
      RecvItem& r = q.front();
      uint64_t tail = c->tail.v.load(std::memory_order_relaxed);
      const uint64_t head = c->head.v.load(std::memory_order_acquire);
      size_t avail = static_cast<size_t>(head - tail) +
                     (inbox_[static_cast<size_t>(peer)].size() - inbox_pos_[static_cast<size_t>(peer)]);
      const uint64_t tail_before = tail;
      bool moved = false;
      if (!r.have_header) {
        if (avail < sizeof(wire::Header)) break;
        wire::Header h;
        take(peer, tail, reinterpret_cast<char*>(&h), sizeof(h));
        if (h.magic != wire::kMessageMagic) {
          throw PeerError(prefix() + ": corrupt message from " + peer_name(peer) + " (bad magic)");
        }
        if (!wire::same_call(h, r.expect)) {
          throw MismatchError(wire::mismatch_message(me(), r.expect, peer_name(peer), "called " + wire::describe(h)));
        }
        if (h.payload != r.n) {
          throw MismatchError(prefix() + ": " + peer_name(peer) + " sent " + std::to_string(h.payload) +
                              " bytes where this rank expected " + std::to_string(r.n));
        }
        avail -= sizeof(h);
        r.have_header = true;
        moved = true;
      }
      const size_t k = std::min(avail, r.n - r.got);
      if (k > 0) {
        take(peer, tail, r.data + r.got, k);
        r.got += k;
        moved = true;
      }
      if (tail != tail_before) {
        c->tail.v.store(tail, std::memory_order_release);
        ring(peer);
      }
      progressed |= moved;
      if (r.got < r.n) break;
      pending_.erase(r.ticket);
      q.pop_front();
    }
    return progressed;
  }

  // Moves what `peer` has written into its ring into this rank's inbox for it, so that a peer
  // blocked on a full ring moves on while this rank is itself blocked sending (two ranks that
  // send to each other before receiving, or a ring of such sends, would otherwise deadlock).
  bool read_ahead(int peer) {
    RingCtl* c = ring_ctl(peer, o_.rank);
    const uint64_t tail = c->tail.v.load(std::memory_order_relaxed);
    const uint64_t head = c->head.v.load(std::memory_order_acquire);
    const size_t k = static_cast<size_t>(head - tail);
    if (k == 0) return false;
    CHORUS_CHECK(k <= ring_bytes_, "receive ring holds more than its size");
    auto& inbox = inbox_[static_cast<size_t>(peer)];
    const size_t old = inbox.size();
    inbox.resize(old + k);
    ring_read(peer, tail, inbox.data() + old, k);
    c->tail.v.store(tail + k, std::memory_order_release);
    ring(peer);
    return true;
  }

  bool pump() {
    bool progressed = false;
    bool sending = false;
    for (int p = 0; p < o_.size; ++p) {
      if (p == o_.rank) continue;
      if (!sends_[static_cast<size_t>(p)].empty()) progressed |= pump_send(p);
      sending = sending || !sends_[static_cast<size_t>(p)].empty();
      if (!recvs_[static_cast<size_t>(p)].empty()) progressed |= pump_recv(p);
    }
    if (sending) {
      for (int p = 0; p < o_.size; ++p) {
        if (p != o_.rank && recvs_[static_cast<size_t>(p)].empty()) progressed |= read_ahead(p);
      }
    }
    return progressed;
  }

  // Throws MismatchError when `peer` has published a different call for this call's sequence
  // number (it publishes in begin(), before it can reach any barrier of the call).
  // `strict`: the peer has reached this call's first barrier, so it must be in a collective with
  // this call's sequence number; otherwise only a published call for it is compared.
  void check_same_call(int peer, bool strict) const {
    if (call_.op == wire::OpType::kSend || call_.op == wire::OpType::kRecv) return;
    const SegHeader* h = segs_[static_cast<size_t>(peer)].hdr;
    const Desc& d = h->desc[call_.seq % kDescHistory];
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
      for (const Desc& e : h->desc) {
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
  void check_same_buffer(int peer, const Desc& d) const {
    const Desc& m = my_hdr().desc[call_.seq % kDescHistory];
    const uint64_t mr = m.region.load(std::memory_order_relaxed), mo = m.offset.load(std::memory_order_relaxed);
    const uint64_t tr = d.region.load(std::memory_order_relaxed), to = d.offset.load(std::memory_order_relaxed);
    if (mr == tr && mo == to) return;
    auto where = [](uint64_t r, uint64_t o) {
      return r == 0 ? std::string("ordinary memory")
                    : "shared buffer #" + std::to_string(r - 1) + " at byte " + std::to_string(o);
    };
    throw MismatchError(me() + ": " + wire::describe(call_) + ": this rank's data is in " + where(mr, mo) + " but " +
                        peer_name(peer) + "'s is in " + where(tr, to) +
                        "; buffers from ProcessGroup::allocate_buffer must be used the same way on every rank "
                        "(the same buffer and range everywhere, or none)");
  }

  // After the first barrier of a native collective every peer has published its call: check them
  // all, so that ranks that disagree never read each other's areas.
  void check_agreement() const {
    for (int p = 0; p < o_.size; ++p) {
      if (p != o_.rank) check_same_call(p, /*strict=*/true);
    }
  }

  // The operation `peer` is in now (its last begin()).
  wire::Call current_call(int peer) const {
    const CurrentCall& cur = segs_[static_cast<size_t>(peer)].hdr->current;
    for (int tries = 0; tries < 1000; ++tries) {
      const uint64_t v = cur.version.load(std::memory_order_acquire);
      wire::Call c = cur.call;
      std::atomic_thread_fence(std::memory_order_acquire);
      if (v % 2 == 0 && cur.version.load(std::memory_order_relaxed) == v) return c;
    }
    return wire::Call{};
  }

  // Whether `peer`'s process has exited (its pidfd is readable; without pidfds, kill(pid, 0)).
  bool gone(int peer) const {
    const int fd = pidfds_[static_cast<size_t>(peer)];
    if (fd >= 0) {
      pollfd pfd{fd, POLLIN, 0};
      return ::poll(&pfd, 1, 0) > 0;
    }
    return ::kill(segs_[static_cast<size_t>(peer)].hdr->pid, 0) != 0 && errno == ESRCH;
  }

  // Whether this rank still needs something from `peer` to finish what it is waiting for.
  bool waiting_on(int peer) const {
    return !recvs_[static_cast<size_t>(peer)].empty() || !sends_[static_cast<size_t>(peer)].empty() ||
           (in_barrier_ && segs_[static_cast<size_t>(peer)].hdr->stage.load(std::memory_order_acquire) < stage_);
  }

  // Peers' failures, departures and disagreements, checked whenever this rank is about to sleep.
  void check_peers() {
    for (int p = 0; p < o_.size; ++p) {
      if (p == o_.rank) continue;
      SegHeader* h = segs_[static_cast<size_t>(p)].hdr;
      uint32_t st = h->state.load(std::memory_order_acquire);
      if (st == kAborted) {
        throw_error(h->error_class, prefix() + ": failed because " + peer_name(p) + " failed: " + h->message);
      }
      check_same_call(p, /*strict=*/false);
      if (!waiting_on(p)) continue;  // a peer that finished and left owes this rank nothing
      // This rank waits on a ring for `p` while `p` waits at a native collective's barrier for this
      // rank: neither can move, whatever happens next. (A barrier needs every rank.)
      if (!in_barrier_ && h->in_barrier.load(std::memory_order_acquire) != 0 &&
          h->stage.load(std::memory_order_acquire) > stage_) {
        pump();  // take what it wrote before it got there
        if (waiting_on(p)) {
          throw MismatchError(wire::mismatch_message(
              me(), call_, peer_name(p),
              "is in " + wire::describe(current_call(p)) + ", waiting for this rank at a shared-memory barrier"));
        }
      }
      const bool dead = gone(p);
      if (st != kClosed && !dead) continue;
      // It left: take what it wrote before it went, and fail only if that is not enough.
      pump();
      if (!waiting_on(p)) continue;
      if (st == kClosed) {
        throw PeerError(prefix() + ": peer " + peer_name(p) + " has closed its process group (it finished or "
                        "destroyed the group) but this operation still needs it");
      }
      if (dead) {
        throw PeerError(prefix() + ": peer " + peer_name(p) + " died (its process is gone) [after " +
                        net::format_duration(Clock::now() - start_) + "]");
      }
    }
  }

  template <typename Done>
  void wait_until(Done done, const char* what) {
    if (aborted_ || closed_) throw PeerError(prefix() + ": the transport is closed");
    SegHeader* h = me_hdr();
    for (;;) {
      if (pump() && done()) return;
      if (done()) return;
      const bool may_spin = gate_ == nullptr || gate_->load(std::memory_order_relaxed) > 0;
      auto spin_until = Clock::now() + std::chrono::microseconds(may_spin ? o_.spin_us : 0);
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
      // Sleep until a peer rings (or 50 ms pass: peers' deaths are noticed by polling).
      h->sleeping.store(1, std::memory_order_seq_cst);
      uint32_t bell = h->doorbell.load(std::memory_order_seq_cst);
      if (!pump() && !done()) {  // re-check after announcing the sleep: no wake-up is lost
        auto left = std::min<Clock::duration>(deadline_ - Clock::now(), std::chrono::milliseconds(50));
        if (left > Clock::duration::zero()) {
          timespec ts{0, static_cast<long>(std::chrono::duration_cast<std::chrono::nanoseconds>(left).count())};
          futex(&h->doorbell, FUTEX_WAIT, bell, &ts);
        }
      }
      h->sleeping.store(0, std::memory_order_relaxed);
    }
  }

  // The collective areas alternate halves chunk by chunk (across calls too): a rank copies into
  // half h only after the barrier that follows its previous copy-in, which every rank passes only
  // once it has finished reading the chunk before, the last one that used h.
  int next_half() { return static_cast<int>(chunks_++ % 2); }

  // Runs step(done, len, mine, half) over [0, total) in pieces of at most `per` units (once, with
  // len 0, when total is 0), each piece in the next half of the collective areas; `mine` is this
  // rank's area in that half. Every rank must call it with the same total and per.
  template <typename Step>
  void for_each_chunk(size_t total, size_t per, Step step) {
    size_t done = 0;
    do {
      const size_t len = std::min(per, total - done);
      const int half = next_half();
      step(done, len, area(o_.rank, half), half);
      done += len;
    } while (done < total);
  }

  void barrier(const char* what) {
    ++stage_;
    SegHeader* h = me_hdr();
    h->stage.store(stage_, std::memory_order_release);
    ring_all();
    in_barrier_ = true;
    h->in_barrier.store(1, std::memory_order_release);
    struct Reset {
      bool& flag;
      std::atomic<uint32_t>& shared;
      ~Reset() {
        flag = false;
        shared.store(0, std::memory_order_release);
      }
    } reset{in_barrier_, h->in_barrier};
    wait_until([&] {
      for (int p = 0; p < o_.size; ++p) {
        if (segs_[static_cast<size_t>(p)].hdr->stage.load(std::memory_order_acquire) < stage_) return false;
      }
      return true;
    }, what);
  }

  [[noreturn]] void fail_timeout(const char* what) {
    std::ostringstream out;
    out << prefix() << ": timed out after " << net::format_duration(Clock::now() - start_) << " waiting for";
    const char* sep = " ";
    for (int p = 0; p < o_.size; ++p) {
      if (p == o_.rank) continue;
      bool waiting = !recvs_[static_cast<size_t>(p)].empty() || !sends_[static_cast<size_t>(p)].empty() ||
                     segs_[static_cast<size_t>(p)].hdr->stage.load() < stage_;
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

  ShmOptions o_;
  size_t ring_bytes_ = 0, coll_half_ = 0, rings_off_ = 0, ring_stride_ = 0, coll_off_ = 0, seg_bytes_ = 0;
  std::string name_;
  bool named_ = false;
  uint64_t next_region_ = 0;
  std::vector<std::weak_ptr<Region>> regions_;  // the shared buffers still alive
  std::vector<Segment> segs_;
  std::vector<int> pidfds_;
  std::vector<std::deque<SendItem>> sends_;
  std::vector<std::deque<RecvItem>> recvs_;
  std::unordered_set<Ticket> pending_;
  Ticket next_ = 1;
  uint64_t stage_ = 0;
  uint64_t chunks_ = 0;
  bool in_barrier_ = false;
  const std::atomic<int>* gate_ = nullptr;
  std::vector<std::vector<char>> inbox_;  // per peer: bytes read ahead of a posted receive
  std::vector<size_t> inbox_pos_;
  wire::Call call_;
  Clock::time_point start_ = Clock::now();
  Deadline deadline_ = Deadline::max();
  bool aborted_ = false;
  bool closed_ = false;
};

}  // namespace

size_t shm_chunk_bytes(const ShmOptions& options) { return layout(options, 1).chunk; }

size_t shm_segment_bytes(const ShmOptions& options, int size) { return layout(options, size).seg_bytes; }

uint64_t shm_free_bytes() {
  struct statvfs st {};
  if (::statvfs("/dev/shm", &st) != 0) return 0;
  return static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
}

std::vector<Announcement> exchange_announcements(Store& store, const std::string& key_prefix, int rank, int size,
                                                 const std::string& token, const Announcement& mine,
                                                 Deadline deadline) {
  const std::string token_hash = std::to_string(fnv1a64(token));
  store.set(key_prefix + "/" + std::to_string(rank),
            std::to_string(size) + "\n" + token_hash + "\n" + mine.host + "\n" + mine.extra);
  std::vector<Announcement> all(static_cast<size_t>(size));
  std::vector<bool> have(static_cast<size_t>(size), false);
  // Reads and checks rank r's announcement (a disagreement is raised as soon as it is seen).
  auto take = [&](int r, const std::string& text) {
    std::istringstream in(text);
    std::string their_size, their_token;
    Announcement& a = all[static_cast<size_t>(r)];
    std::getline(in, their_size);
    std::getline(in, their_token);
    std::getline(in, a.host);
    std::getline(in, a.extra);
    const std::string who = "chorus: rank " + std::to_string(rank) + ": rank " + std::to_string(r);
    if (their_size != std::to_string(size)) {
      throw HandshakeError(who + " has world size " + their_size + " but this rank has " + std::to_string(size) +
                           "; every rank of a group must be started with the same world size");
    }
    if (their_token != token_hash) {
      throw HandshakeError(who + " has a different job token; it belongs to another job (or CHORUS_JOB_TOKEN "
                           "differs between the ranks)");
    }
    have[static_cast<size_t>(r)] = true;
  };
  // Every rank's key, watched all at once in short slices: a disagreement shows as soon as its
  // announcement is there, and a timeout names every rank that is missing, and only those.
  for (;;) {
    std::vector<std::string> missing_keys;
    std::string missing;
    for (int r = 0; r < size; ++r) {
      if (have[static_cast<size_t>(r)]) continue;
      const std::string key = key_prefix + "/" + std::to_string(r);
      if (store.check({key})) {
        take(r, store.get(key));
      } else {
        missing_keys.push_back(key);
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
    }
    if (missing_keys.empty()) break;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      throw TimeoutError("chorus: rank " + std::to_string(rank) + ": group setup: rank(s) [" + missing +
                         "] never announced themselves in the store under " + key_prefix +
                         "/: they are missing (not started, crashed before creating the group, or creating "
                         "another group)");
    }
    try {
      store.wait(missing_keys, std::min(left, std::chrono::milliseconds(50)));
    } catch (const TimeoutError&) {
      // The next round rechecks, and reports once the deadline has passed.
    }
  }
  return all;
}

std::string host_identity() {
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  // The IPC namespace decides whether /dev/shm and futexes are shared; the PID namespace whether
  // a peer's pid means the same process here (death detection uses it).
  auto ns = [](const char* path) {
    struct stat st {};
    return ::stat(path, &st) == 0 ? std::to_string(st.st_ino) : std::string("?");
  };
  return read_first_line("/proc/sys/kernel/random/boot_id") + "/" + host + "/ipc:" + ns("/proc/self/ns/ipc") +
         "/pid:" + ns("/proc/self/ns/pid");
}

std::unique_ptr<ShmTransportApi> make_shm_transport(const ShmOptions& options) {
  if (options.store == nullptr) throw UsageError("make_shm_transport: a store is required");
  auto t = std::make_unique<ShmTransport>(options);
  t->setup();
  return t;
}

}  // namespace chorus::transport
