// PrefixStore: forwards to the base store with every key written as "<prefix>/<key>".
#include <utility>

#include "chorus/comm/error.h"
#include "chorus/comm/store.h"

namespace chorus {

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> base)
    : prefix_(std::move(prefix)), base_(std::move(base)) {
  if (!base_) throw UsageError("PrefixStore('" + prefix_ + "'): the base store is null");
  set_timeout(base_->timeout());
}

void PrefixStore::set(const std::string& k, const std::string& value) { base_->set(key(k), value); }

std::string PrefixStore::get(const std::string& k) {
  // get() waits for this store's timeout, which set_timeout() may have made differ from the base's.
  if (timeout() != base_->timeout()) base_->wait({key(k)}, timeout());
  return base_->get(key(k));
}

int64_t PrefixStore::add(const std::string& k, int64_t delta) { return base_->add(key(k), delta); }

std::string PrefixStore::compare_set(const std::string& k, const std::string& expected,
                                     const std::string& desired) {
  return base_->compare_set(key(k), expected, desired);
}

void PrefixStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::vector<std::string> prefixed;
  prefixed.reserve(keys.size());
  for (const auto& k : keys) prefixed.push_back(key(k));
  base_->wait(prefixed, timeout);
}

bool PrefixStore::check(const std::vector<std::string>& keys) {
  std::vector<std::string> prefixed;
  prefixed.reserve(keys.size());
  for (const auto& k : keys) prefixed.push_back(key(k));
  return base_->check(prefixed);
}

bool PrefixStore::delete_key(const std::string& k) { return base_->delete_key(key(k)); }

int64_t PrefixStore::num_keys() { return base_->num_keys(); }

std::string PrefixStore::describe() const {
  return "PrefixStore(" + prefix_ + ", " + base_->describe() + ")";
}

}  // namespace chorus
