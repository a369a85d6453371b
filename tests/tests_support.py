"""Helpers shared by test modules (importable because tests/ is on sys.path via conftest)."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

import redsrv
from redsrv.core import wire

from worker_main import make_input

__all__ = ["make_input", "poll", "rank_order_sum", "read_frames", "read_one_operation", "rss_bytes", "scripted_handshake",
           "wait_for_open_operations", "why_no_namespaces", "wait_all", "worker_results"]

def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A connected TCP pair on loopback: (sender, receiver), the receiver non-blocking (as an event
    loop's data connection is)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()
    receiver.setblocking(False)
    return sender, receiver


def wait_all(procs: list[subprocess.Popen], timeout: float) -> None:  # type: ignore[type-arg]
    """Wait for every process within one deadline; any still running then is left to the
    caller's tracker, which ends it (a test names the missing results instead of hanging)."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def worker_results(prefix: str, *, arrays: bool = True) -> tuple[dict[str, np.ndarray], dict]:  # type: ignore[type-arg]
    """What a worker process left at ``prefix``: its arrays (``.npz``, unless ``arrays`` is
    False) and its report (``.json``); the tail of its ``.log`` in the error when it left none."""
    import json

    try:
        results: dict[str, np.ndarray] = {}
        if arrays:
            with np.load(prefix + ".npz") as data:
                results = {k: data[k] for k in data.files}
        with open(prefix + ".json") as f:
            return results, json.load(f)
    except OSError:
        with open(prefix + ".log") as f:
            raise AssertionError(f"worker {prefix} wrote no results:\n{f.read()[-4000:]}") from None


_STALL_WARNING = re.compile(r"key (0x[0-9a-f]+) chunk \d+ open for")


def scripted_handshake(conn: socket.socket, incarnation: int) -> Callable[[], wire.Frame]:
    """Answer a client's handshake on an accepted ``conn`` as a reducer without a secret would
    (incarnation ``incarnation``); returns a function reading the next frame (10 s per read), for
    scripted reducers that show client behaviour no real reducer shows."""
    return scripted_join(conn, incarnation)[1]


def scripted_join(conn: socket.socket, incarnation: int) -> tuple[wire.Hello, Callable[[], wire.Frame]]:
    """:func:`scripted_handshake`, with the client's HELLO (its job and rank)."""
    conn.settimeout(10)
    decoder = wire.FrameDecoder()

    def next_frame() -> wire.Frame:
        while (frame := decoder.next_frame()) is None:
            data = conn.recv(1 << 16)
            assert data, "the client hung up early"
            decoder.receive_data(data)
        return frame

    hello = next_frame()
    assert isinstance(hello, wire.Hello)
    conn.sendall(wire.encode(wire.Challenge(incarnation, bytes(32), bytes(32), False)))
    assert isinstance(next_frame(), wire.Proof)
    conn.sendall(wire.encode(wire.Welcome(incarnation, 1 << 26, 200)))
    return hello, next_frame


def read_one_operation(next_frame: Callable[[], wire.Frame]) -> list[wire.Push]:
    """The pushes of one operation, read from a scripted reducer's connection."""
    pushes: list[wire.Push] = []
    while not pushes or sum(p.count for p in pushes) < pushes[0].total:
        if isinstance(frame := next_frame(), wire.Push):
            pushes.append(frame)
    return pushes


def read_frames(sock: socket.socket, timeout: float = 5.0) -> list[wire.Frame]:
    """Every frame a raw peer receives until the other side closes or goes quiet (one decoder:
    several frames may arrive in one read)."""
    sock.settimeout(timeout)
    decoder = wire.FrameDecoder()
    frames: list[wire.Frame] = []
    while True:
        try:
            data = sock.recv(65536)
        except OSError:
            return frames
        try:
            decoder.receive_data(data)
            while (frame := decoder.next_frame()) is not None:
                frames.append(frame)
        except redsrv.RemoteProtocolError:
            return frames
        if not data:
            return frames


def wait_for_open_operations(log: list[str], count: int, timeout: float = 10.0) -> set[str]:
    """Block until a reducer's log (``Reducer.log``, started with a short ``REDSRV_STALL_WARNING``)
    has warned of open chunks of ``count`` distinct operations: their pushes have arrived and wait
    there for a missing rank. Returns the operations' keys as the reducer logs them; fails after
    ``timeout`` seconds, naming what it saw."""

    def warned() -> set[str]:
        return {m.group(1) for line in list(log) if (m := _STALL_WARNING.search(line))}

    try:
        return poll(lambda: keys if len(keys := warned()) >= count else None, timeout,  # type: ignore[no-any-return]
                    f"the reducer warning of open chunks of {count} operation(s)", every=0.02)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; it warned of {sorted(warned())}") from None


def rank_order_sum(arrays: list[np.ndarray]) -> np.ndarray:
    """((x0 + x1) + x2) + ... in the arrays' own dtype: what the reducer computes."""
    total = arrays[0].copy()
    for x in arrays[1:]:
        total += x
    return total


