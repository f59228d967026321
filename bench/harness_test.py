#!/usr/bin/python3
"""bench/harness.py's helpers, and every bench script importing it: each one's --help runs."""

import os
import signal
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.realpath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402


def first_line(path):
    with open(path) as f:
        return f.readline()


class Harness(unittest.TestCase):
    def test_sizes_parse_and_label_back(self):
        for text, n in (("4K", 4096), ("64KiB", 65536), ("16M", 16 << 20), ("1G", 1 << 30), ("4096", 4096),
                        ("12B", 12)):
            self.assertEqual(harness.parse_size(text), n)
        for bad in ("", "K", "4X", "-4K", "0"):
            with self.assertRaises(ValueError):
                harness.parse_size(bad)
        self.assertEqual([harness.size_label(n) for n in (4096, 16 << 20, 1 << 30, 1000, 1536)],
                         ["4 KiB", "16 MiB", "1 GiB", "1000 B", "1536 B"])

    def test_medians_and_ratios_skip_missing_values(self):
        self.assertEqual(harness.median_of([3, None, 1, 2]), 2)
        self.assertIsNone(harness.median_of([None]))
        self.assertEqual(harness.ratio(3.0, 2.0), 1.5)
        self.assertIsNone(harness.ratio(None, 2.0))
        self.assertIsNone(harness.ratio(3.0, 0))
        self.assertEqual(harness.fmt(None, "%.1f"), "-")
        self.assertEqual(harness.fmt(1.25, "%.1f"), "1.2")

    def test_tables_align_labels_left_and_numbers_right(self):
        headers, rows = ["model", "samples/s"], [["cnn", "12.5"], ["resnet18", "3.25"]]
        self.assertEqual(harness.text_table(headers, rows).splitlines(),
                         ["model     samples/s", "cnn            12.5", "resnet18       3.25"])
        self.assertEqual(harness.text_table(headers, rows, label_column=False).splitlines()[1], "     cnn       12.5")
        self.assertEqual(harness.markdown_table(headers, rows).splitlines(),
                         ["| model | samples/s |", "|---|---:|", "| cnn | 12.5 |", "| resnet18 | 3.25 |"])
        self.assertEqual(harness.markdown_table(headers, rows, label_column=False).splitlines()[1], "|---:|---:|")

    def test_child_reports(self):
        self.assertEqual(harness.describe_rc(3), "status 3")
        self.assertEqual(harness.describe_rc(-signal.SIGKILL), "signal SIGKILL")
        self.assertEqual(harness.tail("a\nb\nc\n", lines=2), "    | b\n    | c")
        self.assertEqual(harness.tail(""), "    (no output)")
        with tempfile.NamedTemporaryFile("w", suffix=".log") as f:
            f.write("one\ntwo\n")
            f.flush()
            self.assertEqual(harness.tail_file(f.name, lines=1), "    | two")
        self.assertEqual(harness.tail_file("/nonexistent/log"), "")

    def test_environment_and_machine(self):
        os.environ["RANK"] = "3"
        try:
            env = harness.run_env(EXTRA="1")
        finally:
            del os.environ["RANK"]
        self.assertNotIn("RANK", env)
        self.assertEqual((env["OMP_NUM_THREADS"], env["EXTRA"]), ("1", "1"))
        info = harness.machine_info()
        self.assertGreaterEqual(info["nproc"], 1)
        self.assertTrue(info["kernel"].startswith("Linux"))
        self.assertGreater(harness.free_port(), 0)

    def test_every_bench_script_starts(self):
        """A script whose import of the harness (or anything else) broke fails before --help prints."""
        scripts = sorted(f for f in os.listdir(HERE) if f.startswith("compare-") or f in ("scaling", "gpu-resnet"))
        python = [s for s in scripts if first_line(os.path.join(HERE, s)).startswith("#!/usr/bin/python3")]
        self.assertGreaterEqual(len(python), 7)
        for s in python:
            p = subprocess.run([os.path.join(HERE, s), "--help"], capture_output=True, text=True, timeout=60,
                               stdin=subprocess.DEVNULL)
            self.assertEqual(p.returncode, 0, "%s --help: %s" % (s, p.stderr[-2000:]))
            self.assertIn("usage", p.stdout.lower() + p.stderr.lower(), s)


if __name__ == "__main__":
    unittest.main()
