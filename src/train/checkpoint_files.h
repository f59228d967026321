// Internal to chorus_train: a checkpoint directory's files, without libtorch (checkpoint_files.cc).
// checkpoint.cc serializes the model, the optimizer and the RNG states and decides which rank reads,
// writes and broadcasts; these write, read and checksum the files, name and list the versions,
// sweep the temporaries of a killed writer, prune old versions, read and verify the current
// version, and pack its files into one message. Layout and format: docs/checkpoint.md. Errors are
// CheckpointErrors that name the path and the system's error text.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "chorus/train/checkpoint.h"

namespace chorus::train::ckpt {

inline constexpr const char* kFormat = "chorus-checkpoint";
inline constexpr int kFormatVersion = 1;
inline constexpr const char* kVersionPrefix = "ckpt-";
inline constexpr const char* kTmpPrefix = ".tmp-";
inline constexpr const char* kModelFile = "model.pt";
inline constexpr const char* kOptimizerFile = "optimizer.pt";
inline constexpr const char* kRngFile = "rng.pt";
inline constexpr const char* kStateFile = "state.json";

// "<what> <path>: <strerror(errno)>".
std::string sys_error(const std::string& what, const std::string& path);

void fsync_path(const std::string& path, bool directory);
// Writes a new file (it must not exist) and, when sync is set, fsyncs it before closing.
void write_file(const std::string& path, const void* data, size_t size, bool sync);
std::string read_file(const std::string& path);
// FNV-1a, 64 bit, as 16 hex digits: catches truncated or damaged files; not a defence against tampering.
std::string checksum(const std::string& data);

// "ckpt-000007" for 7.
std::string version_name(int64_t seq);
// The version directories of `dir` as (sequence number, name), oldest first.
std::vector<std::pair<int64_t, std::string>> list_versions(const std::string& dir);
// Resolves `dir` to the directory of its current version; nullopt when there is none.
std::optional<std::string> resolve_version(const std::string& dir);

// Temporary directories and files left by writers killed mid-save (one job writes to a directory
// at a time, so any found before this writer starts are leftovers).
void sweep_temporaries(const std::string& dir);
// Removes all but the newest keep_last versions (never `current`), then the temporaries.
void prune(const std::string& dir, const std::string& current, int keep_last);
void create_dir(const std::string& dir);
// Creates dir (and parents) and checks that a file can be created in it.
void make_writable_dir(const std::string& dir);

// Byte strings by name, packed into one string (u64 length + bytes pairs) for a single broadcast.
using Blobs = std::map<std::string, std::string>;
std::string pack(const Blobs& blobs);
Blobs unpack(const std::string& in);

// Reads and verifies the current version: its files by name plus "state.json". Empty when none.
Blobs read_version(const std::string& dir);
// state.json's epoch, step and extra.
CheckpointState parse_state(const std::string& text);

}  // namespace chorus::train::ckpt
