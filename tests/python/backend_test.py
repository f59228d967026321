#!/usr/bin/python3
"""The "chorus" torch.distributed backend from Python (src/python, docs/python.md), against gloo:

- every operation the backend implements, at W=2 and W=3, env:// and file://, on several dtypes:
  the same inputs through backend "chorus" and backend "gloo" give the same outputs (bit for bit);
- async_op=True: Work.wait(), is_completed() and get_future() resolve with the outputs;
- errors: CUDA-free refusals with chorus's messages as RuntimeError;
- DDP: PyTorch's DistributedDataParallel trained 6 steps (SGD momentum) on chorus and on gloo gives
  the same parameters to 1e-6, with its default allreduce hook chaining on chorus's futures.
Prints "OK: ..." and exits 0, or one line per problem and exits 1.
"""
import datetime
import io
import os
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

import chorus  # noqa: F401  (registers the backend)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src", "ddp"))
import parity_util  # noqa: E402  (run_forked, shared with the DDP parity scripts)

# What gloo (1.13) reduces on the CPU; bfloat16, which gloo refuses, is checked on chorus alone below.
DTYPES = [torch.float32, torch.float64, torch.float16, torch.int8, torch.uint8, torch.int32, torch.int64]


def values(n, rank, dtype, salt=0):
    e = torch.arange(n, dtype=torch.int64)
    return ((e * 7 + rank * 13 + salt * 5) % 17 - 8).to(dtype) if dtype != torch.uint8 else \
        ((e * 7 + rank * 13 + salt * 5) % 17).to(dtype)


