"""Shared fixtures: real reducer processes on free ports, worker processes, leak checks.

Every process a test starts is tracked by pid and terminated, then killed, at teardown; a test
that leaves a process or a thread behind fails.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import psutil
import pytest

from redsrv.cli.fleet import readline_within

# Test modules, and this one, import shared helpers (tests_support, worker_main) by name.
sys.path.insert(0, os.path.dirname(__file__))

from tests_support import poll  # noqa: E402 - importable only once its folder is on the path

LISTEN_RE = re.compile(r"listening on (\S+):(\d+) incarnation=(0x[0-9a-f]+)")

#: Timeouts shrunk for tests (RELIABILITY: tests shrink defaults 10-100x).
FAST_ENV = {
    "REDSRV_HEARTBEAT_INTERVAL": "0.2",
    "REDSRV_HEARTBEAT_MISSES": "5",
    "REDSRV_OP_TIMEOUT": "20",
    "REDSRV_CLOSE_TIMEOUT": "3",
    "REDSRV_CONNECT_TIMEOUT": "10",
    # Workers fail fast on a lost reducer (R2), which the fault tests check; the recovery tests
    # (tests/fault/test_recovery.py) turn reconnects on (R22).
    "REDSRV_RECONNECT_WINDOW": "0",
}


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # The plane under test (tox -e core-python-plane, native-asan) reaches every child; no other
    # REDSRV_* setting of the test run's own does.
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDSRV_") or k == "REDSRV_DATA_PLANE"}
    env.update(FAST_ENV)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    if extra:
        env.update(extra)
    return env


@dataclass
class Reducer:
    proc: subprocess.Popen  # type: ignore[type-arg]
    host: str
    port: int
    incarnation: int
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)


class ProcessTracker:
    """Starts processes, remembers their pids, and ends every one of them at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []  # type: ignore[type-arg]
        self.pumps: list[threading.Thread] = []
        self.files: list = []  # type: ignore[type-arg]

    def popen(self, args: list[str], **kwargs) -> subprocess.Popen:  # type: ignore[no-untyped-def,type-arg]
        proc = subprocess.Popen(args, **kwargs)
        self.procs.append(proc)
        return proc

    def start_reducer(self, *extra: str, port: int = 0, env: dict[str, str] | None = None, timeout: float = 20.0) -> Reducer:
        args = [sys.executable, "-m", "redsrv", "reducer", "--host", "127.0.0.1", "--port", str(port), *extra]
        full_env = child_env(env)
        proc = self.popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env)
        line = readline_within(proc, timeout)
        match = LISTEN_RE.search(line)
        if not match:
            proc.kill()
            _, err = proc.communicate(timeout=10)
            raise RuntimeError(f"reducer did not start: {line!r}\n{err}")
        reducer = Reducer(proc, match.group(1), int(match.group(2)), int(match.group(3), 16), args, full_env)
        reducer.log.append(line)
        self.pumps += _drain(proc, reducer.log)
        return reducer

    def restart_reducer(self, old: Reducer, timeout: float = 20.0) -> Reducer:
        """Start a new reducer process on the same address (after the old one died)."""
        extra = old.args[old.args.index("--port") + 2 :]
        refusals: list[str] = []

        def attempt() -> Reducer | None:  # the port is free once the kernel lets the old socket go
            try:
                return self.start_reducer(*extra, port=old.port, timeout=timeout)
            except RuntimeError as exc:
                refusals.append(str(exc))
                return None

        try:
            return poll(attempt, timeout, f"a reducer restarted on port {old.port}", every=0.2)  # type: ignore[no-any-return]
        except AssertionError as exc:
            raise RuntimeError(f"{exc}; last refusal: {refusals[-1:]}") from None

    def cleanup(self) -> list[int]:
        """End every tracked process still running (SIGCONT, SIGTERM, then SIGKILL, by pid), and
        any process one of them started and left behind. Returns the pids of the tracked processes
        that were still running: reducers are by design; a process that escaped the tracker is
        caught by the ``no_leaked_processes`` fixture instead."""
        leaked = []
        descendants: list[psutil.Process] = []
        for proc in self.procs:
            if proc.poll() is None:
                leaked.append(proc.pid)
                descendants += _descendants(proc.pid)
                try:
                    os.kill(proc.pid, signal.SIGCONT)  # a frozen child cannot act on SIGTERM
                    proc.terminate()
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
                except ProcessLookupError:
                    pass
        _end_processes(descendants)
        for pump in self.pumps:
            pump.join(5)
        for proc in self.procs:
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        for f in self.files:
            f.close()
        return leaked


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _end_processes(processes: list[psutil.Process], grace: float = 5.0) -> None:
    """SIGCONT then SIGTERM each process, wait up to ``grace`` seconds, then SIGKILL the rest."""
    for process in processes:
        try:
            process.send_signal(signal.SIGCONT)  # a frozen process cannot act on SIGTERM
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=grace)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)


def live_children() -> dict[int, psutil.Process]:
    """This process's descendants that are still running (zombies have ended; only unreaped)."""
    children = {}
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                children[child.pid] = child
        except psutil.NoSuchProcess:
            pass
    return children


def _drain(proc: subprocess.Popen, sink: list[str]) -> list[threading.Thread]:  # type: ignore[type-arg]
    """Keep reading the child's pipes so it never blocks on a full pipe."""

    def pump(stream) -> None:  # type: ignore[no-untyped-def]
        for line in stream:
            sink.append(line)

    threads = []
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            t = threading.Thread(target=pump, args=(stream,), daemon=True)
            t.start()
            threads.append(t)
    return threads