def why_no_namespaces() -> str | None:
    """Why the emulated-cluster benchmarks cannot run here (a skip reason), or None when they can:
    Linux, root, iproute2, and ``ip netns add`` actually working (containers may forbid it)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for binary in ("ip", "tc"):
        if shutil.which(binary) is None:
            return f"`{binary}` (iproute2) is not installed"
    probe = f"rsprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def rss_bytes(pid: int) -> int:
    """A process's resident memory, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def poll(predicate, timeout: float, what: str, every: float = 0.05):  # type: ignore[no-untyped-def]
    """Wait until ``predicate()`` is truthy and return its value; fail naming ``what`` after
    ``timeout`` seconds (a poll with a deadline, never a bare sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.1f}s: {what} (last value {value!r})")
        time.sleep(every)  # noqa: TID251 - the interval of a poll with a deadline: the one sleep tests may use


def check_train_blocks(doc: dict, prefix: str, rounds: int) -> None:  # type: ignore[type-arg]
    """What every ``redsrv bench train`` smoke run must show: nothing left behind, every block of
    every round in order and correct (3 timed steps), identical ranks, the redsrv-trained model
    equal to the baseline's and to rank 0's NumPy replay."""
    import psutil

    from redsrv.bench.netns import our_namespaces
    from redsrv.bench.train import MODES

    assert our_namespaces(prefix) == [], "namespaces left behind"
    children = [c for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]
    assert not children, f"processes left behind: {[c.cmdline() for c in children]}"
    blocks = doc["blocks"]
    assert [(b["round"], b["mode"]) for b in blocks] == [(r, m) for r in range(rounds) for m in MODES]
    for b in blocks:
        assert b["correct"], f"round {b['round']} {b['mode']}: {b['checks']}"
        assert len(b["times"]) == 3 and all(t > 0 for t in b["times"])
    gloo_checks = [c for b in blocks if b["mode"] == "gloo" for c in b["checks"]]
    assert all(c["ranks_identical"] for c in gloo_checks), gloo_checks
    hook_checks = [c for b in blocks if b["mode"] == "hook" for c in b["checks"]]
    assert all(c["ranks_identical"] and c["hook_vs_gloo"]["match"] and c["hook_vs_gloo"]["moved"] > 0 for c in hook_checks), \
        hook_checks
    # Rank 0 replays the training in NumPy: every training block, the baseline's too, matches it.
    trained = [b["checks"][0] for b in blocks if b["mode"] in ("gloo", "hook")]
    assert all(c["vs_reference"]["match"] and c["vs_reference"]["moved"] > 0 for c in trained), trained
    compute = [c for b in blocks if b["mode"] == "compute" for c in b["checks"]]
    assert all(c["match"] for c in compute), compute


def check_fused_train_run(doc: dict, framework: str, prefix: str) -> None:  # type: ignore[type-arg]
    """What the JAX and TF smoke runs of ``redsrv bench train`` (one fused float32 vector per
    step, 3 timed steps, one round) must show: :func:`check_train_blocks`, and the rate limit in
    force."""
    from redsrv.bench.train import MODES

    check_train_blocks(doc, prefix, rounds=1)
    model = doc["model"]
    assert model["buckets"] == [[model["params"], "float32"]]  # one fused float32 vector per step
    assert model["grad_bytes"] == 4 * model["params"]
    assert doc["ok"] and doc["summary"]["correct"] and doc["summary"]["framework"] == framework
    assert doc["machine"][framework]
    rows = {r["mode"]: r for r in doc["summary"]["rows"]}
    assert rows.keys() == set(MODES)
    for mode in ("gloo", "hook", "raw"):
        assert rows[mode]["grad_gbps"] <= doc["goodput_gbps"] * 1.05, rows[mode]
    assert doc["summary"]["speedup"] > 0


def elastic_outcome(stdout: str) -> tuple[dict[int, int], dict[str, list[str]]]:
    """What an elastic test script (tests/adapters/horovod/hvd_*elastic_worker.py, under ``redsrv
    run -np 3 --min-np 2``) printed, checked for what every such run must show: rank 0 ("[w0]")
    reported every step it applied ("applied STEP SIZE"); steps 10 and 11 ran at size 3, were lost
    with the uncommitted state and ran again at size 2; the world sizes went 3, 2, 3; the lost
    worker's replacement ended in the last world; and every worker ended with the same weights
    ("final SIZE STEPS WEIGHT..."), after as many steps as were applied. Returns the schedule (the
    size of the last run of each step, the one the weights carry) and each worker's final fields."""
    applied = [line.split() for line in stdout.splitlines() if line.split()[1:2] == ["applied"]]
    assert {row[0] for row in applied} == {"[w0]"}  # rank 0 throughout: a survivor keeps its rank order
    sizes_seen = [(int(row[2]), int(row[3])) for row in applied]
    assert sizes_seen[10:14] == [(10, 3), (11, 3), (10, 2), (11, 2)]
    schedule = dict(sizes_seen)
    assert sorted(schedule) == list(range(len(schedule)))
    sizes = [schedule[s] for s in range(len(schedule))]
    assert sizes[:10] == [3] * 10 and 2 in sizes
    assert [size for size, _ in itertools.groupby(sizes)] == [3, 2, 3] and sizes.index(2) == 10
    finals = {line.split()[0]: line.split()[2:] for line in stdout.splitlines() if line.split()[1:2] == ["final"]}
    assert sorted(finals) == ["[w0]", "[w1]", "[w3]"]  # the replacement ended in the last world
    assert len({tuple(v) for v in finals.values()}) == 1  # identical on every rank, bit for bit
    size, steps = finals["[w0]"][:2]
    assert int(size) == 3 and int(steps) == len(schedule)
    return schedule, finals
