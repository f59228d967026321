#!/usr/bin/python3
"""Tests of `chorus run` with real processes: the worker environment, the root-cause report (a
worker that throws, one that exits 7, one that is SIGKILLed, one that catches its error while a
lower rank fails after it, the training harness's injected failure), restarts with resume, signal
forwarding, the command line (`--`, torchrun's spellings, help and exit codes, numeric checks),
--log-dir keeping rank 0 on the terminal, scratch directories of killed launchers, an unreachable
endpoint, and two nodes meeting at one endpoint.

Every run is bounded by a timeout; every temporary directory is removed."""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

ARGS = None


def run(cmd, timeout=60, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="chorus-launch-test-")
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def chorus(self, *args, timeout=60):
        return run([ARGS.chorus, "run", *args], timeout=timeout)

    def test_environment_matches_torchrun_and_groups_connect(self):
        r = self.chorus("-n", "3", ARGS.probe, "env", self.dir)
        self.assertEqual(r.returncode, 0, r.stderr)
        envs = []
        for rank in range(3):
            with open(os.path.join(self.dir, "rank_%d.env" % rank)) as f:
                envs.append(dict(line.strip().split("=", 1) for line in f if "=" in line))
        ports = {e["MASTER_PORT"] for e in envs}
        # chorus's store is elsewhere: MASTER_PORT is left to PyTorch's env:// store.
        self.assertEqual(len({e["CHORUS_STORE_PORT"] for e in envs}), 1)
        self.assertNotEqual(envs[0]["CHORUS_STORE_PORT"], envs[0]["MASTER_PORT"])
        tokens = {e["CHORUS_JOB_TOKEN"] for e in envs}
        self.assertEqual(len(ports), 1)
        self.assertEqual(len(tokens), 1)
        self.assertGreater(len(tokens.pop()), 16)
        for rank, e in enumerate(envs):
            self.assertEqual(e["RANK"], str(rank))
            self.assertEqual(e["LOCAL_RANK"], str(rank))
            self.assertEqual(e["WORLD_SIZE"], "3")
            self.assertEqual(e["LOCAL_WORLD_SIZE"], "3")
            self.assertEqual(e["GROUP_RANK"], "0")
            self.assertEqual(e["MASTER_ADDR"], "127.0.0.1")
            self.assertEqual(e["CHORUS_RESTART_COUNT"], "0")
        self.assertIn("allreduce gave 3", r.stdout)
        # Two jobs at once never collide: each launcher's store has its own kernel-picked port.
        d2 = os.path.join(self.dir, "second")
        os.mkdir(d2)
        r2 = self.chorus("-n", "2", ARGS.probe, "env", d2)
        self.assertEqual(r2.returncode, 0, r2.stderr)

    def test_report_names_the_worker_that_threw_with_its_message(self):
        r = self.chorus("-n", "3", "--tee", ARGS.probe, "throw", "bad batch at step 7")
        self.assertEqual(r.returncode, 1)
        self.assertIn("root cause: rank 1", r.stderr)
        self.assertIn("SIGABRT", r.stderr)
        self.assertIn("message: bad batch at step 7", r.stderr)
        self.assertIn("[rank1]:", r.stdout)

    def test_report_names_the_first_own_error_not_a_relayed_one(self):
        # Rank 1 fails on its own error; rank 0 then fails because rank 1 is gone; rank 2 has
        # finished normally. Both failures are caught and recorded, and exit 1.
        r = self.chorus("-n", "3", ARGS.probe, "caught", "bad batch at step 7")
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("root cause: rank 1", r.stderr)
        self.assertIn("message: bad batch at step 7", r.stderr)
        self.assertIn("rank 0: exit code 1, failed because another rank did", r.stderr)
        self.assertIn("rank 2: finished normally", r.stderr)
        self.assertNotIn("rank 2: killed", r.stderr)

    def needs_harness(self):
        # A build without libtorch (make sanitize) has no training harness.
        if not os.access(ARGS.fashion_mnist_ddp, os.X_OK):
            self.skipTest("no " + ARGS.fashion_mnist_ddp + " (a build without libtorch)")

    def test_report_names_the_failing_rank_of_the_training_harness(self):
        self.needs_harness()
        r = self.chorus("-n", "2", ARGS.fashion_mnist_ddp, "--fail-at-step", "2", "--max-steps", "5",
                        "--no-checkpoint", "--eval-limit", "100", timeout=120)
        self.assertEqual(r.returncode, 1, r.stderr[-2000:])
        self.assertIn("root cause: rank 1", r.stderr)
        self.assertIn("message: injected failure after step 2", r.stderr)
        self.assertIn("rank 0: exit code 1, failed because another rank did", r.stderr)

    def test_report_names_exit_code_and_log(self):
        logs = os.path.join(self.dir, "logs")
        r = self.chorus("-n", "2", "--log-dir", logs, "--grace-period", "1", ARGS.probe, "exit", "7")
        self.assertEqual(r.returncode, 1)
        self.assertIn("root cause: rank 1", r.stderr)
        self.assertIn("exit code 7", r.stderr)
        self.assertIn(os.path.join(logs, "rank_1.log"), r.stderr)
        self.assertTrue(os.path.exists(os.path.join(logs, "rank_0.log")))

    def test_report_names_the_signal_of_a_killed_worker(self):
        t0 = time.monotonic()
        r = self.chorus("-n", "3", "--grace-period", "1", ARGS.probe, "sigkill")
        self.assertEqual(r.returncode, 1)
        self.assertIn("root cause: rank 1", r.stderr)
        self.assertIn("killed by SIGKILL", r.stderr)
        self.assertLess(time.monotonic() - t0, 20)

    def test_restart_resumes_the_training_job_from_its_checkpoint(self):
        self.needs_harness()
        ckpt = os.path.join(self.dir, "ckpt")
        metrics = os.path.join(self.dir, "m.json")
        r = self.chorus("-n", "2", "--max-restarts", "2", ARGS.fashion_mnist_ddp, "--max-steps", "30",
                        "--checkpoint-every", "10", "--fail-at-step", "15", "--resume", "--checkpoint-dir", ckpt,
                        "--eval-limit", "200", "--metrics-json", metrics, timeout=240)
        self.assertEqual(r.returncode, 0, r.stderr[-2000:])
        self.assertIn("restarting the group (1 of 2 restarts)", r.stderr)
        self.assertIn("injected failure after step 15", r.stderr)
        with open(metrics) as f:
            m = json.load(f)
        self.assertEqual(m["resumed_from_step"], 10)
        self.assertEqual(m["total_steps"], 30)
        self.assertEqual(m["world_size"], 2)

    def test_signals_reach_every_worker(self):
        for sig, expected_rc in ((signal.SIGUSR1, 0), (signal.SIGTERM, 128 + signal.SIGTERM)):
            d = os.path.join(self.dir, "sig%d" % sig)
            os.mkdir(d)
            p = subprocess.Popen([ARGS.chorus, "run", "-n", "2", ARGS.probe, "wait-signal", d],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                deadline = time.monotonic() + 30
                while not all(os.path.exists(os.path.join(d, "rank_%d.ready" % r)) for r in range(2)):
                    self.assertLess(time.monotonic(), deadline, "workers never got ready")
                    time.sleep(0.02)
                p.send_signal(sig)
                _, err = p.communicate(timeout=30)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            self.assertEqual(p.returncode, expected_rc, err)
            for r in range(2):
                with open(os.path.join(d, "rank_%d.signal" % r)) as f:
                    self.assertEqual(int(f.read()), int(sig))

    def test_python_scripts_on_gloo_and_on_chorus(self):
        # PyTorch's env:// store gets MASTER_PORT, chorus's own store CHORUS_STORE_PORT: an
        # unchanged script's init_process_group finds no port taken (docs/python.md). On backend
        # chorus, its setup goes through chorus run's authenticated store: PyTorch's store holds only
        # the 16-character name of the group's keys there.
        script = os.path.join(self.dir, "train.py")
        with open(script, "w") as f:
            f.write("import datetime, sys, torch, torch.distributed as dist\n"
                    "if sys.argv[1] == 'chorus':\n"
                    "    import chorus\n"
                    "dist.init_process_group(sys.argv[1])\n"
                    "if sys.argv[1] == 'chorus':\n"
                    "    from torch.distributed.distributed_c10d import _get_default_store\n"
                    "    store = dist.PrefixStore('0', _get_default_store())\n"
                    "    store.set_timeout(datetime.timedelta(seconds=10))\n"
                    "    print('setup through chorus run\\'s store: %s' % store.get('chorus/python/group').isalnum())\n"
                    "t = torch.ones(3) * (dist.get_rank() + 1)\n"
                    "dist.all_reduce(t)\n"
                    "print('rank %d of %d: %s' % (dist.get_rank(), dist.get_world_size(), t.tolist()), flush=True)\n"
                    "dist.destroy_process_group()\n")
        package = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(ARGS.chorus))), "python")
        backends = ["gloo"] + (["chorus"] if os.path.isdir(os.path.join(package, "chorus")) else [])
        env = dict(os.environ, PYTHONPATH=package)
        for backend in backends:
            r = run([ARGS.chorus, "run", "-n", "3", "/usr/bin/python3", script, backend], timeout=120, env=env)
            self.assertEqual(r.returncode, 0, (backend, r.stderr))
            for rank in range(3):
                self.assertIn("rank %d of 3: [6.0, 6.0, 6.0]" % rank, r.stdout, backend)
            if backend == "chorus":
                self.assertEqual(r.stdout.count("setup through chorus run's store: True"), 3, r.stdout)
        # With the chorus package imported, a Python error's last line is the root cause chorus run
        # reports (python/chorus/__init__.py records it in CHORUS_ERROR_FILE).
        if "chorus" in backends:
            bad = os.path.join(self.dir, "bad.py")
            with open(bad, "w") as f:
                f.write("import os, time, chorus\nif os.environ['RANK'] == '1':\n"
                        "    raise ValueError('no data for rank 1')\ntime.sleep(30)\n")
            r = run([ARGS.chorus, "run", "-n", "2", "/usr/bin/python3", bad], timeout=60, env=env)
            self.assertNotEqual(r.returncode, 0)
            self.assertRegex(r.stderr, r"root cause: rank 1 .*\n\s*message: ValueError: no data for rank 1")

    def test_double_dash_and_torchrun_spellings(self):
        for i, args in enumerate((["-n", "2", "--"], ["--nproc_per_node", "2", "--standalone"],
                                  ["--nproc-per-node=2", "--standalone", "--"])):
            d = os.path.join(self.dir, "run%d" % i)
            os.mkdir(d)
            r = self.chorus(*args, ARGS.probe, "env", d)
            self.assertEqual(r.returncode, 0, (args, r.stderr))
            self.assertEqual(sorted(os.listdir(d)), ["rank_0.env", "rank_1.env"], args)
        # A "--" after PROGRAM is the program's own argument.
        r = self.chorus("-n", "1", "--", "/bin/echo", "a", "--", "-n", "3")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.strip(), "a -- -n 3")

    def test_help_and_exit_codes(self):
        r = run([ARGS.chorus])
        self.assertEqual(r.returncode, 2)
        self.assertIn("Subcommands:", r.stderr)
        self.assertIn("run", r.stderr)
        r = run([ARGS.chorus, "frobnicate"])
        self.assertEqual(r.returncode, 2)
        self.assertIn("unknown subcommand 'frobnicate'", r.stderr)
        r = run([ARGS.chorus, "--help"])
        self.assertEqual(r.returncode, 0)
        self.assertIn("Subcommands:", r.stdout)
        r = run([ARGS.chorus, "run", "--help"])
        self.assertEqual(r.returncode, 0)
        self.assertIn("[--] PROGRAM [ARGS...]", r.stdout)
        self.assertIn("--grace-period FLOAT=5", r.stdout)
        self.assertIn("--nproc_per_node", r.stdout)

    def test_bind_cpu_pins_each_local_rank_to_its_own_cpu(self):
        if len(os.sched_getaffinity(0)) < 2:
            self.skipTest("needs 2 CPUs")
        show = ["/bin/sh", "-c", "grep Cpus_allowed_list /proc/self/status"]
        r = self.chorus("-n", "2", "--bind-cpu", "--tee", "--", *show)
        self.assertEqual(r.returncode, 0, r.stderr)
        cpus = dict(re.findall(r"\[rank(\d)\]:Cpus_allowed_list:\s*(\S+)", r.stdout))
        self.assertEqual(sorted(cpus), ["0", "1"], r.stdout)
        self.assertNotEqual(cpus["0"], cpus["1"])
        for cpu in cpus.values():
            self.assertRegex(cpu, r"^\d+$")  # one CPU each
        r = self.chorus("-n", "2", "--tee", "--", *show)  # without the flag: the launcher's CPUs
        for cpu in re.findall(r"Cpus_allowed_list:\s*(\S+)", r.stdout):
            self.assertNotRegex(cpu, r"^\d+$")

    def test_log_dir_keeps_rank_0_on_the_terminal(self):
        logs = os.path.join(self.dir, "logs")
        r = self.chorus("-n", "2", "--log-dir", logs, ARGS.probe, "env", self.dir)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("rank 0 of 2: allreduce gave 2", r.stdout)
        self.assertNotIn("rank 1 of 2", r.stdout)
        self.assertNotIn("[rank0]:", r.stdout)  # no prefixes without --tee
        for rank in range(2):
            with open(os.path.join(logs, "rank_%d.log" % rank)) as f:
                self.assertIn("rank %d of 2: allreduce gave 2" % rank, f.read())

    def test_ranks_filter_shows_the_chosen_ranks_prefixed_and_logs_every_rank(self):
        logs = os.path.join(self.dir, "logs")
        r = self.chorus("-n", "3", "--ranks-filter", "0,2", "--log-dir", logs, ARGS.probe, "env", self.dir)
        self.assertEqual(r.returncode, 0, r.stderr)
        lines = r.stdout.splitlines()
        self.assertIn("[rank0]:rank 0 of 3: allreduce gave 3", lines)
        self.assertIn("[rank2]:rank 2 of 3: allreduce gave 3", lines)
        self.assertNotIn("rank 1 of 3", r.stdout)
        for line in lines:  # nothing a worker printed reaches the terminal without its rank
            self.assertRegex(line, r"^\[rank[02]\]:")
        for rank in range(3):
            with open(os.path.join(logs, "rank_%d.log" % rank)) as f:
                text = f.read()
            self.assertIn("rank %d of 3: allreduce gave 3\n" % rank, text)
            self.assertNotIn("[rank", text)  # logs keep the lines as the program wrote them

    def test_local_ranks_filter_without_log_dir_says_the_rest_is_discarded(self):
        r = self.chorus("-n", "3", "--local-ranks-filter", "1", ARGS.probe, "env", self.dir)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.splitlines(), ["[rank1]:rank 1 of 3: allreduce gave 3"])
        self.assertIn("add --log-dir DIR to keep every rank's", r.stderr)

    def test_scratch_directories_of_killed_launchers_are_removed(self):
        def scratch(pid):
            return [n for n in os.listdir("/tmp") if n.startswith("chorus-run-%d-" % pid)]
        # A launcher killed by SIGKILL leaves its scratch directory (its workers die with it) ...
        d = os.path.join(self.dir, "sig")
        os.mkdir(d)
        p = subprocess.Popen([ARGS.chorus, "run", "-n", "2", ARGS.probe, "wait-signal", d],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while not all(os.path.exists(os.path.join(d, "rank_%d.ready" % r)) for r in range(2)):
                self.assertLess(time.monotonic(), deadline, "workers never got ready")
                time.sleep(0.02)
            self.assertEqual(len(scratch(p.pid)), 1)
            self.assertIn("-ns%d-" % os.stat("/proc/self/ns/pid").st_ino, scratch(p.pid)[0])
        finally:
            p.kill()
            p.wait(timeout=30)
        self.assertEqual(len(scratch(p.pid)), 1)
        # ... which the next launcher removes, as its pid is dead; a live launcher's stays.
        live = "/tmp/chorus-run-%d-ns%d-testlive" % (os.getpid(), os.stat("/proc/self/ns/pid").st_ino)
        os.mkdir(live)
        try:
            r = self.chorus("-n", "1", "/bin/true")
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(scratch(p.pid), [])
            self.assertTrue(os.path.isdir(live))
        finally:
            os.rmdir(live)

    def test_bad_input_gets_a_clear_message_and_nonzero_exit(self):
        cases = [
            (["--grace-period", "nan", ARGS.probe], "--grace-period must be a number of seconds in [0, 3600]"),
            (["--grace-period", "inf", ARGS.probe], "--grace-period"),
            (["--grace-period", "-1", ARGS.probe], "--grace-period"),
            (["--grace-period", "1e300", ARGS.probe], "--grace-period"),
            (["--rdzv-timeout", "0", ARGS.probe], "--rdzv-timeout"),
            (["--rdzv-timeout", "nan", ARGS.probe], "--rdzv-timeout"),
            (["--master-port", "99999", ARGS.probe], "--master-port 99999 is not a TCP port"),
            (["--master-port", "0", "--master-addr", "127.0.0.1", ARGS.probe], "not a TCP port"),
            (["--max-restarts", "-1", ARGS.probe], "--max-restarts"),
            (["-n", "100000", ARGS.probe], "more than 4096"),
            (["--nnodes", "0", ARGS.probe], "--nnodes"),
            (["--standalone", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", ARGS.probe], "--standalone"),
            (["--no-such-option", ARGS.probe], "unknown option"),
            (["-n", "0", ARGS.probe], "at least 1"),
            (["-n", "two", ARGS.probe], "number or 'auto'"),
            (["/no/such/program"], "not found or not executable"),
            ([], "no program"),
            (["--nnodes", "2", ARGS.probe], "--rdzv-endpoint"),
            (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:1", ARGS.probe], "outside"),
            (["--rdzv-endpoint", "nohostport", ARGS.probe], "HOST:PORT"),
            (["--nnodes", "3:2", ARGS.probe], "below the fewest"),
            (["--nnodes", "1:x", ARGS.probe], "MIN:MAX"),
            (["--nnodes", "1:2", ARGS.probe], "--rdzv-endpoint"),
            (["--nnodes", "1:2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:1", ARGS.probe], "drop --node-rank"),
            (["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-last-call", "-1", ARGS.probe],
             "--rdzv-last-call"),
            (["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:1", ARGS.probe], "needs a job secret"),
            (["--ranks-filter", "2-1", ARGS.probe], "--ranks-filter '2-1'"),
            (["--local-ranks-filter", "x", ARGS.probe], "--local-ranks-filter 'x'"),
            (["--ranks-filter", "0", "--local-ranks-filter", "0", ARGS.probe], "not both"),
        ]
        for args, needle in cases:
            r = self.chorus(*args)
            self.assertEqual(r.returncode, 2, (args, r.stderr))  # a usage error, before any worker starts
            self.assertIn(needle, r.stderr + r.stdout, args)

    def test_unreachable_endpoint_times_out_naming_it(self):
        port = free_port()  # nothing listens there
        t0 = time.monotonic()
        r = self.chorus("--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:%d" % port,
                        "--token", "launch-test-secret", "--rdzv-timeout", "1", ARGS.probe, "env", self.dir)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("127.0.0.1:%d" % port, r.stderr)
        self.assertLess(time.monotonic() - t0, 15)

    def test_several_nodes_need_a_shared_secret(self):
        port = free_port()
        base = ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:%d" % port, "--rdzv-timeout", "1"]
        r = self.chorus(*base, ARGS.probe, "env", self.dir)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("needs a job secret", r.stderr)
        self.assertIn("--token-file", r.stderr)
        loose = os.path.join(self.dir, "loose-token")
        with open(loose, "w") as f:
            f.write("secret\n")
        os.chmod(loose, 0o644)
        r = self.chorus(*base, "--token-file", loose, ARGS.probe, "env", self.dir)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("chmod 600", r.stderr)

    def run_launchers(self, cmds, stagger=0.0, envs=None):
        """Runs the launchers side by side (`stagger` s apart), launcher i with environment envs[i]
        when given; each must exit 0. Their (stdout, stderr)."""
        procs = []
        outs = []
        try:
            for i, cmd in enumerate(cmds):
                if procs:
                    time.sleep(stagger)
                procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                              env=envs[i] if envs else None))
            for p in procs:
                outs.append(p.communicate(timeout=60))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for p, (out, err) in zip(procs, outs):
            self.assertEqual(p.returncode, 0, err)
        return outs

    def rank_environments(self, world):
        """The variables each rank's probe wrote (rank_<r>.env in self.dir)."""
        ranks = {}
        for r in range(world):
            with open(os.path.join(self.dir, "rank_%d.env" % r)) as f:
                ranks[r] = dict(line.strip().split("=", 1) for line in f if "=" in line)
        return ranks

    def test_two_nodes_meet_at_one_endpoint(self):
        port = free_port()
        token_file = os.path.join(self.dir, "token")
        with open(token_file, "w") as f:
            f.write("two-nodes-secret\n")
        os.chmod(token_file, 0o600)
        cmd = lambda node: [ARGS.chorus, "run", "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint",
                            "127.0.0.1:%d" % port, "--token-file", token_file, "-n", "2", ARGS.probe, "env", self.dir]
        self.run_launchers([cmd(0), cmd(1)])
        ranks = self.rank_environments(4)
        self.assertEqual([ranks[r]["GROUP_RANK"] for r in range(4)], ["0", "0", "1", "1"])
        self.assertEqual({ranks[r]["WORLD_SIZE"] for r in range(4)}, {"4"})
        self.assertEqual([ranks[r]["LOCAL_RANK"] for r in range(4)], ["0", "1", "0", "1"])

    def test_kubeflow_pet_variables_and_a_jobset_index_configure_the_launcher(self):
        # Kubeflow's trainer configures torchrun through PET_ variables in each pod; they are chorus
        # run's defaults as they are torchrun's. A JobSet's pod has JOB_COMPLETION_INDEX instead of
        # a node rank: in a job of several nodes, that is its node rank.
        port = free_port()
        base = dict(os.environ, PET_NNODES="2", PET_NPROC_PER_NODE="2", PET_MASTER_ADDR="127.0.0.1",
                    PET_MASTER_PORT=str(port), CHORUS_JOB_TOKEN="pet-secret")
        cmd = [ARGS.chorus, "run", ARGS.probe, "env", self.dir]
        self.run_launchers([cmd, cmd], envs=[dict(base, PET_NODE_RANK="0"), dict(base, JOB_COMPLETION_INDEX="1")])
        ranks = self.rank_environments(4)
        self.assertEqual([ranks[r]["GROUP_RANK"] for r in range(4)], ["0", "0", "1", "1"])
        self.assertEqual({ranks[r]["WORLD_SIZE"] for r in range(4)}, {"4"})
        # A flag wins over its variable; a one-node job keeps node rank 0 whatever its pod's index.
        one = os.path.join(self.dir, "one")
        os.mkdir(one)
        r = run([ARGS.chorus, "run", "-n", "1", ARGS.probe, "env", one],
                env=dict(os.environ, PET_NPROC_PER_NODE="3", JOB_COMPLETION_INDEX="5"))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(os.listdir(one)), ["rank_0.env"])
        r = run([ARGS.chorus, "run", ARGS.probe, "env", one], env=dict(os.environ, PET_MAX_RESTARTS="x"))
        self.assertEqual(r.returncode, 2)
        self.assertIn("PET_MAX_RESTARTS", r.stderr + r.stdout)

    def pytorchjob_v1_pod(self, index, pods, nproc, port):
        """The variables Kubeflow's training operator v1 gives pod `index` of a non-elastic
        PyTorchJob (pkg/controller.v1/pytorch/envvar.go and master.go): RANK is the pod's index and
        WORLD_SIZE counts processes. Plus the job's Secret, as CHORUS_JOB_TOKEN."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "RANK", "WORLD_SIZE", "LOCAL_"))}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(pods * nproc), RANK=str(index),
                   PET_NPROC_PER_NODE=str(nproc), PET_NODE_RANK=str(index), PET_NNODES=str(pods),
                   PYTHONUNBUFFERED="0", CHORUS_JOB_TOKEN="pytorchjob-secret")
        return env

    def test_kubeflow_pytorchjob_v1_pods_run_the_unchanged_command(self):
        # nprocPerNode 2: each pod runs `chorus run PROGRAM`, which takes the node count, processes
        # per node, node rank and master from the pod's variables: one job of 4 ranks.
        port = free_port()
        cmd = [ARGS.chorus, "run", ARGS.probe, "env", self.dir]
        outs = self.run_launchers([cmd, cmd], envs=[self.pytorchjob_v1_pod(i, 2, 2, port) for i in range(2)])
        self.assertIn("MASTER_ADDR:MASTER_PORT (127.0.0.1:%d)" % port, outs[1][1])
        ranks = self.rank_environments(4)
        self.assertEqual([ranks[r]["GROUP_RANK"] for r in range(4)], ["0", "0", "1", "1"])
        self.assertEqual([ranks[r]["RANK"] for r in range(4)], ["0", "1", "2", "3"])
        self.assertEqual({ranks[r]["WORLD_SIZE"] for r in range(4)}, {"4"})
        # nprocPerNode 1: the program runs alone in each pod, on RANK and WORLD_SIZE as they are.
        alone = os.path.join(self.dir, "alone")
        os.mkdir(alone)
        port = free_port()
        outs = self.run_launchers([[ARGS.probe, "env", alone]] * 2,
                                  envs=[self.pytorchjob_v1_pod(i, 2, 1, port) for i in range(2)])
        self.assertEqual(sorted(outs[0][0].splitlines() + outs[1][0].splitlines()),
                         ["rank 0 of 2: allreduce gave 2", "rank 1 of 2: allreduce gave 2"])
        # nprocPerNode 2 without a launcher cannot work: refused at once, saying what to do.
        r = run([ARGS.probe, "env", alone], env=self.pytorchjob_v1_pod(1, 2, 2, free_port()))
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("PyTorchJob with nprocPerNode 2", r.stderr + r.stdout)
        self.assertIn("chorus run", r.stderr + r.stdout)

    def test_an_elastic_job_forms_from_the_launchers_that_come(self):
        # Two launchers on this machine with --nnodes 1:2: the first to listen on the endpoint
        # hosts the store and is node 0; the round closes at MAX (2) without waiting for the last call.
        port = free_port()
        token_file = os.path.join(self.dir, "token")
        with open(token_file, "w") as f:
            f.write("elastic-secret\n")
        os.chmod(token_file, 0o600)
        cmd = [ARGS.chorus, "run", "--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:%d" % port, "--token-file",
               token_file, "--rdzv-last-call", "30", "-n", "2", ARGS.probe, "env", self.dir]
        t0 = time.monotonic()
        outs = self.run_launchers([cmd, cmd], stagger=0.5)  # the first hosts the store
        self.assertLess(time.monotonic() - t0, 25, "a full round waited for the last call")
        self.assertIn("round 0: 2 node(s), 4 worker(s); this is node 0 (ranks 0-1)", outs[0][1])
        self.assertIn("round 0: 2 node(s), 4 worker(s); this is node 1 (ranks 2-3)", outs[1][1])
        ranks = self.rank_environments(4)
        self.assertEqual([ranks[r]["GROUP_RANK"] for r in range(4)], ["0", "0", "1", "1"])
        self.assertEqual({ranks[r]["WORLD_SIZE"] for r in range(4)}, {"4"})
        self.assertEqual({ranks[r]["CHORUS_RESTART_COUNT"] for r in range(4)}, {"0"})


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--chorus", required=True)
    ap.add_argument("--probe", required=True)
    ap.add_argument("--fashion-mnist-ddp", required=True, help="bench/fashion_mnist_ddp, the training harness")
    ARGS, rest = ap.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
