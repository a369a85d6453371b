"""What the emulated-cluster benchmarks (``redsrv bench emulate``, ``redsrv bench train``) share.

Parent side: signals that unwind into the cluster's teardown, the children's environment and
secret, reducer start-up, worker processes whose stdout carries one JSON object per marked line,
the collection loop with its deadline, the merge of every rank's block into one (slowest rank per
timed rep), the teardown that stops processes and drains their pipes, and the provenance written
into every result file. Worker side: :func:`emit` and :class:`CpuMeter`.

Everything the parent starts is tracked by pid in a list the caller owns, so the caller's
``finally`` (:func:`terminate_and_drain`, then :meth:`Cluster.down`) ends it on every exit path.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from redsrv.bench.local import _CLOCK_TICKS, cpu_times
from redsrv.bench.netns import DEFAULT_PREFIX, Cluster, EmulationError, our_namespaces, remove_namespaces, signals_deferred
from redsrv.cli.fleet import readline_within, stop_processes

__all__ = ["MARK", "GLOO_PORT", "Terminated", "raise_on_signals", "say", "add_run_arguments", "run_command", "cleanup",
           "write_secret", "child_env", "start_reducers", "spawn_workers", "terminate_and_drain", "collect", "RankGather",
           "merge_ranks", "tail", "finish_files", "provenance", "command_line", "torch_version", "emit", "cpu_stat",
           "CpuMeter", "exact_data", "timed_steps"]

#: Prefix of the lines on a worker's stdout that carry results (anything else is ignored).
MARK = "@@redsrv-bench "

#: Port of gloo's rendezvous store on worker host 0. Fixed on purpose: the namespace was created
#: for this run, so nothing else can hold it, and reducers use ephemeral ports.
GLOO_PORT = 29500

#: Seconds a reducer may take to print its address (a busy 2-core machine imports slowly).
REDUCER_START_TIMEOUT = 30.0

#: Seconds a worker has to exit once it closed its stdout.
WORKER_EXIT_TIMEOUT = 30.0

#: Seconds each process gets between SIGTERM and SIGKILL at teardown, and each pump to reach EOF.
STOP_TIMEOUT = 5.0

Pumps = list[threading.Thread]


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: unwinds like KeyboardInterrupt so every teardown runs."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(self.name)


@contextmanager
def raise_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so every ``finally`` (the cluster's teardown) runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: object) -> None:
        raise Terminated(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def say(quiet: bool, text: str) -> None:
    if not quiet:
        print(text, flush=True)


def add_run_arguments(b: argparse.ArgumentParser) -> None:
    """The options every emulated-cluster benchmark has: where results go, the namespace prefix,
    and the two modes that run nothing (``--cleanup``, ``--report``)."""
    b.add_argument("--out", default="bench-results", help="folder for the JSON and PNG files (default ./bench-results)")
    b.add_argument("--prefix", default=DEFAULT_PREFIX, help=f"namespace name prefix (default {DEFAULT_PREFIX})")
    b.add_argument("--cleanup", action="store_true",
                   help="only remove namespaces left with this prefix (after a run was killed with SIGKILL)")
    b.add_argument("--report", metavar="JSON", help="only print the table and redraw the plot of an earlier run's JSON")


def run_command(name: str, a: argparse.Namespace, *, run: Callable[[], bool], rereport: Callable[[str], int]) -> int:
    """The exit status of ``redsrv bench NAME``: ``--cleanup``, ``--report JSON``, or ``run()``
    (true when every result was correct). Errors are one clear line and status 2; SIGTERM and
    SIGHUP stop the run after the teardown with 128 + the signal number."""
    try:
        if a.cleanup:
            return cleanup(a.prefix)
        if a.report:
            return rereport(a.report)
        return 0 if run() else 1
    except EmulationError as exc:
        print(f"redsrv bench {name}: error: {exc}", file=sys.stderr)
        return 2
    except Terminated as exc:
        print(f"redsrv bench {name}: stopped by {exc.name}; cluster removed", file=sys.stderr)
        return 128 + exc.signum


def cleanup(prefix: str) -> int:
    """Remove the namespaces a killed run left under ``prefix``; the exit status for the CLI."""
    probe = Cluster(2, 0, prefix=prefix)
    if os.geteuid() != 0:
        raise EmulationError("removing network namespaces needs root")
    names = our_namespaces(probe.prefix)
    if not names:
        print(f"no namespaces with prefix {prefix!r}")
        return 0
    removed = remove_namespaces(sorted(names, key=lambda ns: ns.endswith("-sw")))
    print(f"removed {len(removed)} namespace(s): {', '.join(removed)}")
    return 0 if len(removed) == len(names) else 1


def write_secret(folder: str) -> str:
    """A fresh shared secret in ``folder`` (mode 0600); returns its path."""
    path = os.path.join(folder, "secret")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(uuid.uuid4().hex + uuid.uuid4().hex)
    return path


def child_env(secret: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDSRV_") and k not in ("RANK", "WORLD_SIZE")}
    # One compute thread each: n workers and m reducers share the machine's cores, and both
    # implementations get the same treatment.
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0", REDSRV_SECRET_FILE=secret)
    return env


def start_reducers(cluster: Cluster, hosts: Sequence[int], *, env: dict[str, str], logdir: str, tag: str,
                   procs: list[subprocess.Popen]) -> tuple[list[subprocess.Popen], list[str]]:  # type: ignore[type-arg]
    """One ``redsrv reducer`` on each of ``hosts``, on an ephemeral port; returns the processes and
    their ``host:port`` addresses once every one is listening. Each process joins ``procs`` as
    soon as it exists, so the caller's teardown stops it whatever fails next."""
    reducers = []
    logs = []
    for j, h in enumerate(hosts):
        path = os.path.join(logdir, f"reducer{tag}-{j}.log")
        logs.append(path)
        p = _spawn_logged(cluster, h, [sys.executable, "-m", "redsrv", "reducer", "--host", cluster.hosts[h].ip, "--port", "0",
                                       "--log-level", "warning"], env=env, log_path=path)
        procs.append(p)
        reducers.append(p)
    addresses = []
    for j, p in enumerate(reducers):
        line = readline_within(p, REDUCER_START_TIMEOUT)
        if "listening on" not in line:
            raise EmulationError(f"reducer {j} on h{hosts[j]} did not start within {REDUCER_START_TIMEOUT:.0f}s: printed "
                                 f"{line!r}, exit code {p.poll()}; {tail(logs[j])}")
        addresses.append(line.split("listening on ", 1)[1].split()[0])
    return reducers, addresses


