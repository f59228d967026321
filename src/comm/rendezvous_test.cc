// rendezvous(): URL and environment parsing, its errors, and each scheme with two ranks as threads.
#include "chorus/comm/rendezvous.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "chorus/comm/environment.h"
#include "chorus/comm/error.h"
#include "chorus/comm/signals.h"
#include "chorus/comm/spawn.h"
#include "chorus/comm/tcp_store.h"
#include "socket.h"

namespace chorus {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

// A port nothing listens on (the kernel's pick, released again).
int free_port() {
  net::Fd fd = net::listen_tcp("127.0.0.1", 0);
  return net::local_port(fd.get());
}

std::string temp_path() {
  const char* dir = std::getenv("TMPDIR");
  std::string pattern = std::string(dir != nullptr && dir[0] != '\0' ? dir : "/tmp") +
                        "/chorus-rendezvous-test-XXXXXX";
  int fd = ::mkstemp(pattern.data());
  if (fd < 0) throw std::runtime_error("mkstemp failed for " + pattern);
  ::close(fd);
  return pattern;
}

RendezvousOptions quick() {
  RendezvousOptions options;
  options.timeout = 5s;
  return options;
}

// Expects rendezvous(url, ...) to throw UsageError whose message contains every one of `parts`.
void expect_usage_error(const std::string& url, std::initializer_list<const char*> parts,
                        int rank = -1, int world_size = -1) {
  try {
    rendezvous(url, rank, world_size, quick());
    ADD_FAILURE() << "'" << url << "' was accepted";
  } catch (const UsageError& e) {
    for (const char* part : parts) EXPECT_THAT(e.what(), HasSubstr(part)) << "for '" << url << "'";
  }
}

// Runs rendezvous on ranks 0 and 1 as two threads; each publishes its rank and reads the other's.
void exchange_two_ranks(const std::string& url,
                        const std::function<void(const Rendezvous&)>& check = {}) {
  std::string errors[2];
  auto run = [&](int rank) {
    try {
      Rendezvous rv = rendezvous(url, rank, -1, quick());
      if (rv.rank != rank || rv.world_size != 2) {
        throw std::runtime_error("wrong rank or world size");
      }
      rv.store->set("rank" + std::to_string(rank), std::to_string(rank));
      if (rv.store->get("rank" + std::to_string(1 - rank)) != std::to_string(1 - rank)) {
        throw std::runtime_error("wrong value from the other rank");
      }
      if (check) check(rv);
      // Rank 0 may host the store: it leaves after rank 1 is done with it.
      if (rank == 1) {
        rv.store->set("done1", "");
      } else {
        rv.store->wait({"done1"});
      }
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
  };
  std::thread r1(run, 1);
  run(0);
  r1.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

// Clears the variables rendezvous reads and restores them afterwards.
class RendezvousTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name : kVars) {
      const char* v = std::getenv(name);
      if (v != nullptr) saved_[name] = v;
      ::unsetenv(name);
    }
  }
  void TearDown() override {
    for (const char* name : kVars) {
      auto it = saved_.find(name);
      if (it != saved_.end()) {
        ::setenv(name, it->second.c_str(), 1);
      } else {
        ::unsetenv(name);
      }
    }
  }
  static constexpr const char* kVars[] = {
      "MASTER_ADDR",          "MASTER_PORT",   "RANK",          "WORLD_SIZE",
      "CHORUS_JOB_TOKEN",     "CHORUS_STORE_EXTERNAL",          "CHORUS_JOB_TOKEN_FILE",
      "SLURM_PROCID",         "SLURM_STEP_ID", "SLURM_NTASKS",  "SLURM_JOB_ID",
      "SLURM_STEP_NODELIST",  "SLURM_STEPID",  "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE",
      "OMPI_COMM_WORLD_RANK", "CHORUS_ERROR_FILE", "CHORUS_STORE_PREFIX", "CHORUS_TRANSPORT",
      "CHORUS_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"};
  std::map<std::string, std::string> saved_;
};

