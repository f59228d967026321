#!/usr/bin/python3
"""The seed's experiment on a Dask cluster: ResNet transfer learning from an image folder in S3,
trained by chorus's C++ transfer example at 1, 2 and 4 workers through chorus.dask, with the run
records of each arriving on this machine while it trains, and `chorus report` drawing test
accuracy against time for all of them.

    export AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... [AWS_ENDPOINT_URL=http://s3.local:9000]
    examples/dask/resnet_s3.py --scheduler tcp://scheduler:8786 --data s3://bucket/fmnist \\
        --workers 1,2,4 -- --classes Sandal,Shirt,Sneaker,Bag,Ankle_boot --epochs 3

Each worker runs one rank (a fresh process it starts, placed on the first N workers by address).
The AWS_* variables of this process are passed to every rank. Everything after `--` goes to the
transfer program unchanged. The records land in RUNS/w1, RUNS/w2, ... and the page in RUNS/report;
each rank 0 also keeps its own copy under its worker's working directory (runs/NAME).
"""
import argparse
import os
import shutil
import subprocess
import sys
import time

from distributed import Client

import chorus.dask

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_BIN = os.path.join(HERE, "..", "..", "build", "bin")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scheduler", required=True, help="the Dask scheduler's address (tcp://HOST:PORT)")
    ap.add_argument("--data", required=True, help="s3://bucket/prefix (or a directory every worker sees) with train/ and test/")
    ap.add_argument("--workers", default="1,2,4", help="worker counts to train at, in order (default 1,2,4)")
    ap.add_argument("--runs", default="runs-dask", help="where the run records and the report go")
    ap.add_argument("--transfer", default=os.path.join(BUILD_BIN, "transfer"), help="the transfer program")
    ap.add_argument("--chorus", default=shutil.which("chorus") or os.path.join(BUILD_BIN, "chorus"),
                    help="the chorus tool (for chorus report)")
    ap.add_argument("program_args", nargs="*", help="after --: arguments for the transfer program")
    args = ap.parse_args()
    try:
        args.counts = [int(n) for n in args.workers.split(",")]
    except ValueError:
        ap.error("--workers takes numbers such as 1,2,4, got %r" % args.workers)
    if any(n < 1 for n in args.counts):
        ap.error("--workers: each count must be at least 1")
    return args


def main():
    args = parse_args()
    client = Client(args.scheduler)
    workers = sorted(client.scheduler_info()["workers"])
    if max(args.counts) > len(workers):
        sys.exit("resnet_s3: --workers asks for %d workers; the cluster has %d" % (max(args.counts), len(workers)))
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    transfer = os.path.abspath(args.transfer)
    os.makedirs(args.runs, exist_ok=True)
    runs = []
    for n in args.counts:
        name = "w%d" % n
        results = os.path.join(args.runs, name)
        argv = [transfer, "--data", args.data, "--run-name", "dask-" + name, "--overwrite", *args.program_args]
        print("resnet_s3: %d worker(s): %s" % (n, " ".join(argv)), flush=True)
        t0 = time.monotonic()
        futures = chorus.dask.run_program(client, argv, workers=workers[:n], env=env, results_dir=results)
        client.gather(futures)  # raises ChorusDaskError naming the failed rank, its worker and message
        if not chorus.dask.wait_results(futures):
            sys.exit("resnet_s3: the run records of %s did not complete" % name)
        print("resnet_s3: %d worker(s) done in %.1f s; records in %s" % (n, time.monotonic() - t0, results),
              flush=True)
        runs.append(results)
    report = os.path.join(args.runs, "report")
    out = subprocess.run([args.chorus, "report", *runs, "-o", report], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        sys.exit("resnet_s3: chorus report failed: " + out.stderr.strip())
    print("resnet_s3: " + out.stdout.strip().splitlines()[-1], flush=True)
    client.close()


if __name__ == "__main__":
    main()