def spawn_workers(cluster: Cluster, module: str, specs: Sequence[dict[str, Any]], *, env: dict[str, str], logdir: str,
                  tag: str, procs: list[subprocess.Popen], pumps: Pumps,  # type: ignore[type-arg]
                  events: queue.Queue,  # type: ignore[type-arg]
                  hosts: Sequence[int] | None = None) -> tuple[list[subprocess.Popen], list[str]]:  # type: ignore[type-arg]
    """Rank r runs ``python -m MODULE worker SPEC_JSON`` on host ``hosts[r]`` (default: host r); a
    pump thread per rank puts its marked lines on ``events`` as ``(rank, message)`` and
    ``(rank, None)`` at end of file. Returns the processes and the paths of their stderr logs."""
    workers = []
    logs = []
    for rank, spec in enumerate(specs):
        path = os.path.join(logdir, f"worker{tag}-{rank}.log")
        logs.append(path)
        p = _spawn_logged(cluster, rank if hosts is None else hosts[rank], [sys.executable, "-m", module, "worker",
                                                                            json.dumps(spec)], env=env, log_path=path)
        procs.append(p)
        workers.append(p)
        pump = threading.Thread(target=_pump, args=(p, rank, events), name=f"bench-pump-{rank}", daemon=True)
        pump.start()
        pumps.append(pump)
    return workers, logs


def _spawn_logged(cluster: Cluster, host: int, argv: list[str], *, env: dict[str, str],
                  log_path: str) -> subprocess.Popen:  # type: ignore[type-arg]
    """``argv`` on ``host``: stdout a text pipe to us, stderr to ``log_path`` (read back for errors)."""
    with open(log_path, "w") as log:
        proc: subprocess.Popen = cluster.spawn(host, argv, stdout=subprocess.PIPE, stderr=log,  # type: ignore[type-arg]
                                               stdin=subprocess.DEVNULL, env=env, text=True)
    return proc


def _pump(proc: subprocess.Popen, rank: int, events: queue.Queue) -> None:  # type: ignore[type-arg]
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(MARK):
            events.put((rank, json.loads(line[len(MARK):])))
    events.put((rank, None))


def terminate_and_drain(cluster: Cluster, procs: list[subprocess.Popen], pumps: Pumps) -> None:  # type: ignore[type-arg]
    """Stop the processes, let the readers reach end-of-file, then close the pipes."""
    with signals_deferred():
        stop_processes(procs, timeout=STOP_TIMEOUT)
        for t in pumps:
            t.join(STOP_TIMEOUT)
        cluster.stop(procs)


