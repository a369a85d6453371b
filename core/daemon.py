"""The ``redsrv reducer`` process: binds, accepts, and drives :class:`ReducerCore`.

Threads: one acceptor, one ticker (deadlines), and per connection a reader and a
:class:`~redsrv.core.transport.Sender`. The reader receives each push's payload straight into
a pool buffer handed out by the state machine; the arithmetic happens in the state machine.
A bad frame or a failed handshake closes that connection only.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from . import auth, wire
from . import constants as C
from .config import congestion_setting, require_positive
from .errors import ConfigError
from .reducer import Action, CloseConnection, Log, PushTicket, ReducerCore, SendError, SendResult
from .transport import ConnectionBroken, FramedSocket, Sender, choose_congestion_control, configure_socket

__all__ = ["ReducerDaemon", "DaemonSettings"]

log = logging.getLogger("redsrv.reducer")


@dataclass(frozen=True)
class DaemonSettings:
    host: str = C.DEFAULT_BIND_HOST
    port: int = C.DEFAULT_PORT
    secret: bytes | None = None
    handshake_timeout: float = C.DEFAULT_HANDSHAKE_TIMEOUT_S
    heartbeat_interval: float = C.DEFAULT_HEARTBEAT_INTERVAL_S
    heartbeat_misses: int = C.DEFAULT_HEARTBEAT_MISSES
    send_timeout: float = C.DEFAULT_OP_TIMEOUT_S
    close_timeout: float = C.DEFAULT_CLOSE_TIMEOUT_S
    stall_warning: float = C.DEFAULT_STALL_WARNING_S
    max_frame_payload: int = C.DEFAULT_MAX_FRAME_PAYLOAD
    job_budget_bytes: int = C.DEFAULT_JOB_BUDGET_BYTES
    max_connections: int = 4096
    tcp_congestion: str | None = C.DEFAULT_TCP_CONGESTION  # None or "system": the system default

    def __post_init__(self) -> None:
        if self.tcp_congestion is not None:
            object.__setattr__(self, "tcp_congestion", congestion_setting(self.tcp_congestion))
        require_positive(self, ("handshake_timeout", "heartbeat_interval", "send_timeout", "close_timeout", "stall_warning"))
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")


class _Conn:
    def __init__(self, conn_id: int, sock: socket.socket, daemon: ReducerDaemon) -> None:
        self.id = conn_id
        self.sock = sock
        s = daemon.settings
        self.framed = FramedSocket(sock, read_timeout=s.handshake_timeout, max_payload=s.max_frame_payload)
        self.peer = self.framed.peer
        self.sender: Sender | None = None
        self.label = self.peer  # extended with job/rank after the handshake
        self.joined = False


class ReducerDaemon:
    """One reducer. ``start()`` binds and returns; ``stop()`` fails open operations, closes every
    connection and joins every thread within ``close_timeout``."""

    def __init__(self, settings: DaemonSettings | None = None, *, incarnation: int | None = None) -> None:
        self.settings = settings or DaemonSettings()
        self.incarnation = incarnation if incarnation is not None else int.from_bytes(os.urandom(8), "little") or 1
        self.core = ReducerCore(
            self.incarnation, job_budget_bytes=self.settings.job_budget_bytes, stall_warning=self.settings.stall_warning
        )
        self._lock = threading.Lock()
        self._conns: dict[int, _Conn] = {}
        self._ids = itertools.count(1)
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self._congestion_warned = False
        self.address: tuple[str, int] | None = None

    # --- lifecycle ---

    def start(self) -> tuple[str, int]:
        s = self.settings
        family = socket.AF_INET6 if ":" in s.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((s.host, s.port))
        except OSError as exc:
            listener.close()
            raise ConfigError(f"cannot bind reducer to {s.host}:{s.port}: {exc.strerror}") from None
        listener.listen(512)
        listener.settimeout(C.TICK_INTERVAL_S)
        self._listener = listener
        self.address = listener.getsockname()[:2]
        if s.secret is None and not _is_loopback(s.host):
            log.warning(
                "reducer bound to %s without a secret: anyone who can reach this port can join jobs and read "
                "their sums. Set REDSRV_SECRET_FILE or --secret-file, and restrict the network.", s.host
            )
        for target, name in ((self._accept_loop, "redsrv-accept"), (self._tick_loop, "redsrv-tick")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        log.info("listening on %s:%d incarnation=%#x auth=%s", self.address[0], self.address[1], self.incarnation,
                 "on" if s.secret else "off")
        return self.address

    def stop(self, reason: str = "reducer shutting down") -> None:
        """Idempotent. Bounded by ``close_timeout``."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        deadline = time.monotonic() + self.settings.close_timeout
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            actions = self.core.shutdown(reason)
        self._execute(actions)
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            if conn.sender is not None:
                # A final fatal frame on every connection, so a worker learns why the reducer is
                # going away whichever of its streams notices first.
                conn.sender.send(wire.encode(wire.Error(wire.ErrorCode.SHUTDOWN, True, reason)))
                conn.sender.close_after_drain()
        for conn in conns:
            if conn.sender is not None:
                conn.sender.join(max(0.0, min(1.0, deadline - time.monotonic())))
            _shutdown(conn.sock)
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        log.info("stopped (%s)", reason)

    def snapshot(self) -> dict[str, dict[str, object]]:
        """Per-job counters and gauges for metrics, taken consistently under the lock."""
        import copy

        with self._lock:
            return {
                job: {"stats": copy.deepcopy(stats), "connections": self.core.connections(job),
                      "inflight_bytes": self.core.bytes_held(job), "open_chunks": self.core.open_chunks(job)}
                for job, stats in self.core.job_stats.items()
            }

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    # --- threads ---

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                sock, _addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                time.sleep(C.TICK_INTERVAL_S)  # e.g. EMFILE: back off rather than spin
                continue
            with self._lock:
                too_many = len(self._conns) >= self.settings.max_connections
            if too_many:
                _reject(sock, wire.Error(wire.ErrorCode.OVERLOADED, True, "reducer connection limit reached"))
                continue
            configure_socket(sock)
            refused = choose_congestion_control(sock, self.settings.tcp_congestion)
            if refused and not self._congestion_warned:
                self._congestion_warned = True  # once per reducer: every connection would say the same
                log.warning("%s", refused)
            conn = _Conn(next(self._ids), sock, self)
            with self._lock:
                self._conns[conn.id] = conn
            t = threading.Thread(target=self._serve, args=(conn,), name=f"redsrv-conn-{conn.id}", daemon=True)
            t.start()
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _tick_loop(self) -> None:
        while not self._stopping.wait(C.TICK_INTERVAL_S):
            with self._lock:
                actions = self.core.tick(time.monotonic())
            self._execute(actions)

    def _serve(self, conn: _Conn) -> None:
        reason = "closed"
        try:
            self._handshake(conn)
            conn.framed.set_read_timeout(self.settings.heartbeat_interval * self.settings.heartbeat_misses)
            self._read_loop(conn)
        except ConnectionBroken as exc:
            reason = exc.detail
            if exc.kind == "protocol" and conn.sender is not None:
                conn.sender.send(wire.encode(wire.Error(wire.ErrorCode.PROTOCOL, True, exc.detail)))
            elif exc.kind == "protocol":
                _reject(conn.sock, wire.Error(wire.ErrorCode.PROTOCOL, True, exc.detail))
            level = logging.INFO if exc.kind == "eof" else logging.WARNING
            log.log(level, "connection %s ended: %s", conn.label, exc.detail)
        except _Rejected as exc:
            reason = str(exc)
            log.warning("connection %s rejected: %s", conn.label, exc)
        except Exception as exc:  # a bug must cost one connection, never the daemon
            reason = f"internal error: {exc!r}"
            log.exception("connection %s failed", conn.label)
        finally:
            self._drop(conn, reason)

    def _handshake(self, conn: _Conn) -> None:
        s = self.settings
        frame = conn.framed.read_frame()
        if not isinstance(frame, wire.Hello):
            raise ConnectionBroken("protocol", f"expected HELLO, got {type(frame).__name__.upper()}")
        hello = frame
        conn.label = f"{conn.peer} (job {hello.job!r} rank {hello.rank})"
        server_nonce = auth.new_nonce()
        proof = auth.server_proof(s.secret, hello, server_nonce, self.incarnation) if s.secret else auth.NO_PROOF
        challenge = wire.Challenge(self.incarnation, server_nonce, proof, s.secret is not None)
        conn.sock.sendall(wire.encode(challenge))
        reply = conn.framed.read_frame()
        if isinstance(reply, wire.Error):
            raise _Rejected(f"worker aborted the handshake: {reply.message}")
        if not isinstance(reply, wire.Proof):
            raise ConnectionBroken("protocol", f"expected PROOF, got {type(reply).__name__.upper()}")
        if s.secret is not None and not auth.proofs_equal(reply.proof, auth.client_proof(s.secret, hello, server_nonce, self.incarnation)):
            _reject(conn.sock, wire.Error(wire.ErrorCode.AUTHENTICATION, True, "authentication failed"))
            raise _Rejected("authentication failed")
        conn.sender = Sender(
            conn.sock, name=f"redsrv-send-{conn.id}", heartbeat_interval=s.heartbeat_interval,
            send_timeout=s.send_timeout, on_error=lambda exc: _shutdown(conn.sock),
        )
        with self._lock:
            if self._stopping.is_set():
                raise _Rejected("reducer is shutting down")
            actions = self.core.join(conn.id, hello)
            refused = any(isinstance(a, SendError) and a.conn == conn.id for a in actions)
        if refused:
            for a in actions:
                if isinstance(a, SendError) and a.conn == conn.id:
                    conn.sender.send(wire.encode(a.frame))
                    conn.sender.close_after_drain()
                    conn.sender.join(s.close_timeout)
                    raise _Rejected(a.frame.message)
        self._execute(actions)
        conn.sender.send(wire.encode(wire.Welcome(self.incarnation, s.max_frame_payload, int(s.heartbeat_interval * 1000))))
        conn.joined = True
        log.info("joined: %s session=%#x", conn.label, hello.session)

    def _read_loop(self, conn: _Conn) -> None:
        framed = conn.framed
        while not self._stopping.is_set():
            header = framed.read_header()
            t = header.type
            if t is wire.FrameType.PUSH:
                self._on_push(conn, header)
            elif t is wire.FrameType.HEARTBEAT:
                continue
            elif t is wire.FrameType.ERROR:
                frame = wire.parse_payload(header, framed.read_bytes(header.payload_len))
                assert isinstance(frame, wire.Error)
                raise _Rejected(f"worker reported: {frame.message}")
            else:
                raise ConnectionBroken("protocol", f"unexpected {t.name} frame from a worker after the handshake")

    def _on_push(self, conn: _Conn, header: wire.FrameHeader) -> None:
        push = wire.parse_payload(header, b"")
        assert isinstance(push, wire.Push)
        deadline = None
        while True:
            now = time.monotonic()
            with self._lock:
                outcome = self.core.begin_push(conn.id, push, header.payload_len, now)
            if outcome is not None:
                break
            # Over the job's budget: stop reading this connection (TCP backpressure) until
            # chunks close, but not past the heartbeat bound times the operation's patience.
            deadline = deadline or now + self.settings.send_timeout
            if now > deadline or self._stopping.is_set():
                raise _Rejected(f"job budget of {self.settings.job_budget_bytes} bytes stayed exhausted for {self.settings.send_timeout:.1f}s")
            time.sleep(0.002)
        if isinstance(outcome, list):
            conn.framed.discard(header.payload_len)
            self._execute(outcome)
            return
        ticket: PushTicket = outcome
        try:
            if ticket.buffer is not None:
                conn.framed.read_into(ticket.buffer.data, f"push payload (key {push.key:#x} chunk {push.chunk})")
        except BaseException:
            with self._lock:
                self.core.abort_push(ticket)
            raise
        with self._lock:
            actions = self.core.finish_push(ticket, time.monotonic())
        self._execute(actions)

    def _drop(self, conn: _Conn, reason: str) -> None:
        with self._lock:
            self._conns.pop(conn.id, None)
            actions = self.core.leave(conn.id, reason, time.monotonic()) if conn.joined else []
        self._execute(actions)
        if conn.sender is not None:
            # Let a final error frame out, but never wait on a peer that stopped reading.
            conn.sender.close_after_drain()
            conn.sender.join(min(1.0, self.settings.close_timeout))
            conn.sender.stop()
        _shutdown(conn.sock)
        if conn.sender is not None:
            conn.sender.join(self.settings.close_timeout)
        try:
            conn.sock.close()
        except OSError:
            pass

    # --- actions ---

    def _execute(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, SendResult):
                for conn_id in action.conns:
                    conn = self._conns.get(conn_id)
                    if conn is None or conn.sender is None:
                        action.release()
                        continue
                    conn.sender.send(action.header, action.data, len(action.data), _ignore_ok(action.release), inline=True)
            elif isinstance(action, SendError):
                conn = self._conns.get(action.conn)
                if conn is not None and conn.sender is not None:
                    conn.sender.send(wire.encode(action.frame), inline=True)
                    if action.close_after:
                        conn.sender.close_after_drain()
            elif isinstance(action, CloseConnection):
                conn = self._conns.get(action.conn)
                if conn is not None:
                    _shutdown(conn.sock)
            elif isinstance(action, Log):
                log.log(logging.getLevelName(action.level.upper()), "%s", action.message)


def _ignore_ok(release: Callable[[], None]) -> Callable[[bool], None]:
    """A sender ``done(ok)`` callback that releases a shared result buffer either way."""
    return lambda _ok: release()


class _Rejected(Exception):
    pass


def _reject(sock: socket.socket, frame: wire.Error) -> None:
    try:
        sock.settimeout(1.0)
        sock.sendall(wire.encode(frame))
    except OSError:
        pass
    _shutdown(sock)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
