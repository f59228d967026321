#!/usr/bin/python3
"""The client side of tests/netns/dask_two_hosts_test.sh: a Dask cluster with one worker on each of
two network-namespace hosts (the scheduler and this client on host A).

1. chorus.dask.run(..., backend=None): PyTorch DDP on backend "chorus", set up by the function
   itself, one rank per worker: rank 1 ran on host B's
   worker, MASTER_ADDR is host A's address, and both ranks' parameters equal the single-process
   reference (dask_test.reference) and the same job's under `chorus run -n 2` on host A (with CHORUS).
2. run_program: the C++ transfer example (with CHORUS and TRANSFER given), one rank per host, from
   a small rendered image folder: both ranks exit 0, the client's run directory holds its test
   accuracy and a summary of a world of 2.
3. Host B's worker SIGKILLed while its rank allreduces: rank 0's future raises within 10 s naming
   the dead rank, every future has ended within 30 s, and no rank process is left (pids are
   global: the hosts share a pid namespace).
usage: dask_two_hosts.py SCHEDULER_ADDRESS ADDR_A ADDR_B [CHORUS TRANSFER]. Prints OK: ... and exits 0, else one line
per problem and exits 1.
"""
import json
import os
import subprocess
import sys
import tempfile

from distributed import Client

import chorus.dask
from dask_test import kill_a_worker_mid_training, reference, same_as_under_chorus_run, summarize, train


def main():
    address, addr_a, addr_b = sys.argv[1:4]
    chorus_bin, transfer = (sys.argv[4:6] + ["", ""])[:2]
    problems, notes = [], []
    client = Client(address, timeout=60)
    try:
        client.wait_for_workers(2, timeout=60)
        info = client.scheduler_info()["workers"]
        workers = sorted(info, key=lambda w: info[w]["host"] != addr_a)  # host A's first: rank 0
        hosts = [info[w]["host"] for w in workers]
        if hosts != [addr_a, addr_b]:
            problems.append("workers on hosts %s, expected %s" % (hosts, [addr_a, addr_b]))
        steps = 5
        futures = chorus.dask.run(client, train, steps, own_init=True, workers=workers, backend=None)
        results = client.gather(futures)
        want = reference(2, steps)
        for rank, r in enumerate(results):
            if r["env"]["MASTER_ADDR"] != addr_a:
                problems.append("rank %d's MASTER_ADDR %s, expected host A's %s" % (rank, r["env"]["MASTER_ADDR"], addr_a))
            if max(abs(a - b) for a, b in zip(r["params"], want)) > 1e-6:
                problems.append("rank %d's parameters differ from the single-process reference" % rank)
        placed = client.who_has(futures)
        if [list(placed[f.key]) for f in futures] != [[w] for w in workers]:
            problems.append("placement %s, expected %s" % (placed, workers))
        if chorus_bin:
            problems += same_as_under_chorus_run(chorus_bin, steps, results)
            notes.append("DDP across the two hosts equal to the reference and to the job under chorus run")
        else:
            notes.append("DDP across the two hosts equal to the reference")

        # run_program: the C++ transfer example, one rank per host, from a small image folder (the
        # hosts share this machine's files), its records streamed here
        if chorus_bin and transfer:
            with tempfile.TemporaryDirectory(prefix="chorus-dask-2h-") as tmp:
                data = os.path.join(tmp, "fmnist")
                subprocess.run([chorus_bin, "data", "render-fashion-mnist", data, "--format", "png", "--limit", "12"],
                               check=True, timeout=120, capture_output=True)
                results_dir = os.path.join(tmp, "runs", "transfer")
                argv = [transfer, "--data", data, "--classes", "Trouser,Bag", "--epochs", "1", "--threads", "1",
                        "--loader-threads", "1", "--batch-size", "4", "--run-name", "dask-2h", "--overwrite"]
                futures = chorus.dask.run_program(client, argv, workers=workers, results_dir=results_dir)
                codes = client.gather(futures)
                complete = chorus.dask.wait_results(futures, 60)
                with open(os.path.join(results_dir, "metrics.jsonl")) as f:
                    records = [json.loads(line) for line in f if line.strip()]
                with open(os.path.join(results_dir, "summary.json")) as f:
                    summary = json.load(f)
                accuracy = [r["test_accuracy"] for r in records if r.get("type") == "log" and "test_accuracy" in r]
                if codes != [0, 0] or not complete or len(accuracy) != 1 or summary["world_size"] != 2:
                    problems.append("run_program transfer: exit codes %s, records complete %s, accuracies %s, "
                                    "summary %s" % (codes, complete, accuracy, summary))
                notes.append("run_program trained the C++ transfer example across the hosts (test accuracy %s), "
                             "its records streamed to the client" % accuracy)

        # host B's worker SIGKILLed while its rank allreduces
        problems += kill_a_worker_mid_training(client, workers, notes)
    finally:
        client.close()
    return summarize(problems, notes)


if __name__ == "__main__":
    sys.exit(main())