def collect(workers: Sequence[subprocess.Popen], logs: Sequence[str], events: queue.Queue, *,  # type: ignore[type-arg]
            stall_s: float, label: str, on_message: Callable[[int, dict[str, Any]], str | None]) -> None:
    """Hand every rank's messages other than ``ready``/``done`` to ``on_message`` until each rank
    said ``done`` and exited 0. ``on_message`` may return a new description of where the run
    is, for the errors. Raises :class:`EmulationError` on a worker that exits early or fails, and
    when no rank reports anything for ``stall_s`` seconds."""
    n = len(workers)
    done: set[int] = set()
    ready: set[int] = set()
    phase = "start-up (connect to the reducers, gloo rendezvous)"
    while len(done) < n:
        try:
            rank, msg = events.get(timeout=stall_s)
        except queue.Empty:
            missing = sorted(set(range(n)) - done)
            raise EmulationError(f"{label}: no progress for {stall_s:.0f}s during {phase}; ranks {missing} still running. "
                                 + " | ".join(f"rank {r}: {tail(logs[r])}" for r in missing[:2])) from None
        if msg is None:
            rc = workers[rank].wait(timeout=WORKER_EXIT_TIMEOUT)
            if rank not in done or rc != 0:
                raise EmulationError(f"{label}: worker rank {rank} exited with code {rc} during {phase}: {tail(logs[rank])}")
            continue
        event = msg["event"]
        if event == "ready":
            ready.add(rank)
            if len(ready) == n:
                phase = "the first block"
        elif event == "done":
            done.add(rank)
        else:
            phase = on_message(rank, msg) or phase


class RankGather:
    """Holds each rank's message under a key until all ``n`` ranks sent theirs."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._pending: dict[Any, dict[int, dict[str, Any]]] = {}

    def add(self, key: Any, rank: int, msg: dict[str, Any]) -> dict[int, dict[str, Any]] | None:
        """Every rank's message for ``key`` once this one completed the set, else None."""
        got = self._pending.setdefault(key, {})
        got[rank] = msg
        if len(got) < self.n:
            return None
        del self._pending[key]
        return got


def merge_ranks(got: dict[int, dict[str, Any]], *, count_reducers: bool) -> dict[str, Any]:
    """One block from every rank's: per timed rep the slowest rank's time (the operation is done
    when the last rank is), CPU summed over the workers (plus the reducers', read by rank 0, when
    ``count_reducers``), and the whole-machine CPU busy rank 0 saw."""
    n = len(got)
    r0 = got[0]
    reps = len(r0["times"])
    times = [max(got[r]["times"][k] for r in range(n)) for k in range(reps)]
    cpu = sum(got[r]["cpu_s"] for r in range(n)) + (r0["reducer_cpu_s"] if count_reducers else 0.0)
    user = sum(got[r].get("cpu_user_s", 0.0) for r in range(n)) + (r0.get("reducer_cpu_user_s", 0.0) if count_reducers else 0.0)
    busy_total = r0["stat_total"]
    return {
        "times": times, "rank_times": [got[r]["times"] for r in range(n)], "correct": all(got[r]["correct"] for r in range(n)),
        "cpu_busy": r0["stat_busy"] / busy_total if busy_total else 0.0,
        "cpu_steal": r0.get("stat_steal", 0) / busy_total if busy_total else 0.0, "cpu_s": cpu, "cpu_user_s": user,
        "wall_s": sum(times), "metered_s": r0.get("metered_s", sum(times)),
        "worker_cpu_s": [got[r]["cpu_s"] for r in range(n)],
        "worker_cpu_user_s": [got[r].get("cpu_user_s", 0.0) for r in range(n)],
        "reducer_cpu_s": r0["reducer_cpu_s"], "reducer_cpu_user_s": r0.get("reducer_cpu_user_s", 0.0), "cores": r0["cores"],
    }


def tail(path: str, chars: int = 600) -> str:
    """The end of a child's log, for error messages."""
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return "(no log)"
    text = text.strip()
    return ("..." + text[-chars:]) if len(text) > chars else (text or "(empty log)")


def finish_files(doc: dict[str, Any], json_path: str, png_path: str, draw: Callable[[str], None], *, quiet: bool) -> None:
    """Draw the PNG with ``draw(path)`` when matplotlib is installed, note both files in ``doc``
    (the JSON itself was written before: a missing plot must not lose the results) and say where."""
    try:
        draw(png_path)
        doc["plot"] = png_path
    except ImportError:
        say(quiet, "  matplotlib is not installed: no plot (install redsrv[bench])")
    say(quiet, f"\n  wrote {json_path}" + (f" and {png_path}" if "plot" in doc else ""))
    doc["json"] = json_path


