"""A TCP proxy in front of one reducer that injects one fault at a chosen protocol phase.

It forwards bytes both ways, follows frame boundaries with the wire module's prefix parser, and
when the phase is reached it acts once: signals the reducer or a worker process, closes a
connection, sends garbage in the faulty side's place, or (``corrupt``, phase ``pull``) flips one
byte in the middle of a large RESULT's data: a wrong sum that no protocol check can see, for the
benchmarks' own checks to catch.

Phases: ``handshake`` (a worker's HELLO has reached the reducer), ``push`` (half of a PUSH frame
forwarded), ``wait`` (the victim rank's pushes are slowed, and the reducer's own log shows it
holding a chunk the others pushed while it waits for the victim), ``pull`` (half of a RESULT frame
forwarded).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

from redsrv.core import wire

from tests_support import poll

GARBAGE = b"\x00garbage that is not a redsrv frame\xff" * 8
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}
#: How long the "wait" phase holds each of the victim's reads: under the heartbeat bound (1 s in
#: these tests), so the victim looks slow to the reducer, never frozen.
HELD_PAUSE_S = 0.5
#: (direction is worker->reducer, frame event) that marks each phase but ``wait``, which the
#: reducer's log marks (:meth:`FaultProxy._watch_hold`).
TRIGGERS = {
    "handshake": (True, "end:HELLO"),
    "push": (True, "half:PUSH"),
    "pull": (False, "half:RESULT"),
}
#: A RESULT frame at least this long has data, not header or bitmap, at its middle byte.
LARGE_FRAME_BYTES = 4096
#: How long the reducer may take to show it holds a chunk for the victim once the victim is slowed:
#: its stall warning (REDSRV_STALL_WARNING, short in these tests) comes at its next tick.
HOLD_SEEN_WITHIN_S = 20.0


@dataclass
class Fault:
    kind: str  # kill | stop | term | close | garbage | corrupt
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
                if self.total >= LARGE_FRAME_BYTES:
                    events.append((f"half-large:{self.type.name}", i + self.remaining - half))
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
    ``arm()`` enables the fault (connections made before then only forward).

    The ``wait`` phase needs ``reducer_log`` (the upstream reducer's log lines as they come, from
    a reducer started with a short ``REDSRV_STALL_WARNING``): the fault fires when the reducer
    warns of a chunk open and waiting for the victim, and :attr:`held_line` keeps that line."""

    def __init__(self, upstream: tuple[str, int], fault: Fault, reducer_log: list[str] | None = None) -> None:
        if fault.phase == "wait" and reducer_log is None:
            raise ValueError("the wait phase fires on the reducer's stall warning: pass reducer_log")
        self.upstream = upstream
        self.fault = fault
        self.reducer_log = reducer_log
        self.held_line: str | None = None
        self.hold_error: str | None = None
        self._log_mark = 0  # reducer_log lines before the victim was slowed do not count
        self._last_pusher: _Conn | None = None
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
        if self.fault.phase == "wait":
            self._spawn(self._watch_hold, "hold")

    def _watch_hold(self) -> None:
        """Fire once the reducer shows it holds a chunk and waits for the victim, which it can
        only do once the victim is slowed (after another rank started a push)."""
        assert self.reducer_log is not None
        waiting_for_victim = re.compile(rf"open for .*waiting for rank\(s\) (?:\d+, )*{self.fault.victim}(?:, \d+)*$")

        def held() -> str | None:
            if self.stopping.is_set():
                return "stopping"
            if not self.others_pushing.is_set():
                return None
            return next((line for line in self.reducer_log[self._log_mark :]  # type: ignore[index]
                         if waiting_for_victim.search(line.rstrip())), None)

        try:
            line = poll(held, HOLD_SEEN_WITHIN_S, f"the reducer holding a chunk for rank {self.fault.victim}", every=0.02)
        except AssertionError as exc:
            self.hold_error = str(exc)
            return
        if self.stopping.is_set() or self._last_pusher is None:
            return
        self.held_line = line
        self._fire(self._last_pusher)

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
        if f.kind == "corrupt":
            return True  # _pump flips the byte; the connection carries on
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
        if f.target == "worker":
            return conn.rank == f.victim
        return conn.rank is not None

    def _pump(self, conn: _Conn, to_reducer: bool) -> None:
        src, dst = (conn.down, conn.up) if to_reducer else (conn.up, conn.down)
        frames = _Frames()
        wanted = TRIGGERS.get(self.fault.phase)
        if self.fault.kind == "corrupt":
            wanted = (False, "half-large:RESULT")
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
                self._last_pusher = conn  # the connection a reducer-side close or garbage hits
                if not self.others_pushing.is_set():
                    self._log_mark = len(self.reducer_log or ())
                    self.others_pushing.set()
            held = (self.fault.phase == "wait" and to_reducer and conn.rank == self.fault.victim
                    and self.others_pushing.is_set() and self.fault.fired_at is None)
            if held:
                # The fault's setting, not a synchronisation: the victim's link is slow, so the
                # reducer waits for its contribution (_watch_hold fires once its log shows that).
                # Slow, not silent: a pause as long as the heartbeat bound (0.2 s x 5) raced the
                # reducer's frozen-peer check, which could end the run before the fault fired.
                time.sleep(HELD_PAUSE_S)  # noqa: TID251 - the pacing of a slow link
            cut = next((offset for name, offset in events if (to_reducer, name) == wanted), None) if wanted else None
            fires = cut is not None and self._wants(conn) and self.armed.is_set() and self.fault.fired_at is None
            if fires and self.fault.kind == "corrupt" and self._fire(conn):
                assert cut is not None
                at = min(cut, len(data) - 1)  # the middle byte, or the one before it when the read ends there
                data = data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :]
            elif fires:
                assert cut is not None
                try:
                    dst.sendall(data[:cut])
                except OSError:
                    break
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
