#!/usr/bin/python3
"""One rank of bench/multihost's gloo side: torch.distributed's gloo backend timing a collective
the way `chorus bench` does (warm-up, then --iters timed calls or about --seconds per size; p50 of
the per-call times, the slowest rank's), writing the same JSON records on rank 0.

    multihost_gloo.py --rank R --world W --master ADDR:PORT --op allreduce --sizes 4K,1M [--iters N]
                      [--seconds S] [--json FILE]
"""
import argparse
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))
from harness import parse_size  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def bus_factor(op, world):
    """nccl-tests' bus bandwidth factor: allreduce 2(W-1)/W, allgather (W-1)/W, broadcast 1."""
    return {"allreduce": 2.0 * (world - 1) / world, "allgather": (world - 1) / world}.get(op, 1.0)


def one_call(op, t, outs):
    if op == "allreduce":
        dist.all_reduce(t)
    elif op == "broadcast":
        dist.broadcast(t, 0)
    elif op == "allgather":
        dist.all_gather(outs, t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--op", default="allreduce", choices=["allreduce", "broadcast", "allgather"])
    ap.add_argument("--sizes", default="4K,1M")
    ap.add_argument("--iters", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=0.5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://" + a.master, rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=600))
    records = []
    for size in (parse_size(s) for s in a.sizes.split(",")):
        # allgather: `size` is the gathered result, as chorus bench counts it.
        n = max(1, size // 4 // (a.world if a.op == "allgather" else 1))
        t = torch.ones(n)
        outs = [torch.empty(n) for _ in range(a.world)] if a.op == "allgather" else None
        for _ in range(a.warmup):
            one_call(a.op, t, outs)
        iters = a.iters
        if iters <= 0:
            t0 = time.perf_counter()
            one_call(a.op, t, outs)
            per = time.perf_counter() - t0
            it = torch.tensor([max(3, min(1000, int(a.seconds / max(per, 1e-9))))])
            dist.broadcast(it, 0)
            iters = int(it.item())
        times = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            one_call(a.op, t, outs)
            times.append((time.perf_counter() - t0) * 1e6)
        times.sort()
        p50 = torch.tensor([times[len(times) // 2]], dtype=torch.float64)
        dist.all_reduce(p50, op=dist.ReduceOp.MAX)
        moved = n * 4 * (a.world if a.op == "allgather" else 1)
        algbw = moved / (p50.item() * 1e-6) / 1e9
        records.append({"op": a.op, "transport": "gloo", "world_size": a.world, "bytes": moved, "iters": iters,
                        "p50_us": p50.item(), "algbw_gbps": algbw, "busbw_gbps": algbw * bus_factor(a.op, a.world)})
    if a.rank == 0 and a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
