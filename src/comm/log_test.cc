// The log module: prefix, levels, the sink, silence, whole lines from many threads.
#include "chorus/comm/log.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "chorus/comm/error.h"

namespace chorus {
namespace {

struct Captured {
  std::mutex mu;
  std::vector<std::string> lines;
};

class LogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    set_log_sink([this](LogLevel, const std::string& line) {
      std::lock_guard<std::mutex> lock(captured_.mu);
      captured_.lines.push_back(line);
    });
  }
  void TearDown() override {
    set_log_sink(nullptr);
    set_log_level(LogLevel::kInfo);
    set_log_rank(-1);
  }
  Captured captured_;
};

TEST_F(LogTest, OnePrefixWithHostPidAndRank) {
  char host[256] = {};
  ASSERT_EQ(::gethostname(host, sizeof(host) - 1), 0);
  log(LogLevel::kWarning, "something to know");
  set_log_rank(3);
  log(LogLevel::kInfo, "with a rank");
  ASSERT_EQ(captured_.lines.size(), 2u);
  const std::string pid = std::to_string(::getpid());
  EXPECT_EQ(captured_.lines[0], "chorus[" + std::string(host) + " pid " + pid + "] warning: something to know");
  EXPECT_EQ(captured_.lines[1], "chorus[" + std::string(host) + " pid " + pid + " rank 3] info: with a rank");
}

TEST_F(LogTest, LevelsFilterAndOffSilences) {
  log(LogLevel::kDebug, "dropped at the default level");
  set_log_level(LogLevel::kWarning);
  log(LogLevel::kInfo, "dropped");
  log(LogLevel::kError, "kept");
  set_log_level(LogLevel::kOff);
  log(LogLevel::kError, "silenced");
  set_log_level(LogLevel::kDebug);
  log(LogLevel::kDebug, "kept too");
  log(LogLevel::kOff, "never a line");
  ASSERT_EQ(captured_.lines.size(), 2u);
  EXPECT_NE(captured_.lines[0].find("] error: kept"), std::string::npos);
  EXPECT_NE(captured_.lines[1].find("] debug: kept too"), std::string::npos);
}

TEST_F(LogTest, ParsesLevelNames) {
  EXPECT_EQ(parse_log_level("debug"), LogLevel::kDebug);
  EXPECT_EQ(parse_log_level("warning"), LogLevel::kWarning);
  EXPECT_EQ(parse_log_level("off"), LogLevel::kOff);
  try {
    parse_log_level("verbose");
    FAIL() << "no UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("'verbose': expected debug, info, warning, error or off"), std::string::npos);
  }
}

TEST_F(LogTest, LinesFromManyThreadsStayWhole) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < 200; ++i) log(LogLevel::kInfo, "thread " + std::to_string(t) + " line " + std::to_string(i));
    });
  }
  for (auto& th : threads) th.join();
  ASSERT_EQ(captured_.lines.size(), 1600u);
  for (const auto& line : captured_.lines) {
    EXPECT_EQ(line.rfind("chorus[", 0), 0u) << line;
    EXPECT_NE(line.find("] info: thread "), std::string::npos) << line;
  }
}

}  // namespace
}  // namespace chorus
