#!/usr/bin/python3
"""bench/scaling at a tiny size (registered as bench_scaling_test).

usage: scaling_test.py BIN_DIR    (BIN_DIR holds chorus and transfer)

1. `bench/scaling --limit 20 --epochs 1 --pretrain-epochs 1 --worlds 1,2,4` into a scratch
   directory: 100 training images of 5 classes, so 4, 2 and 1 steps at W = 1, 2, 4.
2. The records: runs/scaling-w1, -w2, -w4 hold config.json with world_size 1, 2, 4, the transport
   expected (shared memory at W=2, the hybrid at W=4: two namespace-hosts), a finished summary and
   one test accuracy per epoch; scaling.json agrees.
3. The page: report/index.html with the test accuracy against wall time and the throughput against
   workers figures, and the three runs.
4. The output says which points are oversubscribed on this machine's cores.
5. Nothing is left: no namespace or veth named after the bench's pid, no temporary directory.
Exits 77 (skipped) when the W=4 point was skipped because network namespaces cannot be made here
(not root, no `ip netns`), after checking the W=1 and W=2 points.
"""
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
WORLDS = (1, 2, 4)


def check(cond, what):
    if not cond:
        sys.exit("FAIL: " + what)


def main():
    bin_dir = sys.argv[1]
    work = tempfile.mkdtemp(prefix="chorus-scaling-test-")
    out = os.path.join(work, "out")
    before = set(glob.glob("/tmp/chorus-scaling-*"))
    try:
        cmd = [os.path.join(HERE, "scaling"), "--bin", bin_dir, "--out", out, "--limit", "20", "--epochs", "1",
               "--pretrain-epochs", "1", "--worlds", ",".join(map(str, WORLDS)), "--timeout", "120"]
        print("$ " + " ".join(cmd), flush=True)
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            text, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.terminate()  # its trap stops the runs and removes the namespaces
            text, _ = p.communicate(timeout=30)
            print(text, flush=True)
            check(False, "bench/scaling did not finish within 240 s")
        print(text, flush=True)
        check(p.returncode == 0, f"bench/scaling exited with status {p.returncode}")

        summary = json.load(open(os.path.join(out, "scaling.json")))
        points = {pt["world_size"]: pt for pt in summary["points"]}
        check(sorted(points) == list(WORLDS), f"scaling.json's points are W = {sorted(points)}")
        want_transport = {2: "shm", 4: "hybrid"}
        for w in WORLDS:
            pt = points[w]
            if w == 4 and pt["status"] == "skipped":
                continue
            check(pt["status"] == "finished", f"W={w}: status {pt['status']}")
            run = os.path.join(out, "runs", f"scaling-w{w}")
            config = json.load(open(os.path.join(run, "config.json")))
            run_summary = json.load(open(os.path.join(run, "summary.json")))
            check(config["world_size"] == w, f"{run}/config.json: world_size {config['world_size']}, expected {w}")
            if w in want_transport:
                check(config["transport"] == want_transport[w],
                      f"{run}/config.json: transport {config['transport']}, expected {want_transport[w]}")
            check(run_summary["status"] == "finished" and run_summary["samples_per_s"] > 0,
                  f"{run}/summary.json: {run_summary}")
            check(len(pt["test_accuracy"]) == 1, f"W={w}: test accuracies {pt['test_accuracy']}, expected 1 epoch")
            check(pt["transport"] == config["transport"] and pt["recorded_world_size"] == w,
                  f"scaling.json's W={w} point disagrees with {run}/config.json: {pt}")
            print(f"PASS: W={w}: {run} holds world_size {w}, transport {config['transport']}, "
                  f"{run_summary['samples_per_s']:.1f} samples/s", flush=True)

        page = open(os.path.join(out, "report", "index.html")).read()
        for what in ("test_accuracy against wall time", "Throughput against workers"):
            check(what in page, f"the report lacks the figure '{what}'")
        ran = [w for w in WORLDS if points[w]["status"] == "finished"]
        for w in ran:
            check(f"scaling-w{w} ({w} worker" in page, f"the report does not show the run scaling-w{w}")
        print("PASS: report/index.html has test accuracy against wall time, throughput against workers and "
              f"the runs W = {ran}", flush=True)

        cores = os.cpu_count()
        for w in ran:
            if w > cores:
                check(f"W={w} is OVERSUBSCRIBED {w / cores:g}x on {cores} cores" in text,
                      f"the output does not say that W={w} is oversubscribed on {cores} cores")
        print(f"PASS: the output names the points oversubscribed on {cores} cores", flush=True)

        left = set(glob.glob("/tmp/chorus-scaling-*")) - before
        check(not left, f"temporary directories left behind: {sorted(left)}")
        if shutil.which("ip"):
            netns = subprocess.run(["ip", "netns", "list"], stdout=subprocess.PIPE, text=True).stdout
            links = subprocess.run(["ip", "-o", "link"], stdout=subprocess.PIPE, text=True).stdout
            for name in (f"chorus_a_{p.pid}", f"chorus_b_{p.pid}"):
                check(name not in netns, f"namespace {name} left behind")
            check(f"chva{p.pid}" not in links, f"veth chva{p.pid} left behind")
        print("PASS: no namespace, veth or temporary directory left behind", flush=True)

        if points[4]["status"] == "skipped":
            print(f"SKIP: the W=4 point (two namespace-hosts) was skipped: {points[4].get('reason')}")
            sys.exit(77)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("PASS")


if __name__ == "__main__":
    main()
