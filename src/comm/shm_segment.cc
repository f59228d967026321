// Shared-memory segments: layout, naming, creation, mapping and the sweep of stale names
// (shm_segment.h; docs/shm.md, "Segment layout").

#include "shm_segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>

#include "chorus/comm/error.h"
#include "error_class.h"

namespace chorus::transport {
namespace shm {

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

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

Segment::Segment(Segment&& o) noexcept : base(o.base), bytes(o.bytes), hdr(o.hdr) {
  o.base = nullptr;
  o.hdr = nullptr;
}

Segment& Segment::operator=(Segment&& o) noexcept {
  if (this != &o) {
    if (base != nullptr) ::munmap(base, bytes);
    base = o.base;
    bytes = o.bytes;
    hdr = o.hdr;
    o.base = nullptr;
    o.hdr = nullptr;
  }
  return *this;
}

Segment::~Segment() {
  if (base != nullptr) ::munmap(base, bytes);
}

RingView Segment::ring(const Layout& l, int to) const {
  char* ctl = static_cast<char*>(base) + l.rings_off + l.ring_stride * static_cast<size_t>(to);
  return RingView{reinterpret_cast<RingCtl*>(ctl), ctl + sizeof(RingCtl), l.ring_bytes};
}

char* Segment::area(const Layout& l, int half) const {
  return static_cast<char*>(base) + l.coll_off + l.chunk * static_cast<size_t>(half);
}

unsigned long namespace_id(const char* kind) {
  struct stat st {};
  return ::stat((std::string("/proc/self/ns/") + kind).c_str(), &st) == 0 ? static_cast<unsigned long>(st.st_ino) : 0;
}

std::string new_segment_name(int rank) {
  return "/chorus-" + std::to_string(namespace_id("pid")) + "-" + std::to_string(::getpid()) + "-" +
         std::to_string(std::random_device{}() & 0xffffffu) + "-" + std::to_string(rank);
}

// Only names of this PID namespace are judged: a pid from another namespace (a container sharing
// /dev/shm) means nothing here.
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

int create_segment(const std::string& name, size_t bytes, const std::string& who) {
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) throw Ranked<Error>(who + ": cannot create shared memory " + name + ": " + std::strerror(errno));
  const int err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (err != 0) {
    ::close(fd);
    ::shm_unlink(name.c_str());
    throw Ranked<UsageError>(who + ": cannot reserve " + std::to_string(bytes) + " bytes of shared memory for " + name + ": " +
                     std::strerror(err) +
                     (err == ENOSPC ? std::string(" (/dev/shm is full or too small: each rank needs about this "
                                                  "much; in a container raise --shm-size, or use transport 'tcp')")
                                    : std::string()));
  }
  return fd;
}

Segment map_segment(int fd, size_t bytes, const std::string& who) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) throw Ranked<Error>(who + ": mmap of shared memory failed: " + std::strerror(err));
  Segment s;
  s.base = p;
  s.bytes = bytes;
  s.hdr = static_cast<SegHeader*>(p);
  return s;
}

Region::Region(uint64_t id, size_t bytes, int rank, int size)
    : id_(id), bytes_(bytes), rank_(rank), bases_(static_cast<size_t>(size), nullptr) {}

Region::~Region() {
  for (void* b : bases_) {
    if (b != nullptr) ::munmap(b, bytes_);
  }
}

void* create_buffer_copy(const std::string& name, size_t bytes, int* err) {
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  *err = fd < 0 ? errno : ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  void* base = nullptr;
  if (*err == 0) {
    base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
      *err = errno;
      base = nullptr;
    }
  }
  if (fd >= 0) ::close(fd);
  if (base == nullptr && fd >= 0) ::shm_unlink(name.c_str());
  return base;
}

void* map_buffer_copy(const std::string& name, size_t bytes, int* err) {
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
  void* base = fd < 0 ? MAP_FAILED : ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  *err = errno;
  if (fd >= 0) ::close(fd);
  return base == MAP_FAILED ? nullptr : base;
}

}  // namespace shm

size_t shm_chunk_bytes(const ShmOptions& options) { return shm::layout(options, 1).chunk; }

size_t shm_segment_bytes(const ShmOptions& options, int size) { return shm::layout(options, size).seg_bytes; }

uint64_t shm_free_bytes() {
  struct statvfs st {};
  if (::statvfs("/dev/shm", &st) != 0) return 0;
  return static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
}

}  // namespace chorus::transport
