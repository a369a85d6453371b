"""The client's I/O loops: ``REDSRV_IO_THREADS`` (k, default 1) ``selectors`` loop threads
(``redsrv-io``, or ``redsrv-io-0`` .. ``redsrv-io-{k-1}``), each serving the streams of a fixed
subset of the reducers (:meth:`IOLoops.owner`). A loop writes what callers' threads could not
write at once, reads result frames (handing them to the :class:`~client_receive.Receiver`), keeps
its streams' deadlines, sends their heartbeats and ACKs, and installs the streams the session's
reconnect thread made for its reducers. One loop moves a few GB/s each way
(docs/performance.md); more loops let one worker use more cores.

See :mod:`client` for the locking rule.
"""

from __future__ import annotations

import functools
import logging
import selectors
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from . import constants as C
from . import wire
from .errors import PeerError
from .transport import ConnectionBroken, FrameReader, FrameWriter, Waker, peer_name, watch

if TYPE_CHECKING:
    from .client_ops import Copy, OpTable
    from .client_receive import Incoming, Receiver
    from .client_session import Session
    from .config import Config

__all__ = ["Stream", "IOLoop", "IOLoops", "shutdown"]

log = logging.getLogger("redsrv.client")

_HEARTBEAT = wire.encode(wire.Heartbeat())
#: Frames read from one stream per wake-up before the loop serves the others.
_FRAMES_PER_TURN = 16


class Stream:
    """One connection to one reducer: its reader and writer (both driven by the I/O loop that
    owns the reducer, number ``loop``; callers' threads may write too, under that loop's
    :attr:`IOLoop.lock`) and the result frame being received."""

    def __init__(self, receiver: Receiver, max_payload: int, reducer: int, index: int, sock: socket.socket,
                 incarnation: int, heartbeat: float, now: float, loop: int = 0) -> None:
        self.reducer = reducer
        self.index = index
        self.loop = loop
        self.sock = sock
        self.peer = peer_name(sock)
        self.incarnation = incarnation
        self.heartbeat = heartbeat
        self.queued = 0  # chunks handed to the writer and not yet written (the push window)
        self.scratch = np.empty(0, dtype=np.uint8)  # for widening compressed results
        self.push_scratch = np.empty(0, dtype=np.uint8)
        self.reader = FrameReader(sock, max_payload=max_payload, now=now, data_frame=wire.FrameType.RESULT,
                                  sender="a reducer", on_header=functools.partial(receiver.on_result_header, self),
                                  on_payload=functools.partial(receiver.on_payload, self),
                                  on_error=functools.partial(receiver.on_error, self),
                                  on_count=functools.partial(receiver.on_count, self))
        self.writer = FrameWriter(sock, now)
        self.events = 0  # what the loop's selector watches
        self.want_write = False  # the writer holds frames the socket did not take (guarded by the I/O lock)
        self.dead = False
        self.frames_received = 0  # RESULT frames read (or skipped) whole: what ACK frames report
        self.frames_acked = 0
        self.bytes_unacked = 0  # result payload received since the last ACK (C.PROMPT_ACK_BYTES)
        self.ack_queued = False  # an ACK waits in the writer: the next one waits for it (IOLoop._acknowledge)
        self.closing = False  # the client is closing: nothing more is written after its goodbye (IOLoops.close)
        # Copies of whole results, kept until the reducer says every rank has them (wire.Safe),
        # to give a restarted reducer the results it lost (R22): (key, chunk index) -> copy.
        self.copies: dict[tuple[int, int], Copy] = {}
        self.partial_copies: dict[tuple[int, int], Copy] = {}
        # The result frame being received (see Receiver.on_result_header).
        self.result: Incoming | None = None
        self.bitmap = bytearray(0)

    def take_scratch(self, nbytes: int, push: bool = False) -> np.ndarray:
        name = "push_scratch" if push else "scratch"
        buf = getattr(self, name)
        if buf.nbytes < nbytes:
            buf = np.empty(nbytes, dtype=np.uint8)
            setattr(self, name, buf)
        view: np.ndarray = buf[:nbytes]
        return view