TEST_F(RendezvousTest, ReadsTheChorusVariablesForTheLayersAbove) {
  const std::string path = "/tmp/chorus-rendezvous-env-" + std::to_string(::getpid());
  Rendezvous plain = rendezvous("file://" + path + "?rank=0&world_size=1");
  EXPECT_EQ(plain.error_file, "");
  EXPECT_EQ(plain.store_prefix, "");
  EXPECT_EQ(plain.transport, "");
  ::setenv("CHORUS_ERROR_FILE", "/tmp/err.json", 1);
  ::setenv("CHORUS_STORE_PREFIX", "attempt-2/", 1);
  ::setenv("CHORUS_TRANSPORT", "tcp", 1);
  Rendezvous rv = rendezvous("file://" + path + "?rank=0&world_size=1");
  EXPECT_EQ(rv.error_file, "/tmp/err.json");
  EXPECT_EQ(rv.store_prefix, "attempt-2/");
  EXPECT_EQ(rv.transport, "tcp");
  std::remove(path.c_str());
}

// The error record names the rank the process group checked, as a JSON number, whatever RANK
// holds (it once copied RANK into the JSON as it stood), and escapes the message. In a child:
// only the first record of a process is written.
TEST_F(RendezvousTest, ErrorRecordWritesTheGroupsRankAsANumber) {
  const std::string path = "/tmp/chorus-error-record-" + std::to_string(::getpid()) + ".json";
  SpawnOptions o;
  o.timeout = std::chrono::seconds(20);
  spawn(1, [&](int, int) {
    ::setenv("RANK", "0, \"injected\": 1", 1);  // what a broken launcher might hand over
    ::setenv("CHORUS_ERROR_FILE", path.c_str(), 1);
    const Rendezvous rv = rendezvous("file://" + path + ".store?rank=0&world_size=1");
    install_error_file_handler(rv.error_file.c_str(), rv.rank);
    record_fatal_error(PeerError("rank 1 left: \"bye\""));
    std::remove((path + ".store").c_str());
  }, o);
  std::FILE* f = std::fopen(path.c_str(), "r");
  ASSERT_NE(f, nullptr);
  char buf[4096] = {};
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  std::remove(path.c_str());
  const std::string record(buf, n);
  EXPECT_THAT(record, ::testing::HasSubstr("\"rank\": 0, "));
  EXPECT_THAT(record, ::testing::Not(::testing::HasSubstr("injected")));
  EXPECT_THAT(record, ::testing::HasSubstr("\"message\": \"rank 1 left: \\\"bye\\\"\""));
  EXPECT_THAT(record, ::testing::HasSubstr("\"relayed\": true"));
}

TEST_F(RendezvousTest, RestartCountIsTheLargestLaunchersCount) {
  EXPECT_EQ(restart_count(), 0);
  ::setenv("TORCHELASTIC_RESTART_COUNT", "2", 1);
  ::setenv("CHORUS_RESTART_COUNT", "1", 1);
  EXPECT_EQ(restart_count(), 2);
  ::setenv("SLURM_RESTART_COUNT", "not a number", 1);  // ignored, not a crash
  EXPECT_EQ(restart_count(), 2);
}

TEST_F(RendezvousTest, LaunchedJobFollowsEachLaunchersVariables) {
  std::string rank = "untouched";
  EXPECT_FALSE(launched_job(&rank));
  EXPECT_EQ(rank, "untouched");
  ::setenv("RANK", "3", 1);  // chorus run, torchrun
  EXPECT_TRUE(launched_job(&rank));
  EXPECT_EQ(rank, "3");
  ::unsetenv("RANK");
  ::setenv("OMPI_COMM_WORLD_RANK", "1", 1);
  ::setenv("OMPI_COMM_WORLD_SIZE", "1", 1);  // a one-process mpirun is no job of ranks
  EXPECT_FALSE(launched_job());
  ::setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  EXPECT_TRUE(launched_job(&rank));
  EXPECT_EQ(rank, "1");
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
  ::setenv("SLURM_PROCID", "2", 1);
  ::setenv("SLURM_NTASKS", "4", 1);
  EXPECT_FALSE(launched_job());  // an sbatch script: no step id
  ::setenv("SLURM_STEP_ID", "0", 1);
  EXPECT_TRUE(launched_job(&rank));
  EXPECT_EQ(rank, "2");
  ::setenv("SLURM_STEP_NUM_TASKS", "1", 1);  // a one-task step, whatever the job's task count
  EXPECT_FALSE(launched_job());
}

