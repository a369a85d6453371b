"""The ``redsrv reducer`` process: binds, accepts, and drives :class:`ReducerCore`.

One event loop (``selectors``: epoll on Linux) owns every joined connection: it reads frames
with non-blocking ``recv_into`` straight into pool buffers handed out by the state machine,
runs the state machine, and writes results with non-blocking ``sendmsg``. A thread per
connection cost one wake-up and one GIL hand-off per frame, which on a loaded host was most of
a small all-reduce's time and most of the reducer's CPU per chunk. Large payloads are received
with a low-water mark (``SO_RCVLOWAT``), so the loop wakes once per result piece (see
``DaemonSettings.result_piece_bytes``), not once per few segments, and tells the state machine
how much of each payload is in so it can forward sums before whole chunks arrive. On the native
plane that reading (pushes, ACKs, heartbeats) runs in C, ``native/pushes.c``, which asks this
daemon's callbacks where each push lands, as the Python reader does.

Handshakes run on the loop too, with no thread of their own: an accepted connection is a
``_Pending`` whose sans-IO :class:`~.handshake.ServerHandshake` is fed at most the bytes it asks
for (so nothing past its last frame leaves the socket), holds at most
``handshake.PRE_AUTH_MAX_BYTES``, and has one deadline from accept however its bytes trickle in;
at ``max_pending_handshakes`` the oldest makes room for the newest. An unauthenticated peer thus
costs the reducer no thread and a bounded number of bytes (R20). Besides the loop
(``redsrv-loop``) there is only the caller's thread (``start``, ``stop``) and, with a metrics
port, the metrics server's, which reads the state machine through :meth:`ReducerDaemon.snapshot`
and :meth:`ReducerDaemon.memory` under the lock that every loop call into :class:`ReducerCore`
holds.

Deadlines live in the loop too: a worker that sends nothing (not even heartbeats) for the
heartbeat bound is frozen; one that stops reading our results for the send timeout is dropped;
an idle connection gets a heartbeat every interval. A bad frame or a failed handshake closes
that connection only.

One loop uses one core: a host with a faster NIC than one core can feed runs several reducer
processes (one per core), each its own entry in the workers' reducer list.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import ipaddress
import itertools
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable

from . import constants as C
from . import wire
from .config import DaemonSettings
from .errors import ConfigError
from .handshake import HandshakeState, ServerHandshake
from .plane import kernels_for
from .reducer import (
    DISCARD,
    WAIT_FOR_MEMORY,
    Action,
    CloseConnection,
    Log,
    MemoryState,
    PushTicket,
    ReducerCore,
    ResultSink,
    SendError,
    SendResult,
    SendSafe,
)
from .transport import (
    SKIP,
    WAIT,
    ConnectionBroken,
    FrameReader,
    HeaderStep,
    Waker,
    choose_congestion_control,
    configure_socket,
    peer_name,
    set_receive_buffer,
    watch,
)

__all__ = ["ReducerDaemon", "DaemonSettings"]

log = logging.getLogger("redsrv.reducer")


#: Where the bytes a resent push repeats are read to be dropped (R22).
_RESENT_SCRATCH = memoryview(bytearray(256 * 1024))

#: Frames handled per connection per wake-up before the loop serves the others.
_FRAMES_PER_TURN = 16


class _Pending:
    """A connection whose handshake is running on the loop: at most the handshake's own bytes
    (:data:`handshake.PRE_AUTH_MAX_BYTES`) and no thread of its own."""

    __slots__ = ("id", "sock", "peer", "deadline", "handshake", "outgoing", "events")

    def __init__(self, conn_id: int, sock: socket.socket, deadline: float, handshake: ServerHandshake) -> None:
        self.id, self.sock, self.peer, self.deadline, self.handshake = conn_id, sock, peer_name(sock), deadline, handshake
        self.outgoing = bytearray()
        self.events = 0


class _Conn:
    """A joined worker connection: its reader and writer, its deadlines."""

    def __init__(self, daemon: ReducerDaemon, conn_id: int, sock: socket.socket, label: str, now: float) -> None:
        self.id = conn_id
        self.sock = sock
        self.peer = peer_name(sock)
        self.label = label
        self.joined = False
        on_header = functools.partial(daemon._begin_push, self)
        on_payload = functools.partial(daemon._on_payload, self)
        on_count = functools.partial(daemon._on_count, self)
        max_payload = daemon.settings.max_frame_payload
        # On the native plane pushes, ACKs and heartbeats are read in C (native/pushes.c), which
        # asks these same callbacks; every other frame goes to the decoder.
        receiver = daemon.kernels.push_receiver
        fast = None if receiver is None else receiver(sock.fileno(), max_payload, C.MAX_RECEIVE_LOWAT_BYTES, on_header,
                                                      on_payload, on_count, WAIT, SKIP)
        self.fast = fast
        self.reader = FrameReader(sock, max_payload=max_payload, now=now, data_frame=wire.FrameType.PUSH,
                                  sender="a worker after the handshake", on_header=on_header, on_payload=on_payload,
                                  on_error=functools.partial(daemon._on_error, self), on_count=on_count,
                                  parser=daemon.kernels.frames, fast=fast)
        self.writer = daemon.kernels.frame_writer(sock, now)
        # What a native forwarder writes this connection's RESULT frames through (ReducerCore._engage).
        self.sink = (self.writer, functools.partial(daemon._watch_writes, self), functools.partial(daemon._write_failed, self))
        self.ticket: PushTicket | None = None
        self.skip_left = 0  # bytes of the current push still to read and drop (resent, or nobody's any more)
        self.in_data = False  # the current push's bytes now land in its buffer
        self.view_start = self.view_end = 0  # the part of its buffer they land in now
        self.blocked = False  # its push waits for memory: not read meanwhile (TCP backpressure)
        self.events = 0
        self.closing_until: float | None = None  # sending a final frame, then closed
        self.closed = False


class ReducerDaemon:
    """One reducer. ``start()`` binds and returns; ``stop()`` fails open operations, closes every
    connection and joins every thread within ``close_timeout``."""

    def __init__(self, settings: DaemonSettings | None = None, *, incarnation: int | None = None) -> None:
        self.settings = settings or DaemonSettings()
        self.incarnation = incarnation if incarnation is not None else int.from_bytes(os.urandom(8), "little") or 1
        self.kernels = kernels_for(self.settings.data_plane)  # the combine kernels and the frame parser (core/plane.py)
        self.core = ReducerCore(
            self.incarnation, job_budget_bytes=self.settings.job_budget_bytes,
            memory_budget_bytes=self.settings.memory_budget_bytes, stall_warning=self.settings.stall_warning,
            piece_bytes=self.settings.result_piece_bytes, rejoin_grace=self.settings.rejoin_grace,
            budget_wait_timeout=self.settings.budget_wait_timeout, min_push_rate=self.settings.min_push_rate,
            slow_push_grace=self.settings.slow_push_grace, kernels=self.kernels, result_sinks=self._result_sink,
        )
        # Guards the state machine against snapshot() from the metrics thread; the loop is its
        # only other user, so it is never contended on the data path.
        self._lock = threading.Lock()
        self._conns: dict[int, _Conn] = {}
        self._ids = itertools.count(1)
        self._stopping = threading.Event()
        self._stop_reason = "reducer shutting down"
        self._selector: selectors.BaseSelector | None = None
        self._loop: threading.Thread | None = None
        self._pending: collections.OrderedDict[int, _Pending] = collections.OrderedDict()  # handshakes, oldest first
        self._waker = Waker()
        self._listener: socket.socket | None = None
        self._accept_paused_until = 0.0
        self._blocked: set[_Conn] = set()
        # Writes of a native forwarder that failed, each the connection's end: handled once the
        # read that made them returns (the forwarder runs inside another connection's read).
        self._failed_writes: list[tuple[_Conn, Exception]] = []
        self._retried_epoch = -1  # the core's memory epoch when the blocked pushes were last asked again
        self._closing: set[_Conn] = set()
        self._congestion_warned = False
        self._now = time.monotonic()
        self._next_trim = self._now + C.POOL_IDLE_RELEASE_S
        self.address: tuple[str, int] | None = None
        #: Set if the event loop itself died (a bug outside any one connection): the reducer
        #: serves nobody any more, and ``redsrv reducer`` exits non-zero so a supervisor restarts it.
        self.failure: BaseException | None = None

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
        listener.setblocking(False)
        self._listener = listener
        self.address = listener.getsockname()[:2]
        if s.secret is None and not _is_loopback(s.host):
            log.warning(
                "reducer bound to %s without a secret: anyone who can reach this port can join jobs and read "
                "their sums. Set REDSRV_SECRET_FILE or --secret-file, and restrict the network.", s.host
            )
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, self._accept_ready)
        self._selector.register(self._waker.read_end, selectors.EVENT_READ, self._waker.drain)
        self._loop = threading.Thread(target=self._run, name="redsrv-loop", daemon=True)
        self._loop.start()
        log.info("listening on %s:%d incarnation=%#x auth=%s plane=%s", self.address[0], self.address[1],
                 self.incarnation, "on" if s.secret else "off", self.plane)
        return self.address

    def stop(self, reason: str = "reducer shutting down") -> None:
        """Idempotent. Bounded by ``close_timeout``."""
        if self._stopping.is_set():
            return
        self._stop_reason = reason
        self._stopping.set()
        deadline = time.monotonic() + self.settings.close_timeout
        self._waker.wake()
        if self._loop is not None and self._loop is not threading.current_thread():
            self._loop.join(max(0.0, deadline - time.monotonic()))
        elif self._loop is None:
            self._close_all_sockets()
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

    def memory(self) -> MemoryState:
        """The reducer-wide budget, its fair share and who waits (for metrics), under the lock."""
        with self._lock:
            return self.core.memory()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    # --- the loop ---

    def _run(self) -> None:
        assert self._selector is not None
        selector = self._selector
        next_tick = time.monotonic() + C.TICK_INTERVAL_S
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                timeout = max(0.0, next_tick - now)
                events = selector.select(timeout)
                self._now = time.monotonic()
                for key, mask in events:
                    handler = key.data
                    if isinstance(handler, _Conn):
                        self._serve(handler, mask)
                    elif isinstance(handler, _Pending):
                        self._serve_pending(handler, mask)
                    else:
                        handler()
                if self._blocked and self.core.memory_epoch != self._retried_epoch:
                    self._retry_blocked()  # memory was freed, or the shares changed
                    self._end_failed_writes()
                if self._now >= next_tick:
                    next_tick = self._now + C.TICK_INTERVAL_S
                    self._tick()
            self._shutdown()
        except Exception as exc:  # the loop is the reducer: say why it died, close, let the process exit
            log.exception("reducer event loop failed")
            self.failure = exc
            self._stopping.set()
            self._close_all_sockets()
        finally:
            selector.close()

    def _serve(self, conn: _Conn, mask: int) -> None:
        try:
            if mask & selectors.EVENT_WRITE and not conn.closed:
                self._flush(conn)
            if mask & selectors.EVENT_READ and not conn.closed and conn.closing_until is None:
                self._read(conn)
        except Exception as exc:
            self._contain(conn, exc)
        self._end_failed_writes()

    def _end_failed_writes(self) -> None:
        while self._failed_writes:
            broken, exc = self._failed_writes.pop()
            self._contain(broken, exc)

    def _contain(self, conn: _Conn, exc: Exception) -> None:
        """Whatever went wrong while serving ``conn`` ends that connection only: a bug must cost
        one connection, never the daemon."""
        if isinstance(exc, ConnectionBroken):
            self._broken(conn, exc)
        elif isinstance(exc, _Closed):
            reason = "the worker closed its client"
            message = str(exc)
            if message != wire.CLIENT_CLOSED_MESSAGE:  # its client failed: the cause reaches the job's other ranks
                reason += ": " + "".join(ch if ch.isprintable() else " " for ch in message)
            log.info("connection %s ended: %s", conn.label, reason)
            self._close(conn, reason, for_good=True)
        elif isinstance(exc, _Rejected):
            log.warning("connection %s rejected: %s", conn.label, exc)
            self._close(conn, str(exc), None if exc.code is None else wire.encode(wire.Error(exc.code, True, str(exc))))
        else:
            log.error("connection %s failed", conn.label, exc_info=exc)
            # Said as a fatal error, so that the worker fails rather than reconnecting into the same bug.
            reason = f"internal error of the reducer while serving this connection: {exc!r}"
            self._close(conn, reason, wire.encode(wire.Error(wire.ErrorCode.PEER_LOST, True, reason)))

    def _broken(self, conn: _Conn, exc: ConnectionBroken) -> None:
        if conn.closing_until is not None:  # already leaving; its final frame cannot get out either
            self._finish_close(conn)
            return
        level = logging.INFO if exc.kind == "eof" else logging.WARNING
        log.log(level, "connection %s ended: %s", conn.label, exc.detail)
        final = wire.encode(wire.Error(wire.ErrorCode.PROTOCOL, True, exc.detail)) if exc.kind == "protocol" else None
        self._close(conn, exc.detail, final)

    def _tick(self) -> None:
        now = self._now
        if self._listener is not None and self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._set_listening(True)
        for conn in [c for c in self._conns.values() if c.ticket is not None and c.in_data and not c.blocked]:
            if now - conn.reader.last_recv >= C.TICK_INTERVAL_S:
                try:  # a low-water mark may hide a slow push's bytes; the state machine measures its rate
                    self._read(conn)
                except Exception as exc:
                    self._contain(conn, exc)
        try:
            with self._lock:
                actions = self.core.tick(now)
            self._execute(actions)
        except Exception:  # deadlines are retried next tick; the connections carry on
            log.exception("reducer tick failed")
        if self._blocked and self.core.memory_epoch != self._retried_epoch:
            self._retry_blocked()  # the tick may have freed memory (reclaimed it, dropped idle shares)
        if now >= self._next_trim:
            self._next_trim = now + C.POOL_IDLE_RELEASE_S
            if _MALLOC_TRIM is not None:
                _MALLOC_TRIM(0)
        s = self.settings
        silent_for = s.heartbeat_interval * s.heartbeat_misses
        heartbeat = wire.encode(wire.Heartbeat())
        for conn in list(self._conns.values()):
            if conn.closed:
                continue
            try:
                writer, reader = conn.writer, conn.reader
                if writer.out and now - writer.last_progress > s.send_stall_timeout:
                    raise ConnectionBroken("timeout", f"{conn.peer} stopped reading: nothing it was sent was taken for "
                                                      f"{s.send_stall_timeout:.1f}s (send stall timeout)")
                if not conn.blocked and conn.closing_until is None and now - reader.last_recv > silent_for:
                    self._read(conn)  # a low-water mark may hide bytes that did arrive
                    if self._now - reader.last_recv > silent_for:
                        raise ConnectionBroken("timeout", f"no data from {conn.peer} while reading {reader.what}")
                if conn.joined and not writer.out and now - writer.last_send >= s.heartbeat_interval:
                    self._send(conn, [memoryview(heartbeat)], None)
            except Exception as exc:
                self._contain(conn, exc)
        for conn in list(self._closing):
            if now >= (conn.closing_until or 0.0):
                self._finish_close(conn)
        self._expire_pending()

    # --- accepting and handshakes ---

    def _accept_ready(self) -> None:
        assert self._listener is not None
        for _ in range(64):
            try:
                sock, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: back off rather than spin
                log.warning("cannot accept connections: %s; retrying in %.1fs", exc.strerror or exc, C.TICK_INTERVAL_S)
                self._set_listening(False)
                self._accept_paused_until = self._now + C.TICK_INTERVAL_S
                return
            if len(self._conns) >= self.settings.max_connections:
                _reject(sock, wire.Error(wire.ErrorCode.OVERLOADED, True,
                                         f"reducer connection limit of {self.settings.max_connections} joined "
                                         "connections reached"))
                continue
            if len(self._pending) >= self.settings.max_pending_handshakes:
                # The oldest pending handshake makes room: a flood of slow or silent connections
                # then delays a real worker by its own round trips, never locks it out (R20).
                _, oldest = self._pending.popitem(last=False)
                log.debug("pending handshake from %s dropped: %d handshakes pending", oldest.peer, len(self._pending) + 1)
                self._drop_pending(oldest)
            configure_socket(sock)
            set_receive_buffer(sock, self.settings.recv_buffer_bytes)
            sock.setblocking(False)
            refused = choose_congestion_control(sock, self.settings.tcp_congestion)
            if refused and not self._congestion_warned:
                self._congestion_warned = True  # once per reducer: every connection would say the same
                log.warning("%s", refused)
            pending = _Pending(next(self._ids), sock, self._now + self.settings.handshake_timeout,
                               ServerHandshake(incarnation=self.incarnation, secret=self.settings.secret,
                                               max_op_timeout_ms=int(self.settings.max_op_timeout * 1000)))
            self._pending[pending.id] = pending
            assert self._selector is not None
            pending.events = watch(self._selector, sock, pending, 0, selectors.EVENT_READ)

    @property
    def plane(self) -> str:
        """Which data plane combines and parses frames here (core/plane.py): ``native`` or ``python``."""
        return self.kernels.name

    def _set_listening(self, on: bool) -> None:
        assert self._selector is not None and self._listener is not None
        if on:
            self._selector.register(self._listener, selectors.EVENT_READ, self._accept_ready)
        else:
            self._selector.unregister(self._listener)

    def _serve_pending(self, pending: _Pending, mask: int) -> None:
        """Drive one connection's handshake with what its socket holds: at most the bytes the
        handshake asks for, so nothing past its last frame is taken from the socket."""
        handshake = pending.handshake
        try:
            if mask & selectors.EVENT_WRITE:
                self._write_pending(pending)
            while mask & selectors.EVENT_READ and handshake.state is HandshakeState.RUNNING:
                try:
                    data = pending.sock.recv(handshake.bytes_needed or 1)
                except BlockingIOError:
                    break
                handshake.receive_data(data)
                pending.outgoing += handshake.data_to_send()
                if not data:
                    break
            pending.outgoing += handshake.data_to_send()
            self._write_pending(pending)
        except OSError as exc:
            self._end_pending(pending, logging.INFO, f"connection failed during the handshake: {exc.strerror or exc}")
            return
        if handshake.state is HandshakeState.FAILED:
            failure = handshake.failure
            assert failure is not None
            level = logging.INFO if "closed the connection" in failure.message else logging.WARNING
            self._end_pending(pending, level, ("worker aborted the handshake: " if failure.remote else "") + failure.message)
        elif handshake.state is HandshakeState.DONE and not pending.outgoing:
            self._promote(pending)

    def _write_pending(self, pending: _Pending) -> None:
        if pending.outgoing:
            sent = pending.sock.send(pending.outgoing)
            del pending.outgoing[:sent]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if pending.outgoing else 0)
        assert self._selector is not None
        pending.events = watch(self._selector, pending.sock, pending, pending.events, events)

    def _end_pending(self, pending: _Pending, level: int, why: str) -> None:
        log.log(level, "connection %s ended during the handshake: %s", pending.peer, why)
        self._pending.pop(pending.id, None)
        self._drop_pending(pending)

    def _drop_pending(self, pending: _Pending) -> None:
        assert self._selector is not None
        pending.events = watch(self._selector, pending.sock, pending, pending.events, 0)
        if pending.outgoing:  # the ERROR that ends the handshake, best effort
            try:
                pending.sock.send(pending.outgoing)
            except OSError:
                pass
        _close_socket(pending.sock)

    def _promote(self, pending: _Pending) -> None:
        """The worker authenticated: its connection joins the loop's data path."""
        assert self._selector is not None
        hello = pending.handshake.hello
        assert hello is not None
        self._pending.pop(pending.id, None)
        pending.events = watch(self._selector, pending.sock, pending, pending.events, 0)
        label = f"{pending.peer} (job {hello.job!r} rank {hello.rank})"
        conn = _Conn(self, pending.id, pending.sock, label, self._now)
        self._conns[conn.id] = conn
        self._set_events(conn, selectors.EVENT_READ)
        try:
            self._join(conn, hello)
        except Exception as exc:
            self._contain(conn, exc)

    def _expire_pending(self) -> None:
        """Each handshake has one deadline from accept, however its bytes trickle in (R20)."""
        while self._pending:
            pending = next(iter(self._pending.values()))
            if pending.deadline > self._now:
                return
            self._end_pending(pending, logging.INFO,
                              f"handshake not complete within {self.settings.handshake_timeout:.1f}s of accept")

    def _join(self, conn: _Conn, hello: wire.Hello) -> None:
        with self._lock:
            actions = self.core.join(conn.id, hello, peer=conn.peer, now=self._now)
        refusal = next((a for a in actions if isinstance(a, SendError) and a.conn == conn.id), None)
        if refusal is not None:
            log.warning("connection %s rejected: %s", conn.label, refusal.frame.message)
            self._close(conn, refusal.frame.message, wire.encode(refusal.frame))
            return
        self._execute(actions)
        s = self.settings
        piece = self.core.report_piece_bytes(hello.mode)
        if piece:  # cut-through: wake for every piece of a payload, not at its end
            conn.reader.max_lowat = piece
        self._send(conn, [memoryview(wire.encode(wire.Welcome(self.incarnation, s.max_frame_payload,
                                                                int(s.heartbeat_interval * 1000))))], None)
        conn.joined = True
        log.info("joined: %s session=%#x", conn.label, hello.session)

    # --- reading ---

    def _read(self, conn: _Conn) -> None:
        """Receive what the socket holds, a bounded number of frames at a time."""
        if not conn.blocked and conn.closing_until is None and not conn.closed:
            self._receive(conn)

    def _receive(self, conn: _Conn) -> None:
        conn.reader.read(self._now, _FRAMES_PER_TURN)
        ticket = conn.ticket
        if ticket is not None and ticket.buffer is not None and conn.in_data and not conn.skip_left:
            landed = conn.reader.payload_received  # part of a payload is in: its rate, and cut-through sums
            if landed:
                with self._lock:
                    actions = self.core.progress(ticket, conn.view_start + landed, self._now)
                self._execute(actions)

    def _on_payload(self, conn: _Conn) -> tuple[memoryview, str] | str | None:
        more = self._push_target(conn)
        if more is not None:
            return more
        ticket = conn.ticket
        assert ticket is not None
        conn.ticket = None
        if conn.fast is not None:
            conn.fast.feed = None
        with self._lock:
            actions = self.core.finish_push(ticket, self._now)
        self._execute(actions)
        return None

    def _on_count(self, conn: _Conn, frame_type: wire.FrameType, value: int) -> None:
        if frame_type is not wire.FrameType.ACK:
            raise ConnectionBroken("protocol", f"unexpected {frame_type.name} frame from a worker")
        with self._lock:
            actions = self.core.ack(conn.id, value)
        self._execute(actions)

    def _on_error(self, conn: _Conn, frame: wire.Error) -> None:
        if frame.code is wire.ErrorCode.CLOSED:
            raise _Closed(frame.message)
        raise _Rejected(f"worker reported: {frame.message}")

    def _begin_push(self, conn: _Conn, header: wire.FrameHeader) -> HeaderStep:
        """A push header is in: where its payload goes. ``WAIT`` when it must wait for memory:
        the connection stops being read (TCP backpressure) and the push is asked again once
        memory was freed or a tick passed; the state machine refuses it after its wait."""
        push = wire.parse_payload(header, b"")
        assert isinstance(push, wire.Push)
        with self._lock:
            obsolete = self.core.superseded(conn.id, push)
        if obsolete is not None and obsolete in self._conns:
            self._close(self._conns[obsolete], "superseded by a new connection of the same client (it reconnected)")
        with self._lock:
            outcome = self.core.begin_push(conn.id, push, header.payload_len, self._now)
        if outcome is None:
            self._block(conn)
            return WAIT
        self._unblock(conn)
        if isinstance(outcome, list):
            self._execute(outcome)
            return SKIP
        conn.ticket = outcome
        conn.skip_left, conn.in_data = outcome.skip, False
        for conn_id, rank in outcome.feeds:  # each push of its chunk still arriving now tells its forwarder
            fed = self._conns.get(conn_id)
            if fed is not None and fed.fast is not None:
                fed.fast.feed = (outcome.forwarder, rank)
        if outcome.replay:
            self._execute(outcome.replay)
        return self._push_target(conn) or (memoryview(b""), f"push payload (key {push.key:#x} chunk {push.chunk})")

    def _push_target(self, conn: _Conn) -> tuple[memoryview, str] | str | None:
        """Where the next bytes of the current push go: a scratch area for the bytes a resent
        push repeats (already in its buffer, R22) or that nobody needs any more, then its buffer
        as far as the state machine funded it (``ReducerCore.extend`` funds a push that
        announced more than a step as its bytes arrive); ``WAIT`` while the next step waits for
        memory; ``None`` when it is all in."""
        ticket = conn.ticket
        assert ticket is not None
        what = f"push payload (key {ticket.push.key:#x} chunk {ticket.push.chunk})"
        if conn.skip_left:
            n = min(conn.skip_left, len(_RESENT_SCRATCH))
            conn.skip_left -= n
            return _RESENT_SCRATCH[:n], what
        buffer = ticket.buffer
        if buffer is None:
            return None
        if not conn.in_data:
            conn.in_data = True
            conn.view_end = ticket.skip
        conn.view_start = end = conn.view_end  # the last part is full
        if end >= buffer.nbytes:
            return None
        if end >= ticket.limit:
            with self._lock:
                actions = self.core.progress(ticket, end, self._now)
                limit = self.core.extend(ticket, self._now)
            self._execute(actions)
            if limit == WAIT_FOR_MEMORY:
                self._block(conn)
                return WAIT
            self._unblock(conn)
            if limit == DISCARD:
                conn.skip_left = buffer.nbytes - end
                return self._push_target(conn)
        conn.view_end = ticket.limit
        return buffer.data.cast("B")[end : ticket.limit], what

    def _block(self, conn: _Conn) -> None:
        """Its push waits for memory: stop reading it until asked again (``_retry_blocked``)."""
        if not conn.blocked:
            conn.blocked = True
            self._blocked.add(conn)
            self._set_events(conn, conn.events & ~selectors.EVENT_READ)

    def _unblock(self, conn: _Conn) -> None:
        if conn.blocked:
            conn.blocked = False
            self._blocked.discard(conn)
            self._set_events(conn, conn.events | selectors.EVENT_READ)

    def _retry_blocked(self) -> None:
        """Ask the state machine again for every push waiting for memory (reading resumes where
        it stopped, a header or the end of a funded part); it refuses one that waited too long."""
        self._retried_epoch = self.core.memory_epoch
        for conn in list(self._blocked):
            if conn.closed:
                self._blocked.discard(conn)
                continue
            try:
                self._receive(conn)
            except Exception as exc:
                self._contain(conn, exc)

    # --- writing ---

    def _result_sink(self, conn_id: int) -> ResultSink | None:
        """What a native forwarder writes ``conn_id``'s RESULT frames through; None once it is
        leaving (ReducerCore._engage)."""
        conn = self._conns.get(conn_id)
        if conn is None or conn.closed or conn.closing_until is not None or conn.fast is None:
            return None
        return conn.sink

    def _watch_writes(self, conn: _Conn) -> None:
        """A forwarder's frame waits in ``conn``'s writer: flush it when the socket drains."""
        if not conn.closed and not conn.events & selectors.EVENT_WRITE:
            self._set_events(conn, conn.events | selectors.EVENT_WRITE)

    def _write_failed(self, conn: _Conn, exc: Exception) -> None:
        self._failed_writes.append((conn, exc))

    def _send(self, conn: _Conn, views: list[memoryview], done: Callable[[bool], None] | None, *,
              ahead: bool = False) -> None:
        """Write a frame now if nothing is queued ahead of it, else queue it (``ahead``: right
        behind the frame being written, ``FrameWriter.send``); ``done(ok)`` runs once the buffers
        are no longer needed."""
        if conn.closed:
            if done is not None:
                done(False)
            return
        finished: list[Callable[[bool], None]] = []
        try:
            conn.writer.send(views, done, self._now, finished, ahead=ahead)
        except ConnectionBroken as exc:
            if done is not None:
                done(False)
            self._broken(conn, exc)
            return
        if conn.writer.out:
            self._set_events(conn, conn.events | selectors.EVENT_WRITE)
        for callback in finished:
            callback(True)

    def _flush(self, conn: _Conn) -> None:
        finished: list[Callable[[bool], None]] = []
        try:
            conn.writer.flush(self._now, finished)
        finally:
            for callback in finished:
                callback(True)
        if conn.writer.out:
            return
        self._set_events(conn, conn.events & ~selectors.EVENT_WRITE)
        if conn.closing_until is not None:
            self._finish_close(conn)

    def _set_events(self, conn: _Conn, events: int) -> None:
        assert self._selector is not None
        if not conn.closed:
            conn.events = watch(self._selector, conn.sock, conn, conn.events, events)

    # --- closing ---

    def _close(self, conn: _Conn, reason: str, final: bytes | None = None, *, for_good: bool = False) -> None:
        """Leave the job now (``for_good``: the worker said its client closed, so its rank keeps no
        place for a reconnect); let ``final`` (and anything queued before it) out within a second
        at most, then close. Idempotent."""
        if conn.closed or conn.closing_until is not None:
            return
        self._conns.pop(conn.id, None)
        self._blocked.discard(conn)
        conn.blocked = False
        if conn.fast is not None:
            conn.fast.feed = None
        with self._lock:
            if conn.ticket is not None:
                self.core.abort_push(conn.ticket)
                conn.ticket = None
            actions = self.core.leave(conn.id, reason, self._now, for_good=for_good) if conn.joined else []
        conn.joined = False
        conn.reader.stopped = True
        conn.closing_until = self._now + min(1.0, self.settings.close_timeout)
        self._closing.add(conn)
        self._set_events(conn, conn.events & ~selectors.EVENT_READ)
        if final is not None:
            self._send(conn, [memoryview(final)], None)
        if not conn.writer.out and not conn.closed:
            self._finish_close(conn)
        self._execute(actions)

    def _finish_close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        self._set_events(conn, 0)
        conn.closed = True
        self._closing.discard(conn)
        self._conns.pop(conn.id, None)
        conn.reader.release()
        leftovers = conn.writer.abandon()
        _close_socket(conn.sock)
        for done in leftovers:
            done(False)

    def _shutdown(self) -> None:
        """On the loop, once ``stop()`` was called: fail every open operation, tell every worker
        why (a final frame on every connection, so a worker learns it whichever of its streams
        notices first), and close within ``close_timeout``."""
        assert self._selector is not None
        if self._listener is not None:
            if not self._accept_paused_until:
                self._set_listening(False)
            self._listener.close()
        reason = self._stop_reason
        with self._lock:
            actions = self.core.shutdown(reason)
        self._execute(actions)
        farewell = wire.encode(wire.Error(wire.ErrorCode.SHUTDOWN, True, reason))
        for conn in list(self._conns.values()):
            self._close(conn, reason, farewell)
        for pending in list(self._pending.values()):
            pending.outgoing += wire.encode(wire.Error(wire.ErrorCode.SHUTDOWN, True, reason))
            self._drop_pending(pending)
        self._pending.clear()
        deadline = time.monotonic() + min(1.0, self.settings.close_timeout)
        while self._closing and time.monotonic() < deadline:
            for key, mask in self._selector.select(max(0.0, deadline - time.monotonic())):
                if isinstance(key.data, _Conn) and mask & selectors.EVENT_WRITE:
                    self._now = time.monotonic()
                    try:
                        self._flush(key.data)
                    except ConnectionBroken:
                        self._finish_close(key.data)
                elif not isinstance(key.data, _Conn):
                    key.data()
        for conn in list(self._closing):
            self._finish_close(conn)
        self._close_all_sockets()

    def _close_all_sockets(self) -> None:
        for conn in list(self._conns.values()) + list(self._closing):
            conn.closed = True
            _close_socket(conn.sock)
        self._conns.clear()
        self._closing.clear()
        for pending in self._pending.values():
            _close_socket(pending.sock)
        self._pending.clear()
        if self._listener is not None:
            self._listener.close()
        self._waker.close()

    # --- actions ---

    def _execute(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, SendResult):
                views = [memoryview(action.header), action.data]
                for conn_id in action.conns:
                    conn = self._conns.get(conn_id)
                    if conn is None:
                        action.release()
                        continue
                    self._send(conn, list(views), _ignore_ok(action.release))
            elif isinstance(action, SendError):
                conn = self._conns.get(action.conn)
                if conn is None:
                    continue
                if action.close_after:
                    self._close(conn, action.frame.message, wire.encode(action.frame))
                else:
                    self._send(conn, [memoryview(wire.encode(action.frame))], None)
            elif isinstance(action, SendSafe):
                conn = self._conns.get(action.conn)
                if conn is not None:
                    # Ahead of queued results: the worker keeps a copy of each result until its
                    # SAFE, and copies it when its operation ends before (Op.take_back_lent).
                    self._send(conn, [memoryview(wire.encode(wire.Safe(action.frames)))], None, ahead=True)
            elif isinstance(action, CloseConnection):
                conn = self._conns.get(action.conn)
                if conn is not None:
                    self._close(conn, "another stream of the same worker failed")
            elif isinstance(action, Log):
                log.log(logging.getLevelName(action.level.upper()), "%s", action.message)


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None
    return trim


