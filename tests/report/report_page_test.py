#!/usr/bin/python3
"""chorus report's page in a real browser: Debian's headless chromium, driven over the DevTools
protocol on a pipe (--remote-debugging-pipe), so that console errors, uncaught exceptions and failed
loads arrive as structured events rather than log lines to scan.

  report_page_test.py --chorus build/bin/chorus [--screenshot OUT.png] [RUN_DIR ...]

With no RUN_DIR, two pages are checked: two runs of the same job at 1 and 2 workers for 3 epochs
(make_runs.py, the 2-worker one resumed), and one run of one epoch. Checks, in order:
  1. the checker itself: a deliberately bad page (console.error, a thrown exception, a missing
     image) must give all three errors, so a clean result below means something;
  2. `chorus report RUN_DIR... -o OUT` exits 0 and prints OUT/index.html as its last line;
  3. the page loads nothing from elsewhere (no script, no src=, no external href or url());
  4. loaded in chromium: no console error, exception or failed load; every expected figure is
     there (loss and throughput against step, loss against time, the breakdown, and each user
     scalar as its logging calls for: with at most two values per run, a bar of each run's last
     value (and against time when there are several runs); logged once per epoch, against epochs
     completed and time; else against step and time)
     and draws, for every run, a legend entry and a line with a point per record (counted
     independently of chorus from metrics.jsonl here); the breakdown has every run's bar label and
     the six phases; the runs table has a row per run;
  5. a 1280x2400 screenshot of each page is written to the temporary directory (and to
     --screenshot, with the page's name before the extension when there are two).
Exits 77 (skipped) when chromium is not installed.
"""
import argparse
import base64
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--no-first-run", "--no-default-browser-check", "--hide-scrollbars", "--mute-audio",
                  "--disable-dev-shm-usage"]


def fail(msg):
    print("FAIL: " + msg, file=sys.stderr)
    sys.exit(1)