def run_ops(rank, world):
    """Every operation once per dtype; returns {name: output tensor}."""
    out = {}
    for dt in DTYPES:
        tag = str(dt).split(".")[-1]
        for n in (1, 1000):
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT):
                t = values(n, rank, dt)
                dist.all_reduce(t, op=op)
                out["all_reduce %s %s x%d" % (op, tag, n)] = t
            t = values(n, rank, dt)
            dist.broadcast(t, src=world - 1)
            out["broadcast %s x%d" % (tag, n)] = t
            t = values(n, rank, dt)
            dist.reduce(t, dst=1 % world)
            if rank == 1 % world:  # elsewhere the tensor's contents are unspecified (gloo leaves partial sums)
                out["reduce %s x%d" % (tag, n)] = t
            parts = [torch.zeros(n, dtype=dt) for _ in range(world)]
            dist.all_gather(parts, values(n, rank, dt))
            out["all_gather %s x%d" % (tag, n)] = torch.cat(parts)
    n = 257
    gl = [torch.zeros(n, dtype=torch.int64) for _ in range(world)] if rank == 0 else None
    dist.gather(values(n, rank, torch.int64), gather_list=gl, dst=0)
    out["gather"] = torch.cat(gl) if rank == 0 else torch.zeros(1)
    got = torch.zeros(n, dtype=torch.int32)
    dist.scatter(got, scatter_list=[values(n, i, torch.int32, 3) for i in range(world)] if rank == 0 else None, src=0)
    out["scatter"] = got
    a2a = torch.zeros(world * 4, dtype=torch.int64)
    dist.all_to_all_single(a2a, values(world * 4, rank, torch.int64))
    out["all_to_all_single"] = a2a
    # all_to_all_single with split sizes: rank r sends r + j + 1 rows of 3 to rank j
    send_splits = [rank + j + 1 for j in range(world)]
    recv_splits = [j + rank + 1 for j in range(world)]
    a2a = torch.zeros(sum(recv_splits), 3, dtype=torch.float64)
    dist.all_to_all_single(a2a, values(sum(send_splits) * 3, rank, torch.float64).reshape(-1, 3),
                           output_split_sizes=recv_splits, input_split_sizes=send_splits)
    out["all_to_all_single splits"] = a2a
    # all_gather_coalesced: two inputs of different sizes and shapes (one dtype, as PyTorch requires)
    lists = [[torch.zeros(5, dtype=torch.int64), torch.zeros(3, 2, dtype=torch.int64)] for _ in range(world)]
    dist.all_gather_coalesced(lists, [values(5, rank, torch.int64), values(6, rank, torch.int64, 1).reshape(3, 2)])
    out["all_gather_coalesced"] = torch.cat([torch.cat([t.reshape(-1).double() for t in lst]) for lst in lists])
    # bitwise reductions on integers
    for op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
        for dt in (torch.uint8, torch.int32, torch.int64):
            t = (torch.arange(100, dtype=torch.int64) * (rank + 3) * 37 % 251).to(dt)
            dist.all_reduce(t, op=op)
            out["all_reduce %s %s" % (op, dt)] = t
        t = (torch.arange(50, dtype=torch.int64) * (rank + 5) * 11 % 127).to(torch.int32)
        dist.reduce(t, dst=world - 1, op=op)
        if rank == world - 1:
            out["reduce %s" % op] = t
    recv = torch.zeros(n)
    reqs = [dist.isend(values(n, rank, torch.float32), (rank + 1) % world),
            dist.irecv(recv, (rank + world - 1) % world)]
    for r in reqs:
        r.wait()
    out["isend/irecv"] = recv
    # batch_isend_irecv with every rank's irecvs listed before its isends (PyTorch's own test
    # does so): the receives must not hold up the sends. A large message each way, and tags.
    nxt, prv = (rank + 1) % world, (rank + world - 1) % world
    small, big = torch.zeros(7), torch.zeros(1 << 20)
    ops = [dist.P2POp(dist.irecv, small, prv, tag=5), dist.P2POp(dist.irecv, big, nxt, tag=6),
           dist.P2POp(dist.isend, values(7, rank, torch.float32, salt=1), nxt, tag=5),
           dist.P2POp(dist.isend, values(1 << 20, rank, torch.float32, salt=2), prv, tag=6)]
    for r in dist.batch_isend_irecv(ops):
        r.wait()
    out["batch_isend_irecv small"], out["batch_isend_irecv big"] = small, big
    # recv without src (recvAnysource): every other rank sends rank 0 its values; rank 0 takes them
    # in arrival order, each dist.recv returning its sender
    if rank == 0:
        got = {}
        for _ in range(world - 1):
            t = torch.zeros(9)
            src = dist.recv(t, tag=8)
            got[src] = t
        out["recv from any source"] = torch.cat([torch.tensor([float(s)]) for s in sorted(got)] +
                                                [got[s] for s in sorted(got)])
    else:
        dist.send(values(9, rank, torch.float32, salt=3), 0, tag=8)
    # async: several in flight, then wait; the future resolves with the output
    ts = [torch.full((1000 + i,), float(rank + i)) for i in range(5)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    fut = works[-1].get_future()
    for w in works:
        w.wait()
    assert all(w.is_completed() for w in works), "is_completed after wait"
    out["async"] = torch.cat(ts)
    out["future"] = fut.wait()[0].clone()
    dist.barrier()
    return out


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def chorus_only_ops(rank, world):
    """What gloo 1.13 lacks on the CPU (all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor,
    all_to_all with lists, bfloat16): checked against the values computed here. Returns a list of problems."""
    problems = []
    n = 257
    big = torch.zeros(world * n)
    dist.all_gather_into_tensor(big, values(n, rank, torch.float32))
    if not torch.equal(big, torch.cat([values(n, r, torch.float32) for r in range(world)])):
        problems.append("all_gather_into_tensor")
    rs = torch.zeros(n)
    dist.reduce_scatter(rs, [values(n, rank, torch.float32, i) for i in range(world)])
    if not torch.equal(rs, sum(values(n, r, torch.float32, rank) for r in range(world))):
        problems.append("reduce_scatter")
    rst = torch.zeros(n, dtype=torch.float64)
    dist.reduce_scatter_tensor(rst, values(world * n, rank, torch.float64))
    if not torch.equal(rst, sum(values(world * n, r, torch.float64) for r in range(world))[rank * n:(rank + 1) * n]):
        problems.append("reduce_scatter_tensor")
    # all_to_all with lists of uneven tensors (an empty one too): rank r sends 2r + j values to j
    outs = [torch.zeros(2 * j + rank, dtype=torch.int32) for j in range(world)]
    dist.all_to_all(outs, [values(2 * rank + j, rank, torch.int32, j) for j in range(world)])
    if not all(torch.equal(outs[j], values(2 * j + rank, j, torch.int32, rank)) for j in range(world)):
        problems.append("all_to_all")
    # An irecv posted before its isend, a slow caller between them, finished by polling
    # is_completed() alone (gloo's send and recv Works complete only in wait()).
    nxt, prv = (rank + 1) % world, (rank + world - 1) % world
    polled = torch.zeros(300)
    reqs = [dist.irecv(polled, prv, tag=9)]
    time.sleep(0.05)
    reqs.append(dist.isend(values(300, rank, torch.float32, salt=3), nxt, tag=9))
    deadline = time.monotonic() + 30
    while not all(r.is_completed() for r in reqs) and time.monotonic() < deadline:
        time.sleep(0.001)
    if not all(r.is_completed() for r in reqs):
        problems.append("irecv before isend, polled with is_completed(): not completed after 30 s;")
    elif not torch.equal(polled, values(300, prv, torch.float32, salt=3)):
        problems.append("irecv before isend, polled with is_completed()")
    t = values(1000, rank, torch.bfloat16)
    dist.all_reduce(t)
    if not torch.equal(t, sum(values(1000, r, torch.float32) for r in range(world)).to(torch.bfloat16)):
        problems.append("bfloat16 all_reduce")
    return ["%s differs from the values computed here" % p for p in problems]


def train_ddp(rank, world):
    torch.manual_seed(0)
    net = Net()
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(6):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(8, 6, generator=g)
        y = torch.randint(4, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def worker(rank, world, backend, init, queue):
    try:
        if init.startswith("env://"):
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = init.split(":")[-1]
            init = "env://"
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        torch.set_num_threads(1)
        out = run_ops(rank, world)
        out["ddp"] = train_ddp(rank, world)
        if backend == "chorus":
            errors = []
            for what, fn, needle in [
                    ("bool reduce", lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool)), "cannot be reduced"),
                    ("float BAND", lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND),
                     "integer or bool"),
                    ("disagreeing splits", lambda: dist.all_to_all_single(
                        torch.zeros(4 * world + 100), torch.zeros(4 * world),
                        output_split_sizes=[100 + 4 * world if j == 0 else 0 for j in range(world)],
                        input_split_sizes=[4] * world), "split sizes disagree"),
                    ("int16", lambda: dist.all_reduce(torch.ones(3, dtype=torch.int16)), "not supported")]:
                try:
                    fn()
                    errors.append("%s: no error" % what)
                except RuntimeError as e:
                    if needle not in str(e):
                        errors.append("%s: message %r lacks %r" % (what, str(e), needle))
            out["errors"] = errors + chorus_only_ops(rank, world)
        dist.barrier()
        dist.destroy_process_group()
        buf = io.BytesIO()  # bytes, not shared tensors: this process ends before the parent reads
        torch.save(out, buf)
        queue.put((rank, buf.getvalue()))
    except Exception:
        queue.put((rank, "exception: " + traceback.format_exc()))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(backend, world, init):
    results = parity_util.run_forked(worker, world, backend, init)
    return {r: out if isinstance(out, str) else torch.load(io.BytesIO(out)) for r, out in results.items()}


