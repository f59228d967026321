#!/usr/bin/python3
"""chorus.dask on a real Dask cluster on this machine (python3-distributed's LocalCluster: a
scheduler and 2 worker processes on loopback), registered as python_dask_test:

1. run(): 2 ranks per worker (W=4) train PyTorch's DDP on backend "chorus"; every rank returns its
   environment's rank variables, its worker's address and its parameters: the placement is the one
   asked for (ranks 0-1 on the first worker, 2-3 on the second), MASTER_ADDR is rank 0's worker
   host, all four hold the same parameters, and they equal a single-process run of the same
   averaged gradients (plain SGD, so the mean of the ranks' gradients gives them exactly), and the
   same job launched by `chorus run -n 4` (this file with --chorus-run-rank) ends with the same ones.
2. run() of a function that raises on rank 2: every future raises ChorusDaskError naming rank 2,
   its worker and the message, within seconds, and no rank's process is left.
3. Cancelling the futures of a job whose ranks sleep stops all of them within seconds.
4. run_program(): a C++ chorus program (launch_probe: writes the variables it got, then allreduces
   through chorus's C++ rendezvous) exits 0 on every rank; when its rank 1 throws, every future
   names rank 1 and the exception's message (the rank's CHORUS_ERROR_FILE record); a rank that dies
   before it can record anything (an import that fails) is named with its stderr's last line.
5. Results: rank 0's chorus.dask.log() scalars land on the client as a run directory (step and log
   lines, summary.json) that `chorus report` (found beside LAUNCH_PROBE) turns into a page.
6. A worker SIGKILLed while its rank allreduces: rank 0 names the dead rank within seconds, the dead
   worker's future is cancelled instead of pending forever, and no rank process is left.
Prints "OK: ..." and exits 0, else one line per problem and exits 1. usage: dask_test.py LAUNCH_PROBE
"""
import os
import signal
import sys
import tempfile
import time

import torch

import chorus.dask
from chorus.dask import ChorusDaskError


def train(steps, own_init=False):
    """DDP for `steps` steps in the group chorus.dask set up (backend="chorus"), or, with own_init,
    in one it sets up itself (run(..., backend=None))."""
    import torch
    import torch.distributed as dist

    if own_init:
        import chorus  # noqa: F401
        dist.init_process_group("chorus")
    backend = dist.get_backend()
    torch.manual_seed(0)
    net = torch.nn.Linear(5, 3)
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    rank = dist.get_rank()
    for step in range(steps):
        g = torch.Generator().manual_seed(step * 100 + rank)
        opt.zero_grad()
        ddp(torch.randn(4, 5, generator=g)).pow(2).mean().backward()
        opt.step()
    if own_init:
        dist.destroy_process_group()
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
    return {"env": {k: os.environ[k] for k in keys}, "pid": os.getpid(), "ppid": os.getppid(), "backend": backend,
            "params": torch.cat([p.detach().reshape(-1) for p in net.parameters()]).tolist()}


def reference(world, steps):
    torch.manual_seed(0)
    net = torch.nn.Linear(5, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(steps):
        grads = []
        for rank in range(world):
            g = torch.Generator().manual_seed(step * 100 + rank)
            net.zero_grad()
            net(torch.randn(4, 5, generator=g)).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        for p, *gs in zip(net.parameters(), *grads):
            p.grad = sum(gs) / world
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).tolist()


def fail_on_rank_2():
    import os
    import time
    if os.environ["RANK"] == "2":
        time.sleep(0.5)
        raise ValueError("no shard for rank 2")
    time.sleep(120)  # the others would wait long: they must be stopped


def sleep_and_report(path, allreduce_every=None):
    """Writes its pid, then sleeps 120 s, or allreduces on backend chorus every `allreduce_every` s."""
    import os
    import time
    if allreduce_every is not None:  # in the group chorus.dask set up
        import torch
        import torch.distributed as dist
    with open(os.path.join(path, "pid-%s" % os.environ["RANK"]), "w") as f:
        f.write(str(os.getpid()))
    if allreduce_every is None:
        time.sleep(120)
        return
    t = torch.ones(16)
    for _ in range(int(120 / allreduce_every)):
        dist.all_reduce(t)
        time.sleep(allreduce_every)


