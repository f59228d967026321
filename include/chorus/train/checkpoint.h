// Checkpoints for data-parallel training: save and resume model, optimizer, progress and RNG state.
//
//   chorus::train::CheckpointState state{epoch, step, {}};
//   chorus::train::save_checkpoint("ckpt/run1", *model, &optimizer, state);     // every rank
//   ...
//   if (auto st = chorus::train::load_checkpoint("ckpt/run1", *model, &optimizer)) {
//     start_epoch = st->epoch;                                                  // resumed
//   }
//
// Contract:
// - Both calls are collective over the group (every rank calls them, in the same order relative to
//   other collectives). With no group given and chorus::dist not initialised, they run as a single
//   process and communicate with no one.
// - save_checkpoint: rank 0 writes; the other ranks wait for it and contribute only their RNG
//   state. The write is atomic: a new version is written into a temporary directory, every file
//   and directory is fsynced, the directory is renamed into place, and only then the `latest`
//   pointer is replaced (write, fsync, rename, fsync of the directory). A writer killed at any
//   point leaves the previous checkpoint current and intact. An error on rank 0 (disk full,
//   permissions) is raised as CheckpointError on every rank, so no rank is left waiting.
// - load_checkpoint: rank 0 reads and verifies the files (sizes and checksums from the manifest)
//   and broadcasts their bytes, so the other ranks need not see the same filesystem. Every rank
//   then copies the values into its model and optimizer and restores its RNG state; if that fails
//   on any rank, every rank raises CheckpointError. Returns nullopt (on every rank) when the
//   directory holds no checkpoint yet.
// - The model is matched by parameter and buffer names, which carry no `module.` prefix (pass the
//   wrapped module, e.g. *ddp.module()). Names, shapes and dtypes must match exactly; otherwise
//   CheckpointError lists the differences. model.pt is a dict {name: tensor} that Python's
//   torch.load reads and nn.Module.load_state_dict accepts as is.
// - The optimizer's per-parameter state (momentum buffers, step counts) is restored by parameter
//   position; its hyper-parameters (learning rate, ...) come from the code, not the checkpoint.
// - RNG: each rank's default CPU generator state is saved and restored per rank. Loading at another
//   world size gives rank r the state saved by rank r % saved_world_size.
// - One job writes to a directory at a time. Older versions beyond keep_last are pruned after a
//   successful save. Temporary directories left by killed writers are removed by the next save
//   (before it writes), the next load and prepare_checkpoint_dir.
// - Timeouts are the group's operation timeout: the other ranks wait at most that long for rank 0.
//
// The on-disk format is described in docs/checkpoint.md.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>

#include "chorus/comm/error.h"
#include "chorus/comm/process_group.h"

namespace torch {
namespace nn {
class Module;
}
namespace optim {
class Optimizer;
}
}  // namespace torch

namespace chorus::train {

// Progress saved alongside the tensors. `extra` holds any user key/values (strings).
struct CheckpointState {
  int64_t epoch = 0;
  int64_t step = 0;
  std::map<std::string, std::string> extra;
};

struct CheckpointOptions {
  ProcessGroup* group = nullptr;  // nullptr = chorus::dist's default group, or none if uninitialised
  int keep_last = 2;              // complete versions kept on disk (>= 1)
  bool save_rng = true;           // save every rank's CPU generator state (restored when present)
  bool fsync = true;              // false skips fsync (tests on tmpfs); atomicity against crashes of
                                  // the process remains, durability across power loss does not
  // For tests: called on the writer at each step of a save, to kill it there. With a file's name
  // ("model.pt", "optimizer.pt", "rng.pt", "state.json") once that file is written and synced in
  // the temporary directory; with "version" once the directory has been renamed into place, just
  // before `latest` is replaced; with "latest" once it has been.
  std::function<void(const std::string& step)> on_save_step;
};

class CheckpointError : public Error {
 public:
  using Error::Error;
};

// Collective. Writes a new version of the checkpoint in `dir` (created if missing). optimizer may
// be nullptr.
void save_checkpoint(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                     const CheckpointState& state, const CheckpointOptions& options = {});

// Collective. Loads the current version in `dir` (or `dir` itself when it is one version's
// directory) into model and optimizer (may be nullptr: its saved state is then ignored). Returns
// nullopt when there is no checkpoint.
std::optional<CheckpointState> load_checkpoint(const std::string& dir, torch::nn::Module& model,
                                               torch::optim::Optimizer* optimizer,
                                               const CheckpointOptions& options = {});

// Collective. Readies `dir` for this job's saves before training, so problems show at the start
// rather than at the first save: rank 0 creates it, checks that it can create files there, and
// removes temporary directories left by killed writers. Returns the current version's state when
// `dir` already holds a checkpoint (nullopt when not), so a job can refuse to replace one it did
// not resume from. Throws CheckpointError on every rank, naming the directory and the system error.
std::optional<CheckpointState> prepare_checkpoint_dir(const std::string& dir, const CheckpointOptions& options = {});

// Local, no communication: whether `dir` holds a checkpoint, and the path of its current version.
std::optional<std::string> latest_checkpoint(const std::string& dir);

}  // namespace chorus::train
