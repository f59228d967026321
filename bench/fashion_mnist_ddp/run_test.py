#!/usr/bin/python3
"""The test suite's run of the Fashion-MNIST harness, the hand-written DDP loop of
bench/fashion_mnist_ddp (registered as fashion_mnist_test).

usage: run_test.py PATH/TO/fashion_mnist_ddp

1. 2 ranks, 20 steps of the CNN, full test-set evaluation, a checkpoint: exits 0, prints progress,
   and the metrics JSON has the issue's keys with sane values (the model learned something).
2. --resume to 30 steps: continues from step 20 (10 more steps), with the same losses as an
   uninterrupted run of 30 steps.
3. Short runs of the MLP with --sync off and with --compression bf16 / --bucket-cap-mb.
Needs Debian's dataset-fashion-mnist (or FASHION_MNIST_DATA=DIR). Only the standard library.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

REQUIRED = ["world_size", "model", "steps", "samples_per_s", "test_accuracy", "train_seconds"]


def run(binary, args, tmp, name):
    metrics = os.path.join(tmp, name + ".json")
    cmd = [binary, "--nproc", "2", "--metrics-json", metrics, "--log-every", "1"] + args
    data = os.environ.get("FASHION_MNIST_DATA")
    if data:
        cmd += ["--data", data]
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240, cwd=tmp)
    print(p.stdout, flush=True)
    if p.returncode != 0:
        sys.exit(f"FAIL: {name}: exit code {p.returncode}")
    with open(metrics) as f:
        m = json.load(f)
    missing = [k for k in REQUIRED if k not in m]
    if missing:
        sys.exit(f"FAIL: {name}: metrics JSON lacks {missing}: {m}")
    return m, p.stdout


def check(cond, what):
    if not cond:
        sys.exit("FAIL: " + what)


def main():
    binary = os.path.abspath(sys.argv[1])
    with tempfile.TemporaryDirectory(prefix="fashion-mnist-test-") as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        m, out = run(binary, ["--max-steps", "20", "--checkpoint-dir", ckpt], tmp, "first")
        check(m["world_size"] == 2 and m["model"] == "cnn" and m["steps"] == 20, f"first run: {m}")
        check(m["samples_per_s"] > 0 and m["train_seconds"] > 0, f"first run timings: {m}")
        check(m["test_items"] == 10000, f"first run evaluated {m['test_items']} items, not 10000")
        # 20 steps of 2 x 64 samples: well above chance (0.10) already.
        check(0.3 < m["test_accuracy"] <= 1.0, f"first run accuracy {m['test_accuracy']}")
        check("step 20/20" in out and "samples/s" in out and "ETA" in out, "no progress line")
        check(os.path.exists(os.path.join(ckpt, "latest")), "no checkpoint written")

        m, out = run(binary, ["--max-steps", "30", "--resume", "--checkpoint-dir", ckpt, "--eval-limit", "2000"],
                     tmp, "resume")
        check(m["resumed_from_step"] == 20 and m["steps"] == 10 and m["total_steps"] == 30, f"resume: {m}")
        check(m["test_items"] == 2000, f"resume evaluated {m['test_items']} items")
        m_full, out_full = run(binary, ["--max-steps", "30", "--no-checkpoint", "--eval-limit", "500"], tmp, "full")
        check(m_full["last_loss"] == m["last_loss"],
              f"last loss {m['last_loss']!r} after resume, {m_full['last_loss']!r} uninterrupted")
        resumed = dict(re.findall(r"step (\d+)/30  loss (\S+)", out))
        full = dict(re.findall(r"step (\d+)/30  loss (\S+)", out_full))
        check(sorted(resumed, key=int) == [str(i) for i in range(21, 31)], f"resumed steps {sorted(resumed)}")
        check(all(resumed[s] == full[s] for s in resumed), f"losses after resume {resumed}, uninterrupted {full}")

        m, _ = run(binary, ["--model", "mlp", "--sync", "off", "--max-steps", "5", "--eval-limit", "500",
                            "--no-checkpoint"], tmp, "nosync")
        check(m["model"] == "mlp" and m["sync"] is False and m["steps"] == 5, f"--sync off: {m}")

        m, _ = run(binary, ["--model", "mlp", "--compression", "bf16", "--bucket-cap-mb", "0.5", "--max-steps", "5",
                            "--eval-limit", "500", "--no-checkpoint"], tmp, "bf16")
        check(m["compression"] == "bf16" and m["steps"] == 5 and m["ddp"]["buckets"] >= 2, f"bf16: {m}")
    print("OK")


if __name__ == "__main__":
    main()
