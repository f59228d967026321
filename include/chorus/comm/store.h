// Key-value stores used for rendezvous: ranks publish addresses and agree on counters through them.
//
// Contract for every Store:
// - Thread-safe: one Store object may be used from several threads at once.
// - Values are byte strings (std::string holds arbitrary bytes).
// - get() and wait() block until the keys exist or the store's timeout (or the one given) passes,
//   then throw chorus::TimeoutError naming the missing keys, the store and the time waited.
// - A store whose server is gone throws chorus::PeerError; nothing blocks past its deadline.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace chorus {

class Store {
 public:
  static constexpr std::chrono::milliseconds kDefaultTimeout{300000};  // 5 minutes, as PyTorch

  virtual ~Store() = default;

  virtual void set(const std::string& key, const std::string& value) = 0;
  // Waits up to timeout() for the key, then returns its value.
  virtual std::string get(const std::string& key) = 0;
  // Adds `delta` to the integer stored at `key` (missing = 0) and returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Atomically: if the key is missing and `expected` is empty, or its value equals `expected`,
  // stores `desired`. Returns the value now stored (or `expected` if the key is missing and
  // `expected` is not empty), as torch.distributed.Store.compare_set does.
  virtual std::string compare_set(const std::string& key, const std::string& expected,
                                  const std::string& desired) = 0;
  // Waits until every key exists; throws TimeoutError naming the missing ones.
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout()); }
  // True when every key exists; does not wait.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Removes the key; true if it existed.
  virtual bool delete_key(const std::string& key) = 0;
  virtual int64_t num_keys() = 0;

  // A short description for error messages: "TcpStore(10.0.0.1:29500)".
  virtual std::string describe() const = 0;

  // The default timeout of get() and wait(keys). Both may be called while other threads use the
  // store (it is atomic); a call already waiting keeps the timeout it started with.
  std::chrono::milliseconds timeout() const { return std::chrono::milliseconds(timeout_ms_.load(std::memory_order_relaxed)); }
  void set_timeout(std::chrono::milliseconds timeout) { timeout_ms_.store(timeout.count(), std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> timeout_ms_{kDefaultTimeout.count()};
};

// In-process store (threads of one process). For tests and single-process groups.
class HashStore : public Store {
 public:
  HashStore();
  ~HashStore() override;
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  using Store::wait;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;
  std::string describe() const override { return "HashStore"; }

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// A store in a file on a filesystem that every rank sees (NFS, /tmp on one host). Processes
// serialise through flock(2); waiting polls the file with a short backoff.
class FileStore : public Store {
 public:
  explicit FileStore(std::string path, std::chrono::milliseconds timeout = kDefaultTimeout);
  ~FileStore() override;
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  using Store::wait;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;
  std::string describe() const override { return "FileStore(" + path_ + ")"; }
  const std::string& path() const { return path_; }

 private:
  struct State;
  std::string path_;
  std::unique_ptr<State> state_;
};

// Prefixes every key with "<prefix>/" so several groups can share one store.
class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> base);
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  using Store::wait;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  // Counts the keys of the whole underlying store, as PyTorch's PrefixStore does.
  int64_t num_keys() override;
  std::string describe() const override;
  const std::shared_ptr<Store>& base() const { return base_; }

 private:
  std::string key(const std::string& k) const { return prefix_ + "/" + k; }
  std::string prefix_;
  std::shared_ptr<Store> base_;
};

}  // namespace chorus
