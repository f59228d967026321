#!/usr/bin/python3
"""bench/multihost's table from its result files: per host count, link rate, op and size, each
system's p50 and busbw, busbw as a percentage of the link rate, each chorus system's busbw over
gloo's, the algorithm a `chorus-tuned` run measured and kept for the size, and, where the
allreduce algorithms ran forced one by one (chorus-ring, chorus-recursive_doubling,
chorus-rabenseifner), each other chorus system's time over the fastest of them, and the forced
time of the algorithm chorus-tuned kept over the fastest (how good its pick is, apart from the noise
of its own run). Runs that compared the algorithms in one job (chorus-onejob) get a table of their
own: each algorithm's p50, the plan's and tuned's time over the fastest forced algorithm's of the
same job (the median over rounds of each round's ratio), and in each round the forced time of the
algorithm tuned kept over the fastest.

    multihost_report.py DIR      (DIR holds N-RATE-SYSTEM-OP-PART.json; SYSTEM may hold dashes)

Repeated runs (bench/multihost --repeat: PART_rK.json) count once per point: the run with the
median p50 (the lower of the two middle ones for an even count), all its figures together.
"""
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))
from harness import fmt, markdown_table, ratio, size_label  # noqa: E402

UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
FORCED = ["chorus-ring", "chorus-recursive_doubling", "chorus-rabenseifner"]


def link_gbps(rate):
    """The link rate in GB/s (1e9 bytes/s); None when unshaped."""
    for unit, scale in UNITS.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale / 8 / 1e9
    return None


def read(directory):
    """Every result file in directory: ({(hosts, rate, op, bytes): {system: [record]}} of the runs of
    one system per job, {(hosts, rate, op, bytes): [{algorithm: record}]} of the jobs that compared
    algorithms, one dict per job)."""
    runs, onejob = {}, {}
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        parts = os.path.basename(path)[:-len(".json")].split("-")
        if len(parts) < 5 or not parts[0].isdigit():
            continue
        n, rate, op, system = int(parts[0]), parts[1], parts[-2], "-".join(parts[2:-2])
        with open(path) as f:
            records = json.load(f)
        jobs = {}
        for rec in records:
            key = (n, rate, op, rec["bytes"])
            if rec.get("compared_in_one_job"):
                jobs.setdefault(key, {})[rec["allreduce_algorithm"]] = rec
            else:
                runs.setdefault(key, {}).setdefault(system, []).append(rec)
        for key, job in jobs.items():
            onejob.setdefault(key, []).append(job)
    return runs, onejob


def load(directory):
    """{(hosts, rate, op, bytes): {system: record}}: each system's median run per point (jobs that
    compared algorithms are left to load_onejob)."""
    runs, _ = read(directory)
    return {key: {system: median_run(recs) for system, recs in by_system.items()} for key, by_system in runs.items()}


def load_onejob(directory):
    """{(hosts, rate, op, bytes): [{algorithm: record}]}: the jobs that compared algorithms."""
    return read(directory)[1]


