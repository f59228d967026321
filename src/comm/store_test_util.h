// Helpers of the store tests (store_test.cc and tcp_store_test.cc, one executable): a temporary
// file, a free port, polling for a condition, and forked children with a bounded wait.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace chorus::store_test {

using Clock = std::chrono::steady_clock;

constexpr std::chrono::milliseconds kShortTimeout{300};  // for operations that are meant to time out
constexpr std::chrono::seconds kLongTimeout{5};          // for operations that are meant to succeed

std::string temp_path();

// A port nothing listens on (the kernel's pick, released again).
int free_port();

bool eventually(const std::function<bool()>& condition, std::chrono::milliseconds timeout = std::chrono::seconds(3));

double seconds_since(Clock::time_point start);

// Waits for a forked child for at most `timeout`, killing it past that. Returns its exit code,
// 128 + signal if it was killed by one, or -1 if it had to be killed here.
int wait_child(pid_t pid, std::chrono::milliseconds timeout);

// Forks `n` children running fn(i); each exits 0 if fn returns and 1 if it throws.
std::vector<pid_t> fork_children(int n, const std::function<void(int)>& fn);

}  // namespace chorus::store_test