@pytest.fixture
def procs() -> Iterator[ProcessTracker]:
    tracker = ProcessTracker()
    yield tracker
    tracker.cleanup()


@pytest.fixture
def fleet(procs: ProcessTracker):  # type: ignore[no-untyped-def]
    """``fleet(m)`` -> list of m running reducer processes."""

    def start(m: int = 2, *extra: str, env: dict[str, str] | None = None) -> list[Reducer]:
        return [procs.start_reducer(*extra, env=env) for _ in range(m)]

    return start


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Fail a test that leaves redsrv threads running (clients or daemons not closed)."""
    before = {t.ident for t in threading.enumerate()}
    yield

    def leaked() -> list[str]:
        return [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("redsrv-") and t.is_alive()]

    try:
        poll(lambda: not leaked(), 5, "redsrv threads the test started ending")
    except AssertionError:
        pytest.fail(f"threads left running: {leaked()}", pytrace=False)


#: How long a process the test started may take to finish exiting after every fixture's teardown.
PROCESS_EXIT_GRACE_S = 2.0


@pytest.fixture(autouse=True)
def no_leaked_processes() -> Iterator[None]:
    """Fail a test that leaves a process of its own running after every fixture's teardown: one
    started outside :class:`ProcessTracker`, or one the tracker could not end. The leftovers are
    ended by pid first, so the next test starts clean.

    Autouse, so it is set up before the test's other fixtures and torn down after them (after
    ``procs`` has ended the reducers and workers it tracks)."""
    before = set(live_children())
    yield
    new = [p for pid, p in live_children().items() if pid not in before]
    _, leaked = psutil.wait_procs(new, timeout=PROCESS_EXIT_GRACE_S)
    if leaked:
        described = []
        for process in leaked:
            try:
                described.append(f"pid {process.pid}: {' '.join(process.cmdline())[:200]}")
            except psutil.Error:
                described.append(f"pid {process.pid}")
        _end_processes(leaked)
        pytest.fail(f"processes left running after the test: {described}", pytrace=False)


WORKER_SCRIPT = os.path.join(os.path.dirname(__file__), "worker_main.py")


@dataclass
class WorkerRun:
    procs: list[subprocess.Popen]  # type: ignore[type-arg]
    prefixes: list[str]
    started: float

    def _progress(self) -> list[str]:
        marks = []
        for prefix in self.prefixes:
            try:
                with open(prefix + ".progress") as f:
                    marks.append(f.read())
            except OSError:
                marks.append("")
        return marks

    def wait_for_steps(self, count: int = 3, timeout: float = 60.0) -> None:
        """Block until every worker of a looping run has completed ``count`` steps."""

        def reached() -> bool:
            if any(p.poll() is not None for p in self.procs):
                raise AssertionError("a worker exited before the fault was injected")
            return all(m.isdigit() and int(m) >= count for m in self._progress())

        poll(reached, timeout, f"every worker reaching step {count}")

    def wait_for_errors(self, timeout: float) -> None:
        """Block until every worker has raised; fail, naming those that have not, after ``timeout``."""
        try:
            poll(lambda: all(m == "error" for m in self._progress()), timeout, "every worker raising")
        except AssertionError:
            silent = [p.pid for p, m in zip(self.procs, self._progress()) if m != "error"]
            raise AssertionError(f"workers (pids {silent}) had not raised {timeout}s after the fault") from None

    def wait(self, timeout: float = 90.0) -> tuple[list[dict], list[dict]]:  # type: ignore[type-arg]
        import json

        import numpy as np

        deadline = time.monotonic() + timeout
        for proc in self.procs:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"worker pid {proc.pid} still running after {timeout}s: a hang") from None
        reports, results = [], []
        for proc, prefix in zip(self.procs, self.prefixes):
            if proc.returncode != 0:
                with open(prefix + ".err") as f:
                    raise AssertionError(f"worker exited with {proc.returncode}: {f.read()}")
            with open(prefix + ".json") as f:
                reports.append(json.load(f))
            with np.load(prefix + ".npz") as data:
                import ml_dtypes

                results.append({k.removesuffix("__bf16"): data[k].view(ml_dtypes.bfloat16) if k.endswith("__bf16") else data[k]
                                for k in data.files})
        return results, reports


@pytest.fixture
def workers(procs: ProcessTracker, tmp_path):  # type: ignore[no-untyped-def]
    """``workers(reducers, world_size, spec, ranks=None)`` starts worker processes running
    ``tests/worker_main.py`` and returns a :class:`WorkerRun`."""
    import json

    counter = iter(range(10_000))

    def start(reducers: list[Reducer] | list[str], world_size: int, spec: dict, ranks: list[int] | None = None,  # type: ignore[type-arg]
              env: dict[str, str] | None = None) -> WorkerRun:
        addresses = [r.address if isinstance(r, Reducer) else r for r in reducers]
        run_id = next(counter)
        ps, prefixes = [], []
        for rank in ranks if ranks is not None else range(world_size):
            full = {"reducers": addresses, "rank": rank, "world_size": world_size, "job": spec.get("job", "test"), **spec}
            prefix = str(tmp_path / f"w{run_id}-{rank}")
            err = open(prefix + ".err", "w")  # a file, not a pipe: a chatty child can never block
            procs.files.append(err)
            ps.append(procs.popen([sys.executable, WORKER_SCRIPT, json.dumps(full), prefix], env=child_env(env), stderr=err))
            prefixes.append(prefix)
        return WorkerRun(ps, prefixes, time.monotonic())

    return start
