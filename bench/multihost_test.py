#!/usr/bin/python3
"""bench/multihost at its smallest: two namespace hosts on a 100 Mbit/s link (tc tbf), chorus's
allreduce at 256 KiB and 1 MiB, by the plan and "tuned", and every algorithm compared in one job
(chorus-onejob). The runs must finish with correct results,
write their files and table (with the setup's time and descriptors, and the algorithm "tuned" kept) and the run's network counters, and at 1 MiB reach 60-110% of the link rate (less: the shaping or the benchmark is broken;
more: the link was not shaped). Exit 77 (skipped) where namespaces cannot be made.

    multihost_test.py BIN_DIR
"""
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.realpath(__file__))


def main():
    with tempfile.TemporaryDirectory(prefix="chorus-multihost-test-") as out:
        p = subprocess.run([os.path.join(HERE, "multihost"), "--hosts", "2", "--rates", "100mbit", "--sizes", "256K,1M",
                            "--systems", "chorus-tcp,chorus-tuned,chorus-onejob", "--seconds", "0.3", "--out", out, "--bin", sys.argv[1],
                            "--timeout", "120"], capture_output=True, text=True, timeout=240)
        print(p.stdout + p.stderr)
        if p.returncode == 2 and "cannot make" in p.stderr:
            return 77
        if p.returncode != 0:
            print("FAIL: bench/multihost exited with %d" % p.returncode)
            return 1
        with open(os.path.join(out, "2-100mbit-chorus-tcp-allreduce-small.json")) as f:
            records = {r["bytes"]: r for r in json.load(f)}
        problems = []
        if sorted(records) != [256 << 10, 1 << 20]:
            problems.append("sizes measured: %s" % sorted(records))
        if not all(r["correct"] and r["world_size"] == 2 for r in records.values()):
            problems.append("a result was wrong or the world was not 2 hosts: %s" % records)
        # Setup's cost as chorus bench reports it: a connected group in seconds, a handful of
        # descriptors (stdio, the store, the peer's connections).
        for r in records.values():
            if not (0 < r["setup_s"] < 60 and 4 <= r["fds_per_rank"] <= 64):
                problems.append("setup figures out of range: %.3f s, %d descriptors" % (r["setup_s"], r["fds_per_rank"]))
        link = 100e6 / 8 / 1e9
        share = records.get(1 << 20, {}).get("busbw_gbps", 0) / link
        if not 0.6 <= share <= 1.1:
            problems.append("1 MiB busbw %.0f%% of the 100 Mbit/s link, expected 60-110%%" % (100 * share))
        # Each run is followed by what it cost the network: TCP retransmissions in the hosts and tc's
        # drops, non-negative counts (a shaped 1 MiB allreduce between two hosts drops nothing).
        counts = re.findall(r"TCP segments retransmitted: (-?\d+); packets dropped by tc: (-?\d+)", p.stderr)
        if not counts or any(int(r) < 0 or int(d) < 0 for r, d in counts):
            problems.append("no network counters after the run, or negative ones: %s" % counts)
        summary = open(os.path.join(out, "summary.md")).read()
        if "| 2 | 100mbit | allreduce | 1 MiB |" not in summary:
            problems.append("summary.md lacks the 1 MiB row")
        # chorus-tuned: right results, and each size's record names the algorithm its trials kept,
        # as does the table.
        with open(os.path.join(out, "2-100mbit-chorus-tuned-allreduce-small.json")) as f:
            tuned = {r["bytes"]: r for r in json.load(f)}
        algorithms = {"ring", "recursive_doubling", "rabenseifner"}
        if sorted(tuned) != [256 << 10, 1 << 20] or not all(r["correct"] and r["tuned_choice"] in algorithms
                                                             for r in tuned.values()):
            problems.append("chorus-tuned: wrong results or no kept algorithm: %s" % tuned)
        if "chorus-tuned picked" not in summary:
            problems.append("summary.md lacks the chorus-tuned picked column")
        # chorus-onejob: one record per size and algorithm from one job, each right and marked as
        # compared; its own table, with the plan's time over the fastest forced one of the job.
        with open(os.path.join(out, "2-100mbit-chorus-onejob-allreduce-small.json")) as f:
            onejob = [(r["bytes"], r["allreduce_algorithm"]) for r in json.load(f)
                      if r["correct"] and r["compared_in_one_job"] and r["world_size"] == 2]
        compared = ["ring", "recursive_doubling", "rabenseifner", "auto", "tuned"]
        if sorted(onejob) != sorted((b, a) for b in (256 << 10, 1 << 20) for a in compared):
            problems.append("chorus-onejob: wrong results or not every algorithm at every size: %s" % onejob)
        row = re.search(r"^\| 2 \| 100mbit \| allreduce \| 1 MiB \| 1 \|(?: [^|]+ \|){6} ([0-9.]+) \|", summary, re.M)
        if "Algorithms compared in one job" not in summary or not row or not 0.5 < float(row.group(1)) < 2:
            problems.append("summary.md lacks the one-job table or its plan / fastest figure at 1 MiB")
        over_ring = re.search(r"^\| 2 \| 100mbit \| allreduce \| 1 MiB \|.* ([0-9.]+) \|$", summary, re.M)
        if "| ring / plan |" not in summary or not over_ring or not 0.5 < float(over_ring.group(1)) < 2:
            problems.append("summary.md's one-job table lacks the ring's time over the plan's at 1 MiB")
        for problem in problems:
            print("FAIL: " + problem)
        print("busbw at 1 MiB: %.0f%% of the link" % (100 * share))
        return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
