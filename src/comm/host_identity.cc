// Which ranks share a host (host_identity) and the store exchange that tells every rank where the
// others are (exchange_announcements): the shared-memory and hybrid transports' first step.

#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <thread>

#include "chorus/comm/error.h"
#include "chorus/comm/hash.h"
#include "chorus/comm/store.h"
#include "error_class.h"
#include "transport.h"

namespace chorus::transport {

using net::Clock;
using net::Deadline;

namespace {

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

}  // namespace

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
      throw Ranked<HandshakeError>(who + " has world size " + their_size + " but this rank has " + std::to_string(size) +
                           "; every rank of a group must be started with the same world size");
    }
    if (their_token != token_hash) {
      throw Ranked<HandshakeError>(who + " has a different job token; it belongs to another job (or CHORUS_JOB_TOKEN "
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
      throw Ranked<TimeoutError>("chorus: rank " + std::to_string(rank) + ": group setup: rank(s) [" + missing +
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

plan::RankCpus this_rank_cpus() {
  plan::RankCpus me;
  std::string machine = read_first_line("/proc/sys/kernel/random/boot_id");
  if (machine.empty()) {
    char host[256] = {0};
    ::gethostname(host, sizeof(host) - 1);
    machine = std::string("host:") + host;
  }
  me.machine = fnv1a64(machine);
  static_assert(CPU_SETSIZE <= 64 * std::tuple_size_v<decltype(me.cpus)>, "RankCpus holds every CPU a set can");
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (::sched_getaffinity(0, sizeof(allowed), &allowed) != 0 || CPU_COUNT(&allowed) == 0) {
    const unsigned n = std::max(1u, std::thread::hardware_concurrency());
    for (unsigned c = 0; c < n && c < CPU_SETSIZE; ++c) CPU_SET(c, &allowed);
  }
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &allowed)) me.cpus[static_cast<size_t>(c / 64)] |= uint64_t{1} << (c % 64);
  }
  return me;
}

}  // namespace chorus::transport