// current_environment(): the snapshot the library's environment-driven decisions default to. It
// holds what setenv set, a variable set to "" as "", and nothing that was unset.
TEST_F(RendezvousTest, CurrentEnvironmentIsASnapshotOfTheProcesssVariables) {
  ::setenv("CHORUS_STORE_PREFIX", "attempt-3/", 1);
  ::setenv("CHORUS_TRANSPORT", "", 1);
  const Environment env = current_environment();
  ::setenv("CHORUS_STORE_PREFIX", "later", 1);  // a snapshot: later changes are not in it
  ASSERT_EQ(env.count("CHORUS_STORE_PREFIX"), 1u);
  EXPECT_EQ(env.at("CHORUS_STORE_PREFIX"), "attempt-3/");
  ASSERT_EQ(env.count("CHORUS_TRANSPORT"), 1u);
  EXPECT_EQ(env.at("CHORUS_TRANSPORT"), "");
  EXPECT_EQ(env.count("CHORUS_ERROR_FILE"), 0u);
}

// The one HOST:PORT parser of rendezvous URLs, chorus run's endpoints and transport addresses.
TEST(SplitHostPort, AcceptsNamesIpv4AndBracketedIpv6) {
  std::string host;
  int port = 0;
  EXPECT_EQ(split_host_port("node-1.cluster:29500", &host, &port), "");
  EXPECT_EQ(host, "node-1.cluster");
  EXPECT_EQ(port, 29500);
  EXPECT_EQ(split_host_port("10.0.0.2:1", &host, &port), "");
  EXPECT_EQ(host, "10.0.0.2");
  EXPECT_EQ(port, 1);
  EXPECT_EQ(split_host_port("[fe80::1%eth0]:65535", &host, &port), "");
  EXPECT_EQ(host, "fe80::1%eth0");
  EXPECT_EQ(port, 65535);
}

TEST(SplitHostPort, SaysWhatIsWrongAndLeavesTheOutputsAlone) {
  std::string host = "untouched";
  int port = 7;
  EXPECT_THAT(split_host_port("node", &host, &port), ::testing::HasSubstr("no port"));
  EXPECT_THAT(split_host_port(":80", &host, &port), ::testing::HasSubstr("no host"));
  EXPECT_THAT(split_host_port("node:0", &host, &port), ::testing::HasSubstr("[1, 65535], got '0'"));
  EXPECT_THAT(split_host_port("node:65536", &host, &port), ::testing::HasSubstr("got '65536'"));
  EXPECT_THAT(split_host_port("node:80x", &host, &port), ::testing::HasSubstr("got '80x'"));
  EXPECT_THAT(split_host_port("node:", &host, &port), ::testing::HasSubstr("got ''"));
  EXPECT_THAT(split_host_port("[::1]80", &host, &port), ::testing::HasSubstr("expected [IPV6]:PORT"));
  EXPECT_THAT(split_host_port("[::1", &host, &port), ::testing::HasSubstr("expected [IPV6]:PORT"));
  EXPECT_EQ(host, "untouched");
  EXPECT_EQ(port, 7);
}

