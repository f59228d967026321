// Checkpoints: rank 0 writes a new version atomically; load reads on rank 0 and broadcasts.
//
// Layout of a checkpoint directory (see docs/checkpoint.md):
//   <dir>/latest               the name of the current version ("ckpt-000007\n")
//   <dir>/ckpt-000007/         one complete version: model.pt optimizer.pt rng.pt state.json
//   <dir>/.tmp-ckpt-000008-*/  a version being written (or left by a killed writer)
#include "chorus/train/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <caffe2/serialize/inline_container.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/csrc/jit/serialization/import_read.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <set>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>
#include <vector>

#include "chorus/comm/hash.h"
#include "chorus/comm/log.h"
#include "chorus/comm/random.h"
#include "chorus/torch/distributed.h"
#include "checkpoint_internal.h"
#include "pickle_bounds.h"

namespace chorus::train {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* kFormat = "chorus-checkpoint";
constexpr int kFormatVersion = 1;
constexpr const char* kVersionPrefix = "ckpt-";
constexpr const char* kTmpPrefix = ".tmp-";
constexpr const char* kModelFile = "model.pt";
constexpr const char* kOptimizerFile = "optimizer.pt";
constexpr const char* kRngFile = "rng.pt";
constexpr const char* kStateFile = "state.json";

std::string sys_error(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

// ---- files --------------------------------------------------------------------------------------

void fsync_path(const std::string& path, bool directory) {
  int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) throw CheckpointError(sys_error("cannot open for fsync", path));
  if (::fsync(fd) != 0) {
    std::string msg = sys_error("fsync failed on", path);
    ::close(fd);
    throw CheckpointError(msg);
  }
  ::close(fd);
}

// Writes a new file (it must not exist) and, when sync is set, fsyncs it before closing.
void write_file(const std::string& path, const void* data, size_t size, bool sync) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) throw CheckpointError(sys_error("cannot create", path));
  const char* p = static_cast<const char*>(data);
  size_t left = size;
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      std::string msg = sys_error("cannot write", path);
      ::close(fd);
      throw CheckpointError(msg);
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  if (sync && ::fsync(fd) != 0) {
    std::string msg = sys_error("fsync failed on", path);
    ::close(fd);
    throw CheckpointError(msg);
  }
  if (::close(fd) != 0) throw CheckpointError(sys_error("cannot close", path));
}

std::string read_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw CheckpointError(sys_error("cannot open", path));
  std::string out;
  char buf[1 << 16];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      std::string msg = sys_error("cannot read", path);
      ::close(fd);
      throw CheckpointError(msg);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

// FNV-1a, 64 bit, as 16 hex digits: catches truncated or damaged files; not a defence against tampering.
std::string checksum(const std::string& data) {
  char out[17];
  std::snprintf(out, sizeof(out), "%016" PRIx64, fnv1a64(data));
  return out;
}

// The sequence number of a version directory's name, or -1 if the name is not one.
int64_t version_seq(const std::string& name) {
  const size_t n = std::strlen(kVersionPrefix);
  if (name.size() <= n || name.compare(0, n, kVersionPrefix) != 0) return -1;
  int64_t seq = 0;
  for (size_t i = n; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || seq > (INT64_MAX - 9) / 10) return -1;
    seq = seq * 10 + (name[i] - '0');
  }
  return seq;
}

std::string version_name(int64_t seq) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%s%06" PRId64, kVersionPrefix, seq);
  return buf;
}

std::vector<std::pair<int64_t, std::string>> list_versions(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::string name = e.path().filename().string();
    int64_t seq = version_seq(name);
    if (seq >= 0 && e.is_directory()) out.emplace_back(seq, name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Resolves `dir` to the directory of its current version; nullopt when there is none.
std::optional<std::string> resolve_version(const std::string& dir) {
  if (fs::exists(fs::path(dir) / kStateFile)) return dir;  // dir is one version's directory
  const fs::path latest = fs::path(dir) / "latest";
  if (fs::exists(latest)) {
    std::string name = read_file(latest.string());
    while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' ')) name.pop_back();
    if (version_seq(name) < 0) {
      throw CheckpointError("checkpoint " + dir + ": 'latest' holds '" + name + "', not a version name");
    }
    std::string path = (fs::path(dir) / name).string();
    if (!fs::is_directory(path)) {
      throw CheckpointError("checkpoint " + dir + ": 'latest' names " + name + ", which does not exist");
    }
    return path;
  }
  // No pointer (removed by hand?): every version directory is complete once renamed into place.
  auto versions = list_versions(dir);
  if (versions.empty()) return std::nullopt;
  return (fs::path(dir) / versions.back().second).string();
}

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
  for (const auto& t : model_tensors(model)) dict.insert(t.name, t.tensor.detach());
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

std::string optimizer_bytes(torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream os;
  archive.save_to(os);
  return os.str();
}

