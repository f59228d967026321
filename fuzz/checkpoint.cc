// Fuzz target: what load_checkpoint reads (src/train/checkpoint_internal.h): state.json (the
// manifest: format, version, files with sizes and checksums; epoch, step, extra), model.pt (a
// pickled dict of tensors, through libtorch's unpickler, into a small fixed model), rng.pt (a
// pickled list of generator states), and the message rank 0 packs them into for the other ranks.
//
// Input: state.json | kSep | model.pt | kSep | rng.pt. The parts are also written as a version
// directory and read back as rank 0 reads one. Errors of any kind are what load_checkpoint turns
// into CheckpointError; what is looked for is a crash, a hang or a sanitizer report.
//
// The seeds are a real checkpoint of FuzzNet: with CHORUS_FUZZ_WRITE_CHECKPOINT=DIR set, the
// first input makes save_checkpoint write one into DIR (fuzz/corpus/README.md).
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <string>
#include <vector>

#include "fuzz_files.h"
#include "fuzz_torch.h"
#include "train/checkpoint_internal.h"

namespace {

const std::string kSep = "\x01PART\x01";

struct FuzzNetImpl : torch::nn::Module {
  FuzzNetImpl() {
    fc = register_module("fc", torch::nn::Linear(3, 2));
    bn = register_module("bn", torch::nn::BatchNorm1d(2));
  }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (parts.size() < 2) {
    const size_t at = text.find(kSep, start);
    if (at == std::string::npos) break;
    parts.push_back(text.substr(start, at - start));
    start = at + kSep.size();
  }
  parts.push_back(text.substr(start));
  parts.resize(3);
  return parts;
}

void write_seed_checkpoint(const char* dir) {
  FuzzNetImpl net;
  chorus::train::CheckpointState state;
  state.epoch = 3;
  state.step = 1234;
  state.extra["best_accuracy"] = "0.853";
  chorus::train::CheckpointOptions options;
  options.fsync = false;
  chorus::train::save_checkpoint(dir, net, nullptr, state, options);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  chorus_fuzz::cheap_torch_errors();
  static const bool seeded = [] {
    if (const char* dir = std::getenv("CHORUS_FUZZ_WRITE_CHECKPOINT")) write_seed_checkpoint(dir);
    return true;
  }();
  (void)seeded;
  static FuzzNetImpl net;
  namespace detail = chorus::train::detail;

  const std::string input(reinterpret_cast<const char*>(data), size);
  const std::vector<std::string> parts = split(input);
  try {
    (void)detail::parse_checkpoint_state(parts[0]);
  } catch (const std::exception&) {
  }
  try {
    (void)detail::unpack_checkpoint_message(input);
  } catch (const chorus::train::CheckpointError&) {
  }
  // As rank 0 reads a version directory: state.json's manifest names the files and their checksums.
  const std::string dir = chorus_fuzz::scratch_dir() + "/version";
  std::filesystem::create_directories(dir);
  const char* names[3] = {"state.json", "model.pt", "rng.pt"};
  for (int i = 0; i < 3; ++i) {
    chorus_fuzz::write_input(std::string("version/") + names[i], reinterpret_cast<const uint8_t*>(parts[i].data()),
                             parts[i].size());
  }
  try {
    (void)detail::read_checkpoint_files(dir);
  } catch (const std::exception&) {
  }
  try {
    detail::load_checkpoint_model(parts[1], net);
  } catch (const std::exception&) {
  }
  try {
    detail::load_checkpoint_rng(parts[2], 1);
  } catch (const std::exception&) {
  }
  return 0;
}
