"""Training dispatched to a Dask cluster (docs/dask.md): one rank per process on the chosen workers.

    from distributed import Client
    import chorus.dask

    client = Client("tcp://scheduler:8786")
    futures = chorus.dask.run(client, train, epochs=3)           # a Python function per rank, its
                                                                 # process group set up (backend="chorus")
    results = client.gather(futures)                             # rank r's return value at [r]
    futures = chorus.dask.run_program(client, ["build/bin/transfer", "--epochs", "1"])  # a program

Each rank runs in a fresh process that its worker starts (not in the worker's thread pool), so it
can be stopped and cleaned up, with torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR = rank 0's worker host, a free MASTER_PORT there) and a
fresh job token (CHORUS_JOB_TOKEN), so `init_process_group("chorus")` (or "gloo") and chorus's C++
rendezvous work unchanged. Ranks are placed explicitly: `workers` (default: every worker, sorted by
address), `nprocs_per_worker` each, never where the scheduler would like.

Results (the role of dask-pytorch-ddp's DaskResultsHandler): rank 0 calls
`chorus.dask.log(step=..., loss=..., **scalars)`; with `run(..., results_dir="runs/name")` the
scalars reach the client while the job trains (a progress line each second) and land there as a
chorus run directory (config.json, metrics.jsonl, summary.json; docs/run-records.md), so
`chorus report runs/name` draws the curves. `run_program(..., results_dir=...)` does the same for
a C++ program: rank 0's chorus::Accelerator mirrors its metrics.jsonl lines to the file its worker
tails (CHORUS_DASK_METRICS).

When a rank raises or exits non-zero, every other rank is stopped within seconds (SIGTERM, then
SIGKILL after 3 s), and every future raises one ChorusDaskError naming the root cause: the rank, its
worker and its message, as `chorus run` reports it. Cancelling a future stops the whole job the same
way. A rank's process dies with its worker (PR_SET_PDEATHSIG); its peers then fail, naming it, and
its own future, which Dask cannot finish once that worker is gone, is cancelled about 8 s later.
"""
import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import cloudpickle

__all__ = ["run", "run_program", "log", "wait_results", "ChorusDaskError"]

KILL_GRACE_S = 3.0
LINGER_S = 5.0  # after an abort, how long a rank's future may stay unfinished before it is cancelled
POLL_S = 0.2


class ChorusDaskError(RuntimeError):
    """A rank of a chorus job on Dask failed; the message names the root cause (rank, worker)."""


def run(client, fn, *args, nprocs_per_worker=1, workers=None, env=None, results_dir=None, backend="chorus",
        **kwargs):
    """Runs fn(*args, **kwargs) once per rank, each in its own process on its worker; returns the
    list of futures, rank 0's first. As dask-pytorch-ddp does, each rank's default process group is
    set up before fn with `backend` ("chorus", "gloo", ...; torch.distributed is ready when fn
    starts) and destroyed after it; backend=None leaves that to fn (init_process_group() with no
    arguments works there). `env` adds variables to every rank's environment. With `results_dir`,
    what rank 0 passes to log() is written there on the client as a run directory."""
    payload = cloudpickle.dumps((fn, args, kwargs))
    name = getattr(fn, "__qualname__", getattr(fn, "__name__", "fn"))
    env = dict(env or {}, CHORUS_DASK_BACKEND=backend or "")
    return _dispatch(client, payload, None, nprocs_per_worker, workers, env, results_dir, [name])


def log(step, **scalars):
    """Rank 0's scalars for the client (run(..., results_dir=...)): `step` (an int) and numbers,
    e.g. log(step=10, loss=0.52, epoch=0, accuracy=0.81). A `loss` also makes the step's loss
    curve. On other ranks, or outside chorus.dask, it does nothing."""
    path = os.environ.get("CHORUS_DASK_METRICS")
    if not path or os.environ.get("RANK") != "0":
        return
    import json
    record = {"step": int(step), "time": time.time()}
    for key, value in scalars.items():
        record[key] = float(value)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def run_program(client, argv, nprocs_per_worker=1, workers=None, env=None, results_dir=None):
    """Runs the program `argv` (a chorus C++ program such as build/bin/transfer, or any command)
    once per rank; each future's value is 0, the exit status, or it raises ChorusDaskError. With
    `results_dir`, the run records rank 0's chorus::Accelerator writes (its metrics.jsonl lines)
    reach the client while the job trains and land there as a run directory, as for run()."""
    if isinstance(argv, str) or not argv:
        raise ValueError("chorus.dask.run_program: argv must be a non-empty list of strings")
    return _dispatch(client, None, [str(a) for a in argv], nprocs_per_worker, workers, env, results_dir, list(argv))