void load_optimizer(const std::string& bytes, torch::optim::Optimizer& optimizer) {
  torch::serialize::InputArchive archive;
  archive.load_from(bytes.data(), bytes.size());
  optimizer.load(archive);
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

// Byte strings by name, packed into one string for a single broadcast.
using Blobs = std::map<std::string, std::string>;

void put_u64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

std::string pack(const Blobs& blobs) {
  std::string out;
  for (const auto& [name, data] : blobs) {
    put_u64(out, name.size());
    out += name;
    put_u64(out, data.size());
    out += data;
  }
  return out;
}

Blobs unpack(const std::string& in) {
  Blobs out;
  size_t pos = 0;
  auto get_u64 = [&]() {
    if (in.size() - pos < 8) throw CheckpointError("corrupt checkpoint message from rank 0");
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(in[pos + i])) << (8 * i);
    pos += 8;
    return v;
  };
  auto get_str = [&]() {
    uint64_t n = get_u64();
    if (in.size() - pos < n) throw CheckpointError("corrupt checkpoint message from rank 0");
    std::string s = in.substr(pos, n);
    pos += n;
    return s;
  };
  while (pos < in.size()) {
    std::string name = get_str();
    out[name] = get_str();
  }
  return out;
}

// ---- save on rank 0 -----------------------------------------------------------------------------

// Removes `names` from dir; a leftover only costs space, so say so and go on.
void remove_entries(const std::string& dir, const std::vector<std::string>& names) {
  for (const auto& name : names) {
    std::error_code rec;
    fs::remove_all(fs::path(dir) / name, rec);
    if (rec) chorus::log(LogLevel::kWarning, "checkpoint " + dir + ": cannot remove " + name + ": " + rec.message());
  }
}

// Temporary directories and files left by writers killed mid-save. One job writes to a directory
// at a time, so any found before this writer starts are leftovers.
void sweep_temporaries(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::string name = e.path().filename().string();
    if (name.compare(0, std::strlen(kTmpPrefix), kTmpPrefix) == 0) names.push_back(name);
  }
  remove_entries(dir, names);
}

void prune(const std::string& dir, const std::string& current, int keep_last) {
  std::vector<std::string> remove;
  auto versions = list_versions(dir);
  const size_t keep = static_cast<size_t>(std::max(1, keep_last));
  for (size_t i = 0; i + keep < versions.size(); ++i) {
    if (versions[i].second != current) remove.push_back(versions[i].second);
  }
  remove_entries(dir, remove);
  sweep_temporaries(dir);
}

void create_dir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir)) {
    throw CheckpointError("cannot create checkpoint directory " + dir + ": " +
                          (ec ? ec.message() : std::string("not a directory")));
  }
}

// Creates dir (and parents) and checks that a file can be created in it; throws CheckpointError.
void make_writable_dir(const std::string& dir) {
  create_dir(dir);
  const std::string probe = (fs::path(dir) / (std::string(kTmpPrefix) + "probe-" + random_token().substr(0, 12))).string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) throw CheckpointError(sys_error("checkpoint directory is not writable: cannot create", probe));
  ::close(fd);
  ::unlink(probe.c_str());
}

void write_version(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                   const CheckpointState& state, const std::vector<std::string>& rng_states, int world,
                   const CheckpointOptions& options) {
  create_dir(dir);
  sweep_temporaries(dir);
  int64_t seq = 1;
  auto versions = list_versions(dir);
  if (!versions.empty()) seq = versions.back().first + 1;
  const std::string name = version_name(seq);
  const std::string tmp = (fs::path(dir) / (kTmpPrefix + name + "-" + random_token().substr(0, 12))).string();
  if (::mkdir(tmp.c_str(), 0755) != 0) throw CheckpointError(sys_error("cannot create", tmp));

  auto hook = [&](const std::string& stage) {
    if (options.on_save_step) options.on_save_step(stage);
  };
  json files = json::object();
  auto write = [&](const char* file, const std::string& bytes) {
    write_file((fs::path(tmp) / file).string(), bytes.data(), bytes.size(), options.fsync);
    files[file] = {{"bytes", bytes.size()}, {"fnv1a64", checksum(bytes)}};
    hook(file);
  };
  write(kModelFile, model_bytes(model));
  if (optimizer != nullptr) write(kOptimizerFile, optimizer_bytes(*optimizer));
  if (!rng_states.empty()) write(kRngFile, rng_bytes(rng_states));

  // state.json last: it is also the manifest of the files above.
  json doc = {{"format", kFormat},
              {"format_version", kFormatVersion},
              {"epoch", state.epoch},
              {"step", state.step},
              {"extra", state.extra},
              {"world_size", world},
              {"created_unix", static_cast<int64_t>(::time(nullptr))},
              {"files", files}};
  const std::string text = doc.dump(2) + "\n";
  write_file((fs::path(tmp) / kStateFile).string(), text.data(), text.size(), options.fsync);
  hook(kStateFile);
  if (options.fsync) fsync_path(tmp, true);

  const std::string final_path = (fs::path(dir) / name).string();
  if (::rename(tmp.c_str(), final_path.c_str()) != 0) {
    throw CheckpointError(sys_error("cannot rename " + tmp + " to", final_path) +
                          " (is another job writing to the same checkpoint directory?)");
  }
  if (options.fsync) fsync_path(dir, true);
  hook("version");

  const std::string latest_tmp = (fs::path(dir) / (std::string(kTmpPrefix) + "latest-" + random_token().substr(0, 12))).string();
  const std::string line = name + "\n";
  write_file(latest_tmp, line.data(), line.size(), options.fsync);
  const std::string latest = (fs::path(dir) / "latest").string();
  if (::rename(latest_tmp.c_str(), latest.c_str()) != 0) throw CheckpointError(sys_error("cannot replace", latest));
  if (options.fsync) fsync_path(dir, true);
  hook("latest");

  prune(dir, name, options.keep_last);
}

