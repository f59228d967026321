// Checkpoints: rank 0 writes a new version atomically; load reads on rank 0 and broadcasts.
// Here the model, optimizer and RNG states become files and back, and the ranks agree on the
// outcome; the files themselves (writing, versions, verifying, packing) are checkpoint_files.cc.
//
// Layout of a checkpoint directory (see docs/checkpoint.md):
//   <dir>/latest               the name of the current version ("ckpt-000007\n")
//   <dir>/ckpt-000007/         one complete version: model.pt optimizer.pt rng.pt state.json
//   <dir>/.tmp-ckpt-000008-*/  a version being written (or left by a killed writer)
#include "chorus/train/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <caffe2/serialize/inline_container.h>
#include <sys/stat.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/csrc/jit/serialization/import_read.h>

#include <algorithm>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <mutex>
#include <set>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>
#include <vector>

#include "checkpoint_files.h"
#include "checkpoint_internal.h"
#include "chorus/comm/random.h"
#include "chorus/torch/distributed.h"
#include "chorus/torch/optimizer_bytes.h"
#include "pickle_bounds.h"

namespace chorus::train {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ---- model, optimizer, RNG ----------------------------------------------------------------------

struct NamedTensor {
  std::string name;
  at::Tensor tensor;
  bool is_buffer;
};

std::vector<NamedTensor> model_tensors(torch::nn::Module& model) {
  std::vector<NamedTensor> out;
  for (const auto& p : model.named_parameters(/*recurse=*/true)) out.push_back({p.key(), p.value(), false});
  for (const auto& b : model.named_buffers(/*recurse=*/true)) out.push_back({b.key(), b.value(), true});
  return out;
}

std::string model_bytes(torch::nn::Module& model) {
  c10::Dict<std::string, at::Tensor> dict;
  // Host copies: a checkpoint written on a GPU loads on a machine without one.
  for (const auto& t : model_tensors(model)) dict.insert(t.name, t.tensor.detach().to(at::kCPU));
  std::vector<char> bytes = torch::pickle_save(dict);
  return std::string(bytes.begin(), bytes.end());
}

std::string strip_module_prefix(const std::string& name) {
  static const std::string prefix = "module.";
  return name.compare(0, prefix.size(), prefix) == 0 ? name.substr(prefix.size()) : name;
}

std::string join_some(const std::vector<std::string>& names) {
  std::string out;
  const size_t shown = std::min<size_t>(names.size(), 10);
  for (size_t i = 0; i < shown; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > shown) out += ", ... (" + std::to_string(names.size()) + " in all)";
  return out;
}

// torch::pickle_load, reading through an istream. pickle_load itself reads its bytes through
// libtorch 1.13's VectorReader, which copies whatever range the zip reader asks for: a damaged
// model.pt or rng.pt made it read past the end of the buffer (found by fuzz/checkpoint.cc; the
// input is fuzz/corpus/checkpoint/regression-rng-pt-read-past-end). libtorch's istream adapter
// checks every read and throws instead.
// Its data.pkl goes through check_pickle_bounds first (pickle_bounds.h).
torch::IValue pickle_load_checked(const std::string& bytes, const std::string& what) {
  detail::check_zip_sizes(bytes.data(), bytes.size(), what);
  std::istringstream in(bytes);
  caffe2::serialize::PyTorchStreamReader archive(&in);
  {
    const auto [pickle, size] = archive.getRecord("data.pkl");
    detail::check_pickle_bounds(static_cast<const char*>(pickle.get()), size, what);
  }
  return torch::jit::readArchiveAndTensors("data", /*pickle_prefix=*/"", /*tensor_prefix=*/"",
                                           /*type_resolver=*/c10::nullopt, /*obj_loader=*/c10::nullopt,
                                           /*device=*/c10::nullopt, archive);
}

void load_model(const std::string& bytes, torch::nn::Module& model) {
  torch::IValue value = pickle_load_checked(bytes, "model.pt");
  if (!value.isGenericDict()) throw CheckpointError("model.pt does not hold a dict of tensors");
  std::map<std::string, at::Tensor> saved;
  for (const auto& item : value.toGenericDict()) {
    if (!item.key().isString() || !item.value().isTensor()) {
      throw CheckpointError("model.pt does not hold a dict of tensors by name");
    }
    saved[strip_module_prefix(item.key().toStringRef())] = item.value().toTensor();
  }
  std::vector<std::string> missing, mismatched;
  auto targets = model_tensors(model);
  for (const auto& t : targets) {
    auto it = saved.find(t.name);
    if (it == saved.end()) {
      missing.push_back(t.name);
    } else if (!it->second.sizes().equals(t.tensor.sizes()) || it->second.scalar_type() != t.tensor.scalar_type()) {
      std::ostringstream os;
      os << t.name << " (checkpoint " << it->second.scalar_type() << it->second.sizes() << ", model "
         << t.tensor.scalar_type() << t.tensor.sizes() << ")";
      mismatched.push_back(os.str());
    }
  }
  std::set<std::string> known;
  for (const auto& t : targets) known.insert(t.name);
  std::vector<std::string> unexpected;
  for (const auto& [name, tensor] : saved) {
    if (known.count(name) == 0) unexpected.push_back(name);
  }
  if (!missing.empty() || !unexpected.empty() || !mismatched.empty()) {
    std::string msg = "the checkpoint's model does not match this model:";
    if (!missing.empty()) msg += " missing from the checkpoint: " + join_some(missing) + ";";
    if (!unexpected.empty()) msg += " not in the model: " + join_some(unexpected) + ";";
    if (!mismatched.empty()) msg += " different shape or dtype: " + join_some(mismatched) + ";";
    msg += " build the model exactly as when it was saved";
    throw CheckpointError(msg);
  }
  torch::NoGradGuard no_grad;
  for (auto& t : targets) t.tensor.copy_(saved.at(t.name));
}

std::string rng_state() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  at::Tensor state;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    state = gen.get_state();
  }
  state = state.contiguous();
  return std::string(static_cast<const char*>(state.data_ptr()), static_cast<size_t>(state.nbytes()));
}