class Browser:
    """One headless chromium, spoken to over fds 3 (commands in) and 4 (replies and events out)."""

    def __init__(self, chromium, profile_dir, timeout=30.0):
        self.timeout = timeout
        cmd_r, self.cmd_w = os.pipe()
        self.out_r, out_w = os.pipe()
        # Keep the child's ends off fds 3 and 4 until the child moves them there.
        hi_cmd_r = os.dup2(cmd_r, 100, inheritable=False)
        hi_out_w = os.dup2(out_w, 101, inheritable=False)
        os.close(cmd_r)
        os.close(out_w)

        def child_fds():
            os.dup2(hi_cmd_r, 3)
            os.dup2(hi_out_w, 4)

        self.proc = subprocess.Popen(
            [chromium] + CHROMIUM_FLAGS + ["--remote-debugging-pipe", "--user-data-dir=" + profile_dir, "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=child_fds, close_fds=False)
        os.close(hi_cmd_r)
        os.close(hi_out_w)
        self.next_id = 0
        self.buf = b""
        self.events = []
        self.session = None

    def _read_message(self, deadline):
        while b"\0" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("chromium sent nothing within %.0f s" % self.timeout)
            r, _, _ = select.select([self.out_r], [], [], left)
            if r:
                chunk = os.read(self.out_r, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed its DevTools pipe (exit code %s)" % self.proc.poll())
                self.buf += chunk
        msg, self.buf = self.buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method, params=None, session=True):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self.cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            m = self._read_message(deadline)
            if m.get("id") == self.next_id:
                if "error" in m:
                    raise RuntimeError("%s: %s" % (method, m["error"]))
                return m.get("result", {})
            self.events.append(m)

    def wait_event(self, method, seconds):
        deadline = time.monotonic() + seconds
        for e in self.events:
            if e.get("method") == method:
                return e
        while True:
            m = self._read_message(deadline)
            self.events.append(m)
            if m.get("method") == method:
                return m

    def settle(self, seconds):
        """Collects events for `seconds` (late console messages, failed loads)."""
        deadline = time.monotonic() + seconds
        try:
            while True:
                self.events.append(self._read_message(deadline))
        except TimeoutError:
            pass

    def open(self, url):
        targets = self.send("Target.getTargets", session=False)["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self.send("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True},
                                 session=False)["sessionId"]
        for domain in ("Runtime.enable", "Log.enable", "Page.enable"):
            self.send(domain)
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": 1280, "height": 2400, "deviceScaleFactor": 1, "mobile": False})
        self.events.clear()
        self.send("Page.navigate", {"url": url})
        self.wait_event("Page.loadEventFired", self.timeout)
        self.settle(0.5)

    def errors(self):
        """Console errors, uncaught exceptions and failed loads, as one line each."""
        out = []
        for e in self.events:
            method, p = e.get("method"), e.get("params", {})
            if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append("console.%s: %s" % (p["type"], " ".join(str(a.get("value", a.get("description")))
                                                                    for a in p.get("args", []))))
            elif method == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                out.append("exception: %s" % d.get("exception", {}).get("description", d.get("text")))
            elif method == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                ent = p["entry"]
                out.append("log (%s): %s %s" % (ent.get("source"), ent.get("text"), ent.get("url", "")))
        return out

    def evaluate(self, expression):
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in r:
            raise RuntimeError("evaluate: %s" % r["exceptionDetails"])
        return r["result"]["value"]

    def screenshot(self, path):
        data = self.send("Page.captureScreenshot", {"format": "png"})["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self):
        try:
            self.send("Browser.close", session=False)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.cmd_w)
        os.close(self.out_r)


def load(chromium, tmp, html_path):
    b = Browser(chromium, tempfile.mkdtemp(dir=tmp, prefix="profile-"))
    try:
        b.open("file://" + os.path.abspath(html_path))
        return b
    except Exception:
        b.close()
        raise


def expected_records(run_dir):
    """Per run, read independently of chorus: the step records after rewinds (a resume at step s, or a
    step that goes back, drops the later ones), the user scalars' keys and their points, the name
    and world size."""
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    steps, scalars = [], []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            if not line.strip():
                continue
            o = json.loads(line)
            if o.get("type") == "step":
                while steps and steps[-1] >= o["step"]:
                    steps.pop()
                    scalars[:] = [s for s in scalars if s[0] < o["step"]]
                steps.append(o["step"])
            elif o.get("type") == "event" and o.get("event") == "resume":
                while steps and steps[-1] > o["step"]:
                    steps.pop()
                scalars[:] = [s for s in scalars if s[0] <= o["step"]]
            elif o.get("type") == "log":
                keys = [k for k, v in o.items() if k not in ("type", "step", "epoch", "time")
                        and isinstance(v, (int, float)) and not isinstance(v, bool)]
                scalars.append((o["step"], keys, o.get("epoch", 0), {k: o[k] for k in keys}))
    keys = []
    for _, ks, _, _ in scalars:
        keys += [k for k in ks if k not in keys]
    points = {k: sum(1 for _, ks, _, _ in scalars if k in ks) for k in keys}
    epochs = {k: [e for _, ks, e, _ in scalars if k in ks] for k in keys}
    per_epoch = {k: len(set(epochs[k])) == len(epochs[k]) for k in keys}
    last = {}
    for _, _, _, vals in scalars:
        last.update(vals)
    return {"name": config.get("run_name") or os.path.basename(os.path.normpath(run_dir)),
            "world": config["world_size"], "steps": len(steps), "scalar_points": points,
            "scalar_per_epoch": per_epoch,
            "scalar_last": last}


def scalar_figures(key, runs):
    """The figures chorus draws for a user scalar, by how the runs logged it (plan_figures)."""
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", key)
    if max(r["scalar_points"].get(key, 0) for r in runs) <= 2:
        return [stem + "_last"] + ([stem + "_vs_time"] if len(runs) > 1 else [])
    if all(r["scalar_per_epoch"].get(key, True) for r in runs):
        return [stem + "_vs_epoch", stem + "_vs_time"]
    return [stem + "_vs_step", stem + "_vs_time"]


FIGURES_JS = r"""
(() => {
  const figs = [];
  for (const fig of document.querySelectorAll('figure[data-figure]')) {
    const plots = [];
    for (const g of fig.querySelectorAll('svg g[id*="gnuplot_plot_"]')) {
      const text = g.querySelector('text');
      let points = 0, filled = 0;
      for (const p of g.querySelectorAll('path')) points += ((p.getAttribute('d') || '').match(/[ML]/g) || []).length;
      for (const p of g.querySelectorAll('polygon, path')) {
        if ((p.getAttribute('fill') || 'none') !== 'none') filled += 1;
      }
      plots.push({legend: text ? text.textContent : null, points, filled});
    }
    const box = fig.querySelector('svg').getBoundingClientRect();
    figs.push({id: fig.dataset.figure, series: fig.dataset.series, plots,
               texts: Array.from(fig.querySelectorAll('svg text')).map(t => t.textContent),
               width: box.width, height: box.height});
  }
  const rows = document.querySelectorAll('#runs-table tr').length - 1;
  return {figs, rows, title: document.title};
})()
"""


def check_page(info, runs):
    figs = {f["id"]: f for f in info["figs"]}
    labels = ["%s (%d %s)" % (r["name"], r["world"], "worker" if r["world"] == 1 else "workers") for r in runs]
    if len(set(labels)) != len(labels):
        labels = None  # same name and world size: chorus names them by directory; check counts only
    keys = []
    for r in runs:
        keys += [k for k in r["scalar_points"] if k not in keys]
    expected = ["loss_vs_step", "loss_vs_time"]
    key_of = {}
    for k in keys:
        for fid in scalar_figures(k, runs):
            expected.append(fid)
            key_of[fid] = k
    expected += ["throughput_vs_step"]
    if len({r["world"] for r in runs}) >= 2:
        expected += ["throughput_vs_workers"]
    expected += ["step_breakdown"]
    if list(figs) != expected:
        fail("figures %s, expected %s" % (list(figs), expected))
    if info["rows"] != len(runs):
        fail("runs table has %d rows for %d runs" % (info["rows"], len(runs)))
    for fid, f in figs.items():
        if f["width"] < 400 or f["height"] < 250:
            fail("%s is drawn %dx%d px: too small to read" % (fid, f["width"], f["height"]))
        if fid == "step_breakdown":
            legends = [p["legend"] for p in f["plots"]]
            phases = ("data", "forward", "backward", "comm wait", "optimizer", "other")
            for phase in phases:
                if phase not in legends:
                    fail("step_breakdown has no legend entry %r (has %s)" % (phase, legends))
            if labels:
                for label in labels:
                    if label not in f["texts"]:
                        fail("step_breakdown has no bar labelled %r" % label)
            for p in f["plots"]:
                # One box per run, and the legend's sample box.
                if p["legend"] in phases and p["filled"] < len(runs) + 1:
                    fail("step_breakdown's %r has %d filled boxes for %d runs" % (p["legend"], p["filled"], len(runs)))
            continue
        titled = [p for p in f["plots"] if p["legend"]]
        if fid.endswith("_last"):
            # A value per run: one bar (and the legend's sample box) per run that logged it, its run's
            # label under it, the value printed above it.
            key = key_of[fid]
            having = [i for i, r in enumerate(runs) if r["scalar_points"].get(key, 0) > 0]
            bars = [p for p in titled if p["legend"] == key]  # (the values' labels are a plot too)
            if len(bars) != 1:
                fail("%s has legend entries %s, expected one %r" % (fid, [p["legend"] for p in titled], key))
            if bars[0]["filled"] < len(having) + 1:
                fail("%s has %d filled boxes for %d runs" % (fid, bars[0]["filled"], len(having)))
            if labels:
                for i in having:
                    if labels[i] not in f["texts"]:
                        fail("%s has no bar labelled %r" % (fid, labels[i]))
            for i in having:
                value = "%.4g" % runs[i]["scalar_last"][key]
                if value not in [t.strip() for t in f["texts"]]:
                    fail("%s does not print run %d's last value %s above its bar: texts %s" % (fid, i, value, f["texts"]))
            continue
        if fid == "throughput_vs_workers":
            worlds = sorted({r["world"] for r in runs})
            legends = [p["legend"] for p in titled]
            if len(legends) != 2 or legends[0] != "measured" or not legends[1].startswith("linear scaling from"):
                fail("throughput_vs_workers has legend entries %s, expected measured and linear scaling" % legends)
            for p in titled:
                if p["points"] < len(worlds):
                    fail("throughput_vs_workers: %r has %d points for %d world sizes" % (p["legend"], p["points"], len(worlds)))
            continue
        if len(titled) != len(runs):
            fail("%s has %d legend entries for %d runs: %s" % (fid, len(titled), len(runs), [p["legend"] for p in titled]))
        for i, r in enumerate(runs):
            if labels and titled[i]["legend"] != labels[i]:
                fail("%s: legend %r, expected %r" % (fid, titled[i]["legend"], labels[i]))
            if fid.startswith("loss_") or fid.startswith("throughput_"):
                want = r["steps"]
            else:
                want = r["scalar_points"].get(key_of[fid], 0)
            # Each point is one M or L (the legend's sample line adds 2); chorus draws at most about
            # 2000 points per line (FigureStyle::max_points), so a longer run needs 1000.
            want = min(want, 1000)
            if titled[i]["points"] < want:
                fail("%s: the line of %r has %d points, expected at least %d (one per record)"
                     % (fid, titled[i]["legend"], titled[i]["points"], want))
    return sorted(figs)


def check_report(chorus, chromium, tmp, name, run_dirs, shot_copy, t0):
    """Steps 2-5 for one page: `chorus report RUN_DIRS`, checked as the module's docstring says."""
    out_dir = os.path.join(tmp, name + "-report")
    p = subprocess.run([chorus, "report"] + run_dirs + ["-o", out_dir], capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        fail("chorus report exited %d:\n%s%s" % (p.returncode, p.stdout, p.stderr))
    index = os.path.join(out_dir, "index.html")
    printed = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    if printed != index:
        fail("chorus report printed %r, expected the page's path %r" % (printed, index))

    # 3. Self-contained.
    with open(index) as f:
        html = f.read()
    for pattern in (r"<script", r"\bsrc\s*=", r"<link", r"\bhref\s*=\s*[\"'](?!#)", r"url\((?!#)"):
        m = re.search(pattern, html)
        if m:
            fail("the page refers to something outside itself: %r" % html[max(0, m.start() - 40):m.end() + 60])

    # 4. In the browser.
    runs = [expected_records(d) for d in run_dirs]
    b = load(chromium, tmp, index)
    try:
        errs = b.errors()
        if errs:
            fail("the page gave browser errors:\n  " + "\n  ".join(errs))
        info = b.evaluate(FIGURES_JS)
        figs = check_page(info, runs)
        # 5. What it looks like.
        shot = os.path.join(tmp, name + "-screenshot.png")
        b.screenshot(shot)
    finally:
        b.close()
    if os.path.getsize(shot) < 20000:
        fail("the screenshot is %d bytes: a blank page?" % os.path.getsize(shot))
    if shot_copy:
        shutil.copyfile(shot, shot_copy)
    print("%s: %d runs, figures %s, no browser errors; screenshot %s (%.1f s)"
          % (name, len(runs), ", ".join(figs), shot_copy or shot, time.monotonic() - t0))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chorus", required=True)
    ap.add_argument("--chromium", default=None, help="the browser (default: chromium in PATH)")
    ap.add_argument("--screenshot", help="also copy the screenshot here")
    ap.add_argument("run_dirs", nargs="*")
    a = ap.parse_args()
    chromium = a.chromium or shutil.which("chromium")
    if chromium is None:
        print("SKIP: chromium is not installed (Debian: chromium; scripts/install-deps)")
        sys.exit(77)
    t0 = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="chorus-report-page-")
    try:
        # 1. The checker catches errors.
        bad = os.path.join(tmp, "bad.html")
        with open(bad, "w") as f:
            f.write("<!DOCTYPE html><html><head><meta charset='utf-8'><title>bad</title></head><body>"
                    "<img src='missing-figure.png'><script>console.error('deliberate console error');"
                    "undefined_function_of_the_bad_page();</script></body></html>")
        b = load(chromium, tmp, bad)
        errs = b.errors()
        b.close()
        for needle in ("deliberate console error", "undefined_function_of_the_bad_page", "missing-figure.png"):
            if not any(needle in e for e in errs):
                fail("the console check missed %r on the deliberately bad page; it saw %s" % (needle, errs))
        print("checker: the bad page gave %d errors, as it should" % len(errs))

        # 2.-5. The report of the given runs, or of two generated sets of runs.
        if a.run_dirs:
            pages = [("page", a.run_dirs)]
        else:
            pages = []
            for name, args in (("two-runs", []), ("one-epoch", ["--worlds", "1", "--epochs", "1"])):
                out = subprocess.run([sys.executable, os.path.join(HERE, "make_runs.py"), os.path.join(tmp, name)] + args,
                                     check=True, capture_output=True, text=True).stdout
                pages.append((name, out.split()))
        for name, run_dirs in pages:
            shot_copy = None
            if a.screenshot:
                stem, ext = os.path.splitext(a.screenshot)
                shot_copy = a.screenshot if len(pages) == 1 else "%s-%s%s" % (stem, name, ext)
            check_report(a.chorus, chromium, tmp, name, run_dirs, shot_copy, t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
