#!/usr/bin/python3
"""loader_bench_test: bench/compare-loader's chorus side keeps working (no timing is checked).

    loader_bench_test.py CHORUS LOADER_BENCH

Renders 3 Fashion-MNIST images per class (30 train images) with `chorus data render-fashion-mnist`
into a temporary directory, then:
  * `loader_bench read` with each transform: one JSON line whose images are 30 per epoch, batch
    shape [B, 3, S, S] (RGB), positive times and peak RSS; a missing root fails with status 1 and
    names it;
  * `loader_bench train --nproc 1` for 2 steps from the folder and from memory: status 0 and a
    summary.json of 2 finished steps with a positive samples_per_s.
Exits 77 (skipped) without Debian's dataset-fashion-mnist.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

DATA = "/usr/share/datasets/fashion-mnist"
PER_CLASS = 3


def run(cmd, cwd=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=cwd, env=env,
                          stdin=subprocess.DEVNULL)


def check(ok, what, p=None):
    if not ok:
        detail = "" if p is None else "\n  stdout: %s\n  stderr: %s" % (p.stdout[-2000:], p.stderr[-2000:])
        print("FAIL: %s%s" % (what, detail))
        sys.exit(1)


def main():
    chorus, bench = sys.argv[1], sys.argv[2]
    if not os.path.isfile(os.path.join(DATA, "train-images-idx3-ubyte.gz")):
        print("skip: no %s (Debian's dataset-fashion-mnist)" % DATA)
        return 77
    tmp = tempfile.mkdtemp(prefix="loader_bench_test_")
    try:
        tree = os.path.join(tmp, "fm")
        p = run([chorus, "data", "render-fashion-mnist", tree, "--size", "28", "--format", "png",
                 "--limit", str(PER_CLASS)])
        check(p.returncode == 0, "render-fashion-mnist", p)
        root = os.path.join(tree, "train")
        images = 10 * PER_CLASS

        for transform, size, batch, epochs in (("pad-crop", 28, 8, 2), ("resize-crop", 24, 7, 1)):
            p = run([bench, "read", root, "--size", str(size), "--transform", transform, "--threads", "2",
                     "--batch-size", str(batch), "--epochs", str(epochs)])
            check(p.returncode == 0, "loader_bench read (%s)" % transform, p)
            lines = [l for l in p.stdout.splitlines() if l.strip()]
            check(len(lines) == 1, "one JSON line on stdout", p)
            r = json.loads(lines[0])
            want = {"mode": "read", "transform": transform, "size": size, "dataset_size": images, "classes": 10,
                    "images": images * epochs, "batches": epochs * -(-images // batch),
                    "batch_shape": [batch, 3, size, size], "threads": 2, "epochs": epochs}
            wrong = {k: (r.get(k), v) for k, v in want.items() if r.get(k) != v}
            check(not wrong, "read JSON (got, expected): %s" % wrong, p)
            for k in ("seconds", "images_per_s", "peak_rss_mb"):
                check(isinstance(r.get(k), (int, float)) and r[k] > 0, "positive %s: %r" % (k, r.get(k)), p)
            check(abs(r["images_per_s"] - r["images"] / r["seconds"]) < 1e-6 * r["images_per_s"],
                  "images_per_s = images / seconds", p)

        p = run([bench, "read", os.path.join(tmp, "missing")])
        check(p.returncode == 1 and "missing" in p.stderr, "a missing root fails naming it", p)

        for source in ("folder", "memory"):
            work = os.path.join(tmp, source)
            os.mkdir(work)
            p = run([bench, "train", "--data", root, "--source", source, "--steps", "2", "--batch-size", "4",
                     "--image-size", "28", "--nproc", "1", "--run-name", source], cwd=work)
            check(p.returncode == 0, "loader_bench train --source %s" % source, p)
            with open(os.path.join(work, "runs", source, "summary.json")) as f:
                s = json.load(f)
            check(s.get("status") == "finished" and s.get("steps") == 2 and s.get("samples") == 8,
                  "summary.json of 2 steps of 4 samples: %s" % {k: s.get(k) for k in ("status", "steps", "samples")})
            check(s.get("samples_per_s", 0) > 0, "positive samples_per_s in summary.json")
        print("loader_bench_test: OK")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
