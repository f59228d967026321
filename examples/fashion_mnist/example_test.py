#!/usr/bin/python3
"""The Fashion-MNIST example on the Accelerator, as a user runs it (registered as fashion_mnist_example_test).

usage: example_test.py PATH/TO/chorus PATH/TO/fashion_mnist

Every run is `chorus run -n 2 fashion_mnist ... --threads 1` in a scratch working directory, so
its records land in runs/<name>/ there.
0. Bad command lines exit 2 and bad values (fp16 on the CPU, a missing data directory, a run name
   with a slash) fail before training with a message naming the fix.
1. An uninterrupted run of N steps: exit 0, plain progress lines (no "\\r" or escape codes when
   stdout is a pipe), the exact test accuracy of all 10000 items, the run directory's files.
2. The same job under `chorus run --max-restarts 1`, rank 1 killed (SIGKILL) after its state was
   saved at step 30: the launcher restarts it, it resumes from the saved state with no flag, and
   every step's loss on every rank equals the uninterrupted run's, bit for bit; each step is
   recorded once.
3. SIGUSR1 to the launcher mid-run: the ranks save their state and exit 0 (status "stopped");
   --resume continues to N, again with the uninterrupted run's losses.
4. A rerun over a saved state without --resume or --overwrite is refused, naming both.
5. bf16 autocast: the loss curve (means over 20 steps) stays within tolerance of fp32; the speed
   of both is printed.
6. On a terminal (a pty) rank 0 draws a bar rewritten in place; with TERM=dumb it prints lines.
7. `chorus report` of the job at 1 and 2 workers, checked in headless chromium by
   tests/report/report_page_test.py (no console errors, every figure has every run's data).
Needs Debian's dataset-fashion-mnist (or FASHION_MNIST_DATA=DIR). Only the standard library.
"""
import json
import os
import pty
import signal
import subprocess
import sys
import tempfile
import time

STEPS = 100


def check(cond, what):
    if not cond:
        sys.exit("FAIL: " + what)


def command(chorus, example, name, *args, launcher=()):
    cmd = [chorus, "run", "-n", "2", *launcher, example, "--run-name", name, "--max-steps", str(STEPS),
           "--threads", "1", *args]
    data = os.environ.get("FASHION_MNIST_DATA")
    if data:
        cmd += ["--data", data]
    return cmd


def run(cmd, cwd, expect_rc=0):
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240, cwd=cwd)
    print(p.stdout, flush=True)
    check(p.returncode == expect_rc, f"exit code {p.returncode}, expected {expect_rc}")
    return p.stdout


def lines(path, kind):
    with open(path) as f:
        return [l for l in map(json.loads, f) if l.get("type") == kind]


def losses(run_dir, rank):
    steps = lines(os.path.join(run_dir, "metrics", f"rank-{rank}.jsonl"), "step")
    numbers = [s["step"] for s in steps]
    check(numbers == list(range(1, len(numbers) + 1)), f"{run_dir} rank {rank}: steps recorded {numbers}")
    return [s["loss"] for s in steps]


def same_losses(reference, run_dir, what):
    for rank in (0, 1):
        got, want = losses(run_dir, rank), losses(reference, rank)
        check(len(got) == STEPS, f"{what}: rank {rank} recorded {len(got)} steps, expected {STEPS}")
        diff = [i + 1 for i, (a, b) in enumerate(zip(got, want)) if a != b]
        check(not diff, f"{what}: rank {rank} losses differ from the uninterrupted run's at steps {diff[:10]}")
    print(f"PASS: {what}: all {STEPS} losses of both ranks equal the uninterrupted run's", flush=True)


def wait_for(path, text, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        check(proc.poll() is None, f"the job ended (exit {proc.returncode}) before {path} showed '{text}'")
        try:
            with open(path) as f:
                if text in f.read():
                    return
        except FileNotFoundError:
            pass
        time.sleep(0.02)
    sys.exit(f"FAIL: {path} did not show '{text}' within {timeout} s")


def rank_pid(name, rank):
    """The pid of the example process that is rank `rank` of the run named `name`."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if b"--run-name" in argv and name.encode() in argv and f"RANK={rank}".encode() in env \
                and not argv[0].endswith(b"chorus"):
            return int(pid)
    sys.exit(f"FAIL: no process is rank {rank} of run {name}")


def run_in_pty(cmd, cwd, env):
    """Runs cmd with a pseudo-terminal as its stdout and stderr; returns (exit code, output)."""
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(cwd)
        os.execvpe(cmd[0], cmd, env)
    out = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the terminal's last writer is gone
            break
        if not data:
            break
        out += data
    else:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")


def main():
    chorus, example = map(os.path.abspath, sys.argv[1:3])
    page_test = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "report",
                             "report_page_test.py")
    with tempfile.TemporaryDirectory(prefix="fashion-mnist-example-") as cwd:
        runs = os.path.join(cwd, "runs")

        # 0. Bad input.
        for args, rc, words in ((["--help"], 0, ["--run-name", "--mixed-precision"]),
                                (["--epochs", "0"], 2, ["--epochs"]),
                                (["--resume", "--overwrite"], 2, ["excludes"]),
                                (["--nproc", "1", "--mixed-precision", "fp16"], 1, ["kBF16"]),
                                (["--nproc", "1", "--data", os.path.join(cwd, "none")], 1, ["dataset-fashion-mnist"]),
                                (["--nproc", "1", "--run-name", "a/b"], 1, ["plain directory name"])):
            p = subprocess.run([example, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               timeout=60)
            check(p.returncode == rc and all(w in p.stdout for w in words),
                  f"{args}: exit {p.returncode} (expected {rc}), output lacks {words}:\n{p.stdout}")
            check(args == ["--help"] or "Traceback" not in p.stdout and "frame #" not in p.stdout,
                  f"{args}: a backtrace in the message")
        print("PASS: bad input gets exit codes and messages that name the fix", flush=True)

        # 1. Uninterrupted.
        out = run(command(chorus, example, "plain"), cwd)
        check("\r" not in out and "\x1b" not in out, "progress with \\r or escape codes in a captured log")
        check(f"step {STEPS}/{STEPS}" in out and "samples/s" in out and "ETA" in out, "no progress lines")
        check("test accuracy" in out and "done: " in out, "no accuracy or closing line")
        plain = os.path.join(runs, "plain")
        for f in ("config.json", "summary.json", "metrics.jsonl", "metrics/rank-0.jsonl", "metrics/rank-1.jsonl",
                  "logs/rank-0.log", "logs/rank-1.log", "state/latest"):
            check(os.path.exists(os.path.join(plain, f)), f"no {f} in the run directory")
        summary = json.load(open(os.path.join(plain, "summary.json")))
        check(summary["status"] == "finished" and summary["steps"] == STEPS and summary["world_size"] == 2,
              f"summary {summary}")
        check(0.5 < summary["last"]["test_accuracy"] <= 1.0, f"test accuracy {summary['last']}")
        acc_lines = lines(os.path.join(plain, "metrics.jsonl"), "log")
        check(len(acc_lines) == 1 and acc_lines[0]["step"] == STEPS, f"accuracy lines {acc_lines}")
        print(f"PASS: uninterrupted run, test accuracy {summary['last']['test_accuracy']:.4f}, "
              f"{summary['samples_per_s']:.0f} samples/s", flush=True)

        # 2. Killed after the save at step 30, restarted by the launcher, resumed with no flag.
        p = subprocess.Popen(command(chorus, example, "killed", "--checkpoint-every", "30",
                                     launcher=("--max-restarts", "1")),
                             cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_for(os.path.join(runs, "killed", "logs", "rank-1.log"), "state saved at step 30", p)
            os.kill(rank_pid("killed", 1), signal.SIGKILL)
            out, _ = p.communicate(timeout=240)
        finally:
            if p.poll() is None:
                p.kill()
        print(out, flush=True)
        check(p.returncode == 0, f"the restarted job exited {p.returncode}")
        check("resumed from" in out, "the restarted ranks did not say they resumed")
        same_losses(plain, os.path.join(runs, "killed"), "SIGKILL at step > 30, restart")

        # 3. SIGUSR1 through the launcher: save, exit 0; then --resume.
        p = subprocess.Popen(command(chorus, example, "signalled"), cwd=cwd, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        try:
            wait_for(os.path.join(runs, "signalled", "logs", "rank-0.log"), "step 50 ", p)
            p.send_signal(signal.SIGUSR1)
            out, _ = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
        print(out, flush=True)
        check(p.returncode == 0, f"the signalled job exited {p.returncode}, expected 0")
        summary = json.load(open(os.path.join(runs, "signalled", "summary.json")))
        check(summary["status"] == "stopped" and 50 <= summary["steps"] < STEPS, f"after SIGUSR1: {summary}")
        check("stopping at step" in out and "SIGUSR1" in out, "no stop notice")
        out = run(command(chorus, example, "signalled", "--resume"), cwd)
        check(f"at epoch 1, step {summary['steps']}" in out, "the resumed run did not name its step")
        same_losses(plain, os.path.join(runs, "signalled"), f"SIGUSR1 at step {summary['steps']}, --resume")

        # 4. A stale state is refused.
        out = run(command(chorus, example, "plain"), cwd, expect_rc=1)
        check("--resume" in out and "--overwrite" in out, "the refusal does not name --resume and --overwrite")
        print("PASS: a rerun over a saved state is refused", flush=True)

        # 5. bf16 autocast against fp32.
        run(command(chorus, example, "bf16", "--mixed-precision", "bf16"), cwd)
        ref = lines(os.path.join(plain, "metrics.jsonl"), "step")
        bf = lines(os.path.join(runs, "bf16", "metrics.jsonl"), "step")
        check(len(bf) == STEPS, f"bf16 run recorded {len(bf)} steps")
        worst = 0.0
        for start in range(0, STEPS, 20):
            a = sum(s["loss"] for s in ref[start:start + 20]) / 20
            b = sum(s["loss"] for s in bf[start:start + 20]) / 20
            worst = max(worst, abs(a - b) / a)
            print(f"  steps {start + 1}-{start + 20}: fp32 loss {a:.4f}, bf16 {b:.4f}", flush=True)
        check(worst < 0.05, f"bf16 loss curve off by {100 * worst:.1f}% of fp32's (tolerance 5%)")
        s32 = json.load(open(os.path.join(plain, "summary.json")))
        s16 = json.load(open(os.path.join(runs, "bf16", "summary.json")))
        print(f"PASS: bf16 loss within {100 * worst:.2f}% of fp32's; test accuracy {s16['last']['test_accuracy']:.4f} "
              f"vs {s32['last']['test_accuracy']:.4f}; speed {s16['samples_per_s']:.0f} vs {s32['samples_per_s']:.0f} "
              f"samples/s (bf16/fp32 {s16['samples_per_s'] / s32['samples_per_s']:.2f}x)", flush=True)
        check(abs(s16["last"]["test_accuracy"] - s32["last"]["test_accuracy"]) < 0.03, "bf16 test accuracy off")

        # 6. The progress bar on a terminal, plain lines on a dumb one.
        for term, in_place in (("xterm", True), ("dumb", False)):
            cmd = [chorus, "run", "-n", "2", example, "--run-name", "tty-" + term, "--max-steps", "20", "--threads", "1"]
            rc, out = run_in_pty(cmd, cwd, dict(os.environ, TERM=term))
            print(repr(out[-600:]), flush=True)
            check(rc == 0, f"TERM={term}: exit code {rc}")
            bar = "\r" in out and "\x1b[K" in out and "#" in out and "step 20/20" in out
            check(bar == in_place, f"TERM={term}: bar drawn in place: {bar}, expected {in_place}")
            if not in_place:
                check("step 20/20" in out, "TERM=dumb: no plain progress line")
        print("PASS: a progress bar on a terminal, plain lines with TERM=dumb", flush=True)

        # 7. The report of the same job at 1 and 2 workers, in a real browser.
        run([chorus, "run", "-n", "1", example, "--run-name", "one-worker", "--max-steps", str(STEPS),
             "--threads", "1"] + (["--data", os.environ["FASHION_MNIST_DATA"]] if "FASHION_MNIST_DATA" in os.environ
                                  else []), cwd)
        shot = os.environ.get("CHORUS_REPORT_SCREENSHOT", os.path.join(cwd, "report.png"))
        run(["/usr/bin/python3", page_test, "--chorus", chorus, "--screenshot", shot,
             os.path.join(runs, "one-worker"), plain], cwd)
        print("PASS: chorus report of real runs at 1 and 2 workers checked in chromium", flush=True)
    print("PASS")


if __name__ == "__main__":
    main()