class IOLoops:
    """The client's k I/O loops and the streams they serve (``streams[reducer]``: one list per
    reducer, shared by the loops). Reducer r belongs to loop ``r % k`` for the client's life, its
    reconnected streams included, so each stream has one loop thread that reads it, flushes it
    and keeps its deadlines. ``receiver`` and ``session`` are set by the client before
    :meth:`start`."""

    def __init__(self, config: Config, ops: OpTable) -> None:
        self.stop = threading.Event()  # one for every loop: the client is closing
        self.goodbye_deadline = 0.0  # until when close() may finish a frame to say goodbye after it
        self.streams: list[list[Stream]] = []
        count = max(1, min(config.io_threads, len(config.reducers)))  # a loop serves whole reducers
        self.loops = [IOLoop(config, ops, self, i, "redsrv-io" if count == 1 else f"redsrv-io-{i}")
                      for i in range(count)]
        self.receiver: Receiver
        self.session: Session

    def owner(self, reducer: int) -> IOLoop:
        return self.loops[reducer % len(self.loops)]

    def start(self) -> None:
        for loop in self.loops:
            loop.start()

    @property
    def threads(self) -> list[threading.Thread]:
        return [loop.thread for loop in self.loops if loop.thread is not None]

    def all_streams(self) -> list[Stream]:
        return [stream for streams in self.streams for stream in streams]

    def send_frame(self, stream: Stream, views: Any, done: Any) -> None:
        """Write a frame to ``stream`` from any thread (see :meth:`IOLoop.send_frame`)."""
        self.loops[stream.loop].send_frame(stream, views, done)

    def set_events(self, stream: Stream, events: int) -> None:
        """On the stream's loop only, or before the loops start."""
        self.loops[stream.loop].set_events(stream, events)

    def abandon(self, stream: Stream) -> None:
        self.loops[stream.loop].abandon(stream)

    def wake(self, reducer: int) -> None:
        self.owner(reducer).waker.wake()

    def shutdown_all(self) -> None:
        for stream in self.all_streams():
            shutdown(stream.sock)

    def begin_close(self, deadline: float) -> None:
        """Tell every loop the client is closing, with until when a goodbye may wait for the frame
        on the wire (a loop that sees the stop before :meth:`close` says the goodbye itself)."""
        self.goodbye_deadline = deadline
        self.stop.set()

    def close(self, deadline: float) -> None:
        """Stop every loop (waiting for each until ``deadline``, except the one this runs on) and
        close every stream. The selectors stay open for :meth:`close_selectors`."""
        self.begin_close(deadline)
        for loop in self.loops:
            callbacks: list[tuple[Any, bool]] = []
            with loop.lock:  # one loop's lock at a time: a thread never holds two (see client)
                for stream in loop.own_streams():
                    if not stream.closing:
                        callbacks += _say_goodbye(stream, deadline)
                    # The goodbye is the client's last frame: an ACK the loop was about to send
                    # is dropped (send_frame), not written after it.
                    stream.closing = True
            _run_callbacks(callbacks)
        self.shutdown_all()
        for loop in self.loops:
            loop.join(deadline)
        for stream in self.all_streams():
            try:
                stream.sock.close()
            except OSError:
                pass

    def close_selectors(self) -> None:
        for loop in self.loops:
            loop.close_selector(on_loop=loop.on_loop())