TEST_F(RendezvousTest, MalformedUrlsAreUsageErrors) {
  expect_usage_error("", {"malformed rendezvous URL", "env://"});
  expect_usage_error("127.0.0.1:29500", {"malformed rendezvous URL", "tcp://HOST:PORT"});
  expect_usage_error("http://host:1?rank=0&world_size=1",
                     {"unsupported", "http://", "file:///PATH"});
  expect_usage_error("tcp://host?rank=0&world_size=1", {"no port"});
  expect_usage_error("tcp://:123?rank=0&world_size=1", {"no host"});
  expect_usage_error("tcp://host:99999?rank=0&world_size=1", {"port", "99999"});
  expect_usage_error("tcp://host:12?rank=0", {"no world_size"});
  expect_usage_error("tcp://host:12?world_size=2", {"no rank"});
  expect_usage_error("tcp://host:12?rank=x&world_size=2", {"rank must be an integer", "'x'"});
  expect_usage_error("tcp://host:12?rank=0&world_size=2&wrold=3", {"unknown parameter 'wrold'"});
  expect_usage_error("tcp://host:12?rank=0&rank=1&world_size=2", {"given twice"});
  expect_usage_error("tcp://[::1?rank=0&world_size=2", {"[IPV6]:PORT"});
  expect_usage_error("file://relative/path?rank=0&world_size=1", {"absolute path"});
  expect_usage_error("env://somewhere", {"MASTER_ADDR and MASTER_PORT"}, 0, 1);
}

TEST_F(RendezvousTest, RankMustBeInsideTheWorld) {
  expect_usage_error("tcp://127.0.0.1:1?rank=2&world_size=2", {"rank 2", "[0, 2)"});
  expect_usage_error("tcp://127.0.0.1:1?rank=0&world_size=2", {"rank 5", "[0, 2)"}, 5);
  expect_usage_error("tcp://127.0.0.1:1?rank=0&world_size=0",
                     {"world_size must be an integer >= 1"});
  expect_usage_error("tcp://127.0.0.1:1?rank=0&world_size=2", {"world_size must be >= 1"}, -1, 0);
}

TEST_F(RendezvousTest, EnvNamesEachMissingVariable) {
  expect_usage_error("env://", {"needs WORLD_SIZE"});
  ::setenv("WORLD_SIZE", "2", 1);
  expect_usage_error("env://", {"needs RANK"});
  ::setenv("RANK", "1", 1);
  expect_usage_error("env://", {"env:// rendezvous needs MASTER_ADDR; set it or use chorus run"});
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  expect_usage_error("env://", {"env:// rendezvous needs MASTER_PORT; set it or use chorus run"});
  ::setenv("MASTER_PORT", "http", 1);
  expect_usage_error("env://", {"MASTER_PORT must be a port", "'http'"});
  ::setenv("RANK", "2", 1);
  expect_usage_error("env://", {"rank 2", "[0, 2)"});
}

TEST_F(RendezvousTest, TcpRankZeroHostsTheStore) {
  const int port = free_port();
  const std::string url =
      "tcp://127.0.0.1:" + std::to_string(port) + "?world_size=2&token=tcp-token";
  exchange_two_ranks(url, [](const Rendezvous& rv) {
    if (rv.token != "tcp-token") throw std::runtime_error("token " + rv.token);
    if (rv.local_address != "127.0.0.1") {
      throw std::runtime_error("local address " + rv.local_address);
    }
    if (rv.store->timeout() != 5s) throw std::runtime_error("store timeout is not options.timeout");
  });
}

TEST_F(RendezvousTest, TcpWithAnExternalServerChecksTheToken) {
  TcpStoreServerOptions options;
  options.host = "127.0.0.1";
  options.token = "secret";
  options.quiet = true;
  TcpStoreServer server(options);
  ::setenv("CHORUS_STORE_EXTERNAL", "1", 1);
  const std::string base = "tcp://127.0.0.1:" + std::to_string(server.port()) + "?world_size=2";
  // Rank 0 must not try to host: the port is taken, so hosting would fail.
  exchange_two_ranks(base + "&token=secret");
  try {
    rendezvous(base + "&token=other", 1, -1, quick());
    FAIL() << "a wrong token was accepted";
  } catch (const HandshakeError& e) {
    EXPECT_THAT(e.what(), HasSubstr("job token mismatch"));
  }
  // The token comes from CHORUS_JOB_TOKEN when the URL has none.
  ::setenv("CHORUS_JOB_TOKEN", "secret", 1);
  Rendezvous rv = rendezvous(base, 1, -1, quick());
  EXPECT_EQ(rv.token, "secret");
  EXPECT_EQ(server.refused_connections(), 1);
}

