// The command-line options every example shares, spelled once: the Accelerator's (--seed,
// --max-steps, --run-name, --resume, --overwrite and, where the example runs on GPUs, --device and
// --mixed-precision), --nproc, and how main() ends (parse, then run_job). Each example adds its own
// options (data, model, schedule) to the same CLI::App first.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>

#include "chorus/train/accelerator.h"

namespace examples {

struct RunOptions {
  chorus::train::AcceleratorOptions accelerator;  // set run_name and seed's defaults before adding
  int nproc = 0;                                  // start this many local ranks (no launcher)
  std::string precision = "no";                   // --mixed-precision, applied by parse_and_run
};

// `seed_help` says what the seed seeds; `run_dir_help` what runs/NAME holds. `devices`: also
// --device and --mixed-precision.
inline void add_run_options(CLI::App& app, RunOptions& r, const std::string& seed_help, const std::string& run_dir_help,
                            bool devices) {
  chorus::train::AcceleratorOptions& o = r.accelerator;
  app.add_option("--seed", o.seed, seed_help);
  app.add_option("--max-steps", o.max_steps, "stop after this many optimizer steps (0: no limit)");
  app.add_option("--run-name", o.run_name, run_dir_help)->capture_default_str();
  app.add_option("--nproc", r.nproc, "start this many local ranks (when no launcher started this process)")
      ->check(CLI::Range(0, 256));
  if (devices) {
    app.add_option("--device", o.device, "cpu, cuda (cuda:LOCAL_RANK) or cuda:N")->capture_default_str();
    app.add_option("--mixed-precision", r.precision, "no, bf16, or fp16 (CUDA)")
        ->check(CLI::IsMember({"no", "bf16", "fp16"}));
  }
  auto* resume = app.add_flag("--resume", o.resume, "continue from the state saved in runs/NAME");
  app.add_flag("--overwrite", o.overwrite, "delete the state saved in runs/NAME and start afresh")->excludes(resume);
}

// The end of main(): parses the command line (status 0 after --help, 2 for a usage error), then
// runs `train` as one rank of the job (chorus::train::run_job, which reports an exception and
// gives the exit status), with --mixed-precision applied to the options.
inline int parse_and_run(CLI::App& app, int argc, char** argv, const char* program, RunOptions& r,
                         const std::function<void(const chorus::train::AcceleratorOptions&)>& train) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  return chorus::train::run_job(program, r.nproc, [&] {
    r.accelerator.mixed_precision = chorus::train::parse_mixed_precision(r.precision);
    train(r.accelerator);
  });
}

}  // namespace examples
