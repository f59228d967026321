#!/usr/bin/python3
"""bench/multihost's table from its result files: per host count, link rate, op and size, each
system's p50 and busbw, busbw as a percentage of the link rate, and each chorus system's busbw over
gloo's.

    multihost_report.py DIR      (DIR holds N-RATE-SYSTEM-OP-PART.json; SYSTEM may hold dashes)
"""
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))
from harness import fmt, markdown_table, ratio, size_label  # noqa: E402

UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def link_gbps(rate):
    """The link rate in GB/s (1e9 bytes/s); None when unshaped."""
    for unit, scale in UNITS.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale / 8 / 1e9
    return None


def load(directory):
    """{(hosts, rate, op, bytes): {system: record}} from every result file in directory."""
    rows = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        parts = os.path.basename(path)[:-len(".json")].split("-")
        if len(parts) < 5 or not parts[0].isdigit():
            continue
        n, rate, op, system = int(parts[0]), parts[1], parts[-2], "-".join(parts[2:-2])
        with open(path) as f:
            for rec in json.load(f):
                rows.setdefault((n, rate, op, rec["bytes"]), {})[system] = rec
    return rows


def main():
    rows = load(sys.argv[1])
    systems = sorted({s for r in rows.values() for s in r})
    others = [s for s in systems if s != "gloo"] if "gloo" in systems else []
    headers = ["hosts", "link", "op", "size"]
    for s in systems:
        headers += ["%s us" % s, "%s busbw GB/s" % s, "%s of link" % s]
    headers += ["%s / gloo busbw" % s for s in others]
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
        table.append(cells)
    print(markdown_table(headers, table))


if __name__ == "__main__":
    main()
