// Fuzz helpers for parsers that read files: a private directory for the process, and the input
// written to a file in it.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace chorus_fuzz {

// A directory of this process's own, made once (removed by nobody: it holds one small file per
// name, rewritten by every input).
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base != nullptr && base[0] != '\0' ? base : "/tmp") + "/chorus-fuzz-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) std::abort();
    return tmpl;
  }();
  return dir;
}

// Writes [data, data + size) to scratch_dir()/name and returns its path.
inline std::string write_input(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = scratch_dir() + "/" + name;
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  return path;
}

}  // namespace chorus_fuzz
