#!/usr/bin/python3
"""PyTorch's own distributed test suite on a backend: runs DistributedTest._DistTestBase from
torch/testing/_internal/distributed/distributed_test.py (shipped with python3-torch 1.13) the way
PyTorch's test/distributed/test_distributed_spawn.py does, with the backend, world size and init
method taken from the command line. chorus is declared to the suite as a plugin backend with DDP
and sub-group support (DistTestCases.backend_feature), as the suite expects of one.

usage: dist_suite.py --backend chorus|gloo [--as-gloo] --world 2|3 --init env|file [--only NAMES_FILE]
                     [--json OUT] [--timeout SECONDS] [test_name ...]

Each test runs in its own W freshly spawned processes (the suite's MultiProcessTestCase). Prints one
line per test (passed / failed / skipped, with the reason of a failure or skip) and the counts; with
--json, writes {"passed": [...], "failed": {name: reason}, "skipped": {name: reason}}. Exit status 0
when nothing failed. docs/python.md gives the counts and every difference from gloo.
"""
import argparse
import os
import sys


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--init", choices=["env", "file"], default="file")
    parser.add_argument("--as-gloo", action="store_true",
                        help="run the suite as if the backend were gloo (its gloo-only tests too), with chorus in gloo's "
                             "place: every process group the suite asks gloo for is made by chorus")
    parser.add_argument("--only", help="a file with one test name per line (# comments): run only those")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per test (the suite's own)")
    parser.add_argument("tests", nargs="*", help="test names (test_...); default: all")
    return parser.parse_args()


# The suite reads its configuration from the environment when it is imported, in this process and
# in every rank it spawns (they re-import this file as __mp_main__): set it before the import.
if __name__ == "__main__":
    _ARGS = parse_args()
    if _ARGS.as_gloo and _ARGS.backend != "chorus":
        sys.exit("dist_suite: --as-gloo puts chorus in gloo's place; it takes --backend chorus")
    os.environ["BACKEND"] = "gloo" if _ARGS.as_gloo else _ARGS.backend
    os.environ["CHORUS_SUITE_AS_GLOO"] = "1" if _ARGS.as_gloo else ""
    os.environ["WORLD_SIZE"] = str(_ARGS.world)
    os.environ["CHORUS_SUITE_INIT"] = _ARGS.init
    # Read by the suite's decorators at import (some tests need file://); each test's own file comes
    # from TestDistBackend.setUp.
    os.environ["INIT_METHOD"] = "env://" if _ARGS.init == "env" else "file:///chorus-suite-init"
    os.environ["CHORUS_SUITE_TIMEOUT"] = str(_ARGS.timeout)

try:
    import expecttest  # noqa: F401  (common_utils needs it; Debian 12 does not package it)
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "suite_shims"))

import chorus  # noqa: E402,F401  registers the backend "chorus"
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

for _feature in ("plugin", "ddp", "subgroup"):
    DistTestCases.backend_feature[_feature].add("chorus")

# The suite's ranks switch DDP to its ReplicatedTensor mode (TestDistBackend._run), whose module
# does not import on Python 3.11 in torch 1.13 (a dataclass with a mutable default, a torch bug that
# fails every DDP test on gloo as on chorus). Leave DDP in its default mode, for every backend alike.
import torch.nn.parallel._replicated_tensor_ddp_utils as _replicated  # noqa: E402

_replicated._set_ddp_with_replicated_tensor = lambda enabled: None

if os.environ.get("CHORUS_SUITE_AS_GLOO"):
    # The suite gates many tests on BACKEND == "gloo" by name. In this mode it believes it runs
    # gloo, and every group it asks gloo for is chorus's: gloo's expectations, chorus's collectives.
    import torch.distributed as _dist

    def _chorus_for_gloo(backend):
        return "chorus" if backend is not None and str(backend).lower() == "gloo" else backend

    _init_process_group, _new_group = _dist.init_process_group, _dist.new_group

    def _init(*args, **kwargs):
        if args:
            args = (_chorus_for_gloo(args[0]),) + args[1:]
        if "backend" in kwargs:
            kwargs["backend"] = _chorus_for_gloo(kwargs["backend"])
        return _init_process_group(*args, **kwargs)

    def _new(*args, **kwargs):
        if len(args) >= 3:
            args = args[:2] + (_chorus_for_gloo(args[2]),) + args[3:]
        if "backend" in kwargs:
            kwargs["backend"] = _chorus_for_gloo(kwargs["backend"])
        return _new_group(*args, **kwargs)

    _dist.init_process_group, _dist.new_group = _init, _new

import torch.testing._internal.common_distributed as common_distributed  # noqa: E402
from torch.testing._internal.common_utils import find_free_port  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

# The suite's per-test limit (MultiProcessTestCase waits this long for its ranks).
common_distributed.TIMEOUT_DEFAULT = int(float(os.environ.get("CHORUS_SUITE_TIMEOUT", "120")))


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        if os.environ.get("CHORUS_SUITE_INIT") == "env":
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(find_free_port())  # inherited by the ranks spawned below
        super().setUp()
        self._spawn_processes()

    @property
    def init_method(self):
        if os.environ.get("CHORUS_SUITE_INIT") == "env":
            return "env://"
        return super().init_method


def main(args):
    import unittest

    loader = unittest.TestLoader()
    names = loader.getTestCaseNames(TestDistBackendWithSpawn)
    wanted = list(args.tests)
    if args.only:
        with open(args.only) as f:
            wanted += [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]
    if wanted:
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            print("dist_suite: not in PyTorch %s's suite: %s" % (__import__("torch").__version__, ", ".join(unknown)))
            return 2
        names = [n for n in names if n in set(wanted)]

    results = {"passed": [], "failed": {}, "skipped": {}}
    for name in names:
        result = unittest.TestResult()
        TestDistBackendWithSpawn(name).run(result)
        if result.errors or result.failures:
            trace = (result.errors + result.failures)[0][1].strip().splitlines()
            reason = trace[-1] if trace else "failed"
            results["failed"][name] = reason
            print("FAILED  %s: %s" % (name, reason[:300]), flush=True)
        elif result.skipped:
            reason = result.skipped[0][1]
            results["skipped"][name] = reason
            print("skipped %s: %s" % (name, reason[:200]), flush=True)
        else:
            results["passed"].append(name)
            print("passed  %s" % name, flush=True)
    print("%s%s W=%d %s://: %d passed, %d failed, %d skipped of %d" % (
        args.backend, " as gloo" if args.as_gloo else "", args.world, args.init, len(results["passed"]), len(results["failed"]),
        len(results["skipped"]), len(names)))
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(_ARGS))
