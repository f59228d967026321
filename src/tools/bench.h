// `chorus bench`: collective benchmark on W local ranks (forked by the command itself).
#pragma once

#include <CLI/CLI.hpp>

#include <string>

namespace chorus::tools {

struct BenchArgs {
  std::string op = "allreduce";
  int world_size = 2;
  std::string transport = "tcp";
  int hosts = 1;  // simulated hosts (ranks split evenly), for hybrid and auto
  std::string sizes = "4K,64K,1M,16M,64M";
  std::string dtype = "f32";
  int iters = 0;           // 0 = calibrate to about `seconds` per size
  int warmup = 5;
  double seconds = 1.0;
  bool check = false;
  std::string json;
  double timeout_s = 60;
  size_t segment_bytes = 1 << 20;
  std::string allreduce_algorithm = "auto";
  double link_latency_us = 0;   // 0 = the library's measured default
  double link_gbit_per_s = 0;
  int socket_buffer = 0;
  int spin_us = -1;   // -1 = the library's default
  bool quiet = false;
  bool launched = false;  // one rank of a job a launcher started (chorus run ...): env:// gives rank and size
};

void add_bench_options(CLI::App& app, BenchArgs& args);
int run_bench(const BenchArgs& args);

// "4K" -> 4096, "1M" -> 1048576, "512" -> 512; throws UsageError otherwise.
size_t parse_size(const std::string& text);

}  // namespace chorus::tools
