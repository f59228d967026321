// ProcessGroup's object collectives on byte strings: gather_object and scatter_object (with
// all_gather_object and broadcast_object between them), on every transport at W = 1, 2, 3, with
// empty objects, objects of very different sizes on each rank and bytes of every value; and their
// errors: a root out of range, a root's list of the wrong length, mismatched calls.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/comm/process_group.h"
#include "testing.h"

namespace chorus {
namespace {

using std::chrono::milliseconds;

struct GroupSetup {
  std::string transport;
  int world;
};

ProcessGroupOptions options(const GroupSetup& s, int rank, milliseconds timeout = milliseconds(20000)) {
  ProcessGroupOptions o;
  o.timeout = timeout;
  o.transport = s.transport;
  if (s.transport == "hybrid") o.host_id = "test-host-" + std::to_string(rank * 2 / s.world);
  return o;
}

// Rank r's object in round k: empty, tiny, or larger than a shared-memory ring (256 KiB), so that
// sizes differ by five orders of magnitude between ranks; every byte value occurs.
std::string object_of(int rank, int round) {
  static const size_t kSizes[] = {0, 1, 300001, 17, 5};
  const size_t n = kSizes[static_cast<size_t>(rank + round) % 5];
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 7 + static_cast<size_t>(rank) * 31 + static_cast<size_t>(round)) & 0xff);
  return s;
}

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

void exercise(const GroupSetup& setup, int rank, int w) {
  auto pg = connect_process_group("env://", rank, w, options(setup, rank));
  for (int round = 0; round < 5; ++round) {
    const std::string tag = "round " + std::to_string(round);
    for (int root = 0; root < w; ++root) {
      auto g = pg->gather_object(object_of(rank, round), root);
      g->wait();
      if (rank == root) {
        require(g->objects().size() == static_cast<size_t>(w), tag + ": gather_object: root got " +
                                                                   std::to_string(g->objects().size()) + " objects");
        for (int i = 0; i < w; ++i) {
          require(g->objects()[static_cast<size_t>(i)] == object_of(i, round),
                  tag + ": gather_object: wrong object from rank " + std::to_string(i));
        }
      } else {
        require(g->objects().empty(), tag + ": gather_object: a non-root got objects");
      }
      // Scatter: the root sends rank i the object rank i + 1 would make (non-roots pass junk).
      std::vector<std::string> out;
      if (rank == root) {
        for (int i = 0; i < w; ++i) out.push_back(object_of(i + 1, round));
      } else {
        out = {"ignored", "on", "non-roots"};
      }
      auto s = pg->scatter_object(out, root);
      s->wait();
      require(s->objects().size() == 1 && s->objects()[0] == object_of(rank + 1, round),
              tag + ": scatter_object: wrong object from root " + std::to_string(root));
    }
    // The older two between them: sequence numbers and calls stay in step.
    auto a = pg->all_gather_object(object_of(rank, round));
    auto b = pg->broadcast_object(rank == w - 1 ? object_of(rank, round) : "x", w - 1);
    a->wait();
    b->wait();
    require(a->objects().size() == static_cast<size_t>(w) && a->objects().back() == object_of(w - 1, round),
            tag + ": all_gather_object");
    require(b->objects().at(0) == object_of(w - 1, round), tag + ": broadcast_object");
  }
  // Async: queued back to back, waited in reverse.
  auto g = pg->gather_object(std::string(static_cast<size_t>(rank) * 3, 'g'), 0);
  auto s = pg->scatter_object(rank == 0 ? std::vector<std::string>(static_cast<size_t>(w), "s") : std::vector<std::string>{}, 0);
  s->wait();
  g->wait();
  require(s->objects().at(0) == "s", "async scatter_object");
  if (rank == 0) require(g->objects().at(static_cast<size_t>(w - 1)) == std::string(static_cast<size_t>(w - 1) * 3, 'g'), "async gather_object");
}

class ObjectCollectives : public ::testing::TestWithParam<GroupSetup> {};

TEST_P(ObjectCollectives, GatherAndScatterUnevenAndEmptyObjects) {
  const GroupSetup setup = GetParam();
  EXPECT_EQ(testing::run_ranks(setup.world, [&](int rank, int w, std::shared_ptr<Store>) { exercise(setup, rank, w); },
                               std::chrono::seconds(60)),
            "");
}

