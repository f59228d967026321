// Built against chorus::comm by a project of its own (tests/package): an allreduce on 2 ranks
// under `chorus run`, checked exactly. Prints "consumer_comm: rank R ok" or exits 1.
#include <cstdint>
#include <cstdio>
#include <exception>
#include <vector>

#include "chorus/comm/process_group.h"

int main() {
  try {
    auto pg = chorus::connect_process_group();
    const int64_t world = pg->size();
    std::vector<int64_t> v(1000, pg->rank() + 1);
    pg->allreduce(v.data(), v.size(), chorus::DataType::kInt64)->wait();
    const int64_t want = world * (world + 1) / 2;
    int wrong = 0;
    for (int64_t x : v) wrong += x != want;
    std::printf("consumer_comm: rank %d of %lld: allreduce %lld (want %lld), %d wrong\n", pg->rank(),
                static_cast<long long>(world), static_cast<long long>(v[0]), static_cast<long long>(want), wrong);
    pg->shutdown();
    if (world < 2 || wrong != 0) return 1;
    std::printf("consumer_comm: rank %d ok\n", pg->rank());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer_comm: %s\n", e.what());
    return 1;
  }
}
