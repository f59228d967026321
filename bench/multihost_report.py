#!/usr/bin/python3
"""bench/multihost's table from its result files: per host count, link rate, op and size, each
system's p50 and busbw, busbw as a percentage of the link rate, each chorus system's busbw over
gloo's, the algorithm a `chorus-tuned` run measured and kept for the size, and, where the
allreduce algorithms ran forced one by one (chorus-ring, chorus-recursive_doubling,
chorus-rabenseifner), each other chorus system's time over the fastest of them, and the forced
time of the algorithm chorus-tuned kept over the fastest (how good its pick is, apart from the noise
of its own run).

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


def load(directory):
    """{(hosts, rate, op, bytes): {system: record}} from every result file in directory."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        parts = os.path.basename(path)[:-len(".json")].split("-")
        if len(parts) < 5 or not parts[0].isdigit():
            continue
        n, rate, op, system = int(parts[0]), parts[1], parts[-2], "-".join(parts[2:-2])
        with open(path) as f:
            for rec in json.load(f):
                runs.setdefault((n, rate, op, rec["bytes"]), {}).setdefault(system, []).append(rec)
    return {key: {system: median_run(recs) for system, recs in by_system.items()} for key, by_system in runs.items()}


def median_run(records):
    """The record with the median p50 (the lower middle one of an even count)."""
    ordered = sorted(records, key=lambda r: r["p50_us"])
    return ordered[(len(ordered) - 1) // 2]


def main():
    rows = load(sys.argv[1])
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
