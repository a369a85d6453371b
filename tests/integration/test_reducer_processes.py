"""``redsrv reducer --processes k``: k reducers behind one command, listed as a port range.

The supervisor starts k ordinary reducer processes, restarts one that dies on the same port,
and ends them all on SIGTERM; workers that list the range get exact, rank-ordered sums.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading

import numpy as np
import psutil
import pytest

import redsrv
from redsrv.core.config import Config, expand_reducers
from redsrv.core.errors import ConfigError

from conftest import child_env
from tests_support import poll, rank_order_sum

pytestmark = pytest.mark.timeout(90)

_LINE = re.compile(r"listening on (\S+):(\d+) incarnation=\S+ plane=(?:native|python) pid=(\d+)")
_SUMMARY = re.compile(r"(\d+) processes; list them as (\S+)")


def _start(procs, processes: int, *extra: str):  # type: ignore[no-untyped-def]
    proc = procs.popen([sys.executable, "-m", "redsrv", "reducer", "--host", "127.0.0.1", "--port", "0",
                        "--processes", str(processes), "--log-level", "warning", *extra],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    lines: list[str] = []
    summary = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if _SUMMARY.search(line):
                summary.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    procs.pumps.append(reader)
    assert summary.wait(30), f"no summary line; printed {lines!r}"
    children = [(int(m.group(2)), int(m.group(3))) for m in map(_LINE.search, lines) if m]
    return proc, lines, children


def _allreduce_everywhere(addresses: list[str], world: int, size: int, key: object) -> list[np.ndarray]:
    inputs = [np.arange(size, dtype=np.float32) * (r + 1) + r for r in range(world)]
    results: list[np.ndarray | None] = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            with redsrv.Client(addresses, rank=rank, world_size=world, job="processes", op_timeout=20) as client:
                results[rank] = client.allreduce(inputs[rank], key=key)
        except BaseException as exc:  # reported below with the rank
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, [str(e) for e in errors]
    expected = rank_order_sum(inputs)
    for rank, out in enumerate(results):
        assert out is not None and out.tobytes() == expected.tobytes(), f"rank {rank} got a different sum"
    return [r for r in results if r is not None]


def test_processes_serve_exact_sums_restart_on_their_port_and_stop_together(procs) -> None:  # type: ignore[no-untyped-def]
    supervisor, lines, children = _start(procs, 3)
    assert len(children) == 3, lines
    ports = [port for port, _ in children]
    pids = [pid for _, pid in children]
    assert set(pids) == {c.pid for c in psutil.Process(supervisor.pid).children()}
    addresses = [f"127.0.0.1:{p}" for p in ports]
    # 3 chunks' worth per reducer at least: every process holds part of the operation.
    _allreduce_everywhere(addresses, world=2, size=3 * 300_000, key="before")

    victim_port, victim_pid = children[1]
    psutil.Process(victim_pid).send_signal(signal.SIGKILL)

    def replaced() -> int | None:
        for child in psutil.Process(supervisor.pid).children():
            if child.pid not in pids and any(c.laddr.port == victim_port for c in child.net_connections("tcp")
                                             if c.status == psutil.CONN_LISTEN):
                return child.pid
        return None

    new_pid = poll(replaced, 20, f"a new reducer process listening on port {victim_port}")
    assert new_pid != victim_pid
    _allreduce_everywhere(addresses, world=2, size=3 * 300_000, key="after")

    survivors = [psutil.Process(p) for p in (pids[0], pids[2], new_pid)]
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(20) == 0
    gone, alive = psutil.wait_procs(survivors, timeout=10)
    assert not alive, f"reducer processes outlived their supervisor: {alive}"
    for port in ports:
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still accepts connections"


def test_a_memory_budget_that_cannot_be_split_is_refused_at_start(procs) -> None:  # type: ignore[no-untyped-def]
    proc = procs.popen([sys.executable, "-m", "redsrv", "reducer", "--host", "127.0.0.1", "--port", "0", "--processes", "8",
                        "--memory-budget", "256MiB"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       env=child_env())
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert "split over 8 processes" in err and "per-job budget" in err, err


def test_port_ranges_expand_in_order_and_bad_ranges_are_config_errors() -> None:
    assert Config(reducers="a:10-12,b:7").reducers == ("a:10", "a:11", "a:12", "b:7")
    assert expand_reducers(("[::1]:1-2",)) == ("[::1]:1", "[::1]:2")
    for bad in ("a:12-10", "a:0-3", "a:1-x", "a:65535-65536", "a:1-1000"):
        with pytest.raises(ConfigError, match="range"):
            expand_reducers(bad)
