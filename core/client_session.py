"""The client's session with the reducer fleet: connecting and the handshake, a broken client,
and transparent recovery (RELIABILITY R22): when a connection to a reducer breaks, a reconnect
thread (``redsrv-reconnect``, only while a reducer is lost) makes new streams within the
reconnect window and the I/O loop that owns the reducer installs them and resends what the
reducer has not answered.

See :mod:`client` for the locking rule.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import selectors
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from . import auth, wire
from . import constants as C
from .client_io import IOLoop, IOLoops, Stream, shutdown
from .client_ops import OpTable, PendingPush
from .errors import (
    AuthenticationError,
    JobMismatchError,
    PeerError,
    PeerLostError,
    PeerTimeoutError,
    RedsrvError,
    ReducerShutdownError,
    RemoteProtocolError,
)
from .handshake import ClientHandshake, HandshakeFailure, HandshakeState
from .transport import ConnectionBroken, choose_congestion_control, configure_socket, set_send_lowat

if TYPE_CHECKING:
    from .client_dispatch import Dispatcher
    from .client_receive import Receiver
    from .config import Config

__all__ = ["Session"]

log = logging.getLogger("redsrv.client")


class Session:
    """Connections to every reducer and their recovery. ``recovering``, ``reconnector`` and
    ``reconnected`` are guarded by the dispatcher's lock, which also guards ``io.streams[r]`` swaps."""

    def __init__(self, config: Config, ops: OpTable, io: IOLoops, dispatcher: Dispatcher, receiver: Receiver) -> None:
        self.config = config
        self.ops = ops
        self.io = io
        self.dispatcher = dispatcher
        self.receiver = receiver
        self.id = int.from_bytes(os.urandom(8), "little")
        self.incarnations: list[int] = []
        # reducer -> when its reconnect window closes; the thread that reconnects; streams it
        # made, for the loop to install.
        self.recovering: dict[int, float] = {}
        self.reconnector: threading.Thread | None = None
        self.reconnected: collections.deque[tuple[int, list[Stream]]] = collections.deque()
        self._congestion_warned = False

    # --- connecting ---

    def connect_all(self) -> None:
        cfg = self.config
        deadline = time.monotonic() + cfg.connect_timeout
        for r, (host, port) in enumerate(cfg.addresses()):
            streams: list[Stream] = []
            self.io.streams.append(streams)
            for s in range(cfg.streams_per_reducer):
                streams.append(self.connect_one(r, s, host, port, deadline))
            incarnations = {st.incarnation for st in streams}
            if len(incarnations) != 1:
                raise PeerLostError(f"reducer {cfg.reducers[r]} restarted while connecting", peer=cfg.reducers[r],
                                    job=cfg.job, rank=cfg.rank, phase="connect")
            self.incarnations.append(streams[0].incarnation)

    def connect_one(self, reducer: int, index: int, host: str, port: int, deadline: float, *,
                    register: bool = True) -> Stream:
        cfg = self.config
        address = cfg.reducers[reducer]
        backoff = C.CONNECT_BACKOFF_INITIAL_S
        started = time.monotonic()
        while True:
            remaining = deadline - time.monotonic()
            try:
                sock = socket.create_connection((host, port), timeout=max(0.05, remaining))
                break
            except OSError as exc:
                if time.monotonic() + backoff > deadline:
                    raise PeerTimeoutError(f"cannot connect to reducer {address}: {exc.strerror or exc}", peer=address,
                                           job=cfg.job, rank=cfg.rank, phase="connect",
                                           elapsed=time.monotonic() - started, timeout=cfg.connect_timeout) from None
                time.sleep(backoff)
                backoff = min(backoff * 2, C.CONNECT_BACKOFF_MAX_S)
        try:
            configure_socket(sock)
            refused = choose_congestion_control(sock, cfg.tcp_congestion)
            if refused and not self._congestion_warned:
                self._congestion_warned = True  # once per client, not once per stream
                log.warning("rank %d, reducer %s: %s", cfg.rank, address, refused)
            incarnation, heartbeat = self._handshake(sock, address)
            set_send_lowat(sock, cfg.send_lowat_bytes)
            sock.setblocking(False)
            stream = Stream(self.receiver, cfg.max_frame_payload, reducer, index, sock, incarnation, heartbeat,
                            time.monotonic(), loop=self.io.owner(reducer).index)
            if register:
                self.io.set_events(stream, selectors.EVENT_READ)  # before the loop starts: no race
            return stream
        except BaseException:
            shutdown(sock)
            sock.close()
            raise

    def _handshake(self, sock: socket.socket, address: str) -> tuple[int, float]:
        """Drive :class:`ClientHandshake` on a blocking socket within one deadline for the whole
        exchange; returns the reducer's incarnation and the heartbeat interval to use."""
        cfg = self.config
        hello = wire.Hello(cfg.job, cfg.rank, cfg.world_size, self.id, auth.new_nonce(), cfg.mode,
                           cfg.min_contributors, int(cfg.deadline * 1000), int(cfg.op_timeout * 1000),
                           int(cfg.reconnect_window * 1000))
        ctx: dict[str, Any] = dict(peer=address, job=cfg.job, rank=cfg.rank, phase="handshake", timeout=cfg.handshake_timeout)
        handshake = ClientHandshake(hello, secret=cfg.secret)
        deadline = time.monotonic() + cfg.handshake_timeout
        try:
            sock.settimeout(cfg.handshake_timeout)
            sock.sendall(handshake.data_to_send())
            while handshake.state is HandshakeState.RUNNING:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                sock.settimeout(remaining)
                data = sock.recv(handshake.bytes_needed or 1)
                handshake.receive_data(data)
                reply = handshake.data_to_send()
                if reply:
                    sock.sendall(reply)
        except TimeoutError:
            raise PeerTimeoutError(f"handshake with reducer {address} timed out", elapsed=time.monotonic() - deadline
                                   + cfg.handshake_timeout, **ctx) from None
        except OSError as exc:
            raise PeerLostError(f"handshake with reducer {address} failed: {exc}", **ctx) from None
        finally:
            sock.settimeout(None)
        if handshake.state is HandshakeState.FAILED:
            assert handshake.failure is not None
            raise self._handshake_error(handshake.failure, address)
        accepted = handshake.accepted
        assert accepted is not None
        heartbeat = min(cfg.heartbeat_interval, accepted.heartbeat_ms / 1000 or cfg.heartbeat_interval)
        return accepted.incarnation, heartbeat

    def _handshake_error(self, failure: HandshakeFailure, address: str) -> RedsrvError:
        cfg = self.config
        ctx: dict[str, Any] = dict(peer=address, job=cfg.job, rank=cfg.rank, phase="handshake")
        code = failure.code
        if code is wire.ErrorCode.AUTHENTICATION:
            return AuthenticationError(f"authentication with reducer {address} failed", **ctx)
        if not failure.remote:  # we refused the reducer, or it closed the connection
            if "closed the connection" in failure.message:
                hint = "" if cfg.secret is not None else " (does it require a secret?)"
                return PeerLostError(f"reducer {address} closed the connection during the handshake{hint}", **ctx)
            return RemoteProtocolError(f"reducer {address}: {failure.message}", **ctx)
        if code is wire.ErrorCode.JOB_MISMATCH:
            return JobMismatchError(f"reducer {address}: {failure.message}", **ctx)
        if code is wire.ErrorCode.PROTOCOL:
            return RemoteProtocolError(f"reducer {address} rejected the handshake: {failure.message}", **ctx)
        if code is wire.ErrorCode.SHUTDOWN:
            return ReducerShutdownError(f"reducer {address} is shutting down: {failure.message}", **ctx)
        return PeerError(f"reducer {address} refused the connection: {failure.message}", **ctx)

    # --- failures ---

    def fail(self, error: BaseException) -> None:
        """The client is broken: fail everything, close every stream. Any thread."""
        self.ops.fail_all(error)
        self.dispatcher.clear()
        self.io.shutdown_all()

    def reconnecting_to(self) -> str:
        """The reducers this client is reconnecting to and the window each has left, for errors
        whose cause may be that loss (another rank that lost it too gave up first); '' if none."""
        with self.dispatcher.lock:
            lost = sorted(self.recovering.items())
        now = time.monotonic()
        return "; ".join(f"this rank lost reducer {self.config.reducers[r]} too and was reconnecting "
                         f"({max(0.0, deadline - now):.1f}s of its reconnect window left)" for r, deadline in lost)

    def connection_failed(self, stream: Stream, exc: ConnectionBroken, direction: str) -> None:
        """A stream broke while pushing or pulling: reconnect (within the reconnect window) or fail."""
        if self.ops.closed or self.io.stop.is_set():
            return
        cfg = self.config
        ctx: dict[str, Any] = dict(peer=stream.peer, job=cfg.job, rank=cfg.rank, phase=direction)
        error: RedsrvError
        if exc.kind == "timeout":
            bound = cfg.heartbeat_timeout if direction == "pull" else cfg.op_timeout
            error = PeerTimeoutError(f"reducer {stream.peer} is unresponsive: {exc.detail}", timeout=bound, **ctx)
        elif exc.kind == "protocol":
            error = RemoteProtocolError(f"reducer {stream.peer} sent an invalid frame: {exc.detail}", **ctx)
        else:
            error = PeerLostError(f"lost reducer {stream.peer}: {exc.detail}", **ctx)
        if cfg.reconnect_window > 0 and exc.kind not in ("protocol", "internal"):  # a bug is not a lost reducer
            self.lose_reducer(stream.reducer, str(error))
            return
        self.fail(error)

    # --- transparent recovery (RELIABILITY R22) ---

    def lose_reducer(self, reducer: int, why: str) -> None:
        """A connection to ``reducer`` broke: close its streams and reconnect within the reconnect
        window, then resend every chunk it has not answered. Any thread."""
        with self.dispatcher.lock:
            if reducer in self.recovering or self.io.stop.is_set() or self.ops.broken is not None:
                return
            self.recovering[reducer] = time.monotonic() + self.config.reconnect_window
            if self.reconnector is None:
                self.reconnector = threading.Thread(target=self._reconnect_loop, name="redsrv-reconnect", daemon=True)
                self.reconnector.start()
        log.warning("rank %d: %s; reconnecting (for up to %.0fs)", self.config.rank, why, self.config.reconnect_window)
        for stream in self.io.streams[reducer]:
            shutdown(stream.sock)  # the loop sees it end and stops serving it

    def _reconnect_loop(self) -> None:
        """The reconnect thread: runs only while some reducer is lost."""
        cfg = self.config
        stop = self.io.stop
        backoff = C.CONNECT_BACKOFF_INITIAL_S
        while not stop.is_set():
            with self.dispatcher.lock:
                lost = {r: d for r, d in self.recovering.items() if all(r != done for done, _ in self.reconnected)}
                if not self.recovering:
                    self.reconnector = None
                    return
            for reducer, deadline in lost.items():
                address = cfg.reducers[reducer]
                now = time.monotonic()
                if now >= deadline:
                    self.fail(PeerLostError(f"lost reducer {address} and could not reconnect within the reconnect "
                                            f"window of {cfg.reconnect_window:.1f}s", peer=address, job=cfg.job,
                                            rank=cfg.rank, phase="reconnect", timeout=cfg.reconnect_window))
                    with self.dispatcher.lock:
                        self.reconnector = None
                    return
                host, port = cfg.addresses()[reducer]
                streams: list[Stream] = []
                try:
                    attempt_deadline = min(deadline, now + cfg.connect_timeout)
                    for index in range(cfg.streams_per_reducer):
                        streams.append(self.connect_one(reducer, index, host, port, attempt_deadline, register=False))
                    if len({st.incarnation for st in streams}) != 1:
                        raise PeerLostError(f"reducer {address} restarted while we reconnected", peer=address)
                except (AuthenticationError, JobMismatchError) as exc:
                    close_streams(streams)
                    self.fail(exc)  # reconnecting cannot fix these
                    with self.dispatcher.lock:
                        self.reconnector = None
                    return
                except RedsrvError as exc:
                    close_streams(streams)
                    log.info("rank %d: reconnecting to %s: %s", cfg.rank, address, exc)
                    continue
                with self.dispatcher.lock:
                    if stop.is_set():
                        close_streams(streams)
                        return
                    self.reconnected.append((reducer, streams))
                self.io.wake(reducer)
                backoff = C.CONNECT_BACKOFF_INITIAL_S
            # Never sleep past a window: ranks that lost a reducer together give up together, and
            # the error comes when the window closes, not up to a backoff later.
            first_deadline = min(lost.values(), default=math.inf)
            stop.wait(max(0.0, min(backoff, first_deadline - time.monotonic())))
            backoff = min(backoff * 2, C.CONNECT_BACKOFF_MAX_S)

    def install_reconnected(self, loop: IOLoop) -> None:
        """On ``loop``: serve the streams the reconnect thread made for the reducers it owns, and
        resend, in their original order and ahead of newer work, the chunks of such a reducer
        that are unanswered."""
        io, dispatcher = self.io, self.dispatcher
        while True:
            with dispatcher.lock:
                mine = next((entry for entry in self.reconnected if io.owner(entry[0]) is loop), None)
                if mine is None:
                    return
                self.reconnected.remove(mine)
                reducer, streams = mine
                old = io.streams[reducer]
                io.streams[reducer] = streams
            for stream in old:
                io.abandon(stream)
                try:
                    stream.sock.close()
                except OSError:
                    pass
            for stream in streams:
                io.set_events(stream, selectors.EVENT_READ)
            restarted = streams[0].incarnation != self.incarnations[reducer]
            self.incarnations[reducer] = streams[0].incarnation
            copies = [kept for stream in old for kept in stream.copies.values()]
            for stream in old:
                stream.copies.clear()
                stream.partial_copies.clear()
            if restarted:  # it lost what it had: give it the results some ranks may still lack
                for i, kept in enumerate(copies):
                    target = streams[i % len(streams)]
                    data = kept.own()  # the frame may leave after ``out`` went back to the caller
                    header = wire.push_header(wire.Push(kept.key, target.incarnation, kept.total, kept.offset,
                                                        data.size, kept.index, kept.dtype, wire.ReduceOp.SETTLED),
                                              data.nbytes)
                    io.send_frame(target, [memoryview(header), data.view(np.uint8).data], None)
            ops = self.ops.snapshot()
            with dispatcher.lock:
                queued = {(id(p.op), p.chunk.reducer, p.chunk.index) for p in dispatcher.pending}
                resend: list[PendingPush] = []
                for op in ops:
                    with op.lock:
                        places = [place for place in op.chunks if place[0] == reducer]
                    for place in places:
                        op.received.pop(place, None)  # its result comes again from the chunk's start
                        push = op.pushes.get(place)
                        if push is not None and (id(op), *place) not in queued:
                            resend.append(push)
                resend.sort(key=lambda p: (p.op.started, p.chunk.index))
                dispatcher.pending.extendleft(reversed(resend))
                del self.recovering[reducer]
            log.warning("rank %d: reconnected to reducer %s (%s); resending %d chunk(s)%s", self.config.rank,
                        self.config.reducers[reducer], "restarted" if restarted else "same incarnation", len(resend),
                        f" and {len(copies)} result(s) it may have lost" if restarted else "")
            dispatcher.dispatch()

    def close(self, deadline: float) -> None:
        """After the loop stopped: wait for the reconnect thread (it sees the stop within a
        connect attempt) and close the streams it made that the loop never installed."""
        reconnector = self.reconnector
        if reconnector is not None and reconnector is not threading.current_thread():
            reconnector.join(max(0.0, deadline - time.monotonic()))
        with self.dispatcher.lock:
            for _reducer, streams in self.reconnected:
                close_streams(streams)
            self.reconnected.clear()


def close_streams(streams: list[Stream]) -> None:
    for stream in streams:
        shutdown(stream.sock)
        stream.sock.close()
