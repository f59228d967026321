// The shared-memory native collectives over staging areas and a barrier (shm_collectives.h).

#include "shm_collectives.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "chorus/comm/error.h"
#include "chorus/comm/log.h"
#include "error_class.h"
#include "plan.h"
#include "reduce.h"

namespace chorus::transport::shm {

std::string ShmNativeCollectives::me() const { return "chorus: rank " + std::to_string(a_.global_rank(a_.rank())); }

template <typename Step>
void ShmNativeCollectives::for_each_chunk(size_t total, size_t per, Step step) {
  size_t done = 0;
  do {
    const size_t len = std::min(per, total - done);
    const int half = next_half();
    step(done, len, a_.area(a_.rank(), half), half);
    done += len;
  } while (done < total);
}

bool ShmNativeCollectives::allreduce(void* buf, size_t count, DataType dtype, ReduceOp op) {
  const size_t bytes = count * element_size(dtype);
  std::shared_ptr<Region> region;
  size_t offset = 0;
  if (bytes > 0) region = find_region(buf, bytes, &offset);
  if (region) {
    // Published before the first barrier, so that check_agreement() sees it: ranks that disagree
    // about where their buffers live fail instead of reading each other's memory.
    a_.publish_buffer(region->id() + 1, offset);
    allreduce_shared(*region, offset, count, dtype, op);
  } else {
    allreduce_with(buf, count, dtype, op, nullptr);
  }
  return true;
}

bool ShmNativeCollectives::broadcast(void* buf, size_t bytes, int root) {
  // Per chunk: the root publishes it in its area, one barrier, the others copy it out.
  char* data = static_cast<char*>(buf);
  const int rank = a_.rank();
  for_each_chunk(bytes, a_.area_bytes(), [&](size_t done, size_t len, char* mine, int half) {
    if (rank == root) std::memcpy(mine, data + done, len);
    a_.barrier("to publish the root's data");
    if (done == 0) a_.check_agreement();
    if (rank != root) std::memcpy(data + done, a_.area(root, half), len);
  });
  return true;
}

bool ShmNativeCollectives::allgather(const void* in, void* out, size_t bytes) {
  // Per chunk of every rank's block: each publishes its piece, one barrier, all copy all pieces.
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  const int rank = a_.rank(), n = a_.size();
  char* own = dst + static_cast<size_t>(rank) * bytes;
  if (own != src) std::memmove(own, src, bytes);  // in place when `in` is this rank's block of `out`
  for_each_chunk(bytes, a_.area_bytes(), [&](size_t done, size_t len, char* mine, int half) {
    std::memcpy(mine, own + done, len);
    a_.barrier("to publish its block");
    if (done == 0) a_.check_agreement();
    for (int k = 0; k < n; ++k) {
      if (k != rank) std::memcpy(dst + static_cast<size_t>(k) * bytes + done, a_.area(k, half), len);
    }
  });
  return true;
}

void ShmNativeCollectives::allreduce_through_leader(void* buf, size_t count, DataType dtype, ReduceOp op,
                                                    const SliceHook& between) {
  const int rank = a_.rank(), n = a_.size();
  const size_t esz = element_size(dtype);
  const size_t chunk_elems = std::max<size_t>(1, a_.area_bytes() / esz);
  for_each_chunk(count, chunk_elems, [&](size_t done, size_t len, char* mine, int half) {
    char* chunk = static_cast<char*>(buf) + done * esz;
    std::memcpy(mine, chunk, len * esz);
    a_.barrier("to copy in its part of the buffer");
    if (done == 0) a_.check_agreement();
    if (rank == 0) {  // only rank 0 reads the areas until the next barrier
      for (int k = 1; k < n; ++k) reduce::reduce_into(dtype, op, chunk, a_.area(k, half), len);
      between(chunk, len);
      std::memcpy(mine, chunk, len * esz);
    }
    a_.barrier("to receive the result from its host's leader");
    if (rank != 0) std::memcpy(chunk, a_.area(0, half), len * esz);
  });
}

// One barrier: every rank publishes its whole buffer and reduces all of them, in rank order, so
// every rank computes the same bits.
void ShmNativeCollectives::allreduce_small(char* user, size_t count, DataType dtype, ReduceOp op,
                                           const SliceHook& between) {
  const int n = a_.size();
  const size_t esz = element_size(dtype);
  const int half = next_half();
  std::memcpy(a_.area(a_.rank(), half), user, count * esz);
  a_.barrier("to copy in its buffer");
  a_.check_agreement();
  std::memcpy(user, a_.area(0, half), count * esz);
  for (int k = 1; k < n; ++k) reduce::reduce_into(dtype, op, user, a_.area(k, half), count);
  if (between) between(user, count);
  if (op == ReduceOp::kAvg) reduce::finish_avg(dtype, user, count, n);
}

void ShmNativeCollectives::allreduce_with(void* buf, size_t count, DataType dtype, ReduceOp op,
                                          const SliceHook& between) {
  const int rank = a_.rank(), n = a_.size();
  const size_t esz = element_size(dtype);
  char* user = static_cast<char*>(buf);
  if (count * esz <= std::min(small_bytes_, a_.area_bytes())) {
    allreduce_small(user, count, dtype, op, between);
    return;
  }
  // Large, per chunk (reduce-scatter, then allgather, through the areas): every rank copies
  // the other ranks' slices of its chunk into its area; reduces its own slice in place in its
  // buffer, reading the peers' copies of it, and publishes the result in its area; then copies
  // the other ranks' results out. Each rank moves 2(n-1)/n of the chunk across cores and never
  // copies its own slice in or out.
  const size_t chunk_elems = std::max<size_t>(1, a_.area_bytes() / esz);
  for_each_chunk(count, chunk_elems, [&](size_t done, size_t len, char* mine, int half) {
    char* chunk = user + done * esz;
    for (int k = 0; k < n; ++k) {
      const plan::Range sk = plan::split(len, n, k);
      if (k != rank) std::memcpy(mine + sk.offset * esz, chunk + sk.offset * esz, sk.count * esz);
    }
    a_.barrier("to copy in its part of the buffer");
    if (done == 0) a_.check_agreement();
    const plan::Range s = plan::split(len, n, rank);
    char* acc = chunk + s.offset * esz;
    for (int k = 0; k < n; ++k) {
      if (k != rank) reduce::reduce_into(dtype, op, acc, a_.area(k, half) + s.offset * esz, s.count);
    }
    if (between) between(acc, s.count);
    if (op == ReduceOp::kAvg) reduce::finish_avg(dtype, acc, s.count, n);
    std::memcpy(mine + s.offset * esz, acc, s.count * esz);
    a_.barrier("to reduce its slice");
    for (int k = 0; k < n; ++k) {
      const plan::Range sk = plan::split(len, n, k);
      if (k != rank) std::memcpy(chunk + sk.offset * esz, a_.area(k, half) + sk.offset * esz, sk.count * esz);
    }
  });
}

std::shared_ptr<Region> ShmNativeCollectives::find_region(const void* buf, size_t bytes, size_t* offset) const {
  const char* p = static_cast<const char*>(buf);
  for (const auto& w : regions_) {
    auto r = w.lock();
    if (!r) continue;
    const char* b = r->base(a_.rank());
    if (p >= b && p + bytes <= b + r->size()) {
      *offset = static_cast<size_t>(p - b);
      return r;
    }
  }
  return nullptr;
}

// A range that lives at the same offset of a shared buffer on every rank: each rank reduces its
// slice out of every rank's copy and writes the result into all of them.
void ShmNativeCollectives::allreduce_shared(const Region& region, size_t offset, size_t count, DataType dtype,
                                            ReduceOp op) {
  const int rank = a_.rank(), n = a_.size();
  const size_t esz = element_size(dtype);
  a_.barrier("to have its buffer ready");
  a_.check_agreement();
  const plan::Range s = plan::split(count, n, rank);
  const size_t at = offset + s.offset * esz;
  char* acc = region.base(rank) + at;
  if (n == 2 && dtype == DataType::kFloat32 && (op == ReduceOp::kSum || op == ReduceOp::kAvg)) {
    // DDP's case: read both copies once, write both once.
    reduce::sum_pair_f32(reinterpret_cast<float*>(acc), reinterpret_cast<float*>(region.base(1 - rank) + at),
                         s.count, op == ReduceOp::kAvg);
    a_.barrier("to write its reduced slice into every rank's buffer");
    return;
  }
  // Every slice is reduced once, in the same order of ranks, and copied: all ranks get the same bits.
  for (int k = 0; k < n; ++k) {
    if (k != rank) reduce::reduce_into(dtype, op, acc, region.base(k) + at, s.count);
  }
  if (op == ReduceOp::kAvg) reduce::finish_avg(dtype, acc, s.count, n);
  for (int k = 0; k < n; ++k) {
    if (k != rank) std::memcpy(region.base(k) + at, acc, s.count * esz);
  }
  a_.barrier("to write its reduced slice into every rank's buffer");
}

std::shared_ptr<SharedRegion> ShmNativeCollectives::allocate_shared(size_t bytes) {
  const int rank = a_.rank(), n = a_.size();
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
  const std::string name = a_.buffer_name(id);
  int err = 0;
  void* base = create_buffer_copy(name, len, &err);
  // The name goes when every rank has mapped the copy, or at once if this operation fails.
  struct Unlink {
    std::string name;
    bool armed;
    ~Unlink() {
      if (armed) ::shm_unlink(name.c_str());
    }
  } unlink_on_exit{name, base != nullptr};
  if (base != nullptr) {
    mine.ok = 1;
    std::snprintf(mine.text, sizeof(mine.text), "%s", name.c_str());
  } else {
    std::snprintf(mine.text, sizeof(mine.text), "cannot reserve %zu bytes of shared memory: %s", len,
                  std::strerror(err));
  }
  auto region = std::make_shared<Region>(id, len, rank, n);
  if (base != nullptr) region->set_base(rank, base);
  allgather(&mine, records.data(), sizeof(Record));
  std::string failed;
  for (int r = 0; r < n && failed.empty(); ++r) {
    if (!records[static_cast<size_t>(r)].ok) {
      records[static_cast<size_t>(r)].text[sizeof(Record::text) - 1] = '\0';
      failed = "rank " + std::to_string(a_.global_rank(r)) + ": " + records[static_cast<size_t>(r)].text;
    }
  }
  if (!failed.empty()) {
    if (rank == 0) {
      chorus::log(LogLevel::kWarning, me() + ": a shared buffer of " + std::to_string(len) + " bytes is not available (" +
                                          failed + "); using ordinary memory, whose allreduce copies through the staging areas");
    }
    return nullptr;
  }
  for (int r = 0; r < n; ++r) {
    if (r == rank) continue;
    Record& rec = records[static_cast<size_t>(r)];
    rec.text[sizeof(rec.text) - 1] = '\0';
    void* pb = map_buffer_copy(rec.text, len, &err);
    if (pb == nullptr) {
      throw Ranked<Error>(me() + ": cannot map " + a_.peer_name(r) + "'s shared buffer " + rec.text + ": " + std::strerror(err));
    }
    region->set_base(r, pb);
  }
  // Every rank has mapped every copy: the names can go, so nothing outlives the processes.
  a_.barrier("to map the shared buffers");
  regions_.erase(std::remove_if(regions_.begin(), regions_.end(), [](const auto& w) { return w.expired(); }),
                 regions_.end());
  regions_.push_back(region);
  return region;
}

}  // namespace chorus::transport::shm
