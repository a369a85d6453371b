"""The client's connections to reducers: connecting (the TCP connection with backoff within a
deadline, its socket options, and the handshake, driving the sans-IO
:class:`~handshake.ClientHandshake` on a blocking socket within one deadline for the whole
exchange), a connection's socket, reader and writer (:class:`Stream`), and the goodbye a closing
client says on it. Used by the engine (:mod:`client_engine`), which drives them; it knows
nothing of operations.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import auth, wire
from . import constants as C
from .client_channel import Channel
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
from .transport import FrameReader, choose_congestion_control, configure_socket, set_send_lowat

if TYPE_CHECKING:
    from .config import Config

__all__ = ["Connector", "Stream", "ReaderCallbacks", "goodbye_frame", "say_goodbye", "run_callbacks", "close_streams", "shutdown"]

log = logging.getLogger("redsrv.client")


class Connector:
    """Opens connections to the reducers for one client session (:attr:`id`, the same in every
    handshake: a reconnect is the same session)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.id = int.from_bytes(os.urandom(8), "little")
        self._congestion_warned = False

    def connect(self, reducer: int, deadline: float) -> tuple[socket.socket, int, float]:
        """A non-blocking socket to ``reducer`` past its handshake, its incarnation and the
        heartbeat interval to use; typed errors naming the reducer on failure."""
        cfg = self.config
        host, port = cfg.addresses()[reducer]
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
            return sock, incarnation, heartbeat
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


ReaderCallbacks = tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any], Callable[..., Any], Callable[..., Any]]


class Stream:
    """One connection to one reducer: the core's :class:`Channel` for it, its socket, reader and
    writer (driven by the engine loop that owns the reducer; callers' threads may write too, under
    that loop's lock). ``reader``: the engine's five reader callbacks (``FrameReader``'s four and
    ``on_fast``), each called with this stream first. Where the channel takes result slots (the
    native plane), the reader gets the plane's result receiver for this socket."""

    __slots__ = ("channel", "sock", "peer", "heartbeat", "reader", "writer", "events", "want_write", "dead", "closing")

    def __init__(self, channel: Channel, sock: socket.socket, heartbeat: float, now: float, max_payload: int,
                 reader: ReaderCallbacks) -> None:
        self.channel = channel
        channel.link = self
        self.sock = sock
        self.peer = channel.peer
        self.heartbeat = heartbeat
        on_header, on_payload, on_error, on_count, on_fast = reader
        fast = None
        if channel.slots is not None:
            fast = channel.kernels.result_receiver(sock.fileno(), max_payload, channel.slots, C.MAX_RECEIVE_LOWAT_BYTES)
        self.reader = FrameReader(sock, max_payload=max_payload, now=now, data_frame=wire.FrameType.RESULT,
                                  sender="a reducer", on_header=functools.partial(on_header, self),
                                  on_payload=functools.partial(on_payload, self),
                                  on_error=functools.partial(on_error, self),
                                  on_count=functools.partial(on_count, self),
                                  parser=channel.kernels.frames, fast=fast,
                                  on_fast=functools.partial(on_fast, self) if fast is not None else None)
        self.writer = channel.kernels.frame_writer(sock, now)
        self.events = 0  # what the loop's selector watches
        self.want_write = False  # the writer holds frames the socket did not take (under the loop's lock)
        self.dead = False
        self.closing = False  # the client is closing: nothing more is written after its goodbye

    @property
    def reducer(self) -> int:
        return self.channel.reducer

    @property
    def loop(self) -> int:
        return self.channel.loop


def goodbye_frame(message: str = wire.CLIENT_CLOSED_MESSAGE) -> bytes:
    """The CLOSED frame a client ends its connections with; ``message``: why, where it failed."""
    return wire.encode(wire.Error(wire.ErrorCode.CLOSED, True, message))


_GOODBYE = goodbye_frame()


def say_goodbye(stream: Stream, deadline: float, frame: bytes = _GOODBYE) -> list[tuple[Any, bool]]:
    """Tell the reducer this client is closing, so that it keeps no place for a reconnect (a new
    client for the rank would otherwise look like a restarted worker and void what the job's
    other new clients already sent). A goodbye goes between whole frames: the frame on the wire
    is finished first (until ``deadline``) and the frames queued behind it are dropped. A
    reducer that does not get it (the deadline passed, the connection broke) keeps the rank's
    place for its rejoin grace instead. Returns the dropped and finished frames' callbacks with
    their ``ok``, for the caller to run outside the loop's lock."""
    if stream.dead:
        return []
    callbacks: list[tuple[Any, bool]] = []
    try:
        if stream.writer.out:
            between, callbacks = stream.writer.finish_frame(deadline)
            if not between:
                return callbacks
            stream.sock.settimeout(max(1e-3, deadline - time.monotonic()))
            stream.sock.sendall(frame)
        else:
            stream.sock.send(frame, socket.MSG_DONTWAIT)
    except OSError:
        pass
    finally:
        try:
            stream.sock.setblocking(False)
        except OSError:
            pass
    return callbacks


def run_callbacks(callbacks: list[tuple[Any, bool]]) -> None:
    for done, ok in callbacks:
        done(ok)


def close_streams(streams: list[Stream]) -> None:
    for stream in streams:
        shutdown(stream.sock)
        stream.sock.close()


def shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass

