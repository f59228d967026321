"""What every bench/compare-* script shares: logging, child-process reports, medians and ratios,
tables, the machine description, signal handling and the environment runs get.

The scripts import it from their own directory (`sys.path` holds a script's directory first), so
they run as `bench/compare-x` from anywhere. Standard library only, Python 3.9+.
"""

import os
import platform
import signal
import socket
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_BIN = os.path.join(REPO, "build", "bin")  # where `make` puts chorus and the benchmarks' binaries
DATA = "/usr/share/datasets/fashion-mnist"      # Debian's dataset-fashion-mnist
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class RunError(Exception):
    """A run that failed: the message says which, how, and what its output ended with."""


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run_env(**extra):
    """The environment of every run: ours, less a launcher's rank variables, one thread each,
    and `extra` on top."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(ONE_THREAD)
    env.update(extra)
    return env


def tail(text, lines=15):
    """The last `lines` lines of `text`, indented under a failure message."""
    text = (text or "").rstrip().splitlines()[-lines:]
    return "\n".join("    | " + line for line in text) if text else "    (no output)"


def tail_file(path, lines=15):
    """tail() of a log file; "" when it cannot be read."""
    try:
        with open(path, errors="replace") as f:
            return tail(f.read(), lines)
    except OSError:
        return ""


def describe_rc(rc):
    """A child's return code as words: "status 1", "signal SIGKILL"."""
    if rc < 0:
        try:
            return "signal %s" % signal.Signals(-rc).name
        except ValueError:
            return "signal %d" % -rc
    return "status %d" % rc


def free_port():
    """A TCP port on loopback that the kernel had free just now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median_of(values):
    """The median of the values that are not None; None when there are none."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(a, b):
    return a / b if a is not None and b else None


def fmt(value, pattern):
    return "-" if value is None else pattern % value


def text_table(headers, rows, label_column=True):
    """Aligned columns; the first one left-aligned when it holds labels, every other right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 and label_column else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(headers)] + [line(r) for r in rows])


def markdown_table(headers, rows, label_column=True):
    """The same table in Markdown, numbers right-aligned."""
    align = ["---" if i == 0 and label_column else "---:" for i in range(len(headers))]
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])


def machine_info():
    """CPUs this process may use, the CPU's model, the kernel and this Python: the header of every
    report (each script adds its peers' versions)."""
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass
    return {"nproc": len(os.sched_getaffinity(0)), "cpu": cpu,
            "kernel": "%s %s" % (platform.system(), platform.release()), "python": sys.executable}


def stop_on_signals():
    """SIGTERM and SIGHUP stop a run like Ctrl-C does, so that the children are cleaned up too
    (each child runs in its own session and does not see the terminal's signals)."""
    def handler(signum, frame):
        raise KeyboardInterrupt
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_DFL:  # leave alone what a parent chose to ignore (nohup)
            signal.signal(sig, handler)


def parse_size(text):
    """'4K' -> 4096, '64M' -> 67108864 (K, M, G are powers of two; KiB/MiB/GiB and B also accepted).
    Raises ValueError for anything else and for sizes below 1 byte."""
    s = text.strip().upper()
    for suffix, mult in (("KIB", 1 << 10), ("MIB", 1 << 20), ("GIB", 1 << 30),
                         ("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("B", 1)):
        if s.endswith(suffix):
            s, m = s[: -len(suffix)], mult
            break
    else:
        m = 1
    try:
        n = int(s) * m
    except ValueError:
        raise ValueError("bad size %r (examples: 4096, 4K, 64M)" % text)
    if n <= 0:
        raise ValueError("size %r: must be at least 1 byte" % text)
    return n


def size_label(n):
    """Bytes as a label: "64 MiB", "4 KiB", "1000 B"."""
    if n >= 1 << 30 and n % (1 << 30) == 0:
        return "%d GiB" % (n >> 30)
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return "%d MiB" % (n >> 20)
    if n >= 1 << 10 and n % (1 << 10) == 0:
        return "%d KiB" % (n >> 10)
    return "%d B" % n
