// A checkpoint directory's files, without libtorch (checkpoint_files.h): writing a file whole and
// fsynced, reading one, checksums, the numbered versions and the `latest` pointer, the sweep of a
// killed writer's temporaries and the pruning of old versions, reading and verifying the current
// version against its manifest, and the packing of its files into rank 0's one broadcast.
#include "checkpoint_files.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "chorus/comm/files.h"
#include "chorus/comm/hash.h"
#include "chorus/comm/log.h"
#include "chorus/comm/random.h"

namespace chorus::train::ckpt {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

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

void put_u64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// Removes `names` from dir; a leftover only costs space, so say so and go on.
void remove_entries(const std::string& dir, const std::vector<std::string>& names) {
  for (const auto& name : names) {
    std::error_code rec;
    remove_tree((fs::path(dir) / name).string(), rec);
    if (rec) chorus::log(LogLevel::kWarning, "checkpoint " + dir + ": cannot remove " + name + ": " + rec.message());
  }
}

}  // namespace

std::string sys_error(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

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

std::string checksum(const std::string& data) {
  char out[17];
  std::snprintf(out, sizeof(out), "%016" PRIx64, fnv1a64(data));
  return out;
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

void make_writable_dir(const std::string& dir) {
  create_dir(dir);
  const std::string probe = (fs::path(dir) / (std::string(kTmpPrefix) + "probe-" + random_token().substr(0, 12))).string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) throw CheckpointError(sys_error("checkpoint directory is not writable: cannot create", probe));
  ::close(fd);
  ::unlink(probe.c_str());
}

// An integer of state.json. nlohmann turns a JSON float into an integer with a C++ cast, which is
// undefined behaviour out of range (format_version 1.2e51: found by fuzz_checkpoint, regression
// input fuzz/corpus/checkpoint/regression-float-format-version).
static int64_t json_int(const json& v, const std::string& what) {
  if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t{INT64_MAX})) {
    throw CheckpointError("state.json: " + what + " is " + v.dump() + ", not an integer (damaged or hand-edited)");
  }
  return v.get<int64_t>();
}

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
  const int64_t version = doc.contains("format_version") ? json_int(doc["format_version"], "format_version") : 0;
  if (version > kFormatVersion) {
    throw CheckpointError("checkpoint " + *path + ": format version " + std::to_string(version) +
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
    const int64_t want_bytes = json_int(meta.at("bytes"), file + "'s bytes");
    if (want_bytes < 0) throw CheckpointError("checkpoint " + *path + ": state.json gives " + file + " a negative size");
    const size_t want = static_cast<size_t>(want_bytes);
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
  st.epoch = json_int(doc.at("epoch"), "epoch");
  st.step = json_int(doc.at("step"), "step");
  st.extra = doc.value("extra", std::map<std::string, std::string>{});
  return st;
}

}  // namespace chorus::train::ckpt
