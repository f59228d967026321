#!/usr/bin/python3
"""Faults from Python on the "chorus" backend (docs/python.md): errors instead of hangs.

- A rank SIGKILLed while the others run an all_reduce: every other rank raises RuntimeError within
  seconds (far inside the 60 s timeout), naming the dead rank.
- A rank that never joins an all_reduce: the others raise RuntimeError once the timeout given to
  init_process_group (3 s) has passed, naming the rank they waited for.
- The link told through the environment (docs/algorithms.md, "Telling the plan the link"): a
  CHORUS_LINK_GBIT that is not a number makes init_process_group raise RuntimeError naming it; one
  rank told a different link than the others makes the all_reduce raise on every rank, within
  seconds, naming CHORUS_LINK_GBIT.
- CHORUS_ALLREDUCE_ALGORITHM=tuned (docs/algorithms.md, "Measured choice"): on every rank, its
  trials and the calls after them sum right; on one rank only, the first call where its trial
  differs from the other rank's plan raises on both, within seconds, naming the variable.
Prints "OK: ..." and exits 0, or one line per problem and exits 1.
"""
import datetime
import os
import signal
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import chorus  # noqa: F401


def report_error(rank, queue, op):
    """Runs op; queues (rank, (seconds, message)) for the RuntimeError it raised, or "no error"."""
    t0 = time.time()
    try:
        op()
        queue.put((rank, "no error"))
    except RuntimeError as e:
        queue.put((rank, (time.time() - t0, str(e))))


def killed_peer(rank, world, store, queue):
    dist.init_process_group("chorus", init_method="file://" + store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    t = torch.ones(1 << 16)
    dist.all_reduce(t)  # everyone is connected
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)

    def keep_reducing():
        for _ in range(100000):
            dist.all_reduce(t)
    report_error(rank, queue, keep_reducing)


def missing_peer(rank, world, store, queue):
    dist.init_process_group("chorus", init_method="file://" + store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=3))
    if rank == 1:
        time.sleep(5)  # never calls the collective
        queue.put((rank, "slept"))
        return
    report_error(rank, queue, lambda: dist.all_reduce(torch.ones(10)))


def bad_link(rank, world, store, queue):
    os.environ["CHORUS_LINK_GBIT"] = "10GbE"
    report_error(rank, queue, lambda: dist.init_process_group(
        "chorus", init_method="file://" + store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)))


def different_links(rank, world, store, queue):
    os.environ["CHORUS_TRANSPORT"] = "tcp"  # the link is TCP's; shared memory has its own
    os.environ["CHORUS_ALLREDUCE_ALGORITHM"] = "rabenseifner"
    if rank == 0:
        os.environ["CHORUS_LINK_GBIT"] = "0.0005"  # every block from 30 bytes takes a handshake
    dist.init_process_group("chorus", init_method="file://" + store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    report_error(rank, queue, lambda: dist.all_reduce(torch.ones(1000)))


TUNED_CALLS = 20  # past the 18 trials of a size class (kTunedAllreduceTrials)


def tuned_calls(rank):
    """TUNED_CALLS all_reduces of 4000 bytes; "ok" when every sum was right, else what went wrong."""
    for call in range(TUNED_CALLS):
        t = torch.full((1000,), float(rank + 1))
        dist.all_reduce(t)
        if not torch.equal(t, torch.full((1000,), 3.0)):
            return "call %d: a wrong sum" % call
    return "ok"


def tuned_everywhere(rank, world, store, queue):
    os.environ["CHORUS_TRANSPORT"] = "tcp"  # shared memory has its own allreduce, not tuned
    os.environ["CHORUS_ALLREDUCE_ALGORITHM"] = "tuned"
    dist.init_process_group("chorus", init_method="file://" + store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    queue.put((rank, tuned_calls(rank)))


def tuned_on_one_rank(rank, world, store, queue):
    os.environ["CHORUS_TRANSPORT"] = "tcp"
    if rank == 0:
        os.environ["CHORUS_ALLREDUCE_ALGORITHM"] = "tuned"
    dist.init_process_group("chorus", init_method="file://" + store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    report_error(rank, queue, lambda: tuned_calls(rank))


def run(fn, world, expect):
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="chorus-fault-") as tmp:
        procs = [ctx.Process(target=fn, args=(r, world, os.path.join(tmp, "store"), queue), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        out = {}
        for _ in range(expect):
            rank, result = queue.get(timeout=60)
            out[rank] = result
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    return out


def main():
    problems = []
    world = 3
    got = run(killed_peer, world, world - 1)
    for rank in range(world - 1):
        r = got.get(rank)
        if not isinstance(r, tuple):
            problems.append("killed peer: rank %d: %r" % (rank, r))
        elif r[0] > 10 or "rank %d" % (world - 1) not in r[1]:
            problems.append("killed peer: rank %d raised after %.1f s: %s" % (rank, r[0], r[1]))
    kill_times = [got[r][0] for r in got if isinstance(got[r], tuple)]
    got = run(missing_peer, world, world)
    for rank in (0, 2):
        r = got.get(rank)
        if not isinstance(r, tuple):
            problems.append("missing peer: rank %d: %r" % (rank, r))
        elif not 2.5 < r[0] < 12 or "rank 1" not in r[1]:
            problems.append("missing peer: rank %d raised after %.1f s: %s" % (rank, r[0], r[1]))
    wait_times = [got[r][0] for r in (0, 2) if isinstance(got.get(r), tuple)]
    for name, fn, needle in [("bad link", bad_link, "CHORUS_LINK_GBIT='10GbE' is not a positive number"),
                             ("different links", different_links, "CHORUS_LINK_GBIT"),
                             ("tuned on one rank", tuned_on_one_rank, "CHORUS_ALLREDUCE_ALGORITHM")]:
        got_link = run(fn, 2, 2)
        for rank in range(2):
            r = got_link.get(rank)
            if not isinstance(r, tuple):
                problems.append("%s: rank %d: %r" % (name, rank, r))
            elif r[0] > 10 or needle not in r[1]:
                problems.append("%s: rank %d raised after %.1f s without %r: %s" % (name, rank, r[0], needle, r[1]))
    got_tuned = run(tuned_everywhere, 2, 2)
    if got_tuned != {0: "ok", 1: "ok"}:
        problems.append("tuned on every rank: %r" % got_tuned)
    for line in problems:
        print(line)
    if not problems:
        print("example messages:\n  " + got[0][1].splitlines()[0][:300])
    print("%s: a SIGKILLed rank raised RuntimeError on the others after %s s; a missing rank after %s s "
          "(timeout 3 s); a bad or disagreeing CHORUS_LINK_GBIT raised naming it; tuned ran right on every rank "
          "and raised naming it on one" % ("FAILED" if problems else "OK", ", ".join("%.2f" % t for t in kill_times),
                             ", ".join("%.2f" % t for t in wait_times)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
