"""A local reducer fleet: start reducer processes on free loopback ports and stop processes by pid;
and benchmark workers on this machine (:func:`run_local_workers`).

Used by ``redsrv demo``, ``redsrv run``, ``redsrv soak``, ``redsrv plan --measure`` and the
benchmarks, which all start reducers on this machine.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

#: What a reducer prints once it listens; group 2 is the port.
LISTEN_LINE = re.compile(r"listening on (\S+):(\d+)")


@dataclass
class _Fleet:
    procs: list[subprocess.Popen]  # type: ignore[type-arg]
    addresses: list[str]


def start_reducers(count: int, timeout: float = 30.0, env: dict[str, str] | None = None, host: str = "127.0.0.1") -> _Fleet:
    """Start ``count`` reducers on free ports of ``host`` (loopback unless workers on other hosts
    need them); returns once every one listens."""
    fleet = _Fleet([], [])
    try:
        for _ in range(count):
            proc = subprocess.Popen(
                [sys.executable, "-m", "redsrv", "reducer", "--host", host, "--port", "0", "--log-level", "warning"],
                stdout=subprocess.PIPE, stderr=None, text=True, env=env,
            )
            fleet.procs.append(proc)
            line = readline_within(proc, timeout)
            match = LISTEN_LINE.search(line)
            if not match:
                raise RuntimeError(f"reducer failed to start (printed {line!r}, exit code {proc.poll()})")
            fleet.addresses.append(f"{match.group(1)}:{match.group(2)}")
    except BaseException:
        stop_processes(fleet.procs)
        raise
    return fleet


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for a rendezvous or a store that cannot take port 0)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def readline_within(proc: subprocess.Popen, timeout: float) -> str:  # type: ignore[type-arg]
    """The first line ``proc`` prints, or "" if none within ``timeout`` seconds."""
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline() if proc.stdout else ""), daemon=True)
    t.start()
    t.join(timeout)
    return box[0] if box else ""


def stop_processes(procs: list[subprocess.Popen], timeout: float = 10.0) -> None:  # type: ignore[type-arg]
    """SIGTERM, then SIGKILL after ``timeout``; by pid, never by name."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def stop_on_signals() -> tuple[threading.Event, list[str]]:
    """An event set on SIGTERM or SIGINT, and the names of the signals received (for the log):
    how ``redsrv reducer`` and its ``--processes`` supervisor learn to stop."""
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop, received


def run_local_workers(module: str, spec: dict[str, Any], workers: int, json_path: str | None, *,
                      timeout: float = 1800.0) -> Any:
    """Run ``python -m module SPEC`` as ``workers`` processes here, each ``SPEC`` the JSON of
    ``spec`` with its ``rank`` and ``out``: the file rank 0 writes its results to (``json_path``,
    else a temporary one in the current folder, removed after). Returns what rank 0 wrote, or
    None (having said why) when a worker failed; every worker is stopped before it returns."""
    out_path = json_path or os.path.join(os.getcwd(), f".{module.rsplit('.', 1)[-1]}-{os.getpid()}.json")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(workers):
            procs.append(subprocess.Popen([sys.executable, "-m", module, json.dumps({**spec, "out": out_path, "rank": rank})]))
        codes = [p.wait(timeout=timeout) for p in procs]
        if any(codes):
            print(f"workers exited with {codes}", file=sys.stderr)
            return None
        with open(out_path) as f:
            return json.load(f)
    finally:
        stop_processes(procs)
        if json_path is None and os.path.exists(out_path):
            os.remove(out_path)
