#!/usr/bin/python3
"""The PyTorch side of accelerator_cuda_test: PyTorch's DistributedDataParallel (gloo, CUDA tensors,
W forked processes on the one GPU) trains the network, data and optimizer that the C++ side trained
through chorus's Accelerator, under torch.autocast("cuda", float16) with torch.amp.GradScaler, and
compares with the JSON files chorus's rank 0 wrote:

- the steps GradScaler skipped (inf/NaN gradients) and its scale after every step: equal;
- the float16 losses: equal to PyTorch's within 1e-3 (relative);
- the float16 loss curve against chorus's float32 one: mean relative difference under 3%, the
  last step's under 5%; bfloat16's the same.

usage: accelerator_cuda_parity.py --dir DIR --world W --steps N --init-scale S --growth-interval G
Exit status 0 and a line starting "OK: " when everything holds; 1 with one line per problem.
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ddp"))
import parity_util  # noqa: E402

PER_RANK = 8
CLASSES = 4
NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 32)
        self.fc2 = torch.nn.Linear(32, CLASSES)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def worker(rank, world, args, queue):
    try:
        dist.init_process_group("gloo", init_method="file://" + os.path.join(args.dir, "torch-store"),
                                rank=rank, world_size=world)
        net = Net()
        params = dict(net.named_parameters())
        with torch.no_grad():
            for k, name in enumerate(NAMES):
                params[name].copy_(parity_util.init_value(k, params[name].shape))
        net.to("cuda")
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cuda", init_scale=args.init_scale, growth_interval=args.growth_interval)
        losses, scales, skipped, diag = [], [], [], []
        # For the report when the skipped steps differ (as the C++ side records them): each
        # parameter's largest |gradient| as backward hands it over and as the optimizer sees it.
        local = [0.0] * len(NAMES)

        def recorder(k):
            def hook(g):
                local[k] = g.abs().max().item()
            return hook

        for k, p in enumerate(net.parameters()):
            p.register_hook(recorder(k))
        for step in range(args.steps):
            x, y = parity_util.batch(step, rank, world, PER_RANK, CLASSES)
            x, y = x.cuda(), y.cuda()
            opt.zero_grad()
            # As Accelerate (and chorus's Accelerator) run it: the forward under autocast, its output
            # converted to float32, the loss outside autocast. (With the loss under autocast,
            # PyTorch 2.11 casts the loss's gradient, scale/N at the target, to float16: that
            # overflows at half the scale, and the skipped steps are not the same.)
            with torch.autocast("cuda", dtype=torch.float16):
                out = ddp(x)
            loss = F.cross_entropy(out.float(), y)
            before = scaler.get_scale()
            scaler.scale(loss).backward()
            diag.append({"local": list(local), "reduced": [p.grad.abs().max().item() for p in net.parameters()]})
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
            skipped.append(scaler.get_scale() < before)  # PyTorch's scaler backs off exactly on a skip
        dist.destroy_process_group()
        queue.put((rank, {"losses": losses, "scales": scales, "skipped": skipped, "diag": diag,
                          "fc2.weight": net.fc2.weight.detach().cpu().reshape(-1).tolist()}))
    except Exception as e:  # reported by the parent, which fails
        queue.put((rank, "exception: %r" % (e,)))


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def report_gradients(args, results):
    """Prints, for the first steps, each rank's scale, skip and largest |gradient| per parameter on
    both sides: where the float16 gradients overflow, and on which rank."""
    print("step rank side   scale     skip  local max |grad| (scaled)             averaged max |grad| (scaled)")
    ours = {}
    for r in range(args.world):
        path = os.path.join(args.dir, "chorus-fp16-rank%d.json" % r)
        if os.path.exists(path):
            with open(path) as f:
                ours[r] = json.load(f)
    # JSON has no inf or NaN: chorus's side writes them as null.
    fmt = lambda xs: " ".join("%9s" % "inf/nan" if x is None or x != x or x in (float("inf"), -float("inf"))  # noqa: E731
                              else "%9.4g" % x for x in xs)
    for step in range(min(args.steps, 10)):
        for r in range(args.world):
            for side, run in (("chorus ", ours.get(r)), ("PyTorch", results.get(r))):
                if not isinstance(run, dict) or "diag" not in run:
                    continue
                d = run["diag"][step]
                scale = run["scales"][step - 1] if step > 0 else args.init_scale
                print("%4d %4d %s %9g %5s %s   %s" % (step, r, side, scale, run["skipped"][step], fmt(d["local"]),
                                                    fmt(d["reduced"])))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--init-scale", type=float, required=True)
    parser.add_argument("--growth-interval", type=int, required=True)
    args = parser.parse_args()

    results = parity_util.run_forked(worker, args.world, args)
    problems = []
    ref = results[0]
    if isinstance(ref, str):
        print("PyTorch rank 0: " + ref)
        return 1
    ours = {}
    for precision in ("no", "fp16", "bf16"):
        with open(os.path.join(args.dir, "chorus-%s.json" % precision)) as f:
            ours[precision] = json.load(f)
    fp16, fp32, bf16 = ours["fp16"], ours["no"], ours["bf16"]

    skipped_ref = [i for i, s in enumerate(ref["skipped"]) if s]
    skipped_ours = [i for i, s in enumerate(fp16["skipped"]) if s]
    if skipped_ours != skipped_ref:
        problems.append("skipped steps: chorus %s, PyTorch %s" % (skipped_ours, skipped_ref))
    if not skipped_ref:
        problems.append("no step was skipped: the test's init scale no longer overflows float16")
    if fp16["scales"] != ref["scales"]:
        problems.append("scales: chorus %s, PyTorch %s" % (fp16["scales"], ref["scales"]))
    worst = max(rel(a, b) for a, b in zip(fp16["losses"], ref["losses"]))
    if worst > 1e-3:
        problems.append("float16 losses differ from PyTorch's by up to %.2e (relative)" % worst)
    parity_util.compare("fc2.weight after %d steps" % args.steps, ref["fc2.weight"], fp16["fc2.weight"], 1e-3,
                        problems)
    curves = {}
    for name, run in (("fp16", fp16), ("bf16", bf16)):
        diffs = [rel(a, b) for a, b in zip(run["losses"], fp32["losses"])]
        mean, last = sum(diffs) / len(diffs), diffs[-1]
        curves[name] = (mean, last)
        if mean > 0.03 or last > 0.05:
            problems.append("%s loss curve vs float32: mean relative difference %.3f, last %.3f (limits 0.03, 0.05)"
                            % (name, mean, last))
    if problems:
        report_gradients(args, results)
    for line in problems:
        print(line)
    print("%s: W=%d, %d steps, skipped %d (%s) as PyTorch's GradScaler, final scale %g; loss fp32 %.4f -> %.4f, "
          "fp16 %.4f -> %.4f (curve vs fp32: mean %.2f%%, last %.2f%%), bf16 curve mean %.2f%%; "
          "fp16 losses vs PyTorch within %.1e" % (
              "MISMATCH" if problems else "OK", args.world, args.steps, len(skipped_ours), skipped_ours,
              fp16["scales"][-1], fp32["losses"][0], fp32["losses"][-1], fp16["losses"][0], fp16["losses"][-1],
              100 * curves["fp16"][0], 100 * curves["fp16"][1], 100 * curves["bf16"][0], worst))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