// ---- load on rank 0 -----------------------------------------------------------------------------

// Reads and verifies the current version: its files by name plus "state.json". Empty when none.
Blobs read_version(const std::string& dir) {
  std::optional<std::string> path = resolve_version(dir);
  if (!path) return {};
  Blobs blobs;
  blobs[kStateFile] = read_file((fs::path(*path) / kStateFile).string());
  json doc;
  try {
    doc = json::parse(blobs[kStateFile]);
  } catch (const std::exception& e) {
    throw CheckpointError("checkpoint " + *path + ": state.json is not valid JSON: " + e.what());
  }
  if (doc.value("format", "") != kFormat) throw CheckpointError("checkpoint " + *path + ": state.json is not a chorus checkpoint");
  if (doc.value("format_version", 0) > kFormatVersion) {
    throw CheckpointError("checkpoint " + *path + ": format version " + std::to_string(doc.value("format_version", 0)) +
                          " is newer than this chorus reads (" + std::to_string(kFormatVersion) + ")");
  }
  for (const auto& [file, meta] : doc.at("files").items()) {
    // Only files of this version: a name with a '/' could reach any file (a device that never
    // ends, a file of another user's), none of which save_checkpoint wrote.
    if (file.empty() || file == "." || file == ".." || file == kStateFile || file.find('/') != std::string::npos) {
      throw CheckpointError("checkpoint " + *path + ": state.json lists '" + file +
                            "', which is not a file name of this version (damaged or hand-edited manifest)");
    }
    std::string bytes = read_file((fs::path(*path) / file).string());
    const size_t want = meta.at("bytes").get<size_t>();
    if (bytes.size() != want || checksum(bytes) != meta.at("fnv1a64").get<std::string>()) {
      throw CheckpointError("checkpoint " + *path + ": " + file + " is damaged (" + std::to_string(bytes.size()) +
                            " bytes, manifest says " + std::to_string(want) + ", or its checksum differs)");
    }
    blobs[file] = std::move(bytes);
  }
  return blobs;
}

CheckpointState parse_state(const std::string& text) {
  json doc = json::parse(text);
  CheckpointState st;
  st.epoch = doc.at("epoch").get<int64_t>();
  st.step = doc.at("step").get<int64_t>();
  st.extra = doc.value("extra", std::map<std::string, std::string>{});
  return st;
}

// What rank 0 tells the others: "ok", "none" or "error".
constexpr const char* kStatus = "\x01status";
constexpr const char* kMessage = "\x01message";

}  // namespace

std::optional<std::string> latest_checkpoint(const std::string& dir) { return resolve_version(dir); }

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
      make_writable_dir(dir);
      sweep_temporaries(dir);
      std::optional<std::string> current = resolve_version(dir);
      verdict = current ? "ok" + read_file((fs::path(*current) / kStateFile).string()) : "none";
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
    return parse_state(verdict.substr(2));
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
    Blobs blobs;
    try {
      if (fs::is_directory(dir) && !fs::exists(fs::path(dir) / kStateFile)) sweep_temporaries(dir);
      blobs = read_version(dir);
      blobs[kStatus] = blobs.empty() ? "none" : "ok";
    } catch (const std::exception& e) {
      blobs = {{kStatus, "error"}, {kMessage, e.what()}};
    }
    message = pack(blobs);
  }
  if (group) message = dist::broadcast_object(message, 0, group);
  Blobs blobs = unpack(message);
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
    st = parse_state(blobs.at(kStateFile));
    load_model(blobs.at(kModelFile), model);
    if (optimizer != nullptr) {
      auto it = blobs.find(kOptimizerFile);
      if (it == blobs.end()) {
        throw CheckpointError("the checkpoint holds no optimizer state (saved with optimizer == nullptr); "
                              "pass nullptr to load it without one");
      }
      load_optimizer(it->second, *optimizer);
    }
    if (auto it = blobs.find(kRngFile); it != blobs.end()) load_rng(it->second, rank);
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

CheckpointFiles read_checkpoint_files(const std::string& dir) { return read_version(dir); }
CheckpointFiles unpack_checkpoint_message(const std::string& message) { return unpack(message); }
CheckpointState parse_checkpoint_state(const std::string& state_json) { return parse_state(state_json); }
void load_checkpoint_model(const std::string& model_pt, torch::nn::Module& model) { load_model(model_pt, model); }
void load_checkpoint_rng(const std::string& rng_pt, int rank) { load_rng(rng_pt, rank); }

}  // namespace detail

}  // namespace chorus::train
