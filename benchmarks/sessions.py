"""``redsrv bench sessions``: the session layer under hostile and unlucky clients, measured.

Five figures, each against real reducer processes on 127.0.0.1 (RELIABILITY R20-R22, R8):

* memory before authentication: a reducer with a secret, and connections whose first header
  announces a 64 MiB frame and then trickle; the reducer's RSS growth;
* pending handshakes: connections that send one byte and stop; the reducer's thread count, and
  how long a real worker then takes to connect and finish an all-reduce;
* a reducer killed and restarted on its address under training workers: seconds from the kill to
  the end of the first step that every worker started after it, and whether any step failed or
  summed wrong;
* a reducer frozen (SIGSTOP) for ``--freeze`` seconds and resumed: the same, from the freeze;
* fair shares (``--only fair_share``): a legitimate 2-rank job's step times on a reducer without a
  secret, first alone, then as a new job while ``--attackers`` connections each join a job of
  their own, announce a ``--attack-announce`` push, send ``--attack-send`` of it and then trickle
  a byte every ``--attack-trickle`` seconds (replaced when the reducer drops them), under
  ``--memory-budget``; every sum is checked.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

import redsrv
from redsrv.cli.fleet import readline_within, stop_processes
from redsrv.cli.units import parse_size
from redsrv.core import auth, wire
from redsrv.core.handshake import ClientHandshake, HandshakeState

_LISTEN = re.compile(r"listening on (\S+):(\d+) incarnation")
MIB = 1 << 20


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("sessions", help="memory, threads and recovery of the session layer under faults",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--announcers", type=int, default=40, help="connections announcing 64 MiB before authentication")
    p.add_argument("--pending", type=int, default=4000, help="silent connections left in their handshake")
    p.add_argument("--workers", type=int, default=3, help="training workers for the recovery figures")
    p.add_argument("--freeze", type=float, default=5.0, help="seconds a reducer stays frozen")
    p.add_argument("--attackers", type=int, default=200, help="slow-push connections for the fair-share figure")
    p.add_argument("--attack-announce", default="64MiB", help="what each attacker's push announces (a size)")
    p.add_argument("--attack-send", default="12MiB", help="what each attacker sends at once before trickling (a size)")
    p.add_argument("--attack-trickle", type=float, default=2.0, help="seconds between an attacker's trickled bytes")
    p.add_argument("--memory-budget", default="1GiB", help="the reducer's --memory-budget for the fair-share figure")
    p.add_argument("--steps", type=int, default=20, help="the legitimate job's steps, alone and during the attack")
    p.add_argument("--step-size", default="1MiB", help="the legitimate job's all-reduce per step (float32, a size)")
    p.add_argument("--only", choices=FIGURES, action="append", help="run only these figures (default: all)")
    p.add_argument("--json", help="write the figures to this file")
    p.set_defaults(func=lambda a: run(a.announcers, a.pending, a.workers, a.freeze, a.json, only=a.only,
                                      attack=AttackSpec(a.attackers, parse_size(a.attack_announce),
                                                        parse_size(a.attack_send), a.attack_trickle),
                                      budget=parse_size(a.memory_budget), steps=a.steps,
                                      step_bytes=parse_size(a.step_size)))


FIGURES = ("pre_auth", "pending", "kill_restart", "freeze", "fair_share")


def run(announcers: int, pending: int, workers: int, freeze: float, json_path: str | None, *,
        only: list[str] | None = None, attack: AttackSpec | None = None, budget: int = 1 << 30, steps: int = 20,
        step_bytes: int = MIB) -> int:
    wanted = set(only or FIGURES)
    figures: dict[str, dict[str, object]] = {}
    if "pre_auth" in wanted:
        p = pre_auth_memory(announcers)
        figures["pre_auth"] = dict(p)
        print(f"memory before authentication: {announcers} connections announcing 64 MiB grew the reducer by "
              f"{p['rss_growth_mib']:.1f} MiB ({p['refused']} refused at the header)")
    if "pending" in wanted:
        h = pending_handshakes(pending)
        figures["pending"] = dict(h)
        print(f"pending handshakes: {pending} silent connections, reducer threads {h['threads_before']} -> "
              f"{h['threads_during']}; a worker joined and finished an all-reduce in {h['worker_seconds']:.2f}s")
    for name, fault in (("kill_restart", "kill"), ("freeze", "freeze")):
        if name in wanted:
            r = figures[name] = recovery(workers, fault, freeze)
            print(f"{name.replace('_', ' and ')}: the first step started after the fault ended "
                  f"{r['first_good_step_s']:.2f}s after it; {r['steps']} steps, {r['failed']} failed, {r['wrong']} wrong sums")
    if "fair_share" in wanted:
        shares = fair_share(attack or AttackSpec(), budget, steps, step_bytes)
        figures["fair_share"] = {**asdict(shares), "summary": shares.summary(),
                                 **{f"{phase}_{what}_ms": getattr(getattr(shares, phase), f"{what}_ms")
                                    for phase in ("alone", "attacked") for what in ("median", "max")}}
        print(shares.summary())
    if json_path:
        with open(json_path, "w") as out:
            json.dump(figures, out, indent=1)
    ok = all(figures[n]["failed"] == 0 and figures[n]["wrong"] == 0 for n in ("kill_restart", "freeze") if n in figures)
    if "fair_share" in wanted:
        ok = ok and all(run.failed == 0 and run.wrong == 0 and run.steps == steps for run in (shares.alone, shares.attacked))
    return 0 if ok else 1


def _start_reducer(port: int, *extra: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:  # type: ignore[type-arg]
    proc = subprocess.Popen([sys.executable, "-m", "redsrv", "reducer", "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "error", *extra], stdout=subprocess.PIPE, text=True,
                            env=None if env is None else {**os.environ, **env})
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


# --- fair shares under a slow-push attack (issue 43) --------------------------------------------


@dataclass(frozen=True)
class AttackSpec:
    """The attack of issue 43: ``connections`` slow pushes, each in a job of its own."""

    connections: int = 200
    announce: int = 64 * MIB  # what each push's header announces
    send: int = 12 * MIB  # sent at once, then ...
    trickle: float = 2.0  # ... one byte every this many seconds (within the reducer's heartbeat bound)


@dataclass
class _Attacker:
    sock: socket.socket
    pending: list[memoryview]  # the header and the first part, as far as not yet written
    sent: int = 0  # payload bytes written
    trickle_at: float = 0.0


@dataclass
class AttackReport:
    connections: int = 0  # connections made, replacements included
    dropped: int = 0  # ended by the reducer
    errors: list[str] = field(default_factory=list)  # the ERROR frames the reducer sent, first 20


class SlowPushAttack:
    """A hostile tenant, as issue 43 ran it: ``spec.connections`` connections, each joining a job of
    its own (rank 0 of 2), pushing one chunk that announces ``spec.announce`` bytes, sending
    ``spec.send`` of it at once and then one byte every ``spec.trickle`` seconds, enough to pass
    for alive. A connection the reducer ends is replaced by a new one in a new job, so the pressure
    lasts until :meth:`stop`. One thread drives them all; it is joined by :meth:`stop`."""

    def __init__(self, address: str, spec: AttackSpec, *, secret: bytes | None = None, op_timeout_ms: int = 600_000,
                 name: str = "attack") -> None:
        self.address, self.spec, self.secret, self.op_timeout_ms, self.name = address, spec, secret, op_timeout_ms, name
        self.report = AttackReport()
        self._payload = memoryview(bytes(spec.send))
        self._selector = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"redsrv-{name}", daemon=True)
        self.ready = threading.Event()  # every first connection has written its first part (or is stopped)

    def __enter__(self) -> SlowPushAttack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _connect(self) -> None:
        host, port = self.address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=10)
        n = self.report.connections
        self.report.connections += 1
        hello = wire.Hello(f"{self.name}-{n}", 0, 2, n + 1, auth.new_nonce(), op_timeout_ms=self.op_timeout_ms)
        handshake = ClientHandshake(hello, secret=self.secret)
        sock.sendall(handshake.data_to_send())
        while handshake.state is HandshakeState.RUNNING:
            data = sock.recv(handshake.bytes_needed)
            if not data:
                raise ConnectionError("the reducer closed the connection during the handshake")
            handshake.receive_data(data)
            sock.sendall(handshake.data_to_send())
        if handshake.accepted is None:
            raise ConnectionError(f"handshake failed: {handshake.failure}")
        count = self.spec.announce // 4
        header = wire.push_header(wire.Push(1, handshake.accepted.incarnation, count, 0, count, 0, wire.DType.FLOAT32),
                                  self.spec.announce)
        sock.setblocking(False)
        attacker = _Attacker(sock, [memoryview(header), self._payload])  # one payload shared by every connection
        self._selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, (attacker, wire.FrameDecoder()))

    def _drop(self, attacker: _Attacker) -> None:
        self._selector.unregister(attacker.sock)
        attacker.sock.close()

    def _run(self) -> None:
        try:
            for _ in range(self.spec.connections):
                self._connect()
            while not self._stop.is_set():
                now = time.monotonic()
                for key, mask in self._selector.select(0.05):
                    attacker, decoder = key.data
                    if mask & selectors.EVENT_READ and not self._read(attacker, decoder):
                        self._drop(attacker)
                        self.report.dropped += 1
                        if not self._stop.is_set():
                            self._connect()  # the attack goes on with a new job
                        continue
                    if mask & selectors.EVENT_WRITE:
                        self._write(attacker, now)
                for key in list(self._selector.get_map().values()):
                    attacker = key.data[0]
                    if not attacker.pending and now >= attacker.trickle_at and attacker.sent < self.spec.announce - 1:
                        try:
                            attacker.sent += attacker.sock.send(b"\0")
                        except (BlockingIOError, OSError):
                            pass  # not read (no memory for it): the byte goes with the next one
                        attacker.trickle_at = now + self.spec.trickle
                if not self.ready.is_set() and all(not k.data[0].pending for k in self._selector.get_map().values()):
                    self.ready.set()
        finally:
            self.ready.set()
            for key in list(self._selector.get_map().values()):
                key.data[0].sock.close()
            self._selector.close()

    def _write(self, attacker: _Attacker, now: float) -> None:
        try:
            sent = attacker.sock.sendmsg(attacker.pending)
        except BlockingIOError:
            return
        except OSError:
            return  # the read side sees the end
        while sent:
            head = attacker.pending[0]
            taken = min(sent, len(head))
            if len(attacker.pending) == 1:  # the payload (the header went first)
                attacker.sent += taken
            sent -= taken
            if taken == len(head):
                attacker.pending.pop(0)
            else:
                attacker.pending[0] = head[taken:]
        if not attacker.pending:
            attacker.trickle_at = now + self.spec.trickle
            self._selector.modify(attacker.sock, selectors.EVENT_READ, self._selector.get_key(attacker.sock).data)

    def _read(self, attacker: _Attacker, decoder: wire.FrameDecoder) -> bool:
        """Take what the reducer sent (heartbeats, an ERROR); False once it ended the connection."""
        try:
            data = attacker.sock.recv(65536)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            return False
        try:
            decoder.receive_data(data)
            while (frame := decoder.next_frame()) is not None:
                if isinstance(frame, wire.Error) and len(self.report.errors) < 20:
                    self.report.errors.append(frame.message)
        except redsrv.RemoteProtocolError:
            return False
        return True


@dataclass
class StepTimes:
    """A training run's steps: each one's time (the slowest rank's), failures, wrong sums."""

    step_s: list[float]
    failed: int
    wrong: int
    errors: list[str]

    @property
    def steps(self) -> int:
        return len(self.step_s)

    @property
    def median_ms(self) -> float:
        return float(np.median(self.step_s)) * 1000 if self.step_s else float("nan")

    @property
    def max_ms(self) -> float:
        return max(self.step_s, default=float("nan")) * 1000


def timed_steps(addresses: list[str], job: str, *, steps: int, count: int, workers: int = 2, **client: object) -> StepTimes:
    """``workers`` ranks (threads, a client each) run ``steps`` all-reduces of ``count`` float32;
    each step's time is the slowest rank's, every sum is checked exactly."""
    times: list[list[float]] = [[] for _ in range(steps)]
    problems = {"failed": 0, "wrong": 0}
    errors: list[str] = []
    lock = threading.Lock()

    def rank_main(rank: int) -> None:
        with redsrv.Client(addresses, rank=rank, world_size=workers, job=job, **client) as c:
            for step in range(steps):
                x = np.full(count, rank + step % 7, np.float32)
                started = time.monotonic()
                try:
                    out = c.allreduce(x, key=("step", step))
                except redsrv.RedsrvError as exc:
                    with lock:
                        problems["failed"] += 1
                        errors.append(f"rank {rank} step {step}: {type(exc).__name__}: {exc}")
                    return
                took = time.monotonic() - started
                with lock:
                    problems["wrong"] += int(not np.all(out == sum(r + step % 7 for r in range(workers))))
                    times[step].append(took)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return StepTimes([max(t) for t in times if len(t) == workers], problems["failed"], problems["wrong"], errors)


@dataclass
class FairShareFigure:
    spec: AttackSpec
    memory_budget: int
    step_bytes: int
    alone: StepTimes
    attacked: StepTimes
    attack: AttackReport
    rss_baseline_mib: float
    rss_during_attack_mib: float

    def summary(self) -> str:
        spec, alone, attacked = self.spec, self.alone, self.attacked
        rates = sum("B/s" in m for m in self.attack.errors)
        first = attacked.step_s[0] * 1000 if attacked.step_s else float("nan")
        return (f"fair shares: {spec.connections} slow pushes announcing {spec.announce / MIB:g} MiB, sending "
                f"{spec.send / MIB:g} MiB then a byte every {spec.trickle:g}s, memory budget {self.memory_budget / MIB:g} MiB "
                f"({self.attack.dropped} dropped by the reducer and replaced, {rates} of the first errors naming a rate; "
                f"reducer RSS {self.rss_baseline_mib:.0f} -> {self.rss_during_attack_mib:.0f} MiB): a 2-rank job's "
                f"{self.step_bytes / MIB:g} MiB step took median {alone.median_ms:.1f} ms, max {alone.max_ms:.1f} ms "
                f"alone; as a new job during the attack median {attacked.median_ms:.1f} ms, max {attacked.max_ms:.1f} ms "
                f"(first step {first:.1f} ms); {attacked.steps} steps, {attacked.failed} failed, {attacked.wrong} wrong sums")


#: How long the attack runs before the legitimate job starts: two default grace windows
#: (constants.DEFAULT_SLOW_PUSH_GRACE_S), so the job meets slow pushes the reducer has judged.
ATTACK_SETTLE_S = 10.0


def fair_share(spec: AttackSpec, budget: int, steps: int, step_bytes: int) -> FairShareFigure:
    """A new legitimate job's step times while ``spec`` slow pushes press on a reducer without a
    secret (its own defaults for heartbeats, the grace and the minimum rate), against the same
    job alone on that reducer just before."""
    # A budget below the per-job default takes the per-job budget down with it (it may not exceed it).
    job_budget = min(budget, redsrv.DaemonSettings().job_budget_bytes)
    proc, address = _start_reducer(0, "--memory-budget", str(budget), env={"REDSRV_JOB_BUDGET_BYTES": str(job_budget)})
    try:
        baseline = _status(proc.pid, "VmRSS")
        alone = timed_steps([address], "legit-alone", steps=steps, count=step_bytes // 4)
        with SlowPushAttack(address, spec) as attack:
            attack.ready.wait(60)
            time.sleep(ATTACK_SETTLE_S)
            rss_attack = _status(proc.pid, "VmRSS")
            attacked = timed_steps([address], "legit", steps=steps, count=step_bytes // 4)
        return FairShareFigure(spec, budget, step_bytes, alone, attacked, attack.report, baseline / 1024, rss_attack / 1024)
    finally:
        stop_processes([proc])