def _dispatch(client, payload, argv, nprocs, workers, env, results_dir, command):
    from distributed import Event, Queue, Variable, wait

    if nprocs < 1:
        raise ValueError("chorus.dask: nprocs_per_worker must be at least 1, got %d" % nprocs)
    known = client.scheduler_info()["workers"]
    chosen = list(workers) if workers else sorted(known)
    unknown = [w for w in chosen if w not in known]
    if unknown or not chosen:
        raise ValueError("chorus.dask: no such worker(s) %s; the cluster has %s" % (unknown or "at all", sorted(known)))
    if len(set(chosen)) != len(chosen):
        raise ValueError("chorus.dask: a worker is named twice in workers=%s" % chosen)
    master = known[chosen[0]]["host"]
    port = client.submit(_free_port, master, workers=[chosen[0]], allow_other_workers=False, pure=False).result()
    token = secrets.token_hex(16)
    job = "chorus-dask-" + token[:12]
    world = len(chosen) * nprocs
    Variable(job + "-cause", client=client).set("")  # the root cause, once a rank fails
    futures = []
    for node, worker in enumerate(chosen):
        for local in range(nprocs):
            rank = node * nprocs + local
            rank_env = _RankEnv(env or {})
            rank_env.update(RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(world),
                            LOCAL_WORLD_SIZE=str(nprocs), GROUP_RANK=str(node), NODE_RANK=str(node),
                            MASTER_ADDR=master, MASTER_PORT=str(port), CHORUS_JOB_TOKEN=token,
                            CHORUS_DASK_JOB=job)
            futures.append(client.submit(_rank_task, job, rank, worker, rank_env, payload, argv,
                                         key="%s-rank-%d" % (job, rank), workers=[worker],
                                         allow_other_workers=False, pure=False, retries=0))
    # Whatever ends first in error or by cancel stops the job: the ranks watch this event.
    abort = Event(job + "-abort", client=client)

    def watch(pending):
        while pending:
            try:
                done, pending = wait(pending, return_when="FIRST_COMPLETED")
                stop = any(f.status in ("error", "cancelled") for f in done)
            except Exception:  # a cancelled future can make wait() itself raise
                stop = True
            if stop:
                try:
                    abort.set()
                except Exception:  # the client closed: the ranks' own checks still stop them
                    return
                # A rank whose worker died never reports: Dask keeps its task for a worker of that
                # address, which a restarted worker does not have. Once the others have had their
                # time to stop, cancel what is left, so that no future waits forever.
                try:
                    wait(list(pending), timeout=KILL_GRACE_S + LINGER_S)
                except Exception:
                    pass
                left = [f for f in pending if not f.done()]
                if left:
                    try:
                        client.cancel(left)
                    except Exception:
                        pass
                return

    threading.Thread(target=watch, args=(list(futures),), name=job + "-watch", daemon=True).start()
    if results_dir is not None:
        handler = _Results(results_dir, Queue(job + "-metrics", client=client), futures, world, command)
        thread = threading.Thread(target=handler.loop, name=job + "-results", daemon=True)
        _RESULT_THREADS[job] = thread
        thread.start()
    return futures


_RESULT_THREADS = {}


def wait_results(futures, timeout=60):
    """Waits until the results_dir of the job these futures belong to is complete (summary.json
    written, about a second after its last rank ends); True if it is, or if it has no results_dir."""
    job = futures[0].key.rsplit("-rank-", 1)[0] if futures else None
    thread = _RESULT_THREADS.get(job)
    if thread is None:
        return True
    thread.join(timeout)
    if thread.is_alive():
        return False
    del _RESULT_THREADS[job]
    return True