def train_and_log(steps):
    import time

    import chorus.dask
    for s in range(1, steps + 1):
        chorus.dask.log(step=s, epoch=0, loss=1.0 / s, accuracy=0.5 + s / 100.0)
        time.sleep(0.05)
    return steps


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open("/proc/%d/stat" % pid) as f:
        return f.read().split()[2] != "Z"


def rank_pids_of(tmp, world):
    """The pids sleep_and_report's ranks wrote to tmp, once all `world` have (30 s at most)."""
    deadline = time.monotonic() + 30
    while len([n for n in os.listdir(tmp) if n.startswith("pid-")]) < world and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = []
    for n in os.listdir(tmp):
        with open(os.path.join(tmp, n)) as f:
            pids.append(int(f.read()))
    return pids


def errors_of(futures):
    """Each future's ChorusDaskError message ("no error" when it finished)."""
    messages = []
    for f in futures:
        try:
            f.result(timeout=60)
            messages.append("no error")
        except ChorusDaskError as e:
            messages.append(str(e))
    return messages


def kill_a_worker_mid_training(client, workers, notes):
    """One rank per worker allreduces on backend chorus; workers[1] (its process) is SIGKILLed: rank
    0's future must raise within 10 s naming rank 1, every future must end within 30 s (rank 1's is
    cancelled: Dask cannot finish it) and no rank process may be left. Returns the problems."""
    problems = []
    with tempfile.TemporaryDirectory(prefix="chorus-dask-test-") as tmp:
        worker_pids = client.run(os.getpid)
        futures = chorus.dask.run(client, sleep_and_report, tmp, allreduce_every=0.05, workers=workers)
        rank_pids = rank_pids_of(tmp, 2)
        time.sleep(0.5)  # a few allreduces in
        t0 = time.monotonic()
        took = -1.0
        os.kill(worker_pids[workers[1]], signal.SIGKILL)
        try:
            futures[0].result(timeout=30)
            problems.append("worker killed: rank 0 finished without an error")
        except ChorusDaskError as e:
            took = time.monotonic() - t0
            if "rank 1" not in str(e) or "died" not in str(e) or took > 10:
                problems.append("worker killed: after %.1f s rank 0 raised %s" % (took, e))
        except Exception as e:
            problems.append("worker killed: rank 0 raised %s: %s" % (type(e).__name__, e))
        end = time.monotonic() + 30
        while not all(f.done() for f in futures) and time.monotonic() < end:
            time.sleep(0.1)
        if not all(f.done() for f in futures):
            problems.append("worker killed: futures still pending 30 s later: %s" % [f.status for f in futures])
        time.sleep(0.5)
        left = [p for p in rank_pids if alive(p)]
        if len(rank_pids) != 2 or left:
            problems.append("worker killed: rank pids %s, still running %s" % (rank_pids, left))
        notes.append("a worker SIGKILLed mid-training: the error named the dead rank in %.1f s, every future "
                     "ended in %.1f s, no rank left" % (took, time.monotonic() - t0))
    # The dead worker's rank left its scratch directory; the next rank task on the machine removes it.
    dead = worker_pids[workers[1]]

    def scratch_of_dead():
        return [n for n in os.listdir(tempfile.gettempdir()) if n.startswith("chorus-dask-%d-" % dead)]

    if not scratch_of_dead():
        problems.append("worker killed: no scratch directory of its rank was left to clean up (naming changed?)")
    client.gather(chorus.dask.run(client, os.getpid, backend=None, workers=[workers[0]]))
    if scratch_of_dead():
        problems.append("worker killed: its ranks' scratch directories are still there: %s" % scratch_of_dead())
    return problems


