#include "chorus/models/state_dict.h"

#include "pickle_reader.h"

#include <torch/nn/module.h>
#include <torch/serialize.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>

namespace chorus::models {
namespace {

void collect(const torch::nn::Module& module, const std::string& prefix, StateDict& out) {
  for (const auto& p : module.named_parameters(/*recurse=*/false)) {
    if (p.value().defined()) out.emplace_back(prefix + p.key(), p.value().detach());
  }
  for (const auto& b : module.named_buffers(/*recurse=*/false)) {
    if (b.value().defined()) out.emplace_back(prefix + b.key(), b.value().detach());
  }
  for (const auto& child : module.named_children()) collect(*child.value(), prefix + child.key() + ".", out);
}

std::string shape(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

// "2 missing keys: a, b"
std::string list(const char* what, const std::vector<std::string>& names) {
  const size_t n = names.size();
  std::string out = std::to_string(n) + " " + what + (n == 1 ? " key: " : " keys: ");
  for (size_t i = 0; i < names.size(); ++i) out += (i ? ", " : "") + names[i];
  return out;
}

LoadResult load(torch::nn::Module& module, const StateDict& state, const LoadOptions& options,
                const std::string& source) {
  std::map<std::string, const at::Tensor*> given;
  for (const auto& [key, tensor] : state) given[key] = &tensor;
  StateDict targets = state_dict(module);
  std::map<std::string, bool> known;
  LoadResult result;
  std::vector<std::string> misshaped;
  for (const auto& [key, tensor] : targets) {
    known[key] = true;
    auto it = given.find(key);
    if (it == given.end()) {
      result.missing.push_back(key);
    } else if (!it->second->sizes().equals(tensor.sizes())) {
      misshaped.push_back(key + " (state dict " + shape(*it->second) + ", model " + shape(tensor) + ")");
    }
  }
  for (const auto& [key, tensor] : state) {
    if (!known.count(key)) result.unexpected.push_back(key);
  }
  const bool strict_failure = options.strict && (!result.missing.empty() || !result.unexpected.empty());
  if (strict_failure || !misshaped.empty()) {
    std::string msg = "load_state_dict (" + std::string(options.strict ? "strict" : "non-strict") + ") from " +
                      source + ": the state dict does not fit the model:";
    std::string sep = " ";
    if (options.strict && !result.missing.empty()) {
      msg += sep + list("missing", result.missing);
      sep = "; ";
    }
    if (options.strict && !result.unexpected.empty()) {
      msg += sep + list("unexpected", result.unexpected);
      sep = "; ";
    }
    if (!misshaped.empty()) msg += sep + list("mis-shaped", misshaped);
    msg += ". Fix: build the model as the state dict's was (e.g. depth, in_channels, num_classes, then "
           "replace_head after loading) or drop those keys from the state dict";
    if (strict_failure) msg += "; LoadOptions::strict = false loads the keys both have and skips the rest";
    throw StateDictError(msg);
  }
  torch::NoGradGuard no_grad;
  for (auto& [key, tensor] : targets) {
    auto it = given.find(key);
    if (it != given.end()) tensor.copy_(*it->second);
  }
  return result;
}

}  // namespace

StateDict state_dict(const torch::nn::Module& module) {
  StateDict out;
  collect(module, "", out);
  return out;
}

LoadResult load_state_dict(torch::nn::Module& module, const StateDict& state, const LoadOptions& options) {
  return load(module, state, options, "a StateDict");
}

LoadResult load_state_dict(torch::nn::Module& module, const std::string& path, const LoadOptions& options) {
  return load(module, read_state_dict(path), options, path);
}

StateDict read_state_dict(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw StateDictError("read_state_dict: cannot open " + path + ": " + std::strerror(errno));
  char magic[4] = {};
  in.read(magic, sizeof magic);
  if (in.gcount() != 4 || std::memcmp(magic, "PK\x03\x04", 4) != 0) {
    throw StateDictError("read_state_dict: " + path +
                         " is not in torch.save's zip format (PyTorch >= 1.6); re-save it in Python with "
                         "torch.save(model.state_dict(), f) without _use_new_zipfile_serialization=False");
  }
  return detail::read_torch_save_dict(path);
}

void save_state_dict(const StateDict& state, const std::string& path) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& [key, tensor] : state) {
    if (dict.contains(key)) throw StateDictError("save_state_dict: key " + key + " appears twice");
    dict.insert(key, tensor.detach());
  }
  const std::vector<char> bytes = torch::pickle_save(dict);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) {
      std::remove(tmp.c_str());
      throw StateDictError("save_state_dict: cannot write " + tmp + ": " + std::strerror(errno));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    throw StateDictError("save_state_dict: cannot rename " + tmp + " to " + path + ": " + std::strerror(err));
  }
}

void save_state_dict(const torch::nn::Module& module, const std::string& path) {
  save_state_dict(state_dict(module), path);
}

}  // namespace chorus::models
