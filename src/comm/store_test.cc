// Store conformance suite (HashStore, FileStore, TcpStore, PrefixStore), then what only one kind
// has: several processes on one store, FileStore's file format, PrefixStore's keys. The TcpStore's
// own client and server tests are tcp_store_test.cc (the same executable, store_test).
#include "chorus/comm/store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "chorus/comm/error.h"
#include "chorus/comm/tcp_store.h"
#include "store_test_util.h"

namespace chorus {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
using store_test::Clock;
using store_test::fork_children;
using store_test::kLongTimeout;
using store_test::kShortTimeout;
using store_test::seconds_since;
using store_test::temp_path;
using store_test::wait_child;

// ---- Conformance suite
// --------------------------------------------------------------------------- Each environment
// holds one store and opens handles onto it: the same object where that is the only way in
// (HashStore), else a new client or a new open of the same file.

struct HashStoreEnv {
  std::shared_ptr<HashStore> store = std::make_shared<HashStore>();
  std::shared_ptr<Store> open() { return store; }
};

struct FileStoreEnv {
  std::string path = temp_path();
  ~FileStoreEnv() { std::remove(path.c_str()); }
  std::shared_ptr<Store> open() { return std::make_shared<FileStore>(path); }
};

struct TcpStoreEnv {
  std::shared_ptr<TcpStore> host;  // the first handle also hosts the server
  std::shared_ptr<Store> open() {
    TcpStoreOptions options;
    options.token = "conformance";
    options.timeout = kLongTimeout;
    if (!host) {
      options.is_server = true;
      host = std::make_shared<TcpStore>(options);
      return host;
    }
    options.port = host->port();
    return std::make_shared<TcpStore>(options);
  }
};

struct PrefixStoreEnv {
  std::shared_ptr<HashStore> base = std::make_shared<HashStore>();
  std::shared_ptr<Store> open() { return std::make_shared<PrefixStore>("group0", base); }
};

template <typename Env>
class StoreConformance : public ::testing::Test {
 protected:
  std::shared_ptr<Store> open(std::chrono::milliseconds timeout = kLongTimeout) {
    auto store = env_.open();
    store->set_timeout(timeout);
    return store;
  }
  Env env_;
};

using StoreEnvs = ::testing::Types<HashStoreEnv, FileStoreEnv, TcpStoreEnv, PrefixStoreEnv>;
class StoreEnvNames {
 public:
  template <typename T>
  static std::string GetName(int) {
    if (std::is_same<T, HashStoreEnv>()) return "HashStore";
    if (std::is_same<T, FileStoreEnv>()) return "FileStore";
    if (std::is_same<T, TcpStoreEnv>()) return "TcpStore";
    return "PrefixStore";
  }
};
TYPED_TEST_SUITE(StoreConformance, StoreEnvs, StoreEnvNames);

TYPED_TEST(StoreConformance, SetThenGetReturnsTheLatestValue) {
  auto store = this->open();
  auto other = this->open();
  store->set("a", "1");
  EXPECT_EQ(other->get("a"), "1");
  other->set("a", "2");
  EXPECT_EQ(store->get("a"), "2");
  store->set("empty", "");
  EXPECT_EQ(other->get("empty"), "");
  const std::string binary("\0\x01\xff zero\0", 9);
  store->set(std::string("key\0with nul", 12), binary);
  EXPECT_EQ(other->get(std::string("key\0with nul", 12)), binary);
}

// Outside bytes in messages: printable ASCII and well-formed UTF-8 kept, the rest escaped, cut long.
TEST(Printable, EscapesWhatATerminalWouldInterpretAndCutsLongText) {
  EXPECT_EQ(printable("plain text, 1-2"), "plain text, 1-2");
  EXPECT_EQ(printable("a\\b"), "a\\\\b");
  EXPECT_EQ(printable(std::string("\x1b[2J\0\n\x7f", 7)), "\\x1b[2J\\x00\\x0a\\x7f");
  EXPECT_EQ(printable("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"), "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
  EXPECT_EQ(printable("\xc3"), "\\xc3");                      // cut short
  EXPECT_EQ(printable("\xc0\xaf"), "\\xc0\\xaf");            // overlong '/'
  EXPECT_EQ(printable("\xed\xa0\x80"), "\\xed\\xa0\\x80");  // a surrogate
  EXPECT_EQ(printable("\xc2\x85"), "\\xc2\\x85");            // a C1 control (NEL)
  EXPECT_EQ(printable(std::string(100, 'k'), 10), "kkkkkkkkkk...(100 bytes)");
  EXPECT_EQ(printable("ab\xc3\xa9", 3), "ab\\xc3...(4 bytes)");  // a sequence is never split
}

TYPED_TEST(StoreConformance, GetTimesOutNamingTheKey) {
  auto store = this->open(kShortTimeout);
  const auto start = Clock::now();
  try {
    store->get("never_set");
    FAIL() << "get of a missing key returned";
  } catch (const TimeoutError& e) {
    const double waited = seconds_since(start);
    EXPECT_GE(waited, 0.25);
    EXPECT_LT(waited, 2.0);
    EXPECT_THAT(e.what(), HasSubstr("never_set"));
    EXPECT_THAT(e.what(), HasSubstr("timed out after"));
  }
}

TYPED_TEST(StoreConformance, GetWaitsForAKeySetLater) {
  auto store = this->open();
  auto other = this->open();
  std::thread setter([&] {
    std::this_thread::sleep_for(50ms);
    other->set("late", "here");
  });
  EXPECT_EQ(store->get("late"), "here");
  setter.join();
}

TYPED_TEST(StoreConformance, AddFromManyThreadsSumsExactly) {
  constexpr int kThreads = 8;
  constexpr int kAdds = 100;
  auto shared = this->open();
  std::vector<std::vector<int64_t>> seen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    // Half the threads share one handle, half have their own.
    auto store = t % 2 == 0 ? shared : this->open();
    threads.emplace_back([&seen, store, t] {
      for (int i = 0; i < kAdds; ++i) seen[t].push_back(store->add("counter", 1));
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(shared->add("counter", 0), kThreads * kAdds);
  // Every add saw a distinct value: none was lost or applied twice.
  std::vector<int64_t> all;
  for (const auto& s : seen) all.insert(all.end(), s.begin(), s.end());
  std::sort(all.begin(), all.end());
  for (int i = 0; i < kThreads * kAdds; ++i) ASSERT_EQ(all[i], i + 1);
}

TYPED_TEST(StoreConformance, AddKeepsDecimalText) {
  auto store = this->open();
  EXPECT_EQ(store->add("n", 5), 5);
  EXPECT_EQ(store->add("n", -7), -2);
  EXPECT_EQ(store->get("n"), "-2");
  store->set("m", "40");
  EXPECT_EQ(store->add("m", 2), 42);
}

TYPED_TEST(StoreConformance, AddOnANonIntegerIsAUsageError) {
  auto store = this->open();
  store->set("text", "abc");
  EXPECT_THROW(store->add("text", 1), UsageError);
  EXPECT_EQ(store->get("text"), "abc");
}

TYPED_TEST(StoreConformance, CompareSetFollowsPyTorch) {
  auto store = this->open();
  // Missing key, empty expected: stores desired.
  EXPECT_EQ(store->compare_set("k", "", "first"), "first");
  EXPECT_EQ(store->get("k"), "first");
  // Present key, matching expected: swaps.
  EXPECT_EQ(store->compare_set("k", "first", "second"), "second");
  // Present key, other expected: returns what is stored, changes nothing.
  EXPECT_EQ(store->compare_set("k", "wrong", "third"), "second");
  EXPECT_EQ(store->get("k"), "second");
  // Missing key, non-empty expected: returns expected, stores nothing.
  EXPECT_EQ(store->compare_set("absent", "x", "y"), "x");
  EXPECT_FALSE(store->check({"absent"}));
}

TYPED_TEST(StoreConformance, WaitReturnsOnceAnotherThreadSetsTheKeys) {
  auto store = this->open();
  auto other = this->open();
  std::thread setter([&] {
    std::this_thread::sleep_for(30ms);
    other->set("w1", "x");
    std::this_thread::sleep_for(30ms);
    other->add("w2", 1);
  });
  const auto start = Clock::now();
  store->wait({"w1", "w2"}, kLongTimeout);
  EXPECT_LT(seconds_since(start), 2.0);
  EXPECT_TRUE(store->check({"w1", "w2"}));
  setter.join();
}

TYPED_TEST(StoreConformance, WaitTimesOutNamingTheMissingKeys) {
  auto store = this->open();
  store->set("a", "1");
  const auto start = Clock::now();
  try {
    store->wait({"a", "b"}, kShortTimeout);
    FAIL() << "wait for a missing key returned";
  } catch (const TimeoutError& e) {
    EXPECT_GE(seconds_since(start), 0.25);
    EXPECT_LT(seconds_since(start), 2.0);
    EXPECT_THAT(e.what(), HasSubstr("b]"));  // a PrefixStore names the base's keys: [p/a, p/b]
    EXPECT_THAT(e.what(), HasSubstr("(missing: "));
    EXPECT_THAT(e.what(), HasSubstr("b)"));
  }
  store->wait({});  // nothing to wait for
}

TYPED_TEST(StoreConformance, ManyWaitersWakeOnOneSet) {
  auto setter = this->open();
  std::vector<std::thread> threads;
  std::atomic<int> woke{0};
  for (int t = 0; t < 4; ++t) {
    auto store = this->open();
    threads.emplace_back([store, &woke] {
      if (store->get("go") == "now") woke++;
    });
  }
  std::this_thread::sleep_for(50ms);
  setter->set("go", "now");
  for (auto& t : threads) t.join();
  EXPECT_EQ(woke.load(), 4);
}

TYPED_TEST(StoreConformance, CheckDoesNotWait) {
  auto store = this->open();
  EXPECT_TRUE(store->check({}));
  EXPECT_FALSE(store->check({"c"}));
  store->set("c", "");
  EXPECT_TRUE(store->check({"c"}));
  EXPECT_FALSE(store->check({"c", "d"}));
}

TYPED_TEST(StoreConformance, DeleteKeyRemovesItEverywhere) {
  auto store = this->open();
  auto other = this->open();
  EXPECT_FALSE(store->delete_key("gone"));
  store->set("gone", "v");
  EXPECT_TRUE(other->check({"gone"}));
  EXPECT_TRUE(store->delete_key("gone"));
  EXPECT_FALSE(other->check({"gone"}));
  EXPECT_FALSE(other->delete_key("gone"));
  other->set("gone", "again");
  EXPECT_EQ(store->get("gone"), "again");
}

TYPED_TEST(StoreConformance, NumKeysCountsLiveKeys) {
  auto store = this->open();
  const int64_t before = store->num_keys();
  store->set("n1", "1");
  store->add("n2", 1);
  store->compare_set("n3", "", "3");
  store->set("n1", "overwritten");
  EXPECT_EQ(store->num_keys(), before + 3);
  store->delete_key("n2");
  EXPECT_EQ(this->open()->num_keys(), before + 2);
}

// ---- Several processes on one store ------------------------------------------------------------

TEST(TcpStoreMultiProcess, AddFromForkedChildrenSumsExactly) {
  TcpStoreServerOptions server_options;
  server_options.host = "127.0.0.1";
  server_options.token = "multiproc";
  server_options.start_serving = false;  // no server thread while forking (see start_serving)
  TcpStoreServer server(server_options);
  const int port = server.port();
  constexpr int kChildren = 4;
  constexpr int kAdds = 100;
  auto pids = fork_children(kChildren, [port](int) {
    TcpStoreOptions options;
    options.port = port;
    options.token = "multiproc";
    options.timeout = 10s;
    TcpStore store(options);
    for (int i = 0; i < kAdds; ++i) store.add("counter", 1);
    store.add("done", 1);
  });
  ASSERT_EQ(pids.size(), static_cast<size_t>(kChildren));
  server.start();  // the children's connections waited in the listen backlog
  for (pid_t pid : pids) EXPECT_EQ(wait_child(pid, 20s), 0);
  TcpStoreOptions options;
  options.port = port;
  options.token = "multiproc";
  TcpStore store(options);
  EXPECT_EQ(store.get("counter"), std::to_string(kChildren * kAdds));
  EXPECT_EQ(store.get("done"), std::to_string(kChildren));
}

TEST(FileStoreMultiProcess, AddFromForkedChildrenSumsExactly) {
  const std::string path = temp_path();
  constexpr int kChildren = 4;
  constexpr int kAdds = 100;
  {
    // Opened before fork: odd children use this inherited object, even ones open the file anew.
    FileStore inherited(path, 10s);
    inherited.set("counter", "0");
    auto pids = fork_children(kChildren, [&](int i) {
      std::unique_ptr<FileStore> own;
      FileStore* store = &inherited;
      if (i % 2 == 0) {
        own = std::make_unique<FileStore>(path, 10s);
        store = own.get();
      }
      for (int k = 0; k < kAdds; ++k) store->add("counter", 1);
    });
    ASSERT_EQ(pids.size(), static_cast<size_t>(kChildren));
    for (pid_t pid : pids) EXPECT_EQ(wait_child(pid, 30s), 0);
    EXPECT_EQ(inherited.get("counter"), std::to_string(kChildren * kAdds));
  }
  std::remove(path.c_str());
}

// ---- FileStore ----------------------------------------------------------------------------------

TEST(FileStore, DropsAnUnfinishedRecordLeftByACrashedWriter) {
  const std::string path = temp_path();
  {
    FileStore store(path, kShortTimeout);
    store.set("a", "1");
    std::ofstream(path, std::ios::app | std::ios::binary) << std::string("\x01\x05\x00\x00\x00", 5);
    FileStore reader(path, kShortTimeout);
    EXPECT_EQ(reader.get("a"), "1");
    EXPECT_EQ(reader.num_keys(), 1);
    reader.set("b", "2");  // truncates the unfinished record first
    FileStore fresh(path, kShortTimeout);
    EXPECT_EQ(fresh.get("a"), "1");
    EXPECT_EQ(fresh.get("b"), "2");
    EXPECT_EQ(fresh.num_keys(), 2);
  }
  std::remove(path.c_str());
}

TEST(FileStore, RefusesAFileThatIsNotAStore) {
  const std::string path = temp_path();
  std::ofstream(path) << "some other program's data\n";
  FileStore store(path, kShortTimeout);
  try {
    store.check({"a"});
    FAIL() << "read a foreign file";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("not a chorus FileStore"));
    EXPECT_THAT(e.what(), HasSubstr(path));
  }
  std::remove(path.c_str());
}

TEST(FileStore, UnwritablePathIsAClearError) {
  try {
    FileStore store("/nonexistent-dir-chorus/store", kShortTimeout);
    FAIL() << "opened a file in a missing directory";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("/nonexistent-dir-chorus/store"));
    EXPECT_THAT(e.what(), HasSubstr("directory exists"));
  }
}

// ---- PrefixStore --------------------------------------------------------------------------------

TEST(PrefixStore, KeysLiveUnderThePrefixInTheBase) {
  auto base = std::make_shared<HashStore>();
  PrefixStore g1("g1", base);
  PrefixStore g2("g2", base);
  g1.set("k", "one");
  g2.set("k", "two");
  EXPECT_EQ(base->get("g1/k"), "one");
  EXPECT_EQ(base->get("g2/k"), "two");
  EXPECT_EQ(g1.get("k"), "one");
  EXPECT_TRUE(g1.delete_key("k"));
  EXPECT_FALSE(g1.check({"k"}));
  EXPECT_TRUE(g2.check({"k"}));
  EXPECT_EQ(g1.num_keys(), 1);  // the whole base, as PyTorch counts
  EXPECT_THAT(g1.describe(), HasSubstr("g1"));
  EXPECT_THAT(g1.describe(), HasSubstr("HashStore"));
}

TEST(PrefixStore, GetHonoursItsOwnTimeout) {
  auto base = std::make_shared<HashStore>();
  base->set_timeout(30s);
  PrefixStore store("p", base);
  store.set_timeout(kShortTimeout);
  const auto start = Clock::now();
  try {
    store.get("missing");
    FAIL() << "get of a missing key returned";
  } catch (const TimeoutError& e) {
    EXPECT_LT(seconds_since(start), 2.0);
    EXPECT_THAT(e.what(), HasSubstr("p/missing"));
  }
}

}  // namespace
}  // namespace chorus
