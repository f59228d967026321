#!/usr/bin/env python3
"""PyTorch's side of bench/gpu-resnet: torchvision's ResNet-18 training steps on a GPU with the same
synthetic batches as gpu_resnet.cc, as plain PyTorch (--mode plain) or under PyTorch's
DistributedDataParallel at W ranks on the one GPU (--mode ddp; nccl at W=1, gloo above, since NCCL
refuses two ranks on one GPU). Prints one JSON line: median step time and samples/s."""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchvision


def run(rank, world, args, port, queue):
    torch.backends.cudnn.benchmark = True
    if args.mode == "ddp":
        backend = "nccl" if world == 1 else "gloo"
        dist.init_process_group(backend, init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world)
    torch.manual_seed(0)
    net = torchvision.models.resnet18().cuda()
    model = torch.nn.parallel.DistributedDataParallel(net) if args.mode == "ddp" else net
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device="cuda")
    y = torch.randint(1000, (args.batch_size,), device="cuda")
    times = []
    for s in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        torch.cuda.synchronize()
        if s >= args.warmup:
            times.append(1000 * (time.perf_counter() - t0))
    median = statistics.median(times)
    if rank == 0:
        queue.put({"impl": "pytorch", "mode": args.mode, "world": world, "batch": args.batch_size,
                   "image": args.image_size, "steps": args.steps, "step_ms": median,
                   "samples_per_s": 1000.0 * args.batch_size * world / median,
                   "backend": backend if args.mode == "ddp" else None, "torch": torch.__version__})
    if args.mode == "ddp":
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["plain", "ddp"], default="ddp")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    world = args.world if args.mode == "ddp" else 1
    procs = [ctx.Process(target=run, args=(r, world, args, port, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    result = queue.get(timeout=600)
    for proc in procs:
        proc.join(timeout=60)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
