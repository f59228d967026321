#!/usr/bin/python3
"""The PyTorch side of zero_parity_test: runs PyTorch 1.13's ZeroRedundancyOptimizer under its
DistributedDataParallel (gloo, W forked processes) on the model, data and optimizer that
src/ddp/zero_parity_test.cc runs through chorus, and compares with the JSON files chorus's ranks
wrote: which rank owns each parameter, every rank's parameters after the steps, and the state that
consolidate_state_dict(0) gathers on rank 0 (momentum buffers; Adam's exp_avg, exp_avg_sq, step).

usage: zero_parity_test.py --dir DIR CASE...      CASE: W<world>_<sgd|adam>, files in DIR/CASE/

Every case runs in this one invocation, so torch is imported once. The model holds parameters of
equal sizes (the partition's order among them matters), a frozen layer (no gradient, still owned
and broadcast) and a head no rank uses (its .grad stays None: no state, no update). Values and
data are small dyadic rationals made by the same formulas on both sides.

Exit status 0 and one "OK: CASE" line per case when everything agrees within the tolerance; 1
with one line per difference otherwise.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer

import parity_util

# The parameters in the order both sides pass them to the optimizer (index k in init_value).
NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "frozen.weight", "frozen.bias",
         "head.weight", "head.bias", "spare.weight", "spare.bias"]
STEPS = 4
PER_RANK = 4
CLASSES = 4
TOLERANCE = 1e-5


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 16)
        self.frozen = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, CLASSES)
        self.spare = torch.nn.Linear(16, CLASSES)  # never used by any rank
        for p in self.frozen.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = h + self.frozen(h)
        h = torch.tanh(self.fc2(h))
        return self.head(h)


def worker(rank, world, optimizer, store, queue):
    try:
        dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
        net = Net()
        params = dict(net.named_parameters())
        with torch.no_grad():
            for k, name in enumerate(NAMES):
                params[name].copy_(parity_util.init_value(k, params[name].shape))
        ddp = torch.nn.parallel.DistributedDataParallel(net, find_unused_parameters=True)
        ordered = [params[name] for name in NAMES]
        if optimizer == "sgd":
            zero = ZeroRedundancyOptimizer(ordered, optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9,
                                           weight_decay=0.01)
        else:
            zero = ZeroRedundancyOptimizer(ordered, optimizer_class=torch.optim.Adam, lr=0.01, weight_decay=0.01)
        for step in range(STEPS):
            zero.zero_grad()
            x, y = parity_util.batch(step, rank, world, PER_RANK, CLASSES)
            F.cross_entropy(ddp(x), y).backward()
            zero.step()
        zero.consolidate_state_dict(to=0)
        out = {"owners": [zero._param_to_rank[p] for p in ordered],
               "params": {name: params[name].detach().reshape(-1).tolist() for name in NAMES}}
        if rank == 0:
            state = {}
            for index, entry in zero.state_dict()["state"].items():
                state[str(index)] = {key: (value.reshape(-1).tolist() if value.dim() > 0 else [value.item()])
                                     for key, value in entry.items()}
            out["state"] = state
        dist.destroy_process_group()
        queue.put((rank, out))
    except Exception as e:  # reported by the parent, which fails
        queue.put((rank, "exception: %r" % (e,)))


def check_case(root, case, problems):
    world, optimizer = int(case.split("_")[0][1:]), case.split("_")[1]
    case_dir = os.path.join(root, case)
    results = parity_util.run_forked(worker, world, optimizer, os.path.join(case_dir, "torch-store"))
    for rank in range(world):
        ref = results[rank]
        if isinstance(ref, str):
            problems.append("%s PyTorch rank %d: %s" % (case, rank, ref))
            continue
        with open(os.path.join(case_dir, "chorus-rank%d.json" % rank)) as f:
            ours = json.load(f)
        if ours["owners"] != ref["owners"]:
            problems.append("%s rank %d: owners %s, PyTorch's %s" % (case, rank, ours["owners"], ref["owners"]))
        for name in NAMES:
            parity_util.compare("%s rank %d %s" % (case, rank, name), ref["params"][name], ours["params"][name],
                                TOLERANCE, problems)
        if rank != 0:
            continue
        if sorted(ref["state"]) != sorted(ours["state"]):
            problems.append("%s: state for parameters %s in PyTorch, %s in chorus" % (
                case, sorted(ref["state"]), sorted(ours["state"])))
            continue
        for index, entry in ref["state"].items():
            if sorted(entry) != sorted(ours["state"][index]):
                problems.append("%s state %s: keys %s in PyTorch, %s in chorus" % (
                    case, index, sorted(entry), sorted(ours["state"][index])))
                continue
            for key, values in entry.items():
                parity_util.compare("%s state %s (%s) %s" % (case, index, NAMES[int(index)], key), values,
                        ours["state"][index][key], TOLERANCE, problems)
    states = len(results[0]["state"]) if isinstance(results[0], dict) else 0
    return "%d parameters, %d with consolidated state" % (len(NAMES), states)


if __name__ == "__main__":
    sys.exit(parity_util.check_cases(check_case))
