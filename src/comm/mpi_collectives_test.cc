// The collectives conformance suite over the MPI backend, and its errors. Run under mpirun with
// 1-4 ranks (ctest does: tests/mpi/run-under-mpirun, labels multiproc and mpi); every rank runs
// every test, in the same order, as collectives require.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <thread>

#include "chorus/comm/error.h"
#include "chorus/comm/mpi.h"
#include "collectives_checks.h"

namespace chorus {
namespace {

ProcessGroupOptions options(std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  ProcessGroupOptions o;
  o.timeout = timeout;
  return o;
}

// The world mpirun started, as its launcher variables say (docs/launch-env.md).
int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? -1 : std::atoi(v);
}

TEST(MpiBackend, RankAndSizeAreMpiCommWorlds) {
  auto pg = connect_mpi_process_group(options());
  EXPECT_EQ(pg->transport(), "mpi");
  EXPECT_EQ(pg->rank(), env_int("OMPI_COMM_WORLD_RANK"));
  EXPECT_EQ(pg->size(), env_int("OMPI_COMM_WORLD_SIZE"));
}

TEST(MpiBackend, EveryCollectiveDtypeOpAndSize) {
  auto pg = connect_mpi_process_group(options());
  conformance::every_collective(*pg);
}

TEST(MpiBackend, LargeBuffers) {
  auto pg = connect_mpi_process_group(options());
  conformance::large_buffers(*pg);
}

TEST(MpiBackend, PointToPointObjectsAndSubgroups) {
  auto pg = connect_mpi_process_group(options());
  conformance::point_to_point_objects_subgroups(*pg);
}

TEST(MpiBackend, AllocatedBuffersAllreduceInPlace) {
  conformance::allocated_buffers(connect_mpi_process_group(options()));
}

// Different counts: every rank raises MismatchError naming the other call, and no MPI collective
// runs with the wrong sizes.
TEST(MpiBackend, MismatchedCountsRaiseMismatchErrorOnEveryRank) {
  auto pg = connect_mpi_process_group(options());
  if (pg->size() < 2) GTEST_SKIP() << "needs two ranks";
  std::vector<float> v(20, 1.0f);
  const size_t count = pg->rank() == 0 ? 10 : 11;
  try {
    pg->allreduce(v.data(), count, DataType::kFloat32)->wait();
    ADD_FAILURE() << "no MismatchError";
  } catch (const MismatchError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("collective mismatch"), std::string::npos) << what;
    EXPECT_NE(what.find(pg->rank() == 0 ? "float32 x 11" : "float32 x 10"), std::string::npos) << what;
  }
  // The group is broken from then on: later calls fail at once with the cause.
  EXPECT_THROW(pg->barrier()->wait(), MismatchError);
}

// A peer that never sends: TimeoutError within about the timeout, naming the peer awaited; the
// failing rank's notice reaches the peer.
TEST(MpiBackend, MissingPeerTimesOutNamingIt) {
  auto pg = connect_mpi_process_group(options(std::chrono::milliseconds(1500)));
  if (pg->size() < 2) GTEST_SKIP() << "needs two ranks";
  if (pg->rank() == 1) {
    int64_t x = 0;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      pg->recv(&x, 1, DataType::kInt64, 0, 5)->wait();
      ADD_FAILURE() << "no TimeoutError";
    } catch (const TimeoutError& e) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      EXPECT_GE(s, 1.4);
      EXPECT_LE(s, 3.0);
      const std::string what = e.what();
      EXPECT_NE(what.find("rank 1: recv #0"), std::string::npos) << what;
      EXPECT_NE(what.find("waiting for rank 0"), std::string::npos) << what;
      EXPECT_NE(what.find("raise the timeout"), std::string::npos) << what;
    }
  }
  // Everyone outlasts rank 1's timeout before the group goes, so its notice has somewhere to go.
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
}

}  // namespace
}  // namespace chorus
