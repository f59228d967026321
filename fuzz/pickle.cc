// Fuzz target: chorus's reader of torch.save files (src/models/pickle_reader.h), what
// read_state_dict / load_state_dict(module, path) run on a file from Python.
// - An input starting with a zip header ("PK\3\4") is a whole torch.save file: written out and read
//   with read_state_dict (libtorch's zip reader, then chorus's pickle machine).
// - Any other input is a data.pkl, run by the pickle machine against a fixed archive whose records
//   data/0 ... data/15 hold 256 bytes each (the storages of the seeds' tensors fit).
// Every failure must be a StateDictError naming the file, and a tensor read must lie inside its
// storage.
#include <caffe2/serialize/inline_container.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>

#include "chorus/models/state_dict.h"
#include "fuzz_files.h"
#include "fuzz_torch.h"
#include "models/pickle_reader.h"

namespace models = chorus::models;

namespace {

// The archive's bytes and a reader over them, made once.
caffe2::serialize::PyTorchStreamReader& fixed_archive() {
  static std::string bytes = [] {
    std::string out;
    caffe2::serialize::PyTorchStreamWriter writer([&out](const void* p, size_t n) {
      out.append(static_cast<const char*>(p), n);
      return n;
    });
    std::string record(256, '\0');
    for (size_t i = 0; i < record.size(); ++i) record[i] = static_cast<char>(i);
    for (int k = 0; k < 16; ++k) writer.writeRecord("data/" + std::to_string(k), record.data(), record.size());
    writer.writeRecord("data.pkl", "N.", 2);
    writer.writeEndOfFile();
    return out;
  }();
  static std::istringstream stream(bytes);
  static caffe2::serialize::PyTorchStreamReader reader(&stream);
  return reader;
}

void check(const models::StateDict& dict) {
  for (const auto& [name, tensor] : dict) {
    if (!tensor.defined()) std::abort();
    // Reading every element must stay inside the storage (ASan sees it otherwise).
    (void)tensor.sum().item<double>();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  chorus_fuzz::cheap_torch_errors();
  try {
    if (size >= 4 && std::memcmp(data, "PK\x03\x04", 4) == 0) {
      const std::string path = chorus_fuzz::write_input("state_dict.pt", data, size);
      check(models::read_state_dict(path));
    } else {
      check(models::detail::read_pickled_dict("fuzz.pkl", fixed_archive(), reinterpret_cast<const char*>(data),
                                              size));
    }
  } catch (const models::StateDictError&) {
  }
  return 0;
}
