"""Shared by the Python sides of the parity tests against PyTorch (ddp_parity_test.py,
zero_parity_test.py): values and data made by the same formulas as parity_util.h makes them, the
reference ranks as forked processes, and the comparison with chorus's values."""
import argparse
import multiprocessing
import queue as queue_module

import torch


def init_value(k, shape):
    """Element e of the k-th parameter is ((7e + 5k) mod 13 - 6) / 32: exact in float."""
    n = 1
    for d in shape:
        n *= d
    e = torch.arange(n, dtype=torch.int64)
    return (((e * 7 + k * 5) % 13 - 6).to(torch.float32) / 32.0).reshape(shape)


def batch(step, rank, world, per_rank, classes):
    """Rank `rank`'s rows of step `step`'s global batch."""
    n = torch.arange(per_rank * world, dtype=torch.int64)
    j = torch.arange(6, dtype=torch.int64)
    x = (((n[:, None] * 5 + j[None, :] * 3 + step * 7) % 11) - 5).to(torch.float32) / 4.0
    y = (n * 3 + step) % classes
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[rows], y[rows]


def run_forked(worker, world, *args, timeout=120):
    """Runs worker(rank, world, *args, queue) in `world` forked processes; each puts (rank, result)
    on the queue (a string for an exception). Returns {rank: result}. The ranks are daemons: one
    that never answers raises queue.Empty here instead of keeping the script from exiting."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world) + args + (queue,), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, out = queue.get(timeout=timeout)
            results[rank] = out
    except queue_module.Empty:  # a rank that never answered: end them all, then say so
        for p in procs:
            p.kill()
            p.join(timeout=10)
        raise
    for p in procs:
        p.join(timeout=30)
    return results


def compare(what, ours, theirs, tol, problems):
    """Appends a line to problems when the lists differ by more than tol (or one of them is None)."""
    if ours is None or theirs is None:
        if (ours is None) != (theirs is None):
            problems.append("%s: PyTorch has %s, chorus has %s" % (
                what, "None" if ours is None else "a tensor", "None" if theirs is None else "a tensor"))
        return
    if len(ours) != len(theirs):
        problems.append("%s: %d elements in PyTorch, %d in chorus" % (what, len(ours), len(theirs)))
        return
    diff = max((abs(a - b) for a, b in zip(ours, theirs)), default=0.0)
    if not diff <= tol:
        problems.append("%s: differs from PyTorch by %.3g (tolerance %.1g)" % (what, diff, tol))


def check_cases(check_case):
    """The main of a script that checks several cases in one run: `--dir DIR CASE...`. For each case,
    check_case(dir, case, problems) appends a line per difference to problems and returns the text
    after the case's name on its "OK: CASE, ..." (or "MISMATCH: CASE, ...") line. Returns the exit
    status: 1 when any case differs."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("cases", nargs="+")
    args = parser.parse_args()
    torch.set_num_threads(1)
    failed = False
    for case in args.cases:
        problems = []
        summary = check_case(args.dir, case, problems)
        for line in problems:
            print(line)
        print("%s: %s, %s" % ("MISMATCH" if problems else "OK", case, summary))
        failed = failed or bool(problems)
    return 1 if failed else 0
