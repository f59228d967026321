// Running a training function as one rank of a job, and the process settings a training loop
// wants: intra-op threads, glibc's malloc, whether stdout can show a progress bar. No libtorch in
// this header (src/train/run_job.cc and run_record.cc implement it).
#pragma once

#include <functional>

#include "chorus/comm/environment.h"

namespace chorus::train {

// Whether stdout shows a line rewritten in place: a terminal, not TERM=dumb, and not a rank of
// mpirun or srun (they relay a pseudo-terminal's output line by line into logs, where "\r" and
// escape codes arrive as garbage; a relay's variable counts when set, even to ""). The
// Accelerator's progress bar is drawn only then. Pure: decided from `env` and whether stdout is a
// terminal.
bool stdout_rewrites_in_place(const Environment& env, bool stdout_is_terminal);
// The same for this process: its environment (current_environment()) and isatty(1).
bool stdout_rewrites_in_place();

// Intra-op threads of this process: torch::set_num_threads, and OpenBLAS's own pool when OpenBLAS
// is the BLAS in use (Debian's libblas.so.3 alternative; it otherwise runs a thread per core, so
// two ranks on two cores would run four BLAS threads).
void set_num_threads(int threads);

// glibc's malloc set for a training loop: blocks up to 32 MiB come from the heap, not from a fresh
// mmap() each, and freed memory stays in the process (the top of the heap is given back to the
// kernel only beyond 1 GiB). With glibc's defaults a step's activations and gradients above the
// mmap threshold (128 KiB at first; it rises only when such a block is freed) are mapped afresh
// and unmapped every step, and every first touch of their pages is a page fault: ResNet-18 at 64 px
// trained 3-4x slower on this project's machine (docs/accelerator.md). Memory then stays at the
// loop's peak instead of falling between steps. Process-wide; the Accelerator calls it, with its
// snapshot of the environment, unless AcceleratorOptions::tune_malloc is false. Returns false and
// changes nothing when `env` has CHORUS_MALLOC_TUNING=0, or MALLOC_MMAP_THRESHOLD_ or
// MALLOC_TRIM_THRESHOLD_ set, even to "" (the user's own settings, which glibc read at startup,
// win); true when applied (again: idempotent).
bool tune_malloc_for_training(const Environment& env);
// The same with this process's environment (current_environment()).
bool tune_malloc_for_training();

// Runs `train` as one rank of a job and returns main()'s exit status. In a process a launcher
// started as one rank (chorus run or torchrun set RANK; mpirun with more than one rank sets
// OMPI_COMM_WORLD_RANK; srun with more than one task sets SLURM_PROCID in a job step) it runs here;
// otherwise in `nproc` local processes started by chorus::spawn (0: one). A launched rank given an
// nproc above 0 is a usage error (status 2): the launcher decides the ranks. An exception
// is printed on one line (libtorch's without its backtrace) as "<program>: rank R: error: ...",
// recorded for chorus run's report, and gives status 2 for a UsageError, else 1.
int run_job(const char* program, int nproc, const std::function<void()>& train);

}  // namespace chorus::train
