// Internal: reads the dict of tensors in a torch.save zip archive (docs/models.md, "Reading
// torch.save files"). libtorch 1.13's own unpickler (torch::pickle_load) turns every
// collections.OrderedDict into None, and a state_dict is one, so chorus reads the archive itself:
// the zip through caffe2's PyTorchStreamReader, data.pkl through the small pickle machine here,
// which knows exactly what torch.save writes for a dict of tensors and refuses anything else.
#pragma once

#include <string>

#include "chorus/models/state_dict.h"

namespace chorus::models::detail {

// The dict's (key, tensor) pairs in the pickle's order. Throws StateDictError naming `path`.
StateDict read_torch_save_dict(const std::string& path);

}  // namespace chorus::models::detail
