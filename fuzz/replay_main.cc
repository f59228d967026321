// The corpus replayer: the main of every fuzz target in the ordinary (gcc) build. Feeds each file
// of the given files and directories (recursively) to LLVMFuzzerTestOneInput, once, so that `make
// test` checks every seed and every crash regression input without clang or libFuzzer.
// Usage: fuzz_<target>_replay PATH...
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

namespace fs = std::filesystem;

std::string g_current;  // the input being replayed, named when it escapes with an exception

[[noreturn]] void on_terminate() {
  std::fprintf(stderr, "uncaught exception while replaying %s\n", g_current.c_str());
  std::abort();
}

std::vector<uint8_t> read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR_OR_FILE...\n", argv[0]);
    return 2;
  }
  std::vector<fs::path> files;
  for (int i = 1; i < argc; ++i) {
    const fs::path arg(argv[i]);
    if (fs::is_directory(arg)) {
      for (const auto& e : fs::recursive_directory_iterator(arg)) {
        if (e.is_regular_file()) files.push_back(e.path());
      }
    } else if (fs::is_regular_file(arg)) {
      files.push_back(arg);
    } else {
      std::fprintf(stderr, "%s: no such file or directory\n", argv[i]);
      return 2;
    }
  }
  if (files.empty()) {
    std::fprintf(stderr, "no corpus files under the given paths\n");
    return 2;
  }
  std::set_terminate(on_terminate);
  for (const auto& f : files) {
    g_current = f.string();
    const std::vector<uint8_t> bytes = read_all(f);
    // An empty vector's data() may be null; libFuzzer passes a valid pointer with size 0.
    static const uint8_t kEmpty = 0;
    LLVMFuzzerTestOneInput(bytes.empty() ? &kEmpty : bytes.data(), bytes.size());
  }
  std::printf("replayed %zu inputs\n", files.size());
  return 0;
}