TEST_F(RendezvousTest, FileStoreForTwoRanks) {
  const std::string path = temp_path();
  exchange_two_ranks("file://" + path + "?world_size=2", [&](const Rendezvous& rv) {
    if (rv.local_address != "") throw std::runtime_error("a FileStore has no local address");
    if (rv.store->describe() != "FileStore(" + path + ")") {
      throw std::runtime_error(rv.store->describe());
    }
  });
  std::remove(path.c_str());
}

TEST_F(RendezvousTest, EnvReadsTheEnvironment) {
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(free_port()).c_str(), 1);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("CHORUS_JOB_TOKEN", "env-token", 1);
  exchange_two_ranks("env://", [](const Rendezvous& rv) {
    if (rv.token != "env-token") throw std::runtime_error("token " + rv.token);
  });
  // RANK and WORLD_SIZE from the environment when no arguments are given.
  ::setenv("MASTER_PORT", std::to_string(free_port()).c_str(), 1);
  ::setenv("WORLD_SIZE", "1", 1);
  ::setenv("RANK", "0", 1);
  Rendezvous rv = rendezvous("env://", -1, -1, quick());
  EXPECT_EQ(rv.rank, 0);
  EXPECT_EQ(rv.world_size, 1);
  rv.store->set("alone", "yes");
  EXPECT_EQ(rv.store->get("alone"), "yes");
}

TEST_F(RendezvousTest, ExplicitArgumentsOverrideTheUrl) {
  const int port = free_port();
  Rendezvous rv =
      rendezvous("tcp://127.0.0.1:" + std::to_string(port) + "?rank=3&world_size=4", 0, 1, quick());
  EXPECT_EQ(rv.rank, 0);
  EXPECT_EQ(rv.world_size, 1);
}

TEST_F(RendezvousTest, UnreachableStoreTimesOut) {
  RendezvousOptions options;
  options.timeout = 300ms;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(rendezvous("tcp://127.0.0.1:" + std::to_string(free_port()) + "?rank=1&world_size=2&token=t",
                          -1, -1, options),
               TimeoutError);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
}

// Without a launcher that can make one up, there is no default token: a stranger could derive any
// default from what the ranks see (the job id, the endpoint) and join the job as a rank.
TEST_F(RendezvousTest, NoTokenIsAUsageErrorNamingTheFix) {
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(free_port()).c_str(), 1);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("RANK", "1", 1);
  expect_usage_error("env://", {"no job token", "CHORUS_JOB_TOKEN", "CHORUS_JOB_TOKEN_FILE"});
  expect_usage_error("tcp://127.0.0.1:" + std::to_string(free_port()) + "?rank=0&world_size=2",
                     {"no job token", "token="});
  // Under srun the job id used to be the token; now the user must share a secret there too.
  for (const char* v : {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"}) ::unsetenv(v);
  ::setenv("SLURM_PROCID", "0", 1);
  ::setenv("SLURM_STEP_ID", "0", 1);
  ::setenv("SLURM_NTASKS", "2", 1);
  ::setenv("SLURM_JOB_ID", "7", 1);
  ::setenv("SLURM_STEP_NODELIST", "localhost", 1);
  expect_usage_error("env://", {"no job token", "slurm", "srun"});
}

TEST_F(RendezvousTest, TokenFileMustBeReadableOnlyByItsOwner) {
  const std::string path = temp_path();
  {
    std::FILE* f = std::fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs("file-secret\n", f);
    std::fclose(f);
  }
  ::chmod(path.c_str(), 0644);
  try {
    read_token_file(path);
    ADD_FAILURE() << "a token file readable by others was accepted";
  } catch (const UsageError& e) {
    EXPECT_THAT(e.what(), HasSubstr("chmod 600 " + path));
    EXPECT_THAT(e.what(), HasSubstr("0644"));
  }
  ::chmod(path.c_str(), 0600);
  EXPECT_EQ(read_token_file(path), "file-secret");
  EXPECT_THROW(read_token_file(path + ".missing"), UsageError);
  // env:// takes it from CHORUS_JOB_TOKEN_FILE.
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(free_port()).c_str(), 1);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("CHORUS_JOB_TOKEN_FILE", path.c_str(), 1);
  exchange_two_ranks("env://", [](const Rendezvous& rv) {
    if (rv.token != "file-secret") throw std::runtime_error("token " + rv.token);
  });
  std::remove(path.c_str());
}

