"""The client's connections: connecting and the handshake (driving the sans-IO
:class:`~handshake.ClientHandshake` on a blocking socket within one deadline), and the reconnect
thread (``redsrv-reconnect``, only while a reducer is lost), which makes new streams within the
reconnect window and hands them to the engine loop that owns the reducer. What is lost, until
when, and what to resend are :class:`~client_core.ClientCore`'s decisions.

See :mod:`client_engine` for the locking rule.
"""

from __future__ import annotations

import logging
import math
import os
import selectors
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from . import auth, wire
from . import constants as C
from .client_core import Channel
from .client_engine import ClientEngine, Stream, shutdown
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
from .transport import choose_congestion_control, configure_socket, peer_name, set_send_lowat

if TYPE_CHECKING:
    from .config import Config

__all__ = ["Connector"]

log = logging.getLogger("redsrv.client")


class Connector:
    """Connections to every reducer and the reconnect thread. ``reconnector`` is guarded by the
    engine's lock."""

    def __init__(self, config: Config, engine: ClientEngine) -> None:
        self.config = config
        self.engine = engine
        self.id = int.from_bytes(os.urandom(8), "little")
        self.reconnector: threading.Thread | None = None
        self._congestion_warned = False

    # --- connecting ---

    def connect_all(self) -> None:
        cfg = self.config
        deadline = time.monotonic() + cfg.connect_timeout
        for r, (host, port) in enumerate(cfg.addresses()):
            streams: list[Stream] = []
            self.engine.streams.append(streams)
            for s in range(cfg.streams_per_reducer):
                streams.append(self.connect_one(r, s, host, port, deadline))
            incarnations = {st.channel.incarnation for st in streams}
            if len(incarnations) != 1:
                raise PeerLostError(f"reducer {cfg.reducers[r]} restarted while connecting", peer=cfg.reducers[r],
                                    job=cfg.job, rank=cfg.rank, phase="connect")
            self.engine.core.connected(r, [st.channel for st in streams])

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
            owner = self.engine.owner(reducer)
            channel = Channel(reducer, index, incarnation, peer_name(sock), loop=owner.index)
            stream = Stream(self.engine, channel, sock, heartbeat, time.monotonic())
            if register:
                owner.set_events(stream, selectors.EVENT_READ)  # before the loop starts: no race
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

    # --- transparent recovery (RELIABILITY R22) ---

    def start_reconnecting(self) -> None:
        """A reducer was lost (the core decided): start the reconnect thread if it is not running."""
        with self.engine.lock:
            if self.reconnector is None and not self.engine.stop.is_set():
                self.reconnector = threading.Thread(target=self._reconnect_loop, name="redsrv-reconnect", daemon=True)
                self.reconnector.start()

    def _reconnect_loop(self) -> None:
        """The reconnect thread: runs only while some reducer is lost."""
        cfg, engine = self.config, self.engine
        stop = engine.stop
        backoff = C.CONNECT_BACKOFF_INITIAL_S
        while not stop.is_set():
            with engine.lock:
                if not engine.core.recovering or engine.core.broken is not None:
                    self.reconnector = None
                    return
                handed = {done for done, _ in engine.reconnected}
                lost = {r: d for r, d in engine.core.recovering.items() if r not in handed}
            for reducer, deadline in lost.items():
                address = cfg.reducers[reducer]
                now = time.monotonic()
                if now >= deadline:
                    engine.call("window_closed", reducer, now)
                    with engine.lock:
                        self.reconnector = None
                    return
                host, port = cfg.addresses()[reducer]
                streams: list[Stream] = []
                try:
                    attempt_deadline = min(deadline, now + cfg.connect_timeout)
                    for index in range(cfg.streams_per_reducer):
                        streams.append(self.connect_one(reducer, index, host, port, attempt_deadline, register=False))
                    if len({st.channel.incarnation for st in streams}) != 1:
                        raise PeerLostError(f"reducer {address} restarted while we reconnected", peer=address)
                except (AuthenticationError, JobMismatchError) as exc:
                    close_streams(streams)
                    engine.fail(exc)  # reconnecting cannot fix these
                    with engine.lock:
                        self.reconnector = None
                    return
                except RedsrvError as exc:
                    close_streams(streams)
                    log.info("rank %d: reconnecting to %s: %s", cfg.rank, address, exc)
                    continue
                with engine.lock:
                    if stop.is_set():
                        close_streams(streams)
                        return
                    engine.reconnected.append((reducer, streams))
                engine.owner(reducer).waker.wake()
                backoff = C.CONNECT_BACKOFF_INITIAL_S
            # Never sleep past a window: ranks that lost a reducer together give up together, and
            # the error comes when the window closes, not up to a backoff later.
            first_deadline = min(lost.values(), default=math.inf)
            stop.wait(max(0.0, min(backoff, first_deadline - time.monotonic())))
            backoff = min(backoff * 2, C.CONNECT_BACKOFF_MAX_S)

    def close(self, deadline: float) -> None:
        """After the loop stopped: wait for the reconnect thread (it sees the stop within a
        connect attempt) and close the streams it made that the loop never installed."""
        reconnector = self.reconnector
        if reconnector is not None and reconnector is not threading.current_thread():
            reconnector.join(max(0.0, deadline - time.monotonic()))
        with self.engine.lock:
            for _reducer, streams in self.engine.reconnected:
                close_streams(streams)
            self.engine.reconnected.clear()


def close_streams(streams: list[Stream]) -> None:
    for stream in streams:
        shutdown(stream.sock)
        stream.sock.close()
