#!/usr/bin/python3
"""PyTorch's DDP tutorial, whole, on Fashion-MNIST, with chorus as the backend (docs/python.md).

The pattern of https://pytorch.org/tutorials/intermediate/ddp_tutorial.html: one process per rank,
init_process_group, a DistributedSampler with set_epoch, DistributedDataParallel, a checkpoint that
rank 0 saves and every rank loads after a barrier, per-rank evaluation results gathered with
all_gather_object, destroy_process_group. The only chorus line is `import chorus`; `--backend`
picks "chorus" or "gloo".

Two ways to start it:

    PYTHONPATH=build/python /usr/bin/python3 examples/python/ddp_tutorial.py --world 2   # mp.spawn
    PYTHONPATH=build/python build/bin/chorus run -n 2 /usr/bin/python3 examples/python/ddp_tutorial.py

Under `chorus run` (or torchrun, Slurm, ...) RANK and WORLD_SIZE come from the environment and this
process is one rank; otherwise it spawns --world ranks itself. Rank 0 prints one JSON line at the
end (accuracy, loss, a checksum of the parameters) and writes it to --json when given.
"""
import argparse
import datetime
import gzip
import json
import os
import socket
import struct

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

try:
    import chorus  # noqa: F401  registers the "chorus" backend
except ImportError:
    chorus = None


def read_idx(path):
    """A gzipped IDX file (Fashion-MNIST's format) as a uint8 tensor."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = struct.unpack(">" + "I" * dims, data[4:4 + 4 * dims])
    return torch.frombuffer(bytearray(data[4 + 4 * dims:]), dtype=torch.uint8).reshape(shape)


def load(data_dir, split, limit):
    prefix = "train" if split == "train" else "t10k"
    images = read_idx(os.path.join(data_dir, prefix + "-images-idx3-ubyte.gz"))[:limit]
    labels = read_idx(os.path.join(data_dir, prefix + "-labels-idx1-ubyte.gz"))[:limit]
    x = (images.float() / 255.0 - 0.2860) / 0.3530  # Fashion-MNIST's mean and standard deviation
    return TensorDataset(x.unsqueeze(1), labels.long())


class Net(nn.Module):
    """PyTorch's MNIST example network."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def run(rank, world, args):
    dist.init_process_group(args.backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    torch.manual_seed(0)  # the same initial model on every rank (DDP broadcasts rank 0's anyway)
    torch.set_num_threads(args.threads)
    train_set = load(args.data, "train", args.limit)
    test_set = load(args.data, "test", args.limit // 4)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a different shuffle every epoch, the same on every rank
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        # Rank 0 saves; the others wait for the file, then everyone loads it.
        if rank == 0:
            torch.save(model.state_dict(), args.checkpoint)
        dist.barrier()
        model.load_state_dict(torch.load(args.checkpoint, map_location="cpu"))

    # Each rank evaluates its share of the test set; rank 0 gathers the counts.
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    test_sampler = DistributedSampler(test_set, num_replicas=world, rank=rank, shuffle=False)
    with torch.no_grad():
        for x, y in DataLoader(test_set, batch_size=256, sampler=test_sampler):
            out = model(x)
            loss_sum += F.cross_entropy(out, y, reduction="sum").item()
            correct += (out.argmax(1) == y).sum().item()
            total += len(y)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"rank": rank, "correct": correct, "total": total, "loss_sum": loss_sum})
    checksum = sum(float(p.double().abs().sum()) for p in model.parameters())
    dist.destroy_process_group()
    if rank == 0:
        result = {
            "backend": args.backend, "world": world, "epochs": args.epochs,
            "accuracy": sum(r["correct"] for r in per_rank) / sum(r["total"] for r in per_rank),
            "test_loss": sum(r["loss_sum"] for r in per_rank) / sum(r["total"] for r in per_rank),
            "per_rank_total": [r["total"] for r in per_rank],
            "parameter_checksum": checksum,
        }
        print(json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="chorus", choices=["chorus", "gloo"])
    parser.add_argument("--world", type=int, default=2, help="ranks to spawn when not started by a launcher")
    parser.add_argument("--data", default=os.environ.get("FASHION_MNIST_DATA", "/usr/share/datasets/fashion-mnist"))
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--limit", type=int, default=4000, help="training images used (test: a quarter)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--timeout", type=float, default=120, help="seconds for each collective")
    parser.add_argument("--checkpoint", default="ddp_tutorial.pt")
    parser.add_argument("--json", help="rank 0 writes its result here")
    args = parser.parse_args()
    if args.backend == "chorus" and chorus is None:
        parser.error("the chorus package is not importable: PYTHONPATH=build/python, or cmake --install it")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by chorus run, torchrun, ...
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    mp.spawn(run, args=(args.world, args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
