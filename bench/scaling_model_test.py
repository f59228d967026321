#!/usr/bin/python3
"""bench/scaling-model: the model's formulas, that the fit recovers the parameters of points made by
the model itself, the DDP bucket share, and that `report` writes the page and its figures from the
committed measurements."""
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.realpath(__file__))
loader = importlib.machinery.SourceFileLoader("scaling_model", os.path.join(HERE, "scaling-model"))
spec = importlib.util.spec_from_loader("scaling_model", loader)
sm = importlib.util.module_from_spec(spec)
loader.exec_module(sm)


class Model(unittest.TestCase):
    def test_formulas_at_a_power_of_two_and_past_it(self):
        a, b, g, n = 10.0, 1e-3, 2e-4, 1 << 20
        self.assertAlmostEqual(sm.predict_us("ring", n, 4, a, b, g), 6 * a + 1.5 * n * b)
        self.assertAlmostEqual(sm.predict_us("recursive_doubling", n, 4, a, b, g), 2 * (a + n * b + n * g))
        self.assertAlmostEqual(sm.predict_us("rabenseifner", n, 4, a, b, g), 4 * a + 1.5 * n * b + 0.75 * n * g)
        fold = 2 * (a + n * b) + n * g  # 6 ranks: 2 fold into the 4
        self.assertAlmostEqual(sm.predict_us("rabenseifner", n, 6, a, b, g), 4 * a + 1.5 * n * b + 0.75 * n * g + fold)
        self.assertEqual(sm.predict_us("ring", n, 1, a, b, g), 0)
        # The ring's reduction shows only where it is slower than the transfer.
        self.assertAlmostEqual(sm.predict_us("ring", n, 2, a, 1e-4, 3e-4), 2 * a + n * 1e-4 + 0.5 * n * 2e-4)

    def test_links_carry_frames_not_payload(self):
        # A 1448-byte segment is a 1514-byte frame to tc tbf and 1538 bytes on a real Ethernet port.
        self.assertAlmostEqual(sm.link_us_per_byte(1e9), 8e-3 * 1514 / 1448)
        self.assertAlmostEqual(sm.link_us_per_byte(1e9, sm.ETHERNET_FRAME), 8e-3 * 1538 / 1448)
        self.assertEqual(sm.link_us_per_byte(None), 0.0)
        # The testbed's links are tbf's, real hosts' (cores=None) Ethernet's; the slower of link and host.
        self.assertAlmostEqual(sm.per_byte(1e-4, 1e9, 8, sm.TESTBED_CORES), 8e-3 * 1514 / 1448)
        self.assertAlmostEqual(sm.per_byte(1e-4, 1e9, 1, None), 8e-3 * 1538 / 1448)
        self.assertAlmostEqual(sm.per_byte(1e-2, 1e9, 8, sm.TESTBED_CORES), 1e-2 * 4)  # 8 hosts on 2 cores

    def test_fit_recovers_the_parameters_it_was_made_with(self):
        truth = (12.0, 10 ** (-62 / 20.0), 1.5e-4)  # beta_host on the fit's grid
        points = []
        for hosts in (2, 4):
            for rate in ("10gbit", "100mbit", "unshaped"):
                for alg in sm.ALGORITHMS:
                    for n in (4096, 65536, 1 << 20, 16 << 20):
                        p = {"hosts": hosts, "rate": rate, "bps": sm.rate_bps(rate), "algorithm": alg, "bytes": n}
                        p["p50_us"] = sm.predict_point(p, truth)
                        points.append(p)
        alpha, beta_host, gamma = sm.fit(points)
        self.assertAlmostEqual(alpha / truth[0], 1, places=3)
        self.assertAlmostEqual(beta_host / truth[1], 1, places=3)
        self.assertAlmostEqual(gamma / truth[2], 1, places=3)

    def test_best_possible_reaches_zero_on_the_models_own_points_and_no_less_where_they_disagree(self):
        # Made by the model at 8 hosts over 1 Gbit/s, gamma above beta and below it: no error, and
        # the parameters found again.
        beta = 1.5 * sm.link_us_per_byte(1e9)
        for gamma in (2e-3, 2e-2):
            points = [{"hosts": 8, "rate": "1gbit", "bps": 1e9, "algorithm": alg, "bytes": n,
                       "p50_us": sm.predict_us(alg, n, 8, 30.0, beta, gamma)}
                      for n in (4096, 1 << 20, 16 << 20) for alg in sm.ALGORITHMS]
            err, alpha, b, g = sm.best_possible(points)
            self.assertLess(err, 1e-6)
            self.assertAlmostEqual(alpha / 30.0, 1, places=4)
            self.assertAlmostEqual(b / beta, 1, places=4)
            self.assertAlmostEqual(g / gamma, 1, places=4)
        # The same call measured at t and 2t: the best a model can do is 4t/3, a third off both.
        twice = [{"hosts": 4, "rate": "1gbit", "bps": 1e9, "algorithm": "ring", "bytes": 4096, "p50_us": t}
                 for t in (100.0, 200.0)]
        self.assertAlmostEqual(sm.best_possible(twice)[0], 1 / 3, places=6)
        # Twice as fast as the link: 100% off with the link's floor, exact without it.
        fast = [{"hosts": 2, "rate": "1gbit", "bps": 1e9, "algorithm": "recursive_doubling", "bytes": n,
                 "p50_us": 0.5 * n * sm.link_us_per_byte(1e9)} for n in (1 << 20, 4 << 20)]
        self.assertAlmostEqual(sm.best_possible(fast)[0], 1.0, places=6)
        self.assertLess(sm.best_possible(fast, link_floor=False)[0], 1e-6)

    def test_connections_follow_the_collectives_peers(self):
        self.assertEqual(sm.collective_peers(0, 8), {1, 2, 4, 6, 7})
        self.assertEqual(len(sm.collective_peers(5, 1024)), 19)  # as plan_test's CollectivePeers
        rows = {int(r[0]): r for r in sm.connections_rows()}
        self.assertEqual(rows[1024][1], "2046")  # the mesh: 2 (W - 1)
        self.assertEqual(rows[1024][2], "38")
        self.assertEqual(rows[8][2], "10")

    def test_plan_check_compares_each_pick_with_the_fastest_forced_algorithm(self):
        rec = lambda system, us: {"hosts": 8, "rate": "1gbit", "system": system, "op": "allreduce",  # noqa: E731
                                  "bytes": 4 << 20, "p50_us": us, "busbw_gbps": None, "algorithm": None}
        data = [rec("chorus-ring", 100.0), rec("chorus-recursive_doubling", 200.0), rec("chorus-rabenseifner", 110.0),
                rec("chorus-tcp", 130.0), rec("chorus-link", 105.0)]
        rows, hits = sm.plan_check(data, (10.0, 0.0, 1e-4))
        self.assertEqual(len(rows), 1)
        row = rows[0]
        self.assertEqual(row[3], "ring")  # the fastest forced
        self.assertEqual(row[8], "1.30")  # chorus-tcp over the fastest
        self.assertEqual(row[9], "1.05")  # chorus-link over the fastest
        self.assertAlmostEqual(float(row[5]), {"ring": 1.0, "Rabenseifner": 1.1, "recursive doubling": 2.0}[row[4]])
        self.assertEqual(hits, 1 if float(row[5]) <= 1.05 else 0)
        data.pop()  # no chorus-link run: the column says so
        self.assertEqual(sm.plan_check(data, (10.0, 0.0, 1e-4))[0][0][9], "-")

    def test_last_bucket_share(self):
        mb = 2 ** 20
        self.assertAlmostEqual(sm.last_bucket_share(27 * mb), 1 / 27)  # 1 + 25 + 1
        self.assertAlmostEqual(sm.last_bucket_share(26 * mb), 25 / 26)
        self.assertEqual(sm.last_bucket_share(mb // 2), 1.0)

    def test_collect_profile_from_keeps_the_ddp_run_and_takes_the_new_points_once_each(self):
        work = tempfile.mkdtemp(prefix="chorus-scaling-collect-")
        try:
            results = os.path.join(work, "run")
            os.makedirs(results)
            with open(os.path.join(results, "8-1gbit-chorus-ring-allreduce-small.json"), "w") as f:
                json.dump([{"bytes": 65536, "p50_us": 1078.0, "busbw_gbps": 0.106, "allreduce_algorithm": "ring"}], f)
            # bench/multihost --repeat 3: the point counts once, its median run.
            for k, p50 in ((2, 900.0), (3, 1500.0)):
                with open(os.path.join(results, "8-1gbit-chorus-ring-allreduce-small_r%d.json" % k), "w") as f:
                    json.dump([{"bytes": 65536, "p50_us": p50, "busbw_gbps": 0.1, "allreduce_algorithm": "ring"}], f)
            old = os.path.join(work, "old.json")
            with open(old, "w") as f:
                json.dump({"measured": "before", "commands": ["bench/multihost --hosts 2", "chorus run -n 2 transfer"],
                           "points": [], "ddp_profile": {"compute_ms": 12.5}}, f)
            r = subprocess.run([sys.executable, os.path.join(HERE, "scaling-model"), "collect", "--profile-from", old,
                                "--command", "bench/multihost --hosts 8", "--measured", "now", results],
                               capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode, 0, r.stderr)
            bundle = json.loads(r.stdout)
            self.assertEqual(bundle["ddp_profile"], {"compute_ms": 12.5})
            self.assertEqual(bundle["commands"], ["bench/multihost --hosts 8", "chorus run -n 2 transfer"])
            self.assertEqual(len(bundle["points"]), 1)
            self.assertEqual((bundle["points"][0]["hosts"], bundle["points"][0]["system"]), (8, "chorus-ring"))
            self.assertEqual(bundle["points"][0]["p50_us"], 1078.0)
            r = subprocess.run([sys.executable, os.path.join(HERE, "scaling-model"), "collect", results],
                               capture_output=True, text=True, timeout=60)
            self.assertNotEqual(r.returncode, 0)
            self.assertIn("--profile-from", r.stderr)
        finally:
            shutil.rmtree(work)

    def test_resnet50_compute_adds_its_efficiency_table(self):
        work = tempfile.mkdtemp(prefix="chorus-scaling-r50-")
        try:
            results = os.path.join(work, "run")
            os.makedirs(results)
            committed = os.path.join(HERE, "data", "multihost.json")
            r = subprocess.run([sys.executable, os.path.join(HERE, "scaling-model"), "collect", "--profile-from",
                                committed, "--gpu-step-ms-resnet50", "40", results],
                               capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode, 0, r.stderr)
            profile = json.loads(r.stdout)["ddp_profile"]
            self.assertEqual(profile["gpu_step_ms_resnet50"], 40.0)
            with open(committed) as f:
                bundle = json.load(f)
            bundle["ddp_profile"] = profile
            data = os.path.join(work, "data.json")
            with open(data, "w") as f:
                json.dump(bundle, f)
            out = os.path.join(work, "out")
            os.makedirs(out)
            r = subprocess.run([sys.executable, os.path.join(HERE, "scaling-model"), "report", "--data", data,
                                "--out", out], capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(os.path.join(out, "scaling-model.md")) as f:
                page = f.read()
            self.assertIn("ResNet-50, 40.00 ms of compute per step", page)
            self.assertNotIn("ResNet-50's efficiency is not tabled", page)
            # The table's 1024-rank row over 100 Gbit/s is the formula's, from the same fit.
            fitted = sm.fit([p for p in sm.points_of(bundle["points"]) if sm.in_fit_set(p)])
            want = sm.efficiency(sm.line_rate_host(fitted), 100, profile, 40.0, sm.PAYLOADS[1][1])[-1]
            table = page[page.index("ResNet-50, 40.00 ms"):]
            row = [l for l in table.splitlines() if l.startswith("| 1024 |")][0]
            self.assertEqual(row.split("|")[-2].strip(), "%.0f%%" % (100 * want))
            self.assertLess(want, 1.0)
        finally:
            shutil.rmtree(work)

    def test_report_writes_the_page_from_the_committed_measurements(self):
        out = tempfile.mkdtemp(prefix="chorus-scaling-model-")
        try:
            r = subprocess.run([sys.executable, os.path.join(HERE, "scaling-model"), "report", "--out", out],
                               capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(os.path.join(out, "scaling-model.md")) as f:
                page = f.read()
            for heading in ("## The fit", "## Held-out points", "## Projections: 8 to 1024 ranks",
                            "## DDP step-time scaling efficiency"):
                self.assertIn(heading, page)
            self.assertIn("| 1024 |", page)
            for fig in ("scaling-fit.svg", "scaling-resnet50.svg", "scaling-efficiency.svg"):
                with open(os.path.join(out, fig)) as f:
                    self.assertIn("<svg", f.read(2000))
            self.assertEqual(sorted(os.listdir(out)), ["scaling-efficiency.svg", "scaling-fit.svg",
                                                       "scaling-model.md", "scaling-resnet50.svg"])
        finally:
            shutil.rmtree(out)


if __name__ == "__main__":
    unittest.main()
