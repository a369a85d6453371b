"""``redsrv bench sessions``: the session layer under hostile and unlucky clients, measured.

Four figures, each against real reducer processes on 127.0.0.1 (RELIABILITY R20-R22):

* memory before authentication: a reducer with a secret, and connections whose first header
  announces a 64 MiB frame and then trickle; the reducer's RSS growth;
* pending handshakes: connections that send one byte and stop; the reducer's thread count, and
  how long a real worker then takes to connect and finish an all-reduce;
* a reducer killed and restarted on its address under training workers: seconds from the kill to
  the end of the first step that every worker started after it, and whether any step failed or
  summed wrong;
* a reducer frozen (SIGSTOP) for ``--freeze`` seconds and resumed: the same, from the freeze.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

import redsrv
from redsrv.cli.fleet import readline_within, stop_processes
from redsrv.core import wire

_LISTEN = re.compile(r"listening on (\S+):(\d+) incarnation")
MIB = 1 << 20


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("sessions", help="memory, threads and recovery of the session layer under faults",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--announcers", type=int, default=40, help="connections announcing 64 MiB before authentication")
    p.add_argument("--pending", type=int, default=4000, help="silent connections left in their handshake")
    p.add_argument("--workers", type=int, default=3, help="training workers for the recovery figures")
    p.add_argument("--freeze", type=float, default=5.0, help="seconds a reducer stays frozen")
    p.add_argument("--json", help="write the figures to this file")
    p.set_defaults(func=lambda a: run(a.announcers, a.pending, a.workers, a.freeze, a.json))


def run(announcers: int, pending: int, workers: int, freeze: float, json_path: str | None) -> int:
    figures: dict[str, dict[str, object]] = {
        "pre_auth": pre_auth_memory(announcers),
        "pending": pending_handshakes(pending),
        "kill_restart": recovery(workers, "kill", freeze),
        "freeze": recovery(workers, "freeze", freeze),
    }
    p, h = figures["pre_auth"], figures["pending"]
    print(f"memory before authentication: {announcers} connections announcing 64 MiB grew the reducer by "
          f"{p['rss_growth_mib']:.1f} MiB ({p['refused']} refused at the header)")
    print(f"pending handshakes: {pending} silent connections, reducer threads {h['threads_before']} -> "
          f"{h['threads_during']}; a worker joined and finished an all-reduce in {h['worker_seconds']:.2f}s")
    for name in ("kill_restart", "freeze"):
        r = figures[name]
        print(f"{name.replace('_', ' and ')}: the first step started after the fault ended {r['first_good_step_s']:.2f}s "
              f"after it; {r['steps']} steps, {r['failed']} failed, {r['wrong']} wrong sums")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(figures, f, indent=1)
    return 0 if all(figures[n]["failed"] == 0 and figures[n]["wrong"] == 0 for n in ("kill_restart", "freeze")) else 1


def _start_reducer(port: int, *extra: str) -> tuple[subprocess.Popen, str]:  # type: ignore[type-arg]
    proc = subprocess.Popen([sys.executable, "-m", "redsrv", "reducer", "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "error", *extra], stdout=subprocess.PIPE, text=True)
    match = _LISTEN.search(readline_within(proc, 30))
    if not match:
        stop_processes([proc])
        raise RuntimeError("reducer did not start")
    return proc, f"{match.group(1)}:{match.group(2)}"


def _status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for {pid}")


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def pre_auth_memory(count: int) -> dict[str, float]:
    with tempfile.NamedTemporaryFile("wb") as secret:
        secret.write(os.urandom(32))
        secret.flush()
        proc, address = _start_reducer(0, "--secret-file", secret.name)
        try:
            baseline = _status(proc.pid, "VmRSS")
            announce = wire.encode(wire.Hello("j", 0, 1, 1, bytes(32)))[:8] + (64 * MIB).to_bytes(4, "little")
            socks = [_connect(address) for _ in range(count)]
            refused = 0
            for sock in socks:
                sock.sendall(announce)
            for sock in socks:
                sock.settimeout(5)
                try:
                    refused += sock.recv(4096)[5:6] == bytes([wire.FrameType.ERROR])
                except OSError:
                    pass
            grown = (_status(proc.pid, "VmRSS") - baseline) / 1024
            for sock in socks:
                sock.close()
            return {"connections": count, "rss_growth_mib": grown, "refused": refused}
        finally:
            stop_processes([proc])


def pending_handshakes(count: int) -> dict[str, float]:
    proc, address = _start_reducer(0)
    socks: list[socket.socket] = []
    try:
        before = _status(proc.pid, "Threads")
        for _ in range(count):
            sock = _connect(address)
            sock.send(b"R")
            socks.append(sock)
        during = _status(proc.pid, "Threads")
        started = time.monotonic()
        with redsrv.Client([address], rank=0, world_size=1, job="real", connect_timeout=30) as client:
            client.allreduce(np.ones(1000, np.float32))
        return {"connections": count, "threads_before": before, "threads_during": during,
                "worker_seconds": time.monotonic() - started}
    finally:
        for sock in socks:
            sock.close()
        stop_processes([proc])


def recovery(workers: int, fault: str, freeze: float) -> dict[str, object]:
    """Train ``workers`` ranks through two reducers; fault reducer 0 after a few steps; time the end
    of the first step every rank started after the fault."""
    procs = [_start_reducer(0) for _ in range(2)]
    addresses = [address for _, address in procs]
    size = 262_144
    started: dict[int, list[float]] = {}
    finished: dict[int, list[float]] = {}
    problems = {"failed": 0, "wrong": 0}
    errors: list[str] = []
    last_step: list[int | None] = [None]  # every rank runs the same steps: set once, under the lock
    lock = threading.Lock()

    def train(rank: int) -> None:
        with redsrv.Client(addresses, rank=rank, world_size=workers, job=f"bench-{fault}") as client:
            step = 0
            while True:
                x = np.full(size, rank + step % 7, np.float32)
                with lock:  # one block: no rank may start a step after the last one was chosen
                    if last_step[0] is not None and step > last_step[0]:
                        return
                    started.setdefault(step, []).append(time.monotonic())
                try:
                    result = client.allreduce(x, key=("step", step), out=x)
                except redsrv.RedsrvError as exc:
                    with lock:
                        problems["failed"] += 1
                        errors.append(f"rank {rank} step {step}: {type(exc).__name__}: {exc}")
                    return
                expected = sum(r + step % 7 for r in range(workers))
                with lock:
                    problems["wrong"] += int(not np.all(result == expected))
                    finished.setdefault(step, []).append(time.monotonic())
                step += 1

    threads = [threading.Thread(target=train, args=(r,)) for r in range(workers)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 60
        while len([s for s, t in finished.items() if len(t) == workers]) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc, address = procs[0]
        at = time.monotonic()
        if fault == "kill":
            proc.kill()
            proc.wait(10)
            procs[0] = _start_reducer(int(address.rsplit(":", 1)[1]))
        else:
            proc.send_signal(signal.SIGSTOP)
            time.sleep(freeze)  # the length of the freeze
            proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 180
        first = None
        while first is None and time.monotonic() < deadline and not problems["failed"]:
            with lock:
                done = [max(t) for step, t in finished.items() if len(t) == workers and min(started[step]) > at]
            first = min(done) - at if done else None
            time.sleep(0.05)
    finally:
        with lock:
            last_step[0] = max(started, default=0)
        for thread in threads:
            thread.join(60)
        stop_processes([p for p, _ in procs])
    for line in errors:
        print(f"{fault}: {line}", file=sys.stderr)
    return {"first_good_step_s": float("nan") if first is None else first,
            "steps": len(finished), **problems, "errors": errors}
