// Fuzz helpers for parsers that read files: a private directory for the process, and the input
// written to a file in it.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace chorus_fuzz {

// A directory of this process's own, made once, holding one small file per name (rewritten by
// every input), and removed with what is in it when the process exits normally (a replay test
// leaves nothing behind; a crash leaves it for a look).
inline const std::string& scratch_dir() {
  struct Dir {
    std::string path;
    Dir() {
      const char* base = std::getenv("TMPDIR");
      path = std::string(base != nullptr && base[0] != '\0' ? base : "/tmp") + "/chorus-fuzz-XXXXXX";
      if (mkdtemp(path.data()) == nullptr) std::abort();
    }
    ~Dir() {
      std::error_code ignored;
      std::filesystem::remove_all(path, ignored);
    }
  };
  static const Dir dir;
  return dir.path;
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
