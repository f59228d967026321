#!/usr/bin/python3
"""examples/dask/resnet_s3.py as a user runs it, small (registered as dask_resnet_example_test):

1. `chorus data render-fashion-mnist` writes a small PNG tree, uploaded (`chorus data upload`) to
   s3rver on loopback.
2. A real Dask cluster: `dask-scheduler` and two `dask-worker` processes, each worker in a working
   directory of its own.
3. The example trains the transfer job from s3:// at 1 and 2 workers through chorus.dask.run_program.
   For each: the client's run directory holds the C++ program's step lines (with loss) and one
   test-accuracy line per epoch, streamed from rank 0, and a summary of a finished job of that world
   size; the test accuracies equal those in rank 0's own records on its worker; the client printed
   progress while the job ran; `chorus report` drew the accuracy curves of both runs.
4. Nothing is left running: no transfer process after the runs, and the cluster and server stopped.

usage: example_test.py PATH/TO/chorus PATH/TO/transfer S3_TEST_DIR [WORKERS]: WORKERS (default 2)
dask-workers, trained at 1, 2, 4, ... up to WORKERS (4: the example's own 1, 2, 4). Needs python3-distributed,
dataset-fashion-mnist and node (s3rver). Exits 0 with PASS lines, else FAIL: ...
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CLASSES = "T-shirt_top,Trouser,Bag"
EPOCHS = 2


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def lines(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def wait_for_file(path, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        check(proc.poll() is None, "%s exited with %s" % (proc.args[0], proc.returncode))
        check(time.monotonic() < deadline, "%s was not written within %d s" % (path, timeout))
        time.sleep(0.1)


def main():
    chorus, transfer, s3_dir = (os.path.abspath(a) for a in sys.argv[1:4])
    n_workers = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    counts = [n for n in (1, 2, 4, 8, 10) if n <= n_workers]
    work = tempfile.mkdtemp(prefix="chorus-dask-example-")
    # the workers' temporary files (rank scratch, Dask's worker space) under work: removed with it,
    # and out of reach of another job's sweep of dead workers' scratch on this machine
    os.mkdir(os.path.join(work, "tmp"))
    os.environ["TMPDIR"] = os.path.join(work, "tmp")
    procs = []
    try:
        def start(cmd, cwd, **kw):
            p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                 start_new_session=True, **kw)
            procs.append(p)
            return p

        data = os.path.join(work, "fmnist")
        subprocess.run([chorus, "data", "render-fashion-mnist", data, "--format", "png", "--limit", "30"],
                       check=True, timeout=120, capture_output=True)
        log = os.path.join(work, "requests.log")
        os.makedirs(os.path.join(work, "s3data"))
        server = subprocess.Popen(["node", "--openssl-legacy-provider", os.path.join(s3_dir, "s3rver_run.js"),
                                   os.path.join(work, "s3data"), log, "chorus-test"], stdout=subprocess.PIPE,
                                  text=True, start_new_session=True)
        procs.append(server)
        line = server.stdout.readline()
        check(line.startswith("PORT "), "s3rver did not start: %r" % line)
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        env.update(AWS_ACCESS_KEY_ID="S3RVER", AWS_SECRET_ACCESS_KEY="S3RVER",
                   AWS_ENDPOINT_URL="http://127.0.0.1:" + line.split()[1])
        subprocess.run([chorus, "data", "upload", data, "s3://chorus-test/fmnist"], check=True, timeout=120,
                       capture_output=True, env=env)
        print("PASS: a small Fashion-MNIST tree in s3://chorus-test/fmnist", flush=True)

        sched_file = os.path.join(work, "scheduler.json")
        sched = start(["dask-scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                       "--scheduler-file", sched_file], work)
        wait_for_file(sched_file, sched)
        with open(sched_file) as f:
            address = json.load(f)["address"]
        worker_dirs = []
        for i in range(n_workers):
            d = os.path.join(work, "worker%d" % i)
            os.makedirs(d)
            worker_dirs.append(d)
            start(["dask-worker", address, "--nworkers", "1", "--nthreads", "1", "--no-dashboard", "--host",
                   "127.0.0.1", "--local-directory", d], d, env=dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", "")))
        from distributed import Client
        with Client(address, timeout=60) as client:
            client.wait_for_workers(n_workers, timeout=60)
        print("PASS: dask-scheduler and %d dask-workers at %s" % (n_workers, address), flush=True)

        runs = os.path.join(work, "runs-dask")
        example = subprocess.run([sys.executable, os.path.join(HERE, "resnet_s3.py"), "--scheduler", address,
                                  "--data", "s3://chorus-test/fmnist", "--workers", ",".join(map(str, counts)), "--runs", runs,
                                  "--transfer", transfer, "--chorus", chorus, "--",
                                  "--classes", CLASSES, "--shots", "20", "--epochs", str(EPOCHS),
                                  "--threads", "1", "--loader-threads", "1"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600,
                                 cwd=work, env=env)
        print(example.stdout, flush=True)
        check(example.returncode == 0, "the example exited with %d" % example.returncode)
        check("chorus.dask: step" in example.stdout, "the client printed no progress while the jobs ran")
        for n in counts:
            name = "w%d" % n
            records = lines(os.path.join(runs, name, "metrics.jsonl"))
            steps = [r for r in records if r.get("type") == "step"]
            acc = [r["test_accuracy"] for r in records if r.get("type") == "log" and "test_accuracy" in r]
            check(steps and all("loss" in r for r in steps), "%s: no step lines with a loss: %s" % (name, records[:3]))
            check(len(acc) == EPOCHS, "%s: %d test accuracies for %d epochs" % (name, len(acc), EPOCHS))
            with open(os.path.join(runs, name, "summary.json")) as f:
                summary = json.load(f)
            check(summary["status"] == "finished" and summary["world_size"] == n, "%s: summary %s" % (name, summary))
            # rank 0 ran on the first worker (by address); its own records there say the same
            holders = [d for d in worker_dirs if os.path.exists(os.path.join(d, "runs", "dask-" + name, "metrics.jsonl"))]
            check(len(holders) == 1, "%s: rank 0's own records found under %s" % (name, holders))
            own = [r["test_accuracy"] for r in lines(os.path.join(holders[0], "runs", "dask-" + name, "metrics.jsonl"))
                   if r.get("type") == "log" and "test_accuracy" in r]
            check(own == acc, "%s: streamed accuracies %s, rank 0's own %s" % (name, acc, own))
            print("PASS: %d worker(s): %d steps, test accuracy by epoch %s, streamed to the client" %
                  (n, len(steps), ["%.3f" % a for a in acc]), flush=True)
        page = open(os.path.join(runs, "report", "index.html")).read()
        check("test_accuracy against wall time" in page and all("w%d" % n in page for n in counts),
              "the report lacks the runs' accuracy curves")
        print("PASS: chorus report drew test accuracy against time for %s workers" % counts, flush=True)
        left = subprocess.run(["pgrep", "-f", "--", "--run-name dask-w"], capture_output=True, text=True).stdout.split()
        check(not left, "transfer processes left running: %s" % left)
        print("PASS: no rank left running", flush=True)
    except AssertionError as e:
        print("FAIL: %s" % e, flush=True)
        return 1
    finally:
        for p in reversed(procs):
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