void set_rng_state(const at::Tensor& state) {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

std::string rng_bytes(const std::vector<std::string>& states) {
  c10::List<at::Tensor> list;
  for (const auto& s : states) {
    at::Tensor t = at::empty({static_cast<int64_t>(s.size())}, at::kByte);
    std::memcpy(t.data_ptr(), s.data(), s.size());
    list.push_back(t);
  }
  std::vector<char> bytes = torch::pickle_save(list);
  return std::string(bytes.begin(), bytes.end());
}

void load_rng(const std::string& bytes, int rank) {
  torch::IValue value = pickle_load_checked(bytes, "rng.pt");
  if (!value.isTensorList()) throw CheckpointError("rng.pt does not hold a list of generator states");
  auto list = value.toTensorList();
  if (list.size() == 0) return;
  set_rng_state(list.get(static_cast<size_t>(rank) % list.size()));
}

// ---- the group ----------------------------------------------------------------------------------

ProcessGroup* resolve_group(const CheckpointOptions& options) {
  if (options.group != nullptr) return options.group;
  return dist::is_initialized() ? &dist::default_group() : nullptr;
}

// ---- save on rank 0 -----------------------------------------------------------------------------

void write_version(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                   const CheckpointState& state, const std::vector<std::string>& rng_states, int world,
                   const CheckpointOptions& options) {
  ckpt::create_dir(dir);
  ckpt::sweep_temporaries(dir);
  int64_t seq = 1;
  auto versions = ckpt::list_versions(dir);
  if (!versions.empty()) seq = versions.back().first + 1;
  const std::string name = ckpt::version_name(seq);
  const std::string tmp = (fs::path(dir) / (ckpt::kTmpPrefix + name + "-" + random_token().substr(0, 12))).string();
  if (::mkdir(tmp.c_str(), 0755) != 0) throw CheckpointError(ckpt::sys_error("cannot create", tmp));

  auto hook = [&](const std::string& stage) {
    if (options.on_save_step) options.on_save_step(stage);
  };
  json files = json::object();
  auto write = [&](const char* file, const std::string& bytes) {
    ckpt::write_file((fs::path(tmp) / file).string(), bytes.data(), bytes.size(), options.fsync);
    files[file] = {{"bytes", bytes.size()}, {"fnv1a64", ckpt::checksum(bytes)}};
    hook(file);
  };
  write(ckpt::kModelFile, model_bytes(model));
  if (optimizer != nullptr) write(ckpt::kOptimizerFile, dist::optimizer_to_bytes(*optimizer));
  if (!rng_states.empty()) write(ckpt::kRngFile, rng_bytes(rng_states));

  // state.json last: it is also the manifest of the files above.
  json doc = {{"format", ckpt::kFormat},
              {"format_version", ckpt::kFormatVersion},
              {"epoch", state.epoch},
              {"step", state.step},
              {"extra", state.extra},
              {"world_size", world},
              {"created_unix", static_cast<int64_t>(::time(nullptr))},
              {"files", files}};
  const std::string text = doc.dump(2) + "\n";
  ckpt::write_file((fs::path(tmp) / ckpt::kStateFile).string(), text.data(), text.size(), options.fsync);
  hook(ckpt::kStateFile);
  if (options.fsync) ckpt::fsync_path(tmp, true);

  const std::string final_path = (fs::path(dir) / name).string();
  if (::rename(tmp.c_str(), final_path.c_str()) != 0) {
    throw CheckpointError(ckpt::sys_error("cannot rename " + tmp + " to", final_path) +
                          " (is another job writing to the same checkpoint directory?)");
  }
  if (options.fsync) ckpt::fsync_path(dir, true);
  hook("version");

  const std::string latest_tmp =
      (fs::path(dir) / (std::string(ckpt::kTmpPrefix) + "latest-" + random_token().substr(0, 12))).string();
  const std::string line = name + "\n";
  ckpt::write_file(latest_tmp, line.data(), line.size(), options.fsync);
  const std::string latest = (fs::path(dir) / "latest").string();
  if (::rename(latest_tmp.c_str(), latest.c_str()) != 0) throw CheckpointError(ckpt::sys_error("cannot replace", latest));
  if (options.fsync) ckpt::fsync_path(dir, true);
  hook("latest");

  ckpt::prune(dir, name, options.keep_last);
}

// What rank 0 tells the others: "ok", "none" or "error".
constexpr const char* kStatus = "\x01status";
constexpr const char* kMessage = "\x01message";

}  // namespace

