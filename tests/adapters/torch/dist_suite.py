"""PyTorch's own multi-process backend suite (``DistributedTest._DistTestBase``, shipped in the
torch wheel) against the redsrv c10d backend, or against gloo for the baseline.

What upstream's ``test/distributed/test_distributed_spawn.py`` does for gloo, for redsrv: the
suite reads ``BACKEND``, ``WORLD_SIZE`` and ``TEMP_DIR`` from the environment and spawns one
process per rank for every test; each of them imports this file again (as ``__mp_main__``),
which registers the redsrv backend there. The reducers are ours: this process starts them
in-process on free loopback ports before the first test and hands their addresses to the
ranks through ``REDSRV_REDUCERS``; every test is its own redsrv job.

    python tests/adapters/torch/dist_suite.py --backend redsrv --world-size 2
    python tests/adapters/torch/dist_suite.py --backend gloo --world-size 3 -k test_reduce

It prints one summary line (``SUITE backend=... world_size=... passed=... failed=...
skipped=...``) and exits non-zero when a test failed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import unittest
import uuid

# The suite reads these when it is imported, in this process and in every rank it forks (the
# ranks inherit the environment). A plain import (pytest's subset test) defaults to redsrv.
# DIST_SUITE_BACKEND is the backend the ranks run; BACKEND is the name the suite's skip
# decorators see, which --gates gloo sets to "gloo" so that the tests the suite reserves for
# gloo by name run on redsrv too.
os.environ.setdefault("DIST_SUITE_BACKEND", "redsrv")
os.environ.setdefault("BACKEND", os.environ["DIST_SUITE_BACKEND"])
os.environ.setdefault("WORLD_SIZE", "2")

import torch  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

import redsrv.torch  # noqa: E402

#: The backend every rank initialises (the suite passes its module-level BACKEND to
#: init_process_group and consults it inside test bodies); the decorators have already run.
distributed_test.BACKEND = os.environ["DIST_SUITE_BACKEND"]
if distributed_test.BACKEND == "redsrv":
    redsrv.torch.register_backend()


#: Where each rank notes the path every collective it issued took (``--report``): one line
#: "<test> reducers|peer_links <operation>" per call, appended by the ranks of every test.
ROUTES_FILE = "DIST_SUITE_ROUTES"


def _record_routes(path: str) -> None:
    """Wrap the two doors of RedsrvProcessGroup: ``_join`` (every operation through the
    reducers) and ``_linked`` (every one over the peer links)."""
    from redsrv.adapters.torch import RedsrvProcessGroup

    join, linked = RedsrvProcessGroup._join, RedsrvProcessGroup._linked

    def note(route: str, what: str) -> None:
        test = os.environ.get("DIST_SUITE_TEST", "?")  # set by setUp before the ranks are forked
        with open(path, "a") as f:
            f.write(f"{test} {route} {what.replace(' ', '_')}\n")

    def joined(self, what, parts, value):  # type: ignore[no-untyped-def]
        note("reducers", what)
        return join(self, what, parts, value)

    def over_links(self, work, op):  # type: ignore[no-untyped-def]
        note("peer_links", op)
        return linked(self, work, op)

    RedsrvProcessGroup._join = joined  # type: ignore[method-assign]
    RedsrvProcessGroup._linked = over_links  # type: ignore[method-assign]


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """Every test of the suite, each in ``WORLD_SIZE`` freshly spawned processes."""

    def setUp(self) -> None:
        super().setUp()
        # A job of its own per test: ranks of an earlier test never share keys with these.
        os.environ["REDSRV_JOB"] = f"suite-{self._testMethodName}-{uuid.uuid4().hex[:8]}"
        os.environ["DIST_SUITE_TEST"] = self._testMethodName
        # Forked, not spawned as upstream does: a CPU-only rank needs nothing fresh, and forking
        # skips importing torch and the suite twice per test (seconds each on a small machine).
        self._start_processes(torch.multiprocessing.get_context("fork").Process)


class _Tally(unittest.TextTestResult):
    """Counts as pytest names them, and each test's duration for the slowest list."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.passed: list[str] = []
        self.durations: dict[str, float] = {}
        self._started = 0.0

    def startTest(self, test: unittest.TestCase) -> None:  # noqa: N802 - unittest's name
        self._started = time.monotonic()
        super().startTest(test)

    def stopTest(self, test: unittest.TestCase) -> None:  # noqa: N802
        self.durations[test.id()] = time.monotonic() - self._started
        super().stopTest(test)

    def addSuccess(self, test: unittest.TestCase) -> None:  # noqa: N802
        self.passed.append(test.id())
        super().addSuccess(test)


def _selected(patterns: list[str]) -> unittest.TestSuite:
    names = unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn)
    if patterns:
        names = [n for n in names if any(p in n for p in patterns)]
    return unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names)


