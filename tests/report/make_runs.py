#!/usr/bin/python3
"""Writes run directories as the Accelerator would (docs/run-records.md), for report tests.

  make_runs.py OUT_ROOT [--name fashion_mnist] [--worlds 1,2] [--epochs 3] [--seed 0]

One directory per world size, OUT_ROOT/<name>-w<W>: the same job (12000 samples, batch 64 per
worker, SGD) at each world size, so that W workers take 1/W of the steps per epoch. The loss falls
with the samples seen, with noise; test_accuracy is logged once per epoch; step times are split
into data/forward/backward/optimizer with the allreduce partly hidden behind backward. The run at
the largest world size (when there are several) dies in its second epoch and resumes from the
checkpoint at the end of its first: its metrics.jsonl keeps the dead attempt's lines, then a
"resume" event, as a file appended to without truncation would. Prints the directories.
"""
import argparse
import json
import math
import os
import random

SAMPLES = 12000
BATCH = 64


def write_json(path, doc):
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


def make_run(root, name, world, epochs, rng, crash):
    d = os.path.join(root, "%s-w%d" % (name, world))
    os.makedirs(os.path.join(d, "metrics"), exist_ok=True)
    os.makedirs(os.path.join(d, "logs"), exist_ok=True)
    os.makedirs(os.path.join(d, "state"), exist_ok=True)
    write_json(os.path.join(d, "config.json"), {
        "run_name": name, "world_size": world, "attempt": 1 if crash else 0,
        "started": "2026-11-23T10:00:00Z", "host": "node0", "transport": "shm" if world > 1 else "none",
        "command": ["build/bin/fashion_mnist", "--epochs", str(epochs)],
        "accelerator": {"gradient_accumulation_steps": 1, "mixed_precision": "no"},
        "ddp": {"bucket_cap_mb": 25, "overlap": True},
        "config": {"lr": 0.01, "momentum": 0.9, "batch_size": BATCH},
    })
    steps_per_epoch = math.ceil(SAMPLES / (BATCH * world))
    total = steps_per_epoch * epochs
    crash_at = steps_per_epoch + steps_per_epoch // 3 if crash else None
    agg = open(os.path.join(d, "metrics.jsonl"), "w")
    ranks = [open(os.path.join(d, "metrics", "rank-%d.jsonl" % r), "w") for r in range(world)]
    logs = [open(os.path.join(d, "logs", "rank-%d.log" % r), "w") for r in range(world)]

    def line(obj, to_ranks=False):
        agg.write(json.dumps(obj) + "\n")
        if to_ranks:
            for f in ranks:
                f.write(json.dumps(obj) + "\n")

    t = 0.0
    attempt = 0
    line({"type": "event", "event": "start", "step": 0, "epoch": 0, "time": 0.0, "attempt": 0})
    step = 0
    saved = 0
    samples_seen = 0
    step_seconds = {}  # step -> its duration, the latest attempt's
    while step < total:
        step += 1
        epoch = (step - 1) // steps_per_epoch
        samples = min(BATCH * world, SAMPLES - ((step - 1) % steps_per_epoch) * BATCH * world)
        samples_seen += samples
        data = 1.5 + rng.random() * 0.6
        fwd = 9.0 + rng.random() * 1.5
        comm = 7.0 + rng.random() * 2 if world > 1 else 0.0
        wait = comm * (0.3 + rng.random() * 0.1) if world > 1 else 0.0
        bwd = 18.0 + rng.random() * 2 + wait
        opt = 2.0 + rng.random() * 0.4
        step_ms = data + fwd + bwd + opt + 0.8 + rng.random() * 0.5 + (120.0 if step == 1 else 0.0)
        t += step_ms / 1000
        step_seconds[step] = step_ms / 1000
        loss = 0.32 + 1.98 * math.exp(-samples_seen / 4500.0)
        loss = max(0.05, loss * (1 + rng.gauss(0, 0.08)))
        row = {"type": "step", "step": step, "epoch": epoch, "time": round(t, 4), "loss": round(loss, 5),
               "lr": 0.01, "samples": samples, "samples_per_s": round(samples / (step_ms / 1000), 2),
               "step_ms": round(step_ms, 3), "data_ms": round(data, 3), "forward_ms": round(fwd, 3),
               "backward_ms": round(bwd, 3), "optimizer_ms": round(opt, 3), "comm_ms": round(comm, 3),
               "comm_wait_ms": round(wait, 3), "hidden": round(1 - wait / comm, 4) if comm else 0}
        line(row)
        for r, f in enumerate(ranks):
            f.write(json.dumps(dict(row, samples=samples // world, loss=round(loss * (1 + 0.02 * r), 5))) + "\n")
        if step % steps_per_epoch == 0 or step == total:
            acc = 0.88 - 0.22 * math.exp(-samples_seen / 9000.0) + rng.gauss(0, 0.004)
            t += 1.2  # evaluation
            line({"type": "log", "step": step, "epoch": epoch, "time": round(t, 4),
                  "test_accuracy": round(acc, 4)})
            line({"type": "event", "event": "save", "step": step, "epoch": epoch, "time": round(t, 4),
                  "path": "state/step-%d" % step})
            saved = step
        if crash_at is not None and step == crash_at and attempt == 0:
            # SIGKILL: no stop event, no summary; the launcher restarts the group from the checkpoint.
            attempt = 1
            t += 6.0
            step = saved
            samples_seen = saved * BATCH * world
            line({"type": "event", "event": "resume", "step": saved, "epoch": saved // steps_per_epoch,
                  "time": round(t, 4), "path": "state/step-%d" % saved, "attempt": 1})
    line({"type": "event", "event": "finish", "step": total, "epoch": epochs - 1, "time": round(t, 4)})
    for r, f in enumerate(logs):
        f.write("[rank %d] finished %d steps\n" % (r, total))
    for f in ranks + logs + [agg]:
        f.close()
    train_seconds = sum(step_seconds.values())  # the kept steps only: no evaluation, no lost work
    write_json(os.path.join(d, "summary.json"), {
        "run_name": name, "world_size": world, "status": "finished", "steps": total, "epochs": epochs,
        "samples": SAMPLES * epochs, "samples_per_s": round(SAMPLES * epochs / train_seconds, 2),
        "train_seconds": round(train_seconds, 3), "wall_seconds": round(t + 2.5, 3),
        "loss": row["loss"], "last": {"test_accuracy": acc},
    })
    return d


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_root")
    ap.add_argument("--name", default="fashion_mnist")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    worlds = [int(w) for w in a.worlds.split(",")]
    rng = random.Random(a.seed)
    for w in worlds:
        print(make_run(a.out_root, a.name, w, a.epochs, rng, crash=len(worlds) > 1 and w == max(worlds)))


if __name__ == "__main__":
    main()
