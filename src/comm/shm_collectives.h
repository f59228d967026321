// Internal: the shared-memory transport's native collectives (docs/shm.md, "Native allreduce" and
// "Shared buffers"), written against a small interface of staging areas plus a barrier.
//
// Each rank has a collective area of two halves that every rank can read. A collective moves its
// data in chunks of at most one half: a rank copies (part of) its chunk into its area, all meet at
// a barrier, and each reads what it needs straight out of the others' areas. Consecutive chunks
// (across calls too) alternate halves, so a chunk's copy-in never races the previous chunk's
// reads: a rank writes half h again only after a barrier that every rank passes once it has
// finished with h's previous chunk.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shm_segment.h"
#include "transport.h"

namespace chorus::transport::shm {

// What the native collectives need from the transport under them. The caller has begun the
// collective's call on the transport (Transport::begin) before calling into ShmNativeCollectives.
class CollectiveAreas {
 public:
  virtual ~CollectiveAreas() = default;
  virtual int rank() const = 0;  // among the ranks sharing memory
  virtual int size() const = 0;
  virtual int global_rank(int local) const = 0;  // in the whole group, for messages
  virtual std::string peer_name(int peer) const = 0;
  virtual size_t area_bytes() const = 0;  // one half of a rank's area
  virtual char* area(int owner, int half) const = 0;
  // Returns once every rank has reached this barrier; throws (TimeoutError, PeerError,
  // MismatchError) when one cannot. `what` completes "waiting for rank r (...)".
  virtual void barrier(const char* what) = 0;
  // Past a collective's first barrier every rank has published its call: throws MismatchError
  // when any differs, so that ranks that disagree never read each other's areas.
  virtual void check_agreement() const = 0;
  // Before the first barrier: where this rank's data for the current allreduce lives (a shared
  // buffer's id + 1 and the offset in it), for check_agreement.
  virtual void publish_buffer(uint64_t region_plus_one, uint64_t offset) = 0;
  // The /dev/shm name of this rank's copy of shared buffer `id`.
  virtual std::string buffer_name(uint64_t id) const = 0;
};

class ShmNativeCollectives final : public ShmCollectives {
 public:
  explicit ShmNativeCollectives(CollectiveAreas& areas, size_t small_bytes) : a_(areas), small_bytes_(small_bytes) {}

  bool allreduce(void* buf, size_t count, DataType dtype, ReduceOp op) override;
  bool broadcast(void* buf, size_t bytes, int root) override;
  bool allgather(const void* in, void* out, size_t bytes) override;
  std::shared_ptr<SharedRegion> allocate_shared(size_t bytes) override;
  void allreduce_with(void* buf, size_t count, DataType dtype, ReduceOp op, const SliceHook& between) override;
  void allreduce_through_leader(void* buf, size_t count, DataType dtype, ReduceOp op,
                                const SliceHook& between) override;

 private:
  std::string me() const;
  void allreduce_small(char* user, size_t count, DataType dtype, ReduceOp op, const SliceHook& between);
  // The shared buffer holding [buf, buf + bytes) on this rank, and the offset of buf in it.
  std::shared_ptr<Region> find_region(const void* buf, size_t bytes, size_t* offset) const;
  void allreduce_shared(const Region& region, size_t offset, size_t count, DataType dtype, ReduceOp op);
  int next_half() { return static_cast<int>(chunks_++ % 2); }
  // Runs step(done, len, mine, half) over [0, total) in pieces of at most `per` units (once, with
  // len 0, when total is 0), each piece in the next half of the areas; `mine` is this rank's area
  // in that half. Every rank must call it with the same total and per.
  template <typename Step>
  void for_each_chunk(size_t total, size_t per, Step step);

  CollectiveAreas& a_;
  size_t small_bytes_;
  uint64_t chunks_ = 0;
  uint64_t next_region_ = 0;
  std::vector<std::weak_ptr<Region>> regions_;  // the shared buffers still alive
};

}  // namespace chorus::transport::shm