class _Results:
    """The client's side of log(): drains the job's metrics queue while it runs, prints a progress
    line at most once a second, and writes the run directory (docs/run-records.md)."""

    def __init__(self, directory, queue, futures, world, command):
        import datetime
        import json
        os.makedirs(directory, exist_ok=True)
        self.dir, self.queue, self.futures, self.world = directory, queue, futures, world
        self.started = time.time()
        self.last = {}
        self.steps = 0
        config = {"run_name": os.path.basename(os.path.abspath(directory)), "world_size": world, "attempt": 0,
                  "started": datetime.datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ"), "host": socket.gethostname(),
                  "transport": "chorus.dask", "command": command}
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
        self.metrics = open(os.path.join(directory, "metrics.jsonl"), "w")
        self._write({"type": "event", "event": "start", "step": 0, "epoch": 0, "time": 0.0, "attempt": 0})

    def _write(self, record):
        import json
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()

    def _record(self, r):
        if "type" in r:  # a line of a C++ program's run record (chorus::Accelerator): kept as it is
            if r["type"] == "event":
                return  # the client writes the job's own start and finish
            self._write(r)
            self.steps = max(self.steps, int(r.get("step", 0)))
            self.last.update({k: v for k, v in r.items()
                              if isinstance(v, (int, float)) and k not in ("step", "epoch", "time", "attempt")})
            return
        step, t = r.pop("step"), r.pop("time") - self.started
        epoch = int(r.pop("epoch", 0))
        if "loss" in r:
            self._write({"type": "step", "step": step, "epoch": epoch, "time": t, "loss": r["loss"]})
        others = {k: v for k, v in r.items() if k != "loss"}
        if others:
            self._write(dict({"type": "log", "step": step, "epoch": epoch, "time": t}, **others))
        self.steps = max(self.steps, step)
        self.last.update(r)

    def loop(self):
        import json
        printed = 0.0
        done = False
        while True:
            try:
                batch = self.queue.get(timeout=0.5, batch=True)
            except Exception:
                batch = []
            for line in batch:
                self._record(json.loads(line))
            if batch and time.time() - printed >= 1.0:
                printed = time.time()
                print("chorus.dask: step %d  %s" % (self.steps, "  ".join(
                    "%s %.4g" % (k, v) for k, v in sorted(self.last.items()))), flush=True)
            if done:
                break
            # one more drain after the job ends: rank 0's last lines are sent before its task ends
            done = all(f.done() for f in self.futures)
        status = "finished" if all(f.status == "finished" for f in self.futures) else "failed"
        self._write({"type": "event", "event": "finish" if status == "finished" else "stop", "step": self.steps,
                     "epoch": 0, "time": time.time() - self.started})
        self.metrics.close()
        summary = {"run_name": os.path.basename(os.path.abspath(self.dir)), "world_size": self.world, "status": status,
                   "steps": self.steps, "wall_seconds": time.time() - self.started, "last": self.last}
        with open(os.path.join(self.dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)


class _RankEnv(dict):
    """A rank's environment variables; printed without the job token (Dask logs a failed task's
    arguments)."""

    def __repr__(self):
        return repr({k: ("<hidden>" if k == "CHORUS_JOB_TOKEN" else v) for k, v in self.items()})


def _free_port(host):
    """A port free on this host for rank 0's store, outside the kernel's ephemeral range: a port the
    kernel hands out for `bind(0)` and outgoing connections could be taken by another job's server
    between this check and rank 0's bind, and rank 1 would then talk to that server."""
    import random
    low, high = 32768, 60999
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        pass
    candidates = [p for p in range(20000, 65536) if not low <= p <= high] or list(range(1024, 65536))
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in random.sample(candidates, min(200, len(candidates))):
        with socket.socket(family) as s:
            try:
                s.bind(("", port))
                return port
            except OSError:
                continue
    with socket.socket(family) as s:  # every candidate taken: let the kernel choose
        s.bind(("", 0))
        return s.getsockname()[1]


def _die_with_parent():
    # Runs in the child between fork and exec: it gets SIGKILL when the worker that started it dies.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _rank_task(job, rank, worker, env, payload, argv):
    """One rank, in a task on its worker: starts the rank's process, watches it and the job's abort
    event, and reports."""
    from distributed import Event, Lock, Variable

    abort = Event(job + "-abort")
    cause_var = Variable(job + "-cause")
    _sweep_scratch()
    with tempfile.TemporaryDirectory(prefix="chorus-dask-%d-" % os.getpid()) as tmp:
        result_path = os.path.join(tmp, "result")
        error_path = os.path.join(tmp, "error.json")
        metrics = _Tail(os.path.join(tmp, "metrics.jsonl"), job + "-metrics") if rank == 0 else None
        if metrics is not None:
            env = dict(env, CHORUS_DASK_METRICS=metrics.path)
        if argv is None:
            payload_path = os.path.join(tmp, "payload")
            with open(payload_path, "wb") as f:
                f.write(payload)
            argv = [sys.executable, "-m", "chorus._dask_child", payload_path, result_path]
        full_env = dict(os.environ)
        full_env.update(env)
        full_env["CHORUS_ERROR_FILE"] = error_path  # a C++ rank (or chorus's excepthook) records its error
        proc = subprocess.Popen(argv, env=full_env, start_new_session=True, preexec_fn=_die_with_parent,
                                stderr=subprocess.PIPE)
        stderr_tail = _StderrTail(proc.stderr)
        stopped = False
        while proc.poll() is None:
            if metrics is not None:
                metrics.send()
            if abort.wait(timeout=POLL_S):
                stopped = True
                _stop(proc)
                break
        rc = proc.wait()
        stderr_tail.join()
        if metrics is not None:
            metrics.send()
        outcome = None
        if os.path.exists(result_path):
            with open(result_path, "rb") as f:
                outcome = cloudpickle.load(f)
        if rc == 0 and not stopped and (outcome is None or "value" in outcome):
            return 0 if outcome is None else outcome["value"]
        if not stopped:
            message = _message(rc, outcome, error_path, stderr_tail.last())
            cause = "rank %d (worker %s, pid %d) failed first: %s" % (rank, worker, proc.pid, message)
            with Lock(job + "-lock"):
                first = cause_var.get()
                if not first:
                    cause_var.set(cause)
                    first = cause
            abort.set()
            raise ChorusDaskError("chorus job %s: %s" % (job, first))
        # Stopped because another rank failed or the job was cancelled: name the root cause.
        deadline = time.monotonic() + 5.0
        first = cause_var.get()
        while not first and time.monotonic() < deadline:
            time.sleep(0.1)
            first = cause_var.get()
        raise ChorusDaskError("chorus job %s: rank %d (worker %s) was stopped: %s" % (
            job, rank, worker, first or "the job was cancelled"))


class _Tail:
    """Rank 0's log() lines (a file its process appends to), sent to the job's metrics queue."""

    def __init__(self, path, queue_name):
        self.path, self.queue_name, self.offset, self.queue = path, queue_name, 0, None

    def send(self):
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # whole lines only: the writer may be mid-line
        if end == 0:
            return
        self.offset += end
        if self.queue is None:
            from distributed import Queue
            self.queue = Queue(self.queue_name)
        for line in data[:end].decode().splitlines():
            if line.strip():
                self.queue.put(line)


def _stop(proc):
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _sweep_scratch():
    """Removes the scratch directories of rank tasks whose worker process is gone: a worker that is
    SIGKILLed cannot remove its own (/tmp/chorus-dask-<worker pid>-XXXX, of this user)."""
    import shutil
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if len(parts) < 4 or parts[0] != "chorus" or parts[1] != "dask" or not parts[2].isdigit():
            continue
        path = os.path.join(root, name)
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
            os.kill(int(parts[2]), 0)
            continue  # its worker still runs
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (OSError, ValueError):
            continue


class _StderrTail:
    """A rank's stderr, passed on to the worker's as it comes, its last line kept: the root cause of
    a process that died before it could record one (an ImportError on a worker without chorus on
    its path, say), as a Python traceback's last line is."""

    def __init__(self, stream):
        self.stream, self.lines = stream, []
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self):
        out = getattr(sys.stderr, "buffer", None)
        for line in iter(self.stream.readline, b""):
            if out is not None:
                out.write(line)
                out.flush()
            if line.strip():
                self.lines = (self.lines + [line])[-5:]
        self.stream.close()

    def join(self):
        self.thread.join(timeout=5)

    def last(self):
        return self.lines[-1].decode(errors="replace").strip() if self.lines else ""


def _message(rc, outcome, error_path, last_line=""):
    if outcome is not None and "error" in outcome:
        return outcome["error"]
    if os.path.exists(error_path):
        import json
        try:
            with open(error_path) as f:
                return json.load(f).get("message", "exit code %d" % rc)
        except (OSError, ValueError):
            pass
    said = "; its last output: " + last_line[-300:] if last_line else ""
    if rc < 0:
        return "killed by signal %d%s" % (-rc, said)
    return "exit code %d%s" % (rc, said)
