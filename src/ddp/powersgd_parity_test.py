#!/usr/bin/python3
"""The PyTorch side of powersgd_parity_test: runs PyTorch 1.13's DistributedDataParallel (gloo, W
forked processes) with its own powerSGD_hook on the model, data, optimizer and PowerSGD settings
that src/ddp/powersgd_parity_test.cc runs through chorus's PowerSGDHook, and compares every rank's
parameters after the last step and the .grad of that step (PowerSGD's decompressed average) with
the JSON files chorus's ranks wrote.

usage: powersgd_parity_test.py --dir DIR CASE...

A CASE is a directory under DIR named W<world>_r<rank>_b<batch same shapes>_ws<warm start>_s<seed>,
holding chorus-rank<r>.json. Every case trains STEPS steps with start_powerSGD_iter START: plain
allreduce first, then PowerSGD with error feedback. Prints "OK: CASE, ..." or one line per
difference and "MISMATCH: CASE"; exit status 1 when any case differs.
"""
import json
import os
import re
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

import parity_util

NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias", "head.weight", "head.bias"]
STEPS = 6
START = 3
PER_RANK = 4
CLASSES = 4
# Orthogonalisation divides by column norms, so the last bits of a sum taken in another order (gloo's
# and chorus's allreduce add the ranks' values in different orders at W=3) grow over the steps.
TOLERANCE = 1e-4


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 24)
        self.fc2 = torch.nn.Linear(24, 24)
        self.fc3 = torch.nn.Linear(24, 24)
        self.head = torch.nn.Linear(24, CLASSES)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = torch.tanh(self.fc2(h))
        h = torch.relu(self.fc3(h))
        return self.head(h)


def parse(case):
    """(world, rank, batch same shapes, warm start, seed) from a case name."""
    w, r, b, ws, s = re.fullmatch(r"W(\d+)_r(\d+)_b([01])_ws([01])_s(\d+)", case).groups()
    return int(w), int(r), b == "1", ws == "1", int(s)


def worker(rank, world, case, store, queue):
    try:
        _, approx_rank, batch_same, warm_start, seed = parse(case)
        dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
        net = Net()
        params = dict(net.named_parameters())
        with torch.no_grad():
            for k, name in enumerate(NAMES):
                params[name].copy_(parity_util.init_value(k, params[name].shape))
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=approx_rank,
                                       start_powerSGD_iter=START, min_compression_rate=2, use_error_feedback=True,
                                       warm_start=warm_start, orthogonalization_epsilon=0, random_seed=seed,
                                       batch_tensors_with_same_shape=batch_same)
        ddp.register_comm_hook(state, powerSGD.powerSGD_hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        for step in range(STEPS):
            opt.zero_grad()
            x, y = parity_util.batch(step, rank, world, PER_RANK, CLASSES)
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        out = {name: {"values": params[name].detach().reshape(-1).tolist(),
                      "grad": params[name].grad.reshape(-1).tolist()} for name in NAMES}
        out["compressed"] = [state.total_numel_before_compression, state.total_numel_after_compression]
        dist.barrier()
    except Exception as e:  # reported by the parent, which fails
        out = "exception: %r" % (e,)
    # Out without destructors: tearing down gloo after the hook's future chains sometimes ran the
    # group's destructor on one of its own threads ("terminate called ... Resource deadlock
    # avoided", about 1 run in 20), which lost this rank's result.
    queue.put((rank, out))
    queue.close()
    queue.join_thread()
    os._exit(0)


def check_case(root, case, problems):
    world = parse(case)[0]
    case_dir = os.path.join(root, case)
    results = parity_util.run_forked(worker, world, case, os.path.join(case_dir, "torch-store"))
    for rank in range(world):
        ref = results[rank]
        if isinstance(ref, str):
            problems.append("%s PyTorch rank %d: %s" % (case, rank, ref))
            continue
        with open(os.path.join(case_dir, "chorus-rank%d.json" % rank)) as f:
            ours = json.load(f)
        if ours["compressed"] != ref["compressed"]:
            problems.append("%s rank %d: numel before/after compression %s, PyTorch's %s" % (
                case, rank, ours["compressed"], ref["compressed"]))
        for name in NAMES:
            parity_util.compare("%s rank %d %s" % (case, rank, name), ref[name]["values"], ours[name]["values"],
                                TOLERANCE, problems)
            parity_util.compare("%s rank %d %s.grad" % (case, rank, name), ref[name]["grad"], ours[name]["grad"],
                                TOLERANCE, problems)
    before, after = results[0]["compressed"] if isinstance(results[0], dict) else (0, 0)
    return "%d parameters, %d steps (PowerSGD from step %d), numel %d -> %d" % (len(NAMES), STEPS, START, before, after)


if __name__ == "__main__":
    sys.exit(parity_util.check_cases(check_case))
