// Internal: a shared-memory segment and its layout (docs/shm.md, "Segment layout").
//
// Every rank of a shared-memory group owns one segment, created in /dev/shm and mapped read-write
// by every rank of the group:
//   [SegHeader][ring to rank 0]...[ring to rank n-1][collective area: 2 halves]
// The header is written by its owner and read by the peers; every field a peer reads while the
// owner runs is an atomic (lock-free, hence usable across processes), or is written once before
// the segment's name is published, or is guarded by a seqlock (Desc, CurrentCall).
// Shared buffers (Region) are further segments, one per rank per buffer.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "message.h"
#include "shm_ring.h"
#include "transport.h"

namespace chorus::transport::shm {

constexpr uint32_t kSegMagic = 0x4d534843;  // "CHSM"
// Collective descriptors kept per rank: a peer may lag this many collectives and still find the
// descriptor of the call it checks.
constexpr int kDescHistory = 8;

enum State : uint32_t { kLive = 0, kAborted = 1, kClosed = 2 };

// One collective this rank is in (or was in), for the peers' agreement checks.
// A seqlock: the owner stores seq_plus_one last, a reader re-reads it after copying `call`.
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
  // Written once by the owner before its name is announced; read by peers after they map it.
  uint32_t magic;
  int32_t rank;
  int32_t size;
  int32_t pid;
  uint64_t token_hash;
  uint64_t ring_bytes;
  uint64_t collective_bytes;
  uint64_t small_bytes;
  // kLive, then kAborted (error_class and message written first) or kClosed.
  alignas(64) std::atomic<uint32_t> state;
  uint8_t error_class;
  char message[2048];
  alignas(64) std::atomic<uint32_t> doorbell;  // futex word: bumped whenever a peer may proceed
  alignas(64) std::atomic<uint32_t> sleeping;  // 1 while the owner sleeps (or is about to) on it
  alignas(64) std::atomic<uint64_t> stage;     // barriers the owner has reached
  Desc desc[kDescHistory];                     // the collectives this rank is in, by seq
  CurrentCall current;
  alignas(64) std::atomic<uint32_t> in_barrier;  // 1 while it waits at a native collective's barrier
};

// Processes of one group map the same bytes: nothing in the header may need a lock or a pointer.
static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free,
              "shared-memory atomics must be lock-free to work across processes");
static_assert(std::is_trivially_copyable_v<wire::Call>, "wire::Call is copied under a seqlock");
static_assert(std::is_standard_layout_v<SegHeader>, "the header is shared between processes");
static_assert(alignof(SegHeader) == 64 && sizeof(SegHeader) % 64 == 0, "header fields sit on their own lines");
static_assert(sizeof(SegHeader) <= 4096, "the header fits the page before the rings");
static_assert(sizeof(RingCtl) == 128, "a ring's head and tail sit on lines of their own");

size_t align_up(size_t x, size_t a);

// Where things are in a segment of a group of `size` ranks.
struct Layout {
  size_t ring_bytes;   // data bytes of one ring
  size_t chunk;        // bytes of one half of the collective area
  size_t rings_off;    // the first ring's RingCtl
  size_t ring_stride;  // from one ring's RingCtl to the next
  size_t coll_off;     // the collective area's first half
  size_t seg_bytes;    // the whole segment
};
Layout layout(const ShmOptions& options, int size);

// One mapping of a segment; unmapped when destroyed.
struct Segment {
  void* base = nullptr;
  size_t bytes = 0;
  SegHeader* hdr = nullptr;
  Segment() = default;
  Segment(Segment&& o) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  Segment& operator=(Segment&& o) noexcept;
  ~Segment();

  RingView ring(const Layout& l, int to) const;  // the ring this segment's owner writes to rank `to`
  char* area(const Layout& l, int half) const;   // half 0 or 1 of the collective area
};

// The inode of one of this process's namespaces ("pid", "ipc"), or 0.
unsigned long namespace_id(const char* kind);

// A fresh name for this process's segment of shm rank `rank`: /chorus-<pid ns>-<pid>-<nonce>-<rank>.
// The pid lets a later job sweep it if this process dies during setup; the nonce keeps two groups
// of one process (or two namespaces' pids) apart.
std::string new_segment_name(int rank);

// Removes segments left in /dev/shm by chorus processes of this PID namespace that no longer exist
// (killed during setup, before the names were unlinked).
void sweep_stale_segments();

// Creates the named segment of `bytes`, reserving its pages (a full /dev/shm fails here with
// UsageError instead of SIGBUS on first touch). `who` starts the error messages.
int create_segment(const std::string& name, size_t bytes, const std::string& who);

// Maps `bytes` of `fd` shared and closes `fd`; throws Error naming `who`.
Segment map_segment(int fd, size_t bytes, const std::string& who);

// One shared buffer: every rank's copy, mapped here. Unmapped when the last user lets go.
class Region final : public SharedRegion {
 public:
  Region(uint64_t id, size_t bytes, int rank, int size);
  ~Region() override;
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

// Creates and maps this rank's copy of a shared buffer: the mapping, or nullptr with *err set to
// the errno (nothing is thrown: the ranks first agree whether every copy exists).
void* create_buffer_copy(const std::string& name, size_t bytes, int* err);
// Maps a peer's copy by name: the mapping, or nullptr with *err set.
void* map_buffer_copy(const std::string& name, size_t bytes, int* err);

}  // namespace chorus::transport::shm