def main():
    problems = []
    counted = 0
    with tempfile.TemporaryDirectory(prefix="chorus-python-") as tmp:
        for world in (2, 3):
            for kind in ("env", "file"):
                outs = {}
                for backend in ("gloo", "chorus"):
                    init = ("env://127.0.0.1:%d" % free_port()) if kind == "env" else \
                        "file://" + os.path.join(tmp, "%s-%d-%s" % (backend, world, kind))
                    outs[backend] = run(backend, world, init)
                for rank in range(world):
                    ref, got = outs["gloo"][rank], outs["chorus"][rank]
                    for name, r in (("gloo", ref), ("chorus", got)):
                        if isinstance(r, str):
                            problems.append("W=%d %s rank %d (%s): %s" % (world, kind, rank, name, r))
                    if isinstance(ref, str) or isinstance(got, str):
                        continue
                    problems.extend("W=%d rank %d: %s" % (world, rank, e) for e in got.pop("errors"))
                    for key, want in ref.items():
                        have = got.get(key)
                        counted += 1
                        if have is None:
                            problems.append("W=%d %s rank %d: %s missing" % (world, kind, rank, key))
                        elif key == "ddp":
                            diff = (have - want).abs().max().item()
                            if diff > 1e-6:
                                problems.append("W=%d %s rank %d: DDP parameters differ from gloo's by %g" %
                                                (world, kind, rank, diff))
                        elif not torch.equal(have, want):
                            problems.append("W=%d %s rank %d: %s differs from gloo's" % (world, kind, rank, key))
    for line in problems[:40]:
        print(line)
    print("%s: %d results compared with gloo's at W=2,3 over env:// and file://; %d problems" %
          ("MISMATCH" if problems else "OK", counted, len(problems)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
