// HashStore: a map under one mutex; waiters sleep on a condition variable that every write wakes.
#include <condition_variable>
#include <mutex>
#include <unordered_map>

#include "chorus/comm/error.h"
#include "chorus/comm/store.h"
#include "socket.h"
#include "store_internal.h"

namespace chorus {
struct HashStore::State {
  std::mutex mu;
  std::condition_variable changed;  // notified on every write
  std::unordered_map<std::string, std::string> map;

  std::vector<std::string> missing(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    for (const auto& k : keys) {
      if (map.count(k) == 0) out.push_back(k);
    }
    return out;
  }

  // Blocks (with `lock` held on return) until every key exists; throws TimeoutError at `timeout`.
  void wait_locked(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys,
                   std::chrono::milliseconds timeout) {
    const auto start = net::Clock::now();
    const net::Deadline deadline = net::deadline_after(timeout);
    auto all_present = [&] {
      for (const auto& k : keys) {
        if (map.count(k) == 0) return false;
      }
      return true;
    };
    if (deadline == net::Deadline::max()) {
      changed.wait(lock, all_present);
      return;
    }
    if (!changed.wait_until(lock, deadline, all_present)) {
      throw TimeoutError(
          detail::wait_timeout_message("HashStore", keys, missing(keys), net::Clock::now() - start,
                                       "another thread of this process must set them"));
    }
  }
};

HashStore::HashStore() : state_(std::make_unique<State>()) {}
HashStore::~HashStore() = default;

void HashStore::set(const std::string& key, const std::string& value) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->map[key] = value;
  }
  state_->changed.notify_all();
}

std::string HashStore::get(const std::string& key) {
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->wait_locked(lock, {key}, timeout());
  return state_->map.at(key);
}

int64_t HashStore::add(const std::string& key, int64_t delta) {
  int64_t result = 0;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto it = state_->map.find(key);
    std::string error;
    if (!detail::add_to_value(key, it == state_->map.end() ? nullptr : &it->second, delta, &result,
                              &error)) {
      throw UsageError(describe() + ": " + error);
    }
    state_->map[key] = std::to_string(result);
  }
  state_->changed.notify_all();
  return result;
}

std::string HashStore::compare_set(const std::string& key, const std::string& expected,
                                   const std::string& desired) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto it = state_->map.find(key);
    if (it == state_->map.end()) {
      if (!expected.empty()) return expected;
      state_->map.emplace(key, desired);
    } else if (it->second == expected) {
      it->second = desired;
    } else {
      return it->second;
    }
  }
  state_->changed.notify_all();
  return desired;
}

void HashStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->wait_locked(lock, keys, timeout);
}

bool HashStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->missing(keys).empty();
}

bool HashStore::delete_key(const std::string& key) {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->map.erase(key) > 0;
}

int64_t HashStore::num_keys() {
  std::lock_guard<std::mutex> lock(state_->mu);
  return static_cast<int64_t>(state_->map.size());
}

}  // namespace chorus
