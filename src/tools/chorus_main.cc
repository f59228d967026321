// The `chorus` command: `chorus bench ...` (and, later, `chorus run ...`).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

#include "bench.h"
#include "chorus/config.h"

int main(int argc, char** argv) {
  CLI::App app{"chorus: distributed data-parallel training for libtorch"};
  app.set_version_flag("--version", std::string(CHORUS_VERSION));
  app.require_subcommand(1);
  chorus::tools::BenchArgs bench;
  CLI::App* b = app.add_subcommand("bench", "measure a collective on W local ranks");
  chorus::tools::add_bench_options(*b, bench);
  CLI11_PARSE(app, argc, argv);
  try {
    if (b->parsed()) return chorus::tools::run_bench(bench);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "chorus: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