def median(values):
    """The median (the lower middle one of an even count); None for none."""
    ordered = sorted(v for v in values if v is not None)
    return ordered[(len(ordered) - 1) // 2] if ordered else None


ALGORITHMS = ["ring", "recursive_doubling", "rabenseifner"]


def onejob_table(onejob):
    """The algorithms compared in one job: each one's p50 (median over jobs), the plan's and
    tuned's time over the fastest forced algorithm's of the same job (median over jobs, and each
    job's), and the ring's time over the plan's (median over jobs: how much faster the plan ran than
    the ring would have, the issue's 1.3x)."""
    headers = ["hosts", "link", "op", "size", "jobs", "ring us", "RD us", "Rab us", "plan us", "tuned us",
               "fastest forced", "plan / fastest", "tuned / fastest", "tuned kept", "tuned's pick forced / fastest",
               "plan / fastest, each job", "ring / plan"]
    table = []
    for key in sorted(onejob, key=lambda k: (k[0], -(link_gbps(k[1]) or 1e9), k[2], k[3])):
        n, rate, op, size = key
        jobs = onejob[key]
        p50 = {a: median(j.get(a, {}).get("p50_us") for j in jobs) for a in ALGORITHMS + ["auto", "tuned"]}
        fastest = [min((a for a in ALGORITHMS if a in j), key=lambda a: j[a]["p50_us"], default=None) for j in jobs]
        per_job = [ratio(j.get("auto", {}).get("p50_us"), j[f]["p50_us"]) if f else None for j, f in zip(jobs, fastest)]
        tuned = [ratio(j.get("tuned", {}).get("p50_us"), j[f]["p50_us"]) if f else None for j, f in zip(jobs, fastest)]
        over_ring = [ratio(j.get("ring", {}).get("p50_us"), j.get("auto", {}).get("p50_us")) for j in jobs]
        winners = sorted(set(f for f in fastest if f))
        kept = [j.get("tuned", {}).get("tuned_choice") or "-" for j in jobs]
        # The pick apart from its own group's noise: the forced time of the algorithm tuned kept,
        # over the fastest forced time, in the same job.
        pick = [ratio(j.get(k, {}).get("p50_us"), j[f]["p50_us"]) if f else None for j, k, f in zip(jobs, kept, fastest)]
        table.append([str(n), rate, op, size_label(size), str(len(jobs))] +
                     [fmt(p50[a], "%.0f") for a in ALGORITHMS + ["auto", "tuned"]] +
                     [", ".join(winners) or "-", fmt(median(per_job), "%.2f"),
                      fmt(median(tuned), "%.2f"), ", ".join(kept),
                      " ".join(fmt(x, "%.2f") for x in pick), " ".join(fmt(x, "%.2f") for x in per_job),
                      fmt(median(over_ring), "%.2f")])
    return markdown_table(headers, table)


def median_run(records):
    """The record with the median p50 (the lower middle one of an even count)."""
    ordered = sorted(records, key=lambda r: r["p50_us"])
    return ordered[(len(ordered) - 1) // 2]


def main():
    rows, onejob = load(sys.argv[1]), load_onejob(sys.argv[1])
    if onejob:
        print("Algorithms compared in one job (chorus-onejob):\n")
        print(onejob_table(onejob))
        print()
    if not rows:
        return
    systems = sorted({s for r in rows.values() for s in r})
    others = [s for s in systems if s != "gloo"] if "gloo" in systems else []
    headers = ["hosts", "link", "op", "size"]
    for s in systems:
        headers += ["%s us" % s, "%s busbw GB/s" % s, "%s of link" % s]
    headers += ["%s / gloo busbw" % s for s in others]
    # allreduce "tuned": the algorithm its trials kept for the size (bench.cc's tuned_choice).
    picked = [s for s in systems if any(r.get(s, {}).get("tuned_choice") for r in rows.values())]
    headers += ["%s picked" % s for s in picked]
    forced = [s for s in systems if s in FORCED]
    choosers = [s for s in systems if s.startswith("chorus-") and s not in FORCED] if forced else []
    headers += ["%s / fastest forced" % s for s in choosers]
    # How good the tuned pick is, apart from its own run's noise: the forced run of the algorithm
    # it kept, over the fastest forced run.
    regret = [s for s in picked if forced]
    headers += ["%s pick, forced / fastest forced" % s for s in regret]
    table = []
    for key in sorted(rows, key=lambda k: (k[0], -(link_gbps(k[1]) or 1e9), k[2], k[3])):
        n, rate, op, size = key
        r = rows[key]
        link = link_gbps(rate)
        cells = [str(n), rate, op, size_label(size)]
        for s in systems:
            rec = r.get(s, {})
            bus = rec.get("busbw_gbps")
            cells += [fmt(rec.get("p50_us"), "%.0f"), fmt(bus, "%.3f"),
                      fmt(100 * bus / link if bus is not None and link else None, "%.0f%%")]
        gloo = r.get("gloo", {}).get("busbw_gbps")
        cells += [fmt(ratio(r.get(s, {}).get("busbw_gbps"), gloo), "%.2fx") for s in others]
        cells += [r.get(s, {}).get("tuned_choice") or "-" for s in picked]
        fastest = min((r[s]["p50_us"] for s in forced if s in r), default=None)
        cells += [fmt(ratio(r.get(s, {}).get("p50_us"), fastest), "%.2f") for s in choosers]
        for s in regret:
            pick = r.get(s, {}).get("tuned_choice")
            cells.append(fmt(ratio(r.get("chorus-" + pick, {}).get("p50_us"), fastest), "%.2f") if pick else "-")
        table.append(cells)
    print(markdown_table(headers, table))


if __name__ == "__main__":
    main()