// What a stranger could try: no token, the old defaults derived from the endpoint or the job id,
// and a near miss. The store refuses them all.
TEST_F(RendezvousTest, GuessedAbsentOrWrongTokensAreRefused) {
  TcpStoreServerOptions options;
  options.host = "127.0.0.1";
  options.token = random_token();
  options.quiet = true;
  TcpStoreServer server(options);
  const std::string base = "tcp://127.0.0.1:" + std::to_string(server.port()) + "?rank=1&world_size=2";
  const std::vector<std::string> guesses = {
      "", "chorus-endpoint-127.0.0.1:" + std::to_string(server.port()), "slurm:7.0", "openmpi:1234",
      options.token.substr(0, options.token.size() - 1), options.token + "x"};
  for (const auto& guess : guesses) {
    try {
      rendezvous(base + "&token=" + guess, -1, -1, quick());
      ADD_FAILURE() << "the guess '" << guess << "' was accepted";
    } catch (const HandshakeError& e) {
      EXPECT_THAT(e.what(), HasSubstr("job token mismatch"));
    } catch (const UsageError& e) {
      EXPECT_EQ(guess, "") << e.what();  // no token at all is refused before connecting
      EXPECT_THAT(e.what(), HasSubstr("no job token"));
    }
  }
  EXPECT_EQ(server.refused_connections(), static_cast<int64_t>(guesses.size()) - 1);
  Rendezvous rv = rendezvous(base + "&token=" + options.token, -1, -1, quick());
  rv.store->set("in", "yes");
  EXPECT_EQ(rv.store->get("in"), "yes");
}

TEST_F(RendezvousTest, UnresolvableHostFailsAtOnceNamingItAndTheFix) {
  ::setenv("MASTER_ADDR", "no-such-host.invalid", 1);
  ::setenv("MASTER_PORT", "29500", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("RANK", "1", 1);
  ::setenv("CHORUS_JOB_TOKEN", "t", 1);
  RendezvousOptions options;
  options.timeout = 30s;
  const auto start = std::chrono::steady_clock::now();
  try {
    rendezvous("env://", -1, -1, options);
    ADD_FAILURE() << "an unresolvable MASTER_ADDR was accepted";
  } catch (const UsageError& e) {
    EXPECT_THAT(e.what(), HasSubstr("cannot resolve host 'no-such-host.invalid'"));
    EXPECT_THAT(e.what(), HasSubstr("MASTER_ADDR"));
    EXPECT_THAT(e.what(), HasSubstr("give an IP address"));
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

TEST_F(RendezvousTest, WaitingForAnAbsentStoreSaysSoOnStderr) {
  const int port = free_port();
  RendezvousOptions options;
  options.timeout = 1700ms;
  options.progress_interval = 500ms;
  ::testing::internal::CaptureStderr();
  EXPECT_THROW(rendezvous("tcp://127.0.0.1:" + std::to_string(port) + "?rank=1&world_size=2&token=t", -1, -1,
                          options),
               TimeoutError);
  const std::string err = ::testing::internal::GetCapturedStderr();
  int lines = 0;
  for (size_t at = 0; (at = err.find("still waiting", at)) != std::string::npos; ++at) ++lines;
  EXPECT_GE(lines, 2) << err;
  EXPECT_LE(lines, 4) << err;
  EXPECT_THAT(err, HasSubstr("chorus: rank 1: still waiting for the TcpStore server at 127.0.0.1:" +
                             std::to_string(port)));
  EXPECT_THAT(err, HasSubstr(" so far, giving up after 1.7"));
  EXPECT_THAT(err, HasSubstr("Connection refused"));
}

}  // namespace
}  // namespace chorus
