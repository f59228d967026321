#!/usr/bin/python3
"""The PyTorch side of sync_batch_norm_test: for every case in the input file, runs one
torch.nn.BatchNorm1d/2d/3d (training mode) in one process on the concatenated global batch, the
batch that chorus's ranks split among themselves, and writes what each rank's slice must match.

usage: sync_batch_norm_test.py --input IN.json --output OUT.json

Input: {"cases": [{"name", "channels", "spatial" ([] for (N, C), [L], [H, W] or [D, H, W]),
"batch" (global N), "eps", "momentum" (null: cumulative average), "affine", "track_running_stats",
"weight", "bias" (flat lists), "steps": [{"x", "loss_weights"}] (flat, row-major), "eval_x"}]}.
Each step computes out = bn(x) and backpropagates (out * loss_weights).sum() from fresh gradients.

Output: {name: {"steps": [{"out", "grad_input", "grad_weight", "grad_bias", "running_mean",
"running_var"}], "eval_out"}}, flat lists; null where the module has no such tensor.
"""
import argparse
import json
import sys

import torch

BATCH_NORM = {0: torch.nn.BatchNorm1d, 1: torch.nn.BatchNorm1d, 2: torch.nn.BatchNorm2d, 3: torch.nn.BatchNorm3d}


def flat(t):
    return None if t is None else t.detach().reshape(-1).tolist()


def run_case(case):
    shape = [case["batch"], case["channels"]] + case["spatial"]
    bn = BATCH_NORM[len(case["spatial"])](case["channels"], eps=case["eps"], momentum=case["momentum"],
                                          affine=case["affine"],
                                          track_running_stats=case["track_running_stats"])
    if case["affine"]:
        with torch.no_grad():
            bn.weight.copy_(torch.tensor(case["weight"]))
            bn.bias.copy_(torch.tensor(case["bias"]))
    bn.train()
    steps = []
    for step in case["steps"]:
        bn.zero_grad()
        x = torch.tensor(step["x"], dtype=torch.float32).reshape(shape).requires_grad_()
        out = bn(x)
        (out * torch.tensor(step["loss_weights"]).reshape(shape)).sum().backward()
        steps.append({"out": flat(out), "grad_input": flat(x.grad),
                      "grad_weight": flat(bn.weight.grad) if case["affine"] else None,
                      "grad_bias": flat(bn.bias.grad) if case["affine"] else None,
                      "running_mean": flat(bn.running_mean), "running_var": flat(bn.running_var)})
    bn.eval()
    with torch.no_grad():
        eval_out = bn(torch.tensor(case["eval_x"]).reshape(shape))
    return {"steps": steps, "eval_out": flat(eval_out)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with open(args.input) as f:
        cases = json.load(f)["cases"]
    golden = {case["name"]: run_case(case) for case in cases}
    with open(args.output, "w") as f:
        json.dump(golden, f)
    print("OK: %d cases, torch %s" % (len(cases), torch.__version__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
