"""What every bench/compare-* script shares: logging, child-process reports, medians and ratios,
tables, the machine description, signal handling and the environment runs get.

The scripts import it from their own directory (`sys.path` holds a script's directory first), so
they run as `bench/compare-x` from anywhere. Standard library only, Python 3.9+.
"""

import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
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


def build_c(tmp, name, source, opt, timeout):
    """Compiles a helper program; returns (binary, None) or (None, why it is skipped)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "skipped: no C compiler"
    src, binary = os.path.join(tmp, name + ".c"), os.path.join(tmp, name)
    with open(src, "w") as f:
        f.write(source)
    try:
        p = subprocess.run([cc, opt, "-pthread", "-o", binary, src], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=min(timeout, 120))
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, "skipped: cc failed: %s" % e
    if p.returncode != 0:
        return None, "skipped: cc %s failed: %s" % (opt, p.stderr.strip()[:200])
    return binary, None


# The TCP ceiling: two processes stream N-byte messages to each other in both directions at once, nothing else, in the fastest plain arrangement measured here: a connection per direction
# (as chorus uses; one shared socket serialises the two directions on its lock) and, in each
# process, a thread that only sends while the main thread only receives, with blocking calls. The
# sender never waits for the receiver between messages, so the pipeline never drains; a sample is
# the time between the completions of two successive N-byte receives. A W=2 ring allreduce of N
# bytes moves exactly N bytes each way per rank, so N / (that time) is the scale a TCP allreduce's
# busbw can reach here: a reference, not a proof of a bound (a program that busy-polls, as chorus
# does, gets a little above it); for small N it measures streaming throughput, not latency.
# Over loopback by default; across two network namespaces when CEILING_ADDR is the address to
# listen on (in the namespace the program starts in) and CEILING_PEER_NETNS the path of the other
# namespace (/var/run/netns/NAME), which the forked peer enters before it connects.
TCP_CEILING_SOURCE = r"""
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <fcntl.h>
#include <sched.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static int cmp(const void* a, const void* b) { double x = *(const double*)a, y = *(const double*)b; return x < y ? -1 : x > y; }
static void send_all(int fd, const char* b, size_t n) {
  while (n > 0) { ssize_t k = send(fd, b, n, MSG_NOSIGNAL); if (k <= 0) exit(3); b += k; n -= (size_t)k; }
}
static void recv_all(int fd, char* b, size_t n) {
  while (n > 0) { ssize_t k = recv(fd, b, n, 0); if (k <= 0) exit(3); b += k; n -= (size_t)k; }
}
struct stream { int fd; const char* buf; size_t n; long count; };
static void* sender(void* p) {
  struct stream* s = p;
  for (long k = 0; k < s->count; ++k) send_all(s->fd, s->buf, s->n);
  return 0;
}
/* Sends `count` messages of n bytes on tx from a thread while receiving as many on rx; t[k] (if
   given) gets the time from the previous receive's completion to the k-th one's. */
static void stream_both(int tx, int rx, const char* sb, char* rb, size_t n, long count, double* t) {
  struct stream s = {tx, sb, n, count};
  pthread_t th;
  if (pthread_create(&th, 0, sender, &s)) exit(4);
  double last = now();
  for (long k = 0; k < count; ++k) {
    recv_all(rx, rb, n);
    double c = now();
    if (t) t[k] = c - last;
    last = c;
  }
  pthread_join(th, 0);
}
int main(int argc, char** argv) {
  double target = atof(argv[1]);
  int l = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {0}; a.sin_family = AF_INET; a.sin_addr.s_addr = htonl(0x7f000001);
  const char* addr = getenv("CEILING_ADDR"); const char* peer_ns = getenv("CEILING_PEER_NETNS");
  if (addr && inet_pton(AF_INET, addr, &a.sin_addr) != 1) { fprintf(stderr, "bad CEILING_ADDR %s\n", addr); return 2; }
  socklen_t al = sizeof a;
  if (bind(l, (void*)&a, sizeof a) || listen(l, 2) || getsockname(l, (void*)&a, &al)) return 2;
  pid_t child = fork();
  int tx, rx;  /* the child's first connection is its tx and the parent's rx, the second the reverse */
  if (child == 0) {
    if (peer_ns) {
      int fd = open(peer_ns, O_RDONLY);
      if (fd < 0 || setns(fd, CLONE_NEWNET)) { perror(peer_ns); return 2; }
    }
    int c1 = socket(AF_INET, SOCK_STREAM, 0), c2 = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(c1, (void*)&a, sizeof a) || connect(c2, (void*)&a, sizeof a)) return 2;
    tx = c1; rx = c2;
  } else {
    rx = accept(l, 0, 0); tx = accept(l, 0, 0);
  }
  int one = 1;
  setsockopt(tx, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(rx, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  for (int i = 2; i < argc; ++i) {
    size_t n = strtoull(argv[i], 0, 10);
    char* sb = malloc(n + 1); char* rb = malloc(n + 1); memset(sb, 1, n); memset(rb, 0, n);
    stream_both(tx, rx, sb, rb, n, 3, 0);
    double t0 = now(); stream_both(tx, rx, sb, rb, n, 2, 0);
    long iters = (long)(target / ((now() - t0) / 2 + 1e-9));
    if (iters < 20) iters = 20; if (iters > 100000) iters = 100000;
    /* both sides must run the same count: the parent decides */
    if (child != 0) send_all(tx, (char*)&iters, sizeof iters); else recv_all(rx, (char*)&iters, sizeof iters);
    double* t = malloc(sizeof(double) * iters);
    stream_both(tx, rx, sb, rb, n, iters, t);
    qsort(t, iters, sizeof(double), cmp);
    if (child != 0) printf("RESULT %zu %ld %.9f\n", n, iters, t[(iters - 1) / 2]);
    free(t); free(sb); free(rb);
  }
  if (child != 0) { int st = 0; waitpid(child, &st, 0); }
  return 0;
}
"""
