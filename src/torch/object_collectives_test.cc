// chorus::dist's object collectives in real processes, over tcp and shm at W = 1, 2, 3:
// PyTorch's gather_object, scatter_object_list and broadcast_object_list, and the typed helpers,
// on records, maps, empty strings, objects of very different sizes and tensors; and their errors
// (dst/src out of range, lists of the wrong length, another type on another rank).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "chorus/torch/objects.h"
#include "testing.h"

namespace chorus::dist {
namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

// Expects fn to throw UsageError containing `needle`.
template <typename F>
void expect_usage(F&& fn, const std::string& needle) {
  const std::string e = testing::usage_error(fn);
  require(e.find(needle) != std::string::npos, "expected a UsageError with '" + needle + "', got: " + e);
}

using Record = std::tuple<int64_t, std::string, std::vector<double>>;

// Rank 0's record is empty, rank 1's large (800 KB), the others small.
Record record_of(int rank) {
  const size_t n = rank == 0 ? 0 : rank == 1 ? 100000 : static_cast<size_t>(rank);
  std::vector<double> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<double>(i) * 0.5 + rank;
  return Record{rank * 10, std::string(static_cast<size_t>(rank) * 3, static_cast<char>('a' + rank)), v};
}

std::map<std::string, at::Tensor> shard_of(int rank) {
  return {{"weight", at::arange(rank * 6, at::kFloat).reshape({rank, 6})},  // rank 0: 0 x 6
          {"mask", at::arange(rank + 2) % 2 == 0},
          {"step", at::scalar_tensor(rank, at::kLong)}};
}

void require_same(const std::map<std::string, at::Tensor>& got, const std::map<std::string, at::Tensor>& want,
                  const std::string& what) {
  require(got.size() == want.size(), what + ": entries");
  for (const auto& [k, v] : want) {
    const at::Tensor& g = got.at(k);
    require(g.scalar_type() == v.scalar_type() && g.sizes() == v.sizes() && at::equal(g, v), what + ": " + k);
  }
}

void pytorch_style(int rank, int world) {
  for (int dst = 0; dst < world; ++dst) {
    std::vector<Record> all;
    if (rank == dst) all.resize(static_cast<size_t>(world));
    gather_object(record_of(rank), rank == dst ? &all : nullptr, dst);
    for (int i = 0; rank == dst && i < world; ++i) {
      require(all[static_cast<size_t>(i)] == record_of(i), "gather_object: record of rank " + std::to_string(i));
    }
  }
  // Empty strings, and an empty list on a non-destination rank (allowed, as None is).
  std::vector<std::string> names(rank == 0 ? static_cast<size_t>(world) : 0, "stale");
  gather_object(std::string(), &names, 0);
  if (rank == 0) require(names == std::vector<std::string>(static_cast<size_t>(world)), "gather_object: empty strings");

  const int src = world - 1;
  std::vector<std::map<std::string, at::Tensor>> shards;
  if (rank == src) {
    for (int i = 0; i < world; ++i) shards.push_back(shard_of(i));
  }
  std::vector<std::map<std::string, at::Tensor>> out(2);  // at least one entry; the first gets it
  scatter_object_list(out, rank == src ? &shards : nullptr, src);
  require_same(out[0], shard_of(rank), "scatter_object_list");
  require(out[1].empty(), "scatter_object_list touched out[1]");

  using Config = std::map<std::string, int64_t>;
  std::vector<Config> configs(3);
  if (rank == 0) configs = {{{"epochs", 3}, {"batch", 64}}, {}, {{"seed", -1}}};
  broadcast_object_list(configs, 0);
  require(configs == std::vector<Config>{{{"epochs", 3}, {"batch", 64}}, {}, {{"seed", -1}}}, "broadcast_object_list");

  std::vector<at::Tensor> tensors(2);
  at::Tensor base = at::arange(12, at::kDouble).reshape({3, 4});
  if (rank == src) tensors = {base.t(), at::Tensor()};  // not contiguous; undefined
  broadcast_object_list(tensors, src);
  require(at::equal(tensors[0], base.t()) && !tensors[1].defined(), "broadcast_object_list of tensors");
  require(rank == src || tensors[0].is_contiguous(), "broadcast_object_list: a received tensor is contiguous");
}

void typed_helpers(int rank, int world) {
  std::vector<double> losses = all_gather_object(0.25 * rank);
  require(losses.size() == static_cast<size_t>(world) && losses.back() == 0.25 * (world - 1), "all_gather_object<double>");

  // Tensors of a different shape on every rank.
  std::vector<at::Tensor> parts = all_gather_object(at::full({rank + 1, 2}, rank, at::kInt));
  for (int i = 0; i < world; ++i) {
    require(at::equal(parts[static_cast<size_t>(i)], at::full({i + 1, 2}, i, at::kInt)), "all_gather_object<tensor>");
  }
  auto cfg = broadcast_object(rank == 0 ? std::map<std::string, std::string>{{"opt", "sgd"}, {"", ""}}
                                        : std::map<std::string, std::string>{},
                              0);
  require(cfg == std::map<std::string, std::string>{{"opt", "sgd"}, {"", ""}}, "broadcast_object<map>");

  std::vector<Record> got = gather_object(record_of(rank), world - 1);
  require(got.size() == (rank == world - 1 ? static_cast<size_t>(world) : 0u), "gather_object<T>: size");
  for (size_t i = 0; i < got.size(); ++i) require(got[i] == record_of(static_cast<int>(i)), "gather_object<T>");

  std::vector<std::string> words;
  if (rank == 0) {
    for (int i = 0; i < world; ++i) words.push_back(std::string(static_cast<size_t>(i) * 1000, 'w'));  // rank 0: ""
  }
  require(scatter_object(words, 0) == std::string(static_cast<size_t>(rank) * 1000, 'w'), "scatter_object<string>");
}

void errors(int rank, int world) {
  const std::string w = std::to_string(world);
  int64_t x = rank;
  std::vector<int64_t> list;
  expect_usage([&] { gather_object(x, &list, world); }, "gather_object: dst " + w + " is not a rank of this group of size " + w);
  expect_usage([&] { (void)gather_object(x, -1); }, "gather_object: dst -1 is not a rank");
  std::vector<int64_t> one(1);
  expect_usage([&] { scatter_object_list(one, &list, world); }, "scatter_object_list: src " + w + " is not a rank");
  expect_usage([&] { broadcast_object_list(list, -1); }, "broadcast_object_list: src -1 is not a rank");
  expect_usage([&] { broadcast_object(x, world); }, "broadcast_object: src " + w + " is not a rank");

  // Each rank gets its own list wrong, so every rank raises before communicating.
  std::vector<int64_t> wrong(static_cast<size_t>(world) + 1);
  expect_usage([&] { gather_object(x, &wrong, 0); },
               rank == 0 ? "object_gather_list has " + std::to_string(world + 1) + " entries on rank 0; it needs one per rank (" + w + ")"
                         : "object_gather_list must be nullptr or empty on rank " + std::to_string(rank));
  expect_usage([&] { gather_object(x, static_cast<std::vector<int64_t>*>(nullptr), rank); }, "nullptr on the destination rank");
  std::vector<int64_t> none;
  if (rank == 0) {
    expect_usage([&] { scatter_object_list(one, &wrong, 0); }, "scatter_object_input_list has " + std::to_string(world + 1));
  } else {
    expect_usage([&] { scatter_object_list(none, &wrong, 0); }, "scatter_object_output_list is empty on rank " + std::to_string(rank));
  }
  expect_usage([&] { scatter_object_list(one, static_cast<std::vector<int64_t>*>(nullptr), rank); },
               "scatter_object_input_list is nullptr on the source rank");

  // A list shorter than src's: UsageError on that rank after the broadcast; the group goes on.
  std::vector<std::string> objs(rank == 0 ? 3 : 2, "x");
  if (rank == 0) {
    broadcast_object_list(objs, 0);
  } else {
    expect_usage([&] { broadcast_object_list(objs, 0); },
                 "object_list has 2 entries on rank " + std::to_string(rank) + " but 3 on src 0; it must have the same length");
  }
  // Another type on rank 0: every rank that decodes a value of the other type says whose it was.
  if (world > 1) {
    if (rank == 0) {
      expect_usage([&] { all_gather_object(int32_t{1}); },
                   "all_gather_object: the object from rank 1 does not decode as int32 (chorus::objects::decode: at byte 1 "
                   "of 10: expected int32 but found float64");
    } else {
      expect_usage([&] { all_gather_object(2.0); }, "the object from rank 0 does not decode as float64");
    }
  }
  barrier();
}

struct TorchSetup {
  std::string backend;
  int world;
};

std::ostream& operator<<(std::ostream& out, const TorchSetup& s) { return out << s.backend << " W=" << s.world; }

class TorchObjectCollectives : public ::testing::TestWithParam<TorchSetup> {
 protected:
  void run(void (*body)(int, int)) {
    const TorchSetup s = GetParam();
    EXPECT_EQ(testing::run_ranks(s.world, [&](int rank, int world, std::shared_ptr<Store>) {
      InitOptions o;
      o.timeout = std::chrono::seconds(20);
      init_process_group(s.backend, "env://", -1, -1, o);
      body(rank, world);
      destroy_process_group();
    }, std::chrono::seconds(60)), "");
  }
};

TEST_P(TorchObjectCollectives, PyTorchsGatherScatterAndBroadcastLists) { run(pytorch_style); }
TEST_P(TorchObjectCollectives, TypedHelpers) { run(typed_helpers); }
TEST_P(TorchObjectCollectives, Errors) { run(errors); }

std::vector<TorchSetup> setups() {
  std::vector<TorchSetup> out;
  for (int w : {1, 2, 3}) {
    out.push_back({"tcp", w});
    out.push_back({"shm", w});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Transports, TorchObjectCollectives, ::testing::ValuesIn(setups()), [](const auto& info) {
  return info.param.backend + "_W" + std::to_string(info.param.world);
});

}  // namespace
}  // namespace chorus::dist