_LISTENING = re.compile(r"listening on (\S+):(\d+)")


def _start_reducers(count: int) -> tuple[list[subprocess.Popen[str]], list[str]]:
    """``count`` reducer processes on free loopback ports and their addresses. Processes, not
    threads of this one: the ranks are forked from here and must not inherit running threads."""
    procs, addresses = [], []
    for _ in range(count):
        proc = subprocess.Popen([sys.executable, "-m", "redsrv", "reducer", "--host", "127.0.0.1", "--port", "0",
                                 "--log-level", "warning"], stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the daemon prints its address first thing, or dies
        match = _LISTENING.search(line)
        if not match:
            raise RuntimeError(f"reducer did not start: {line!r}")
        addresses.append(f"{match.group(1)}:{match.group(2)}")
        # Keep its output flowing (to ours) so that it never blocks on a full pipe.
        threading.Thread(target=shutil.copyfileobj, args=(proc.stdout, sys.stdout), daemon=True).start()
    return procs, addresses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["redsrv", "gloo"], default="redsrv")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--gates", choices=["own", "gloo"], default="own",
                        help="gloo: the suite's skip decisions are gloo's (its tests reserved for gloo by name run too)")
    parser.add_argument("--reducers", type=int, default=2, help="in-process reducers (redsrv only)")
    parser.add_argument("-k", action="append", default=[], help="run tests whose name contains this (repeatable)")
    parser.add_argument("--list", action="store_true", help="print the outcome of every test")
    parser.add_argument("--report", help="write every test's outcome, and which path its collectives took, to this JSON file")
    args = parser.parse_args(argv)
    gates = args.backend if args.gates == "own" else args.gates
    wanted = {"DIST_SUITE_BACKEND": args.backend, "BACKEND": gates, "WORLD_SIZE": str(args.world_size)}
    if any(os.environ[name] != value for name, value in wanted.items()):
        # The suite module has already read BACKEND and WORLD_SIZE: start again with them set.
        env = dict(os.environ, **wanted)
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:])], env)
    daemons, addresses = _start_reducers(args.reducers) if args.backend == "redsrv" else ([], [])
    os.environ["REDSRV_REDUCERS"] = ",".join(addresses)
    routes = ""
    if args.report and args.backend == "redsrv":
        routes = os.path.abspath(args.report) + ".routes"
        if os.path.exists(routes):
            os.unlink(routes)
        _record_routes(routes)  # before the ranks are forked from this process
    try:
        runner = unittest.TextTestRunner(resultclass=_Tally, verbosity=2 if args.list else 1)
        result = runner.run(_selected(args.k))
    finally:
        for proc in daemons:
            proc.terminate()
            proc.wait(timeout=15)
    assert isinstance(result, _Tally)
    failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
    print(f"SUITE backend={args.backend} gates={gates} world_size={args.world_size} passed={len(result.passed)} "
          f"failed={failed} skipped={len(result.skipped)} torch={torch.__version__} revision={_revision()}")
    for test, _ in result.failures + result.errors:
        print(f"FAILED {test.id()}")
    if args.report:
        _write_report(args.report, routes, result, backend=args.backend, gates=gates, world_size=args.world_size)
    return 1 if failed else 0


def _name(test_id: str) -> str:
    return test_id.rsplit(".", 1)[-1]


def _write_report(path: str, routes: str, result: _Tally, **run: object) -> None:
    import json

    paths: dict[str, set[str]] = {}
    operations: dict[str, set[str]] = {}
    if routes and os.path.exists(routes):
        with open(routes) as f:
            for line in f:
                test, route, what = line.split()
                paths.setdefault(test, set()).add(route)
                operations.setdefault(test, set()).add(what)
        os.unlink(routes)
    failed = [_name(t.id()) for t, _ in result.failures + result.errors] + [_name(t.id()) for t in result.unexpectedSuccesses]
    report = {
        **run, "torch": torch.__version__, "revision": _revision(),
        "passed": sorted(_name(t) for t in result.passed), "failed": sorted(failed),
        "skipped": sorted(_name(t.id()) for t, _ in result.skipped),
        # per passing test: "reducers", "peer_links", "both" or "neither" (only C++-dispatched
        # operations, or none), and the operations it issued through each door
        "routes": {name: ("both" if len(paths.get(name, ())) == 2 else next(iter(paths.get(name, {"neither"}))))
                   for name in sorted(_name(t) for t in result.passed)},
        "operations": {name: sorted(ops) for name, ops in sorted(operations.items())},
    }
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def _revision() -> str:
    """The source revision the counts belong to: the commit, and "+changes" for a dirty tree."""
    root = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                               text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return commit + ("+changes" if dirty else "")


if __name__ == "__main__":
    sys.exit(main())