#: glibc's ``malloc_trim``: after the pool dropped idle buffers, hand the freed heap back to the
#: system. glibc raises its mmap threshold after large frees, so chunk-sized buffers may live on
#: the heap, whose free memory is otherwise kept by the process (RELIABILITY R21: RSS returns
#: near its baseline after an attack).
_MALLOC_TRIM = _load_malloc_trim()


def _ignore_ok(release: Callable[[], None]) -> Callable[[bool], None]:
    """A ``done(ok)`` callback that releases a shared result buffer either way."""
    return lambda _ok: release()


class _Closed(Exception):
    """The worker said its client closed (wire.ErrorCode.CLOSED): a goodbye, not a failure."""


class _Rejected(Exception):
    """Ends one connection; ``code``: the ERROR the worker is told before it closes."""

    def __init__(self, message: str, code: wire.ErrorCode | None = None) -> None:
        super().__init__(message)
        self.code = code


def _reject(sock: socket.socket, frame: wire.Error) -> None:
    """Best-effort final frame on a connection that never joined, then close it. A fresh
    connection's send buffer is empty, so the frame leaves without blocking."""
    try:
        sock.setblocking(False)
        sock.send(wire.encode(frame))
    except OSError:
        pass
    _close_socket(sock)


def _close_socket(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