TEST_P(ObjectCollectives, BadArgumentsAreUsageErrorsAndLeaveTheGroupUsable) {
  const GroupSetup setup = GetParam();
  EXPECT_EQ(testing::run_ranks(setup.world, [&](int rank, int w, std::shared_ptr<Store>) {
    auto pg = connect_process_group("env://", rank, w, options(setup, rank));
    const std::string bad = std::to_string(w);
    std::string e = testing::usage_error([&] { pg->gather_object("x", w); });
    require(e.find("gather_object: root " + bad + " is not a rank of this group of size " + bad) != std::string::npos, e);
    e = testing::usage_error([&] { pg->scatter_object({}, -1); });
    require(e.find("scatter_object: root -1 is not a rank") != std::string::npos, e);
    // Only the root reads the list: the others are already in the call when the root's check
    // fails, and it completes once the root calls again correctly.
    std::shared_ptr<Work> pending;
    if (rank == 0) {
      e = testing::usage_error([&] { pg->scatter_object(std::vector<std::string>(static_cast<size_t>(w) + 1), 0); });
      require(e.find("scatter_object: the root's objects has " + std::to_string(w + 1) +
                     " entries; it needs one per rank (" + bad + ")") != std::string::npos, e);
      pending = pg->scatter_object(std::vector<std::string>(static_cast<size_t>(w), "ok"), 0);
    } else {
      pending = pg->scatter_object({}, 0);
    }
    pending->wait();
    require(pending->objects().at(0) == "ok", "scatter_object after the root's UsageError");
  }, std::chrono::seconds(60)), "");
}

std::vector<GroupSetup> setups() {
  std::vector<GroupSetup> out;
  for (int w : {1, 2, 3}) {
    out.push_back({"tcp", w});
    out.push_back({"shm", w});
    if (w > 1) out.push_back({"hybrid", w});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Transports, ObjectCollectives, ::testing::ValuesIn(setups()), [](const auto& info) {
  return info.param.transport + "_W" + std::to_string(info.param.world);
});

// A rank in gather_object while another is in all_gather_object (or scatter_object against
// broadcast_object): MismatchError on every rank, stating both calls, well within the timeout.
class ObjectMismatch : public ::testing::TestWithParam<std::string> {};

std::string outcome(const std::function<void()>& op) {
  try {
    op();
    return "ok";
  } catch (const MismatchError& e) {
    return std::string("MismatchError: ") + e.what();
  } catch (const std::exception& e) {
    return std::string("other error: ") + e.what();
  }
}

TEST_P(ObjectMismatch, DifferentObjectCollectivesRaiseMismatchErrorOnEveryRank) {
  const std::string transport = GetParam();
  struct Case {
    std::string mine, theirs;
  };
  for (const Case& c : {Case{"gather_object #0", "all_gather_object #0"}, Case{"scatter_object #0", "broadcast_object #0"}}) {
    const auto start = std::chrono::steady_clock::now();
    auto reports = testing::run_ranks_independent(2, [&](int rank, int w) -> std::string {
      auto pg = connect_process_group("env://", rank, w, options({transport, w}, rank, milliseconds(5000)));
      return outcome([&] {
        if (c.mine == "gather_object #0") {
          (rank == 0 ? pg->gather_object("abc", 0) : pg->all_gather_object("defg"))->wait();
        } else {
          (rank == 0 ? pg->scatter_object({"a", "bc"}, 0) : pg->broadcast_object("", 0))->wait();
        }
        pg->barrier()->wait();  // a root that only sent learns of it here at the latest
      });
    });
    for (const auto& r : reports) {
      SCOPED_TRACE(transport + " rank " + std::to_string(r.rank) + ": " + r.text);
      EXPECT_EQ(r.text.rfind("MismatchError", 0), 0u);
      EXPECT_NE(r.text.find(c.mine), std::string::npos);
      EXPECT_NE(r.text.find(c.theirs), std::string::npos);
    }
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 4.0);
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, ObjectMismatch, ::testing::Values("tcp", "shm"));

}  // namespace
}  // namespace chorus
