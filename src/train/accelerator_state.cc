// The Accelerator's state: save_state writes the prepared model(s), the optimizer and, as the
// checkpoint's extra fields, the step, each loader's position, the schedulers' step counts, the
// learning rates, the registered user objects and allreduce "tuned"'s decisions (docs/checkpoint.md);
// load_state puts them back, moving each loader's position when the world size or batch size changed.
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "accelerator_internal.h"
#include "chorus/torch/distributed.h"
#include "chorus/train/checkpoint.h"

namespace chorus::train {

namespace {

std::string to_hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

std::string from_hex(const std::string& hex) {
  auto value = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  std::string out(hex.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(value(hex[2 * i]) << 4 | value(hex[2 * i + 1]));
  return out;
}

int64_t extra_int(const CheckpointState& st, const std::string& key, int64_t fallback) {
  auto it = st.extra.find(key);
  return it == st.extra.end() ? fallback : std::stoll(it->second);
}

// allreduce "tuned"'s decisions (ProcessGroup::tuned_allreduce) as the state's "allreduce.tuned".
std::string tuned_to_json(const std::vector<TunedAllreduce>& decisions) {
  nlohmann::json out = nlohmann::json::array();
  for (const TunedAllreduce& d : decisions) {
    nlohmann::json measured = nlohmann::json::array();
    for (const auto& [name, us] : d.measured_us) measured.push_back({name, us});
    out.push_back({{"ranks", d.ranks}, {"min_bytes", d.min_bytes}, {"max_bytes", d.max_bytes},
                   {"chosen", d.chosen}, {"measured_us", measured}});
  }
  return out.dump();
}

std::vector<TunedAllreduce> tuned_from_json(const nlohmann::json& decisions) {
  std::vector<TunedAllreduce> out;
  for (const auto& j : decisions) {
    TunedAllreduce d;
    d.ranks = j.at("ranks").get<int>();
    d.min_bytes = j.at("min_bytes").get<size_t>();
    d.max_bytes = j.at("max_bytes").get<size_t>();
    d.chosen = j.at("chosen").get<std::string>();
    for (const auto& m : j.at("measured_us")) d.measured_us.emplace_back(m.at(0).get<std::string>(), m.at(1).get<double>());
    out.push_back(std::move(d));
  }
  return out;
}
}  // namespace

// The module save_checkpoint gets: the one prepared model, or a holder of several under "0", "1"...
std::shared_ptr<torch::nn::Module> Accelerator::state_module(const std::vector<PreparedRecord>& models) {
  if (models.size() == 1) return models.front().module;
  auto holder = std::make_shared<torch::nn::Module>("PreparedModels");
  for (size_t i = 0; i < models.size(); ++i) holder->register_module(std::to_string(i), models[i].module);
  return holder;
}

CheckpointOptions Accelerator::checkpoint_options() const {
  CheckpointOptions co;
  co.group = group_;
  co.keep_last = options_.keep_last;
  co.fsync = options_.fsync;
  return co;
}

void Accelerator::register_for_checkpointing(const std::string& name, std::function<std::string()> save,
                                             std::function<void(const std::string&)> load) {
  if (name.empty() || !save || !load) throw UsageError(who() + ": register_for_checkpointing needs a name, save and load");
  for (const auto& u : user_objects_) {
    if (u.name == name) throw UsageError(who() + ": an object named '" + name + "' is registered already");
  }
  user_objects_.push_back({name, std::move(save), std::move(load)});
}

std::string Accelerator::save_state() {
  if (accumulated_ != 0) {
    throw UsageError(who() + ": save_state after micro-step " + std::to_string(accumulated_) + " of " +
                     std::to_string(options_.gradient_accumulation_steps) +
                     " of an accumulation: the accumulated gradients are not part of the state, so a resumed run "
                     "would differ. Save after a sync step (when sync_gradients() is true)");
  }
  if (models_.empty()) throw UsageError(who() + ": save_state: no model is prepared");
  if (optimizers_.size() > 1) {
    throw UsageError(who() + ": save_state keeps one prepared optimizer's state, and " +
                     std::to_string(optimizers_.size()) + " are prepared; save the others with "
                     "register_for_checkpointing (e.g. torch::save into a string)");
  }
  settle_step();
  flush_aggregate();
  CheckpointState st;
  st.step = global_step_;
  st.epoch = loaders_.empty() ? 0 : loaders_.front()->resume_epoch();
  st.extra["accelerator.world_size"] = std::to_string(world_size_);
  char elapsed_text[64];
  std::snprintf(elapsed_text, sizeof(elapsed_text), "%.17g", elapsed());
  st.extra["accelerator.elapsed"] = elapsed_text;
  st.extra["accelerator.loaders"] = std::to_string(loaders_.size());
  for (size_t i = 0; i < loaders_.size(); ++i) {
    const auto& l = *loaders_[i];
    const std::string p = "loader." + std::to_string(i) + ".";
    st.extra[p + "epoch"] = std::to_string(l.resume_epoch());
    st.extra[p + "position"] = std::to_string(l.resume_position());
    st.extra[p + "batch_size"] = std::to_string(l.batch_size);
    st.extra[p + "dataset_size"] = std::to_string(l.sampler->dataset_size());
  }
  for (size_t i = 0; i < schedulers_.size(); ++i) {
    st.extra["scheduler." + std::to_string(i) + ".steps"] = std::to_string(*schedulers_[i].steps);
  }
  if (!optimizers_.empty()) {
    nlohmann::json lrs = nlohmann::json::array();
    for (auto& group : optimizers_.front()->param_groups()) lrs.push_back(group.options().get_lr());
    st.extra["optimizer.0.lrs"] = lrs.dump();
  }
  if (scaler_) st.extra["grad_scaler"] = scaler_->state();
  {
    // Every rank's decisions, by rank (under hybrid each host's rail measured its own). Gathered on
    // every save, tuned or not: whether a rank has decisions is not a condition all ranks can see.
    const std::vector<std::string> tuned = dist::all_gather_object(tuned_to_json(group_->tuned_allreduce()), group_);
    if (std::any_of(tuned.begin(), tuned.end(), [](const std::string& t) { return t != "[]"; })) {
      std::string all = "[";
      for (size_t r = 0; r < tuned.size(); ++r) all += (r == 0 ? "" : ",") + tuned[r];
      st.extra["allreduce.tuned"] = all + "]";
    }
  }
  for (const auto& u : user_objects_) st.extra["user." + u.name] = to_hex(u.save());

  auto module = state_module(models_);
  save_checkpoint(state_dir_, *module, optimizers_.empty() ? nullptr : optimizers_.front(), st, checkpoint_options());
  saved_step_ = global_step_;
  const std::string path = latest_checkpoint(state_dir_).value_or(state_dir_);
  records_->recorder.line({{"type", "event"}, {"event", "save"}, {"step", global_step_}, {"epoch", st.epoch},
                           {"time", elapsed()}, {"path", path}},
                          rank_ == 0);
  records_->recorder.log_line("state saved at step " + std::to_string(global_step_) + " in " + path);
  records_->recorder.flush();
  return path;
}

bool Accelerator::load_state(const std::string& dir) {
  if (models_.empty()) throw UsageError(who() + ": load_state: prepare the model(s) first, then load");
  if (optimizers_.size() > 1) {
    throw UsageError(who() + ": load_state restores one prepared optimizer's state, and " +
                     std::to_string(optimizers_.size()) + " are prepared");
  }
  const std::string from = dir.empty() ? state_dir_ : dir;
  auto module = state_module(models_);
  auto st = load_checkpoint(from, *module, optimizers_.empty() ? nullptr : optimizers_.front(), checkpoint_options());
  if (!st) {
    notice("no saved state in " + from + ": starting afresh");
    return false;
  }
  global_step_ = st->step;
  settled_step_ = saved_step_ = global_step_;
  first_step_ = global_step_;
  accumulated_ = 0;
  sync_ = true;
  if (auto it = st->extra.find("accelerator.elapsed"); it != st->extra.end()) {
    timing_->elapsed_offset = std::stod(it->second) - seconds_between(timing_->created, Clock::now());
  }
  const int64_t saved_world = extra_int(*st, "accelerator.world_size", world_size_);
  if (auto it = st->extra.find("allreduce.tuned"); it != st->extra.end()) {
    // What "tuned" kept before the save, kept again, each rank its own: the resumed steps sum as
    // the first attempt's did. At another world size the job measures afresh.
    try {
      const auto all = nlohmann::json::parse(it->second);
      if (!all.is_array() || static_cast<int64_t>(all.size()) != saved_world) {
        throw UsageError("not one list of decisions per rank of the " + std::to_string(saved_world) + " that saved it");
      }
      if (saved_world == world_size_) {
        group_->keep_tuned_allreduce(tuned_from_json(all.at(static_cast<size_t>(rank_))));
      } else {
        notice("note: allreduce \"tuned\" measures its algorithms afresh: the state was saved by " +
               std::to_string(saved_world) + " rank(s), this run has " + std::to_string(world_size_));
      }
    } catch (const std::exception& e) {
      throw UsageError(who() + ": load_state: the state's allreduce.tuned is not what save_state writes (" + e.what() +
                       "); " + from + " was written by something else or damaged");
    }
  }
  const int64_t saved_loaders = extra_int(*st, "accelerator.loaders", 0);
  for (size_t i = 0; i < loaders_.size() && static_cast<int64_t>(i) < saved_loaders; ++i) {
    auto& l = *loaders_[i];
    const std::string p = "loader." + std::to_string(i) + ".";
    int64_t epoch = extra_int(*st, p + "epoch", 0);
    int64_t position = extra_int(*st, p + "position", 0);
    const int64_t saved_batch = extra_int(*st, p + "batch_size", l.batch_size);
    if (saved_world != world_size_ || saved_batch != l.batch_size) {
      // Batch b of an epoch covers the first (b+1) x batch x world positions of the epoch's
      // shuffled order, at any world size: resume at the last batch boundary before the samples
      // not yet trained on.
      const int64_t done = position * saved_batch * saved_world;
      position = done / (l.batch_size * world_size_);
      notice("note: the state was saved by " + std::to_string(saved_world) + " rank(s) x batch " +
             std::to_string(saved_batch) + ", this run has " + std::to_string(world_size_) + " x " +
             std::to_string(l.batch_size) + ": loader " + std::to_string(i) + " resumes epoch " +
             std::to_string(epoch + 1) + " at batch " + std::to_string(position) + " (" +
             std::to_string(done - position * l.batch_size * world_size_) +
             " sample(s) trained on again), and each rank's batches differ from the original run's");
    }
    if (position >= l.batches_per_epoch) {
      ++epoch;
      position = 0;
    }
    l.sampler->set_epoch(epoch);
    l.pass_completed = false;
    l.skip = position;
    l.position = position;
  }
  for (size_t i = 0; i < schedulers_.size(); ++i) {
    const int64_t steps = extra_int(*st, "scheduler." + std::to_string(i) + ".steps", 0);
    for (int64_t s = 0; s < steps; ++s) schedulers_[i].scheduler->step();  // its step count, from the start
    *schedulers_[i].steps = steps;
  }
  if (auto it = st->extra.find("optimizer.0.lrs"); it != st->extra.end() && !optimizers_.empty()) {
    auto lrs = nlohmann::json::parse(it->second, nullptr, false);
    auto& groups = optimizers_.front()->param_groups();
    if (lrs.is_array() && lrs.size() == groups.size()) {
      for (size_t g = 0; g < groups.size(); ++g) groups[g].options().set_lr(lrs[g].get<double>());
    }
  }
  if (auto it = st->extra.find("grad_scaler"); it != st->extra.end() && scaler_) scaler_->load_state(it->second);
  for (const auto& u : user_objects_) {
    if (auto it = st->extra.find("user." + u.name); it != st->extra.end()) u.load(from_hex(it->second));
  }
  if (options_.records) {
    records_->recorder.rewind(global_step_);
  }
  const std::string path = latest_checkpoint(from).value_or(from);
  notice("resumed from " + path + " at epoch " + std::to_string(epoch() + 1) + ", step " + std::to_string(global_step_));
  return true;
}

}  // namespace chorus::train
