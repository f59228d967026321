#!/usr/bin/python3
"""`chorus report` on the command line: the errors a user meets, and where the page goes.

  report_cli_test.py --chorus build/bin/chorus

Asserts: a missing directory and a directory without metrics.jsonl exit 2 naming the missing
path; a bad metrics.jsonl line exits 2 naming file:line; no gnuplot in PATH exits 1 naming the
Debian package and writes nothing; with no -o, one run's page goes to RUN_DIR/report and several
runs' to ./chorus-report, the path printed as the last line.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def fail(msg):
    print("FAIL: " + msg, file=sys.stderr)
    sys.exit(1)


def report(chorus, args, cwd, env=None):
    return subprocess.run([chorus, "report"] + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def expect_error(p, code, needles, what):
    if p.returncode != code:
        fail("%s: exit code %d, expected %d\nstdout: %s\nstderr: %s" % (what, p.returncode, code, p.stdout, p.stderr))
    for n in needles:
        if n not in p.stderr:
            fail("%s: stderr does not say %r:\n%s" % (what, n, p.stderr))
    print("%s: %s" % (what, p.stderr.strip().splitlines()[0]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chorus", required=True)
    chorus = os.path.abspath(ap.parse_args().chorus)
    tmp = tempfile.mkdtemp(prefix="chorus-report-cli-")
    try:
        runs = subprocess.run([sys.executable, os.path.join(HERE, "make_runs.py"), tmp, "--epochs", "1"],
                              check=True, capture_output=True, text=True).stdout.split()
        one, two = runs

        expect_error(report(chorus, ["no-such-run"], tmp), 2, ["no-such-run is not a directory"], "missing directory")

        os.makedirs(os.path.join(tmp, "half"))
        shutil.copy(os.path.join(one, "config.json"), os.path.join(tmp, "half"))
        expect_error(report(chorus, ["half"], tmp), 2,
                     ["half is not a run directory", os.path.join("half", "metrics.jsonl") + " is missing"],
                     "no metrics.jsonl")

        bad = os.path.join(tmp, "bad")
        shutil.copytree(one, bad)
        with open(os.path.join(bad, "metrics.jsonl")) as f:
            lines = f.readlines()
        lines[2] = lines[2][: len(lines[2]) // 2] + "\n"  # a line cut in half
        with open(os.path.join(bad, "metrics.jsonl"), "w") as f:
            f.writelines(lines)
        expect_error(report(chorus, [one, "bad"], tmp), 2, ["bad/metrics.jsonl:3: not a JSON object"], "bad line")

        env = dict(os.environ, PATH=os.path.join(tmp, "empty-path"))
        p = report(chorus, [one, "-o", "nogp"], tmp, env)
        expect_error(p, 1, ["gnuplot", "gnuplot-nox"], "no gnuplot")
        if os.path.exists(os.path.join(tmp, "nogp")):
            fail("no gnuplot: the output directory was created anyway")

        p = report(chorus, [one], tmp)
        want = os.path.join(one, "report", "index.html")
        if p.returncode != 0 or p.stdout.strip().splitlines()[-1] != want or not os.path.isfile(want):
            fail("one run, no -o: exit %d, printed %r, expected %r\n%s" % (p.returncode, p.stdout, want, p.stderr))
        p = report(chorus, [one, two], tmp)
        want = os.path.join("chorus-report", "index.html")
        if p.returncode != 0 or p.stdout.strip().splitlines()[-1] != want or not os.path.isfile(os.path.join(tmp, want)):
            fail("two runs, no -o: exit %d, printed %r, expected %r\n%s" % (p.returncode, p.stdout, want, p.stderr))
        print("default output directories: RUN_DIR/report, ./chorus-report")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
