// A process group's setup keys leave the store once every rank is set up: new_group and
// allocate_buffer cycles keep the store's key count and bytes flat.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "chorus/comm/process_group.h"
#include "chorus/comm/tcp_store.h"
#include "testing.h"

namespace chorus {
namespace {

constexpr char kToken[] = "group-keys-test";

ProcessGroupOptions group_options(const std::string& transport) {
  ProcessGroupOptions o;
  o.transport = transport;
  o.token = kToken;
  o.timeout = std::chrono::seconds(20);
  return o;
}

// One cycle on a sub-group of every rank: create it, allocate a buffer, allreduce in it (each rank
// adds rank + 1), check the sum, drop both.
void cycle(ProcessGroup& pg) {
  std::vector<int> all(static_cast<size_t>(pg.size()));
  for (int r = 0; r < pg.size(); ++r) all[static_cast<size_t>(r)] = r;
  auto sub = pg.new_group(all);
  auto buf = sub->allocate_buffer(sizeof(int32_t));
  int32_t v = pg.rank() + 1;
  std::memcpy(buf->data(), &v, sizeof(v));
  sub->allreduce(buf->data(), 1, DataType::kInt32, ReduceOp::kSum)->wait();
  std::memcpy(&v, buf->data(), sizeof(v));
  const int32_t want = pg.size() * (pg.size() + 1) / 2;
  if (v != want) throw std::runtime_error("allreduce gave " + std::to_string(v) + ", want " + std::to_string(want));
}

struct Sample {
  int cycle;
  int64_t keys;
  int64_t bytes;
};

// 2 ranks as threads, each with its own TcpStore client of one in-process server, so that the
// server's byte count can be read. Rank 0 samples the store after the cycles in `at`.
std::vector<Sample> run_tcp_cycles(int cycles, const std::vector<int>& at) {
  TcpStoreServerOptions so;
  so.host = "127.0.0.1";
  so.token = kToken;
  TcpStoreServer server(so);
  std::vector<Sample> samples;
  std::vector<std::string> errors(2);
  auto rank_main = [&](int rank) {
    try {
      TcpStoreOptions co;
      co.port = server.port();
      co.token = kToken;
      co.timeout = std::chrono::seconds(20);
      auto store = std::make_shared<TcpStore>(co);
      ProcessGroup pg(store, rank, 2, group_options("tcp"));
      size_t next = 0;
      for (int c = 0; c <= cycles; ++c) {
        if (c > 0) cycle(pg);
        if (next < at.size() && at[next] == c) {
          // Between two barriers: both ranks have finished cycle c and neither has begun c + 1.
          pg.barrier()->wait();
          if (rank == 0) samples.push_back({c, store->num_keys(), server.stored_bytes()});
          pg.barrier()->wait();
          ++next;
        }
      }
    } catch (const std::exception& e) {
      errors[static_cast<size_t>(rank)] = e.what();
    }
  };
  std::thread other(rank_main, 1);
  rank_main(0);
  other.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  return samples;
}

TEST(GroupKeys, SetupKeysAreDeletedOnceEveryRankIsSetUp) {
  const auto s = run_tcp_cycles(1, {0, 1});
  ASSERT_EQ(s.size(), 2u);
  // A fresh store holds nothing once the group and a sub-group are set up.
  EXPECT_EQ(s[0].keys, 0);
  EXPECT_EQ(s[0].bytes, 0);
  EXPECT_EQ(s[1].keys, 0);
  EXPECT_EQ(s[1].bytes, 0);
}

TEST(GroupKeys, TenThousandCyclesKeepTheTcpStoreFlat) {
  const auto s = run_tcp_cycles(10000, {100, 10000});
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].keys, s[1].keys) << "keys after cycle 100 vs after cycle 10000";
  EXPECT_EQ(s[0].bytes, s[1].bytes) << "stored bytes after cycle 100 vs after cycle 10000";
  EXPECT_EQ(s[1].keys, 0);
}

// The shared-memory and hybrid transports write keys of their own (announcements, a counter,
// per-host prefixes): as processes, through the rendezvous store.
void expect_flat_as_processes(int world, const std::string& transport, int hosts, int cycles) {
  const std::string err = testing::run_ranks(world, [&](int rank, int size, std::shared_ptr<Store> store) {
    ProcessGroupOptions o = group_options(transport);
    o.host_id = "keys-test-host-" + std::to_string(rank * hosts / size);
    ProcessGroup pg(store, rank, size, o);
    pg.barrier()->wait();
    const int64_t before = store->num_keys();
    pg.barrier()->wait();  // no rank begins a cycle before every rank has counted
    for (int c = 0; c < cycles; ++c) cycle(pg);
    pg.barrier()->wait();
    const int64_t after = store->num_keys();
    if (after != before) {
      throw std::runtime_error(transport + ": the store held " + std::to_string(before) + " keys before " +
                               std::to_string(cycles) + " cycles and " + std::to_string(after) + " after");
    }
  });
  EXPECT_EQ(err, "");
}

TEST(GroupKeys, ShmCyclesKeepTheStoreFlat) { expect_flat_as_processes(2, "shm", 1, 300); }

TEST(GroupKeys, HybridCyclesKeepTheStoreFlat) { expect_flat_as_processes(4, "hybrid", 2, 50); }

}  // namespace
}  // namespace chorus