class IOLoop:
    """One loop thread: its selector and waker, and the streams of the reducers it owns.

    :meth:`send_frame` may be called from any thread; everything else runs on the loop (or
    before it starts)."""

    def __init__(self, config: Config, ops: OpTable, group: IOLoops, index: int, name: str) -> None:
        self.config = config
        self.ops = ops
        self.group = group
        self.index = index
        self.name = name
        self.lock = threading.Lock()  # its streams' writers, want_write, dead, wants_write, unregistering
        self.stop = group.stop
        self.selector = selectors.DefaultSelector()
        self.waker = Waker()
        self.selector.register(self.waker.read_end, selectors.EVENT_READ, None)
        self.wants_write: list[Stream] = []  # streams whose writer a caller's thread left with frames
        self.now = time.monotonic()
        self.thread: threading.Thread | None = None
        self.teardown_on_loop = False

    @property
    def receiver(self) -> Receiver:
        return self.group.receiver

    @property
    def session(self) -> Session:
        return self.group.session

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self.thread.start()

    def on_loop(self) -> bool:
        return self.thread is threading.current_thread()

    def own_streams(self) -> list[Stream]:
        group = self.group
        return [stream for r, streams in enumerate(group.streams) if group.owner(r) is self for stream in streams]

    def _run(self) -> None:
        selector = self.selector
        next_tick = time.monotonic() + C.TICK_INTERVAL_S
        try:
            while not self.stop.is_set():
                events = selector.select(max(0.0, next_tick - time.monotonic()))
                self.now = time.monotonic()
                for key, mask in events:
                    stream = key.data
                    if stream is None:
                        self.waker.drain()
                    else:
                        self._serve(stream, mask)
                if self.wants_write:
                    self._watch_writes()
                if self.session.reconnected:
                    self.session.install_reconnected(self)
                if self.now >= next_tick:
                    next_tick = self.now + C.TICK_INTERVAL_S
                    self._tick()
        except Exception as exc:  # never let a bug leave a future unresolved
            log.exception("the I/O loop %s of rank %d failed", self.name, self.config.rank)
            self.session.fail(PeerError(f"internal error in the client's I/O loop: {exc!r}", job=self.config.job,
                                        rank=self.config.rank))
        finally:
            for stream in self.own_streams():
                if self.stop.is_set() and not stream.dead:
                    # The client is closing (IOLoops.close) and this loop saw it first: say the
                    # goodbye close() would have said, before the stream is dropped here.
                    with self.lock:
                        callbacks = [] if stream.closing else _say_goodbye(stream, self.group.goodbye_deadline)
                        stream.closing = True
                    _run_callbacks(callbacks)
                self.abandon(stream)
            if self.teardown_on_loop:  # close() ran on this thread: the selector was left to us
                self.close_selector()

    def _serve(self, stream: Stream, mask: int) -> None:
        direction = "push"
        try:
            if mask & selectors.EVENT_WRITE:
                self._flush(stream)
            direction = "pull"
            if mask & selectors.EVENT_READ and not stream.dead:
                stream.reader.read(self.now, _FRAMES_PER_TURN)
                # Large results at once, not at the next tick: the reducer's SAFE then comes back
                # before most operations end, so their results need no copy kept for recovery
                # (Op.take_back_lent). Small ones wait for the tick: there the copy costs less.
                if stream.bytes_unacked >= C.PROMPT_ACK_BYTES:
                    self._acknowledge(stream)
        except ConnectionBroken as exc:
            self.stream_broken(stream, exc, direction)
        except Exception as exc:  # a bug while serving one stream must still fail its operations
            log.exception("serving reducer %s failed", stream.peer)
            self.stream_broken(stream, ConnectionBroken("internal", f"internal error: {exc!r}"), direction)

    def _tick(self) -> None:
        """Deadlines: operations (on loop 0: they span the reducers), its reducers that went
        silent or stopped reading, heartbeats."""
        now = self.now
        if self.index == 0:
            self.receiver.expire(now)
        silent_for = self.config.heartbeat_timeout
        for stream in self.own_streams():
            if stream.dead:
                continue
            writer, reader = stream.writer, stream.reader
            try:
                if writer.out and now - writer.last_progress > self.config.op_timeout:
                    stalled = ConnectionBroken("timeout", f"{stream.peer} stopped reading: send timed out")
                    self.stream_broken(stream, stalled, "push")
                    continue
                if reader.lowat > 1:  # waiting for the rest of a chunk: an ERROR that came instead wakes nobody
                    reader.read(now, _FRAMES_PER_TURN)
                if now - reader.last_recv > silent_for:
                    reader.read(now, _FRAMES_PER_TURN)  # a low-water mark may hide bytes that did arrive
                    if now - reader.last_recv > silent_for:
                        raise ConnectionBroken("timeout", f"no data from {stream.peer} while reading {reader.what}")
            except ConnectionBroken as exc:
                self.stream_broken(stream, exc, "pull")
                continue
            if stream.partial_copies:  # pieces of results whose operation failed meanwhile
                with self.ops.lock:
                    gone = [place for place in stream.partial_copies if place[0] not in self.ops.ops]
                for place in gone:
                    del stream.partial_copies[place]
            if not self._acknowledge(stream) and not writer.out and now - writer.last_send >= stream.heartbeat:
                self.send_frame(stream, [memoryview(_HEARTBEAT)], None)

    def _acknowledge(self, stream: Stream) -> bool:
        """Tell the reducer which results arrived, if any arrived since the last ACK (on the loop).
        The reducer keeps each result until every rank has it (R22), and says so with a SAFE."""
        if (stream.frames_received == stream.frames_acked or self.config.reconnect_window <= 0 or stream.dead
                or stream.ack_queued):
            return False
        stream.frames_acked = stream.frames_received
        stream.bytes_unacked = 0
        stream.ack_queued = True

        def written(ok: bool) -> None:
            stream.ack_queued = False

        # Ahead of queued pushes: an ACK behind a push window of chunks would come too late to
        # spare the copies it exists for.
        self.send_frame(stream, [memoryview(wire.encode(wire.Ack(stream.frames_acked)))], written, ahead=True)
        return True

    def send_frame(self, stream: Stream, views: Any, done: Any, *, ahead: bool = False) -> None:
        """Write a frame from any thread: now, as far as the socket takes it without blocking,
        the rest from the loop as the socket drains. ``done(ok)`` runs once the frame is out.
        ``ahead``: the frame overtakes those queued (``FrameWriter.send``)."""
        finished: list[Any] = []
        broken: ConnectionBroken | None = None
        wake = dropped = False
        with self.lock:
            if stream.dead:
                broken = ConnectionBroken("reset", "stream closed")
            elif stream.closing:
                dropped = True
            else:
                try:
                    stream.writer.send(views, done, time.monotonic(), finished, ahead=ahead)
                except ConnectionBroken as exc:
                    broken = exc
                if broken is None and stream.writer.out and not stream.want_write:
                    stream.want_write = True
                    if self.on_loop():
                        self.set_events(stream, selectors.EVENT_READ | selectors.EVENT_WRITE)
                    else:
                        self.wants_write.append(stream)
                        wake = True
        for callback in finished:
            callback(True)
        if dropped and done is not None:
            done(False)
        if broken is not None:
            if done is not None:
                done(False)
            if not stream.dead:
                self.session.connection_failed(stream, broken, "push")  # the loop cleans up
        if wake:
            self.waker.wake()

    def _flush(self, stream: Stream) -> None:
        finished: list[Any] = []
        try:
            with self.lock:
                stream.writer.flush(self.now, finished)
        finally:
            for callback in finished:
                callback(True)  # may queue the next chunk: then the socket stays watched for writing
        with self.lock:
            if not stream.writer.out and stream.want_write:
                stream.want_write = False
                self.set_events(stream, selectors.EVENT_READ)

    def _watch_writes(self) -> None:
        with self.lock:
            streams, self.wants_write = self.wants_write, []
            for stream in streams:
                if stream.want_write and not stream.dead:
                    self.set_events(stream, selectors.EVENT_READ | selectors.EVENT_WRITE)

    def set_events(self, stream: Stream, events: int) -> None:
        """On the loop only (the selector is not shared with callers' threads), or before it starts."""
        if not stream.dead:
            stream.events = watch(self.selector, stream.sock, stream, stream.events, events)

    def stream_broken(self, stream: Stream, exc: ConnectionBroken, direction: str) -> None:
        """On the loop: stop serving ``stream`` and tell the session (one broken stream means the
        reducer, or the path to it, is gone)."""
        self.abandon(stream)
        self.session.connection_failed(stream, exc, direction)

    def abandon(self, stream: Stream) -> None:
        with self.lock:
            if stream.events:
                try:
                    self.selector.unregister(stream.sock)
                except (KeyError, ValueError, OSError):
                    pass
            stream.events = 0
            stream.dead = True
            stream.reader.stopped = True
            leftovers = stream.writer.abandon()
        for done in leftovers:
            done(False)

    def join(self, deadline: float) -> None:
        """After :attr:`stop` is set: wait for the loop to end (not from the loop itself), or
        abandon the streams of a loop that never started."""
        if self.thread is None:
            for stream in self.own_streams():
                self.abandon(stream)
        elif not self.on_loop():
            self.waker.wake()
            self.thread.join(max(0.0, deadline - time.monotonic()))

    def close_selector(self, on_loop: bool = False) -> None:
        if on_loop:
            self.teardown_on_loop = True  # the loop returns after this turn and closes the selector
            return
        self.selector.close()
        self.waker.close()


_GOODBYE = wire.encode(wire.Error(wire.ErrorCode.CLOSED, True, "the client was closed"))


def _say_goodbye(stream: Stream, deadline: float) -> list[tuple[Any, bool]]:
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
            stream.sock.sendall(_GOODBYE)
        else:
            stream.sock.send(_GOODBYE, socket.MSG_DONTWAIT)
    except OSError:
        pass
    finally:
        try:
            stream.sock.setblocking(False)
        except OSError:
            pass
    return callbacks


def _run_callbacks(callbacks: list[tuple[Any, bool]]) -> None:
    for done, ok in callbacks:
        done(ok)


def shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