def provenance(torch: str | None) -> dict[str, Any]:
    """``machine`` and ``redsrv`` entries of a result file: where and with what it ran, and how
    fast the machine was just before (:func:`machine_speed`)."""
    from redsrv import __version__

    return {"machine": {"host": platform.node(), "cpus": os.cpu_count(), "kernel": platform.release(),
                        "python": platform.python_version(), "torch": torch, "speed": machine_speed(),
                        # allocator settings change how much a fresh buffer costs (docs/performance.md)
                        "glibc_tunables": os.environ.get("GLIBC_TUNABLES")},
            "redsrv": {"version": str(__version__), "source": _source_revision()}}


def machine_speed(trials: int = 3) -> dict[str, float]:
    """How fast one core runs Python and numpy right now, best of ``trials`` short runs (about
    0.3 s in all). A shared machine's speed moves by tens of percent from hour to hour, and every
    CPU-bound figure with it, gloo's and redsrv's alike: compare result files only where these agree.

    >>> sorted(machine_speed(trials=1))
    ['numpy_add_gbps', 'python_msteps_per_s']
    """
    steps = 1_000_000
    acc = np.ones(4 * 1024 * 1024, dtype=np.float32)
    other = np.ones_like(acc)
    adds = 5
    best_python = best_numpy = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        sum(range(steps))
        best_python = min(best_python, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(adds):
            np.add(acc, other, out=acc)
        best_numpy = min(best_numpy, time.perf_counter() - t0)
    return {"python_msteps_per_s": round(steps / best_python / 1e6, 1),
            "numpy_add_gbps": round(adds * acc.nbytes / best_numpy / 1e9, 2)}


def describe_speed(speed: dict[str, float]) -> str:
    """One line for the terminal."""
    return (f"machine speed: Python {speed['python_msteps_per_s']:g} M loop steps/s, numpy in-place float32 add "
            f"{speed['numpy_add_gbps']:g} GB/s (compare runs only where these agree)")


def command_line(name: str) -> str | None:
    """The ``redsrv bench NAME ...`` command this process runs, when it was started that way."""
    return " ".join(["redsrv", "bench", name, *sys.argv[3:]]) if sys.argv[1:3] == ["bench", name] else None


def _source_revision() -> str | None:
    """The git commit of an editable checkout (``+dirty`` with local changes); None otherwise."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return rev.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def torch_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:
        return None


# --- inside the worker processes -----------------------------------------------------------


def emit(**fields: Any) -> None:
    """One result line for the parent's pump."""
    print(MARK + json.dumps(fields), flush=True)


def cpu_stat() -> tuple[int, int, int]:
    """(busy, total, steal) jiffies of the whole machine; namespaces do not hide other load.
    Steal (time the hypervisor gave to other machines) counts as busy: we could not use it."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]] + [0] * 8
    idle = fields[3] + fields[4]
    total = sum(fields[:8])
    return total - idle, total, fields[7]


#: /proc/PID/stat flag of kernel threads (PF_KTHREAD): the kernel's own workers, which also carry
#: the emulated links' packets (softirqs), so they are not "other load".
_KERNEL_THREAD = 0x00200000


def _processes_cpu() -> dict[tuple[int, int], tuple[int, float]]:
    """(pid, start time) -> (parent pid, CPU seconds) of every user-space process now running."""
    found: dict[tuple[int, int], tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended meanwhile
        if int(fields[6]) & _KERNEL_THREAD:
            continue
        found[(int(entry), int(fields[19]))] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS)
    return found


class OtherLoad:
    """The share of the machine that processes other than this run's own used while it ran (a
    ``with`` block): every user-space process but this one and its descendants, over the block's
    wall time x the machine's cores. A performance figure measured while others used much of the
    machine measures them, not the network (docs/performance.md, "Method").

    Processes that start and end inside the block (the run's own: workers, reducers, ``ip``) are
    never seen; kernel threads are left out, since they carry the emulated network's packets."""

    def __init__(self) -> None:
        self.share = 0.0
        self.seconds = 0.0
        self.by_pid: dict[int, float] = {}  # the other processes' CPU seconds in the block, where non-zero
        self._before: dict[tuple[int, int], tuple[int, float]] = {}
        self._started = 0.0

    def __enter__(self) -> OtherLoad:
        self._before = _processes_cpu()
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._started
        after = _processes_cpu()
        parent = {pid: ppid for (pid, _), (ppid, _) in after.items()}

        def ours(pid: int) -> bool:
            for _ in range(64):  # a parent chain; bounded in case of a cycle read mid-change
                if pid == os.getpid():
                    return True
                if pid not in parent or pid <= 1:
                    return False
                pid = parent[pid]
            return False

        used = {key[0]: cpu - self._before.get(key, (0, 0.0))[1] for key, (_, cpu) in after.items() if not ours(key[0])}
        self.by_pid = {pid: seconds for pid, seconds in used.items() if seconds > 0}
        self.seconds = sum(self.by_pid.values())
        self.share = self.seconds / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0


class CpuMeter:
    """CPU spent during the timed parts of a block only: whole-machine busy, total and steal
    jiffies, this process's CPU seconds (every thread: gloo's and redsrv's transport
    included) and, where ``reducer_pids`` are given (rank 0), the reducers' CPU seconds, each also
    as its user-space part; and the wall time it ran (``metered_s``), against which shares of the
    machine are taken."""

    def __init__(self, reducer_pids: Sequence[int]) -> None:
        self.reducer_pids = list(reducer_pids)
        self.own_s = self.own_user_s = self.reducers_s = self.reducers_user_s = self.wall_s = 0.0
        self.busy = self.total = self.steal = 0
        self._start: tuple[tuple[int, int, int], os.times_result, tuple[float, float], float] | None = None

    def _reducers(self) -> tuple[float, float]:
        times = [cpu_times(p) for p in self.reducer_pids]
        return sum(u for u, _ in times), sum(s for _, s in times)

    def start(self) -> None:
        self._start = (cpu_stat(), os.times(), self._reducers(), time.perf_counter())

    def stop(self) -> None:
        assert self._start is not None, "CpuMeter.stop() without start()"
        (busy, total, steal), own, (reducers_user, reducers_system), wall = self._start
        s1 = cpu_stat()
        self.wall_s += time.perf_counter() - wall
        own1 = os.times()
        self.own_user_s += own1.user - own.user
        self.own_s += own1.user + own1.system - own.user - own.system
        user1, system1 = self._reducers()
        self.reducers_user_s += user1 - reducers_user
        self.reducers_s += user1 + system1 - reducers_user - reducers_system
        self.busy += s1[0] - busy
        self.total += s1[1] - total
        self.steal += s1[2] - steal
        self._start = None

    def fields(self) -> dict[str, Any]:
        """The block fields :func:`merge_ranks` reads."""
        return {"cpu_s": self.own_s, "cpu_user_s": self.own_user_s, "reducer_cpu_s": self.reducers_s,
                "reducer_cpu_user_s": self.reducers_user_s, "stat_busy": self.busy, "stat_total": self.total,
                "stat_steal": self.steal, "cores": os.cpu_count(), "metered_s": self.wall_s}


def exact_data(dtype: np.dtype, size: int, rank: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s input of ``size`` bytes and the sum over ``n`` ranks. Small integers, so every
    sum is exact in every dtype and on 16-bit wires (for n <= 42): results can be compared bit
    for bit. The pattern repeats every 4093 elements (a prime), so a chunk delivered to the wrong
    offset (always a multiple of a power of two here) shows as a wrong sum.

    >>> base, total = exact_data(np.dtype("float32"), 16, rank=1, n=2)
    >>> base.tolist(), total.tolist()
    ([1.0, 4.0, 3.0, 2.0], [1.0, 7.0, 5.0, 3.0])
    """
    count = size // dtype.itemsize
    pattern = (np.arange(4093, dtype=np.int64) * 7 % 4093 % 4).astype(np.float32)
    reps = -(-count // pattern.size)
    base = np.tile(pattern + rank % 4, reps)[:count].astype(dtype)
    expected = np.tile(pattern * n + sum(r % 4 for r in range(n)), reps)[:count].astype(dtype)
    return base, expected


def timed_steps(step: Callable[[int], None], *, warmup: int, steps: int, barrier: Callable[[], None],
                reducer_pids: Sequence[int]) -> tuple[list[float], CpuMeter]:
    """``bench train``'s timing rule for every framework: ``warmup`` untimed steps (the first
    compiles or traces), then ``steps`` timed ones, each after a barrier; CPU is counted over the
    timed steps only."""
    meter = CpuMeter(reducer_pids)
    times: list[float] = []
    for i in range(warmup + steps):
        barrier()
        timed = i >= warmup
        if timed:
            meter.start()
        t0 = time.perf_counter()
        step(i)
        elapsed = time.perf_counter() - t0
        if timed:
            meter.stop()
            times.append(elapsed)
    return times, meter
