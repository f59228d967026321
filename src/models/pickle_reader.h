// Internal: reads the dict of tensors in a torch.save zip archive (docs/models.md, "Reading
// torch.save files"). libtorch 1.13's own unpickler (torch::pickle_load) turns every
// collections.OrderedDict into None, and a state_dict is one, so chorus reads the archive itself:
// the zip through caffe2's PyTorchStreamReader, data.pkl through the small pickle machine here,
// which knows exactly what torch.save writes for a dict of tensors and refuses anything else.
#pragma once

#include <cstddef>
#include <string>

#include "chorus/models/state_dict.h"

namespace caffe2::serialize {
class PyTorchStreamReader;
}

namespace chorus::models::detail {

// The dict's (key, tensor) pairs in the pickle's order. Throws StateDictError naming `path`.
StateDict read_torch_save_dict(const std::string& path);

// The same from an archive already open: `pickle` holds its data.pkl (size bytes), whose storages
// are read from the archive's data/<key> records; `path` names it in errors. (fuzz/pickle.cc feeds
// it pickles against a fixed archive.)
StateDict read_pickled_dict(const std::string& path, caffe2::serialize::PyTorchStreamReader& archive,
                            const char* pickle, size_t size);

}  // namespace chorus::models::detail
