// Internal: the readers inside checkpoint.cc, for fuzz/checkpoint.cc. They read what comes from
// disk (a version's state.json manifest and its files) and from rank 0 (the packed message every
// rank unpacks); load_checkpoint is their only other caller. Each throws CheckpointError, or the
// JSON or libtorch error it meets, which load_checkpoint turns into CheckpointError.
#pragma once

#include <map>
#include <string>

#include "chorus/train/checkpoint.h"

namespace torch::nn {
class Module;
}

namespace chorus::train::detail {

// Files by name, as rank 0 reads a version and broadcasts it.
using CheckpointFiles = std::map<std::string, std::string>;

// The current version of `dir` (or `dir` itself when it holds state.json): state.json and every
// file its manifest lists, each checked against its size and checksum. Empty when there is none.
CheckpointFiles read_checkpoint_files(const std::string& dir);
// What the other ranks make of rank 0's message (the files packed as u64 length + bytes pairs).
CheckpointFiles unpack_checkpoint_message(const std::string& message);
// state.json's epoch, step and extra.
CheckpointState parse_checkpoint_state(const std::string& state_json);
// model.pt's dict of tensors into `model` (every name, shape and dtype must match).
void load_checkpoint_model(const std::string& model_pt, torch::nn::Module& model);
// rng.pt's list of generator states: `rank`'s (modulo their number) becomes the CPU generator's.
void load_checkpoint_rng(const std::string& rng_pt, int rank);

}  // namespace chorus::train::detail