std::optional<std::string> latest_checkpoint(const std::string& dir) { return ckpt::resolve_version(dir); }

void save_checkpoint(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                     const CheckpointState& state, const CheckpointOptions& options) {
  ProcessGroup* group = resolve_group(options);
  const int rank = group ? group->rank() : 0;
  const int world = group ? group->size() : 1;

  std::vector<std::string> rng_states;
  if (options.save_rng) {
    std::string mine = rng_state();
    rng_states = group ? dist::all_gather_object(mine, group) : std::vector<std::string>{mine};
  }
  std::string error;
  if (rank == 0) {
    try {
      write_version(dir, model, optimizer, state, rng_states, world, options);
    } catch (const std::exception& e) {
      error = e.what();
      if (error.empty()) error = "unknown error";
    }
  }
  if (group) error = dist::broadcast_object(error, 0, group);  // also the others' wait for rank 0
  if (!error.empty()) {
    throw CheckpointError("save_checkpoint " + dir + ": " + (rank == 0 ? "" : "rank 0 failed to write: ") + error);
  }
}

std::optional<CheckpointState> prepare_checkpoint_dir(const std::string& dir, const CheckpointOptions& options) {
  ProcessGroup* group = resolve_group(options);
  const int rank = group ? group->rank() : 0;
  // Rank 0's verdict for everyone: "error" or "ok" followed by the message or state.json, or "none".
  std::string verdict;
  if (rank == 0) {
    try {
      ckpt::make_writable_dir(dir);
      ckpt::sweep_temporaries(dir);
      std::optional<std::string> current = ckpt::resolve_version(dir);
      verdict = current ? "ok" + ckpt::read_file((fs::path(*current) / ckpt::kStateFile).string()) : "none";
    } catch (const std::exception& e) {
      verdict = std::string("error") + e.what();
    }
  }
  if (group) verdict = dist::broadcast_object(verdict, 0, group);
  if (verdict.rfind("error", 0) == 0) {
    throw CheckpointError("checkpoint directory " + dir + ": " + (rank == 0 ? "" : "rank 0 found: ") +
                          verdict.substr(5));
  }
  if (verdict == "none") return std::nullopt;
  try {
    return ckpt::parse_state(verdict.substr(2));
  } catch (const std::exception& e) {
    throw CheckpointError("checkpoint directory " + dir + ": its current version's state.json is unreadable: " +
                          e.what());
  }
}

