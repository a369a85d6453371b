"""A TCP proxy in front of one reducer that injects one fault at a chosen protocol phase.

It forwards bytes both ways, follows frame boundaries with the wire module's prefix parser, and
when the phase is reached it acts once: signals the reducer or a worker process, closes a
connection, or sends garbage in the faulty side's place.

Phases: ``handshake`` (a worker's HELLO has reached the reducer), ``push`` (half of a PUSH frame
forwarded), ``wait`` (a PUSH fully forwarded while the victim rank's pushes are held back, so the
reducer is waiting for contributions), ``pull`` (half of a RESULT frame forwarded).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

from redsrv.core import wire

GARBAGE = b"\x00garbage that is not a redsrv frame\xff" * 8
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}
#: How long the "wait" phase holds each of the victim's reads: under the heartbeat bound (1 s in
#: these tests), so the victim looks slow to the reducer, never frozen.
HELD_PAUSE_S = 0.5
#: (direction is worker->reducer, frame event) that marks each phase.
TRIGGERS = {
    "handshake": (True, "end:HELLO"),
    "push": (True, "half:PUSH"),
    "wait": (True, "end:PUSH"),
    "pull": (False, "half:RESULT"),
}


@dataclass
class Fault:
    kind: str  # kill | stop | term | close | garbage
    target: str  # reducer | worker
    phase: str  # handshake | push | wait | pull
    reducer_pid: int
    worker_pids: dict[int, int]  # rank -> pid
    victim: int = 2  # the rank hit by worker faults, and the rank held back in the wait phase
    fired_at: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Conn:
    down: socket.socket  # to the worker
    up: socket.socket  # to the reducer
    rank: int | None = None
    dead: bool = False


class _Frames:
    """Follows frame boundaries in one direction and reports events with byte offsets."""

    def __init__(self) -> None:
        self.prefix = bytearray()
        self.remaining = 0
        self.total = 0
        self.type: wire.FrameType | None = None
        self.hello = bytearray()

    def feed(self, data: bytes) -> list[tuple[str, int]]:
        events = []
        i = 0
        while i < len(data):
            if self.remaining == 0 and self.type is None:
                take = data[i : i + wire.PREFIX.size - len(self.prefix)]
                self.prefix += take
                i += len(take)
                if len(self.prefix) < wire.PREFIX.size:
                    break
                ftype, hlen, plen = wire.parse_prefix(bytes(self.prefix), 1 << 30)
                self.prefix.clear()
                events.append((f"start:{ftype.name}", i))
                self.type, self.remaining, self.total = ftype, hlen + plen, hlen + plen
                if self.remaining == 0:
                    events.append((f"end:{ftype.name}", i))
                    self.type = None
                continue
            assert self.type is not None
            take = min(self.remaining, len(data) - i)
            half = self.total // 2
            if self.remaining > half >= self.remaining - take:
                events.append((f"half:{self.type.name}", i + self.remaining - half))
            if self.type is wire.FrameType.HELLO:
                self.hello += data[i : i + take]
            self.remaining -= take
            i += take
            if self.remaining == 0:
                events.append((f"end:{self.type.name}", i))
                self.type = None
        return events

    def rank(self) -> int | None:
        return int.from_bytes(self.hello[:4], "little") if len(self.hello) >= 4 else None


class FaultProxy:
    """Listens on a free loopback port and forwards to ``upstream``; fires ``fault`` once.
    ``arm()`` enables the fault (connections made before then only forward)."""

    def __init__(self, upstream: tuple[str, int], fault: Fault) -> None:
        self.upstream = upstream
        self.fault = fault
        self.armed = threading.Event()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.listener.settimeout(0.1)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.stopping = threading.Event()
        # Wait phase: set once another rank starts a push after arming. Only then is the victim
        # held back: holding it in the middle of a step whose other pushes had all gone through
        # before arming would only make that step time out (the hold outlasts the operation
        # timeout), and with every worker failed no push would ever come to fire the fault.
        self.others_pushing = threading.Event()
        self.conns: list[_Conn] = []
        self.threads: list[threading.Thread] = []
        self._spawn(self._accept, "accept")

    def arm(self) -> None:
        self.armed.set()

    def close(self) -> None:
        self.stopping.set()
        self.listener.close()
        for c in self.conns:
            for s in (c.down, c.up):
                _shut(s)
                s.close()
        for t in self.threads:
            t.join(5)

    def _spawn(self, target, name: str, *args) -> None:  # type: ignore[no-untyped-def]
        t = threading.Thread(target=target, args=args, daemon=True, name=f"fault-proxy-{name}")
        t.start()
        self.threads.append(t)

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                down, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            try:
                up = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                down.close()
                continue
            for s in (down, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(0.1)
            conn = _Conn(down, up)
            self.conns.append(conn)
            self._spawn(self._pump, "up", conn, True)
            self._spawn(self._pump, "down", conn, False)

    def _victim_conns(self) -> list[_Conn]:
        return [c for c in self.conns if c.rank == self.fault.victim]

    def _fire(self, trigger: _Conn) -> bool:
        f = self.fault
        with f.lock:
            if f.fired_at is not None or not self.armed.is_set():
                return False
            f.fired_at = time.time()
        if f.kind in SIGNALS:
            os.kill(f.reducer_pid if f.target == "reducer" else f.worker_pids[f.victim], SIGNALS[f.kind])
            return True
        # close / garbage act on connections: the triggering one for reducer faults, all of the
        # victim's for worker faults.
        conns = [trigger] if f.target == "reducer" else self._victim_conns()
        for c in conns:
            c.dead = True
            if f.kind == "garbage":
                try:  # in the faulty side's place
                    (c.down if f.target == "reducer" else c.up).sendall(GARBAGE)
                except OSError:
                    pass
            else:
                _shut(c.down)
                _shut(c.up)
        return True

    def _wants(self, conn: _Conn) -> bool:
        """Whether this connection's event may trigger the fault."""
        f = self.fault
        if f.phase == "wait":
            return conn.rank is not None and conn.rank != f.victim  # the others have pushed
        if f.target == "worker":
            return conn.rank == f.victim
        return conn.rank is not None

    def _pump(self, conn: _Conn, to_reducer: bool) -> None:
        src, dst = (conn.down, conn.up) if to_reducer else (conn.up, conn.down)
        frames = _Frames()
        wanted = TRIGGERS[self.fault.phase]
        while not self.stopping.is_set():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            if conn.dead:
                continue  # replaced by garbage, or closed: nothing more passes
            events = frames.feed(data)
            if to_reducer and conn.rank is None and frames.rank() is not None and any(e == "end:HELLO" for e, _ in events):
                conn.rank = frames.rank()
            if (to_reducer and self.armed.is_set() and conn.rank is not None and conn.rank != self.fault.victim
                    and any(name == "start:PUSH" for name, _ in events)):
                self.others_pushing.set()
            held = (self.fault.phase == "wait" and to_reducer and conn.rank == self.fault.victim
                    and self.others_pushing.is_set() and self.fault.fired_at is None)
            if held:
                # The victim's link is slow: the reducer waits for its contribution. Slow, not
                # silent: a pause as long as the heartbeat bound (0.2 s x 5) raced the reducer's
                # frozen-peer check, which could end the run before the fault fired.
                time.sleep(HELD_PAUSE_S)
            cut = next((offset for name, offset in events if (to_reducer, name) == wanted), None)
            if cut is not None and self._wants(conn) and self.armed.is_set() and self.fault.fired_at is None:
                try:
                    dst.sendall(data[:cut])
                except OSError:
                    break
                if self.fault.phase == "wait":
                    time.sleep(0.3)  # the reducer now holds this push and waits for the victim
                if self._fire(conn):
                    data = data[cut:]
                    if conn.dead:
                        continue
                else:
                    data = data[cut:]
            try:
                dst.sendall(data)
            except OSError:
                break
        _shut(dst)


def _shut(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