def same_as_under_chorus_run(chorus_bin, steps, results):
    """The same DDP job launched by `chorus run -n W` on this host (this file in its
    --chorus-run-rank mode), W = len(results): every rank's parameters equal the Dask job's rank's."""
    import json
    import subprocess
    with tempfile.TemporaryDirectory(prefix="chorus-dask-test-") as tmp:
        r = subprocess.run([chorus_bin, "run", "-n", str(len(results)), sys.executable, os.path.abspath(__file__),
                            "--chorus-run-rank", str(steps), tmp],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
        if r.returncode != 0:
            return ["the job under chorus run failed: %s" % r.stdout[-800:]]
        problems = []
        for rank, dask_result in enumerate(results):
            with open(os.path.join(tmp, "rank_%d.json" % rank)) as f:
                params = json.load(f)
            if len(params) != len(dask_result["params"]) or \
                    max(abs(a - b) for a, b in zip(params, dask_result["params"])) > 1e-6:
                problems.append("rank %d's parameters under chorus.dask differ from the same job under chorus run" % rank)
        return problems


def chorus_run_rank(steps, out_dir):
    """One rank of the comparison job: train() in a group it sets up from chorus run's variables."""
    import json
    result = train(steps, own_init=True)
    with open(os.path.join(out_dir, "rank_%s.json" % os.environ["RANK"]), "w") as f:
        json.dump(result["params"], f)
    return 0


def summarize(problems, notes):
    """Prints each problem, then OK or MISMATCH with the notes; the exit status."""
    for p in problems:
        print(p)
    print("%s: %s" % ("MISMATCH" if problems else "OK", "; ".join(notes)))
    return 1 if problems else 0


def main():
    probe = sys.argv[1]
    problems = []
    notes = []
    # The workers' temporary files (rank scratch directories, Dask's worker space) in a directory of
    # this test's own: a rank task sweeps dead workers' scratch in its TMPDIR, and another job on this
    # machine must not sweep this one's before step 6 has looked.
    private_tmp = tempfile.mkdtemp(prefix="chorus-dask-test-tmp-")
    os.environ["TMPDIR"] = private_tmp
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    try:
        return run_checks(probe, problems, notes)
    finally:
        import shutil
        shutil.rmtree(private_tmp, ignore_errors=True)


def run_checks(probe, problems, notes):
    from distributed import Client, LocalCluster

    cluster = LocalCluster(n_workers=2, threads_per_worker=2, processes=True, host="127.0.0.1",
                           dashboard_address=None)
    client = Client(cluster)
    try:
        workers = sorted(client.scheduler_info()["workers"])
        # 1. DDP across the workers
        steps = 5
        futures = chorus.dask.run(client, train, steps, nprocs_per_worker=2)
        results = client.gather(futures)
        placed = client.who_has(futures)
        want = reference(4, steps)
        for rank, r in enumerate(results):
            if r["env"]["RANK"] != str(rank) or r["env"]["WORLD_SIZE"] != "4" or r["env"]["LOCAL_WORLD_SIZE"] != "2":
                problems.append("rank %d's environment: %s" % (rank, r["env"]))
            if r["env"]["LOCAL_RANK"] != str(rank % 2) or r["env"]["MASTER_ADDR"] != "127.0.0.1":
                problems.append("rank %d's local rank or master: %s" % (rank, r["env"]))
            holder = list(placed[futures[rank].key])
            if holder != [workers[rank // 2]]:
                problems.append("rank %d ran on %s, not %s" % (rank, holder, workers[rank // 2]))
            if r["backend"] != "chorus":
                problems.append("rank %d's default group has backend %s, not chorus" % (rank, r["backend"]))
            if r["params"] != results[0]["params"]:
                problems.append("rank %d's parameters differ from rank 0's" % rank)
            if max(abs(a - b) for a, b in zip(r["params"], want)) > 1e-6:
                problems.append("rank %d's parameters differ from the single-process reference" % rank)
        if len({r["pid"] for r in results}) != 4:
            problems.append("ranks shared a process: %s" % [r["pid"] for r in results])
        problems += same_as_under_chorus_run(os.path.join(os.path.dirname(probe), "chorus"), steps, results)
        notes.append("DDP at W=4 (2 per worker) equal to the reference and to the job under chorus run")

        # 2. a failing rank stops the job; every future names it
        t0 = time.monotonic()
        futures = chorus.dask.run(client, fail_on_rank_2, nprocs_per_worker=2)
        messages = errors_of(futures)
        took = time.monotonic() - t0
        for rank, m in enumerate(messages):
            if "rank 2 (worker %s" % workers[1] not in m or "ValueError: no shard for rank 2" not in m:
                problems.append("rank %d's error does not name the root cause: %s" % (rank, m))
        if took > 15:
            problems.append("the failed job took %.1f s to stop (limit 15 s)" % took)
        notes.append("a failing rank stopped the job in %.1f s" % took)

        # 3. cancel
        with tempfile.TemporaryDirectory(prefix="chorus-dask-test-") as tmp:
            futures = chorus.dask.run(client, sleep_and_report, tmp, nprocs_per_worker=2)
            pids = rank_pids_of(tmp, 4)
            if len(pids) != 4:
                problems.append("only %d ranks started before the cancel" % len(pids))
            t0 = time.monotonic()
            client.cancel(futures)
            while any(alive(p) for p in pids) and time.monotonic() - t0 < 20:
                time.sleep(0.1)
            left = [p for p in pids if alive(p)]
            if left:
                problems.append("ranks still running 20 s after the cancel: %s" % left)
            notes.append("a cancel stopped every rank in %.1f s" % (time.monotonic() - t0))

        # 5. results: rank 0's log() lines become a run directory on the client that chorus report reads
        with tempfile.TemporaryDirectory(prefix="chorus-dask-test-") as tmp:
            run_dir = os.path.join(tmp, "runs", "dask-job")
            futures = chorus.dask.run(client, train_and_log, 8, results_dir=run_dir)
            client.gather(futures)
            if not chorus.dask.wait_results(futures, 60):
                problems.append("results: the run directory was not complete 60 s after the job")
            import json
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                records = [json.loads(line) for line in f]
            steps = [r for r in records if r["type"] == "step"]
            logs = [r for r in records if r["type"] == "log"]
            if [r["step"] for r in steps] != list(range(1, 9)) or [r["loss"] for r in steps] != [1.0 / s for s in range(1, 9)]:
                problems.append("results: step lines %s" % steps)
            if [r["accuracy"] for r in logs] != [0.5 + s / 100.0 for s in range(1, 9)]:
                problems.append("results: log lines %s" % logs)
            with open(os.path.join(run_dir, "summary.json")) as f:
                summary = json.load(f)
            if summary["status"] != "finished" or summary["steps"] != 8:
                problems.append("results: summary %s" % summary)
            report = os.path.join(os.path.dirname(probe), "chorus")
            if os.path.exists(report):
                import subprocess
                r = subprocess.run([report, "report", run_dir, "-o", os.path.join(tmp, "page")],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
                if r.returncode != 0 or not os.path.exists(os.path.join(tmp, "page", "index.html")):
                    problems.append("results: chorus report failed: %s" % r.stdout[-500:])
        notes.append("rank 0's scalars became a run directory that chorus report draws")

        # 4. a C++ chorus program per rank: launch_probe's "env" mode writes the variables it got,
        # then allreduces through chorus's C++ rendezvous; "throw" makes rank 1 throw.
        with tempfile.TemporaryDirectory(prefix="chorus-dask-test-") as tmp:
            codes = client.gather(chorus.dask.run_program(client, [probe, "env", tmp]))
            files = sorted(os.listdir(tmp))
            if codes != [0, 0] or files != ["rank_0.env", "rank_1.env"]:
                problems.append("run_program: exit codes %s, files %s" % (codes, files))
        messages = errors_of(chorus.dask.run_program(client, [probe, "throw", "bad batch"]))
        for rank, m in enumerate(messages):
            if "rank 1 (worker %s" % workers[1] not in m or "bad batch" not in m:
                problems.append("run_program: rank %d's error does not name rank 1's exception: %s" % (rank, m))
        # a rank that dies before it can record an error: its last line of stderr is the message
        messages = errors_of(chorus.dask.run_program(client, [sys.executable, "-c", "import chorus_no_such_module"]))
        for rank, m in enumerate(messages):
            if "ModuleNotFoundError: No module named 'chorus_no_such_module'" not in m:
                problems.append("run_program: rank %d's error lacks its stderr's last line: %s" % (rank, m))
        notes.append("run_program ran a chorus C++ program per worker and named its exception")

        # 6. a worker SIGKILLed mid-training (last: its nanny restarts it under a new address)
        problems += kill_a_worker_mid_training(client, workers, notes)
    finally:
        client.close()
        cluster.close()
    return summarize(problems, notes)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--chorus-run-rank":
        sys.exit(chorus_run_rank(int(sys.argv[2]), sys.argv[3]))
    sys.exit(main())