std::optional<CheckpointState> load_checkpoint(const std::string& dir, torch::nn::Module& model,
                                               torch::optim::Optimizer* optimizer, const CheckpointOptions& options) {
  ProcessGroup* group = resolve_group(options);
  const int rank = group ? group->rank() : 0;

  std::string message;
  if (rank == 0) {
    ckpt::Blobs blobs;
    try {
      if (fs::is_directory(dir) && !fs::exists(fs::path(dir) / ckpt::kStateFile)) ckpt::sweep_temporaries(dir);
      blobs = ckpt::read_version(dir);
      blobs[kStatus] = blobs.empty() ? "none" : "ok";
    } catch (const std::exception& e) {
      blobs = {{kStatus, "error"}, {kMessage, e.what()}};
    }
    message = ckpt::pack(blobs);
  }
  if (group) message = dist::broadcast_object(message, 0, group);
  ckpt::Blobs blobs = ckpt::unpack(message);
  const std::string status = blobs[kStatus];
  if (status == "none") return std::nullopt;
  if (status != "ok") {
    throw CheckpointError("load_checkpoint " + dir + ": " + (rank == 0 ? "" : "rank 0 failed to read: ") +
                          blobs[kMessage]);
  }

  // Every rank applies the bytes; then all agree, so a failure on one rank fails them all.
  CheckpointState st;
  std::string error;
  try {
    st = ckpt::parse_state(blobs.at(ckpt::kStateFile));
    load_model(blobs.at(ckpt::kModelFile), model);
    if (optimizer != nullptr) {
      auto it = blobs.find(ckpt::kOptimizerFile);
      if (it == blobs.end()) {
        throw CheckpointError("the checkpoint holds no optimizer state (saved with optimizer == nullptr); "
                              "pass nullptr to load it without one");
      }
      dist::optimizer_from_bytes(it->second, *optimizer);
    }
    if (auto it = blobs.find(ckpt::kRngFile); it != blobs.end()) load_rng(it->second, rank);
  } catch (const std::exception& e) {
    error = e.what();
    if (error.empty()) error = "unknown error";
  }
  std::vector<std::string> errors = group ? dist::all_gather_object(error, group) : std::vector<std::string>{error};
  if (!error.empty()) throw CheckpointError("load_checkpoint " + dir + ": " + error);
  for (size_t r = 0; r < errors.size(); ++r) {
    if (errors[r].empty()) continue;
    throw CheckpointError("load_checkpoint " + dir + ": rank " + std::to_string(r) + " failed to apply it: " + errors[r]);
  }
  return st;
}

// ---- entry points for the fuzz target (checkpoint_internal.h) -----------------------------------

namespace detail {

CheckpointFiles read_checkpoint_files(const std::string& dir) { return ckpt::read_version(dir); }
CheckpointFiles unpack_checkpoint_message(const std::string& message) { return ckpt::unpack(message); }
CheckpointState parse_checkpoint_state(const std::string& state_json) { return ckpt::parse_state(state_json); }
void load_checkpoint_model(const std::string& model_pt, torch::nn::Module& model) { load_model(model_pt, model); }
void load_checkpoint_rng(const std::string& rng_pt, int rank) { load_rng(rng_pt, rank); }

}  // namespace detail

}  // namespace chorus::train
