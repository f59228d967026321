#!/usr/bin/python3
"""PyTorch's DistributedDataParallel from Python on backend "chorus" against the same training on
"gloo" (docs/python.md): at W=2 and W=3, every variant below trains N steps from the same seed on
the same per-rank data, and the parameters must agree to TOLERANCE, 1e-6 (fp16_compress at W=3:
see FP16_TOLERANCE_W3), and agree across chorus's ranks exactly:

- sgd_momentum, adam: the default allreduce hook chaining on chorus's futures;
- find_unused: find_unused_parameters=True with a layer used only on even steps;
- no_sync: two micro-batches per step, the first under ddp.no_sync();
- fp16_compress: register_comm_hook(None, fp16_compress_hook), float16 on the wire;
- join: uneven inputs (rank r trains 4 + r steps) under ddp.join().

PyTorch 1.13's DDP join over gloo itself hangs now and then on this machine (join_parity_test.py
says how often); a gloo run that has not finished in REFERENCE_TIMEOUT_S is killed and run again,
up to REFERENCE_ATTEMPTS times. chorus's runs are never retried.
Prints "OK: ..." and exits 0, or one line per problem and exits 1.
"""
import datetime
import os
import queue as queue_module
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import chorus  # noqa: F401  (registers the backend)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src", "ddp"))
import parity_util  # noqa: E402

VARIANTS = ["sgd_momentum", "adam", "find_unused", "no_sync", "fp16_compress", "join"]
STEPS = 6
TOLERANCE = 1e-6
# float16 on the wire: chorus and gloo both add in float16, rounding after every addition, but in a
# different order at W >= 3 (their rings start at different ranks), so an averaged gradient may
# differ by one float16 ulp (about 1e-3 of its size); after 6 steps at lr 0.1 the parameters differ
# by a few 1e-5. At W=2 there is one order and the 1e-6 bound holds.
FP16_TOLERANCE_W3 = 1e-4
REFERENCE_TIMEOUT_S = 60
REFERENCE_ATTEMPTS = 3
CHORUS_TIMEOUT_S = 120  # a run takes about a second; this only bounds a hang


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.extra = torch.nn.Linear(16, 16)  # used on even steps only by find_unused

    def forward(self, x, use_extra=True):
        h = torch.relu(self.fc1(x))
        if use_extra:
            h = torch.relu(self.extra(h))
        return self.fc2(h)


def batch(step, rank, micro=0):
    g = torch.Generator().manual_seed(step * 1000 + rank * 10 + micro)
    return torch.randn(8, 6, generator=g), torch.randint(4, (8,), generator=g)


def train(variant, rank, world):
    torch.manual_seed(0)
    net = Net()
    ddp = torch.nn.parallel.DistributedDataParallel(net, find_unused_parameters=(variant == "find_unused"))
    if variant == "fp16_compress":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    if variant == "adam":
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

    def loss(step, micro=0, use_extra=True):
        x, y = batch(step, rank, micro)
        return torch.nn.functional.cross_entropy(ddp(x, use_extra), y)

    if variant == "join":
        with ddp.join():
            for step in range(4 + rank):
                opt.zero_grad()
                loss(step).backward()
                opt.step()
    else:
        for step in range(STEPS):
            opt.zero_grad()
            if variant == "no_sync":
                with ddp.no_sync():
                    loss(step, 1).backward()
                loss(step, 2).backward()
            else:
                loss(step, use_extra=(variant != "find_unused" or step % 2 == 0)).backward()
            opt.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).tolist()


def worker(rank, world, backend, init, queue):
    try:
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        torch.set_num_threads(1)
        out = {v: train(v, rank, world) for v in VARIANTS}
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, out))
    except Exception:
        queue.put((rank, "exception: " + traceback.format_exc()))


def main():
    problems = []
    compared = 0
    notes = []
    with tempfile.TemporaryDirectory(prefix="chorus-python-ddp-") as tmp:
        for world in (2, 3):
            results = {}
            for backend in ("gloo", "chorus"):
                attempts = REFERENCE_ATTEMPTS if backend == "gloo" else 1
                for attempt in range(attempts):
                    init = "file://" + os.path.join(tmp, "%s-%d-%d" % (backend, world, attempt))
                    try:
                        results[backend] = parity_util.run_forked(
                            worker, world, backend, init,
                            timeout=REFERENCE_TIMEOUT_S if backend == "gloo" else CHORUS_TIMEOUT_S)
                        break
                    except queue_module.Empty:
                        if backend == "chorus":
                            problems.append("W=%d: chorus's ranks did not finish within %d s" % (world, CHORUS_TIMEOUT_S))
                        else:
                            notes.append("W=%d: gloo's own ranks hung (attempt %d), killed and rerun" % (world, attempt + 1))
            if set(results) != {"gloo", "chorus"}:
                problems.append("W=%d: no result from %s" % (world, sorted({"gloo", "chorus"} - set(results))))
                continue
            for backend, outs in results.items():
                for rank, out in outs.items():
                    if isinstance(out, str):
                        problems.append("W=%d %s rank %d: %s" % (world, backend, rank, out))
            if any(isinstance(o, str) for outs in results.values() for o in outs.values()):
                continue
            for variant in VARIANTS:
                for rank in range(world):
                    tol = FP16_TOLERANCE_W3 if variant == "fp16_compress" and world >= 3 else TOLERANCE
                    parity_util.compare("W=%d %s rank %d" % (world, variant, rank), results["gloo"][rank][variant],
                                        results["chorus"][rank][variant], tol, problems)
                    if results["chorus"][rank][variant] != results["chorus"][0][variant]:
                        problems.append("W=%d %s: chorus's rank %d differs from its rank 0" % (world, variant, rank))
                    compared += 1
    for line in notes + problems:
        print(line)
    print("%s: %d (W, variant, rank) parameter sets compared with gloo's to %g (fp16_compress at W=3: %g): %s; "
          "W=2,3" % ("MISMATCH" if problems else "OK", compared, TOLERANCE, FP16_TOLERANCE_W3, ", ".join(VARIANTS)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
