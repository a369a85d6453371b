"""The client's engine: the sockets, selectors and threads that drive :class:`~client_core.ClientCore`.

``REDSRV_IO_THREADS`` (k, default 1) ``selectors`` loop threads (``redsrv-io``, or ``redsrv-io-0``
.. ``redsrv-io-{k-1}``) each serve the streams of a fixed subset of the reducers (reducer r
belongs to loop ``r % k`` for the client's life, reconnects included): a loop writes what
callers' threads could not write at once (and, with k > 1, the large pushes they leave it, so
that the loops copy them in parallel: ``C.LOOP_WRITES_MIN_BYTES``), reads result frames straight
into the views the core names, keeps its streams' socket deadlines (send stalls, silent
reducers), sends heartbeats, and installs the streams the reconnect thread (``redsrv-reconnect``,
only while a reducer is lost) made for its reducers. Connecting itself is :mod:`client_connect`'s. Every decision is the
core's; this module executes its actions.

The locking rule. :attr:`ClientEngine.lock` guards the core, and is the only lock held while
calling it: taken briefly around each core call (one per frame header, one per landed payload,
one per submission, one per written push), never while touching a socket or settling a future.
Byte work happens outside it, into views the core handed out (``recv_into`` of a payload, the
widening and mean of :meth:`Landing.finish_bytes`, writing a push). Beside it, each loop's
:attr:`IOLoop.lock` guards its streams' writers (``FrameWriter``, ``want_write``, ``dead``,
``closing``) and its ``wants_write`` and ``handed_off`` lists, because callers' threads write
too; a thread holds at most one lock at a time (the engine's, or one loop's), so there is no
order to keep. Futures are settled and writers' ``done`` callbacks run with no lock held. Owned by one loop, no lock: its
selector's registrations, each of its streams' ``FrameReader``, and the byte buffers of each of
its streams' :class:`Channel` that the core handed out (``bitmap``, ``scratch``, the
:class:`Landing` being received); a channel's ``push_scratch`` belongs to whichever thread writes
the stream, under its loop's lock.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import selectors
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from . import constants as C
from . import wire
from .buffer_pool import OutputPool
from .client_channel import Channel, Landing
from .client_connect import Connector, Stream, close_streams, goodbye_frame, run_callbacks, say_goodbye, shutdown
from .client_core import Action, Broken, ClientCore, Complete, Fail, Reconnect, Retire, SendFrame, TracePull
from .client_ops import label, set_exception
from .errors import AuthenticationError, JobMismatchError, PeerError, PeerLostError, RedsrvError
from .plane import kernels_for
from .timeline import Timeline
from .transport import SKIP, ConnectionBroken, HeaderStep, Waker, peer_name, watch

if TYPE_CHECKING:
    from .config import Config

__all__ = ["IOLoop", "ClientEngine"]

log = logging.getLogger("redsrv.client")

_HEARTBEAT = wire.encode(wire.Heartbeat())
#: Frames read from one stream per wake-up before the loop serves the others.
_FRAMES_PER_TURN = 16


class ClientEngine:
    """The k loops, the streams they serve (``streams[reducer]``), the reconnect thread and its
    hand-over queue, and the one lock around the core (module docstring)."""

    def __init__(self, config: Config, core: ClientCore, connector: Connector, timeline: Timeline | None) -> None:
        self.config = config
        self.core = core
        self.connector = connector
        self.lock = threading.Lock()
        self.kernels = kernels_for(config.data_plane)  # every channel's byte work (core/plane.py)
        self.outputs = OutputPool()  # the results of operations given no ``out``
        self.timeline = timeline
        self.pushed_at: dict[tuple[int, int, int], float] = {}  # (key, reducer, chunk) -> push end, for the timeline
        self.stop = threading.Event()  # one for every loop: the client is closing
        self.goodbye_deadline = 0.0  # until when close() may finish a frame to say goodbye after it
        self.streams: list[list[Stream]] = []
        count = max(1, min(config.io_threads, len(config.reducers)))  # a loop serves whole reducers
        self.loops = [IOLoop(self, i, "redsrv-io" if count == 1 else f"redsrv-io-{i}") for i in range(count)]
        # The reconnect thread, and the streams it made for the owning loop to install (both under ``lock``).
        self.reconnector: threading.Thread | None = None
        self.reconnected: collections.deque[tuple[int, list[Stream]]] = collections.deque()
        self._local = threading.local()

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

    # --- executing the core's actions ---

    def call(self, event: str, *args: Any) -> None:
        """Feed the core one event under the lock, then execute its actions outside it."""
        with self.lock:
            actions = getattr(self.core, event)(*args)
        if actions:
            self.run(actions)

    def run(self, actions: Iterable[Action]) -> None:
        """Execute actions in order. A thread already executing some (a frame written at once
        whose ``written`` released the next chunk) queues them behind, so that a long run of
        chunks written at once is a loop, not a recursion."""
        local = self._local
        queue: collections.deque[Action] | None = getattr(local, "queue", None)
        if queue is not None:
            queue.extend(actions)
            return
        local.queue = queue = collections.deque(actions)
        try:
            while queue:
                self._execute(queue.popleft())
        finally:
            local.queue = None

    def _execute(self, action: Action) -> None:
        if isinstance(action, SendFrame):
            stream: Stream = action.channel.link
            views, done = action.views, functools.partial(self.written, action.channel, action.kind)
            if action.push is not None and self.timeline is not None:
                views, done = self._timed_push(views, done, action)
            push = action.push
            loop_writes = (push is not None and len(self.loops) > 1 and push.sends_payload
                           and push.chunk.count * push.wire_dt.itemsize >= C.LOOP_WRITES_MIN_BYTES)
            self.loops[stream.loop].send_frame(stream, views, done, ahead=action.ahead, loop_writes=loop_writes)
        elif isinstance(action, Complete):
            op = action.op
            if self.timeline is not None:
                self.timeline.span(f"allreduce {label(op.label)}", "operations", op.started, time.monotonic(),
                                   bytes=op.out.nbytes, contributors=op.min_count)
            op.future.contributors = action.contributors
            # Wakes the waiters here; the future's done-callbacks run on the completion thread (ReduceFuture).
            if op.future.set_running_or_notify_cancel():
                op.future.set_result(action.result)
        elif isinstance(action, Fail):
            set_exception(action.op.future, action.error)
        elif isinstance(action, TracePull):
            self._trace_pull(action)
        elif isinstance(action, Reconnect):
            log.warning("rank %d: %s; reconnecting (for up to %.0fs)", self.config.rank, action.why,
                        self.config.reconnect_window)
            self._start_reconnecting()
            for stream in self.streams[action.reducer]:
                shutdown(stream.sock)  # the loop sees it end and stops serving it
        elif isinstance(action, Retire):
            for channel in action.channels:
                old: Stream = channel.link
                self.loops[old.loop].abandon(old)
                try:
                    old.sock.close()
                except OSError:
                    pass
        elif isinstance(action, Broken):
            self.say_failed(action.error)
            self.shutdown_all()

    def written(self, channel: Channel, kind: str, ok: bool) -> None:
        """A frame the core asked for is out, or was dropped (any thread, no lock held)."""
        if kind == "settled":
            return
        with self.lock:
            actions = self.core.written(channel, kind, ok)
        if actions:
            self.run(actions)

    def _timed_push(self, views: Any, done: Any, action: SendFrame) -> tuple[Any, Any]:
        timeline, push, channel = self.timeline, action.push, action.channel
        assert timeline is not None and push is not None
        box: list[float] = []

        def produce() -> Any:
            box.append(timeline.now())
            return views() if callable(views) else views

        def timed_done(ok: bool) -> None:
            end = timeline.now()
            c = push.chunk
            self.pushed_at[(push.op.key, c.reducer, c.index)] = end
            if box:
                timeline.span(f"push {label(push.op.label)}", f"reducer {c.reducer} stream {channel.index}", box[0],
                              end, chunk=c.index, elements=c.count, ok=ok)
            done(ok)

        return produce, timed_done

    def _trace_pull(self, action: TracePull) -> None:
        timeline = self.timeline
        assert timeline is not None
        op, channel = action.op, action.channel
        track = f"reducer {channel.reducer} stream {channel.index}"
        pushed = self.pushed_at.pop((op.key, channel.reducer, action.chunk), None)
        if pushed is not None and pushed < action.arrived:
            timeline.span(f"wait {label(op.label)}", track, pushed, action.arrived, chunk=action.chunk)
        timeline.span(f"pull {label(op.label)}", track, action.arrived, time.monotonic(), chunk=action.chunk,
                      contributors=action.contributors)

    # --- the reader's callbacks (on the stream's loop) ---

    def on_header(self, stream: Stream, header: wire.FrameHeader) -> HeaderStep:
        channel = stream.channel
        with self.lock:
            landing, actions = self.core.frame_header(channel, header, self.loops[channel.loop].now)
        if actions:
            self.run(actions)
        if not isinstance(landing, Landing):
            return SKIP
        landing.save_input(self.core.chunk_buffers.copy)
        if landing.in_bitmap:
            return memoryview(channel.bitmap)[: landing.bitmap_len], "a result bitmap"
        return landing.data

    def on_payload(self, stream: Stream) -> tuple[memoryview, str] | None:
        channel = stream.channel
        landing = channel.result
        assert landing is not None
        if landing.in_bitmap:
            landing.in_bitmap = False
            return landing.data
        landing.finish_bytes(channel)
        with self.lock:
            more, actions = self.core.payload_landed(channel)
        if actions:
            self.run(actions)
        if more:  # more pieces of this chunk: one wake-up for all of them
            stream.reader.expect_at_least(more)
        return None

    def on_fast(self, stream: Stream) -> None:
        """The native receiver read from ``stream``: what it landed goes to the core."""
        receiver = stream.reader.fast
        landed = receiver.take_landed()
        frames, nbytes, safe = receiver.take_counts()
        if not frames and safe is None:
            return
        with self.lock:
            actions = self.core.results_landed(stream.channel, landed, frames, nbytes, safe)
        if actions:
            self.run(actions)

    def on_error(self, stream: Stream, frame: wire.Error) -> None:
        self.call("error_frame", stream.channel, frame, time.monotonic())
        if frame.fatal:
            stream.reader.stopped = True  # the reducer closes the connection after a fatal error

    def on_count(self, stream: Stream, frame_type: wire.FrameType, frames: int) -> None:
        if frame_type is not wire.FrameType.SAFE:
            raise ConnectionBroken("protocol", f"unexpected {frame_type.name} frame from a reducer")
        with self.lock:
            self.core.safe(stream.channel, frames)

    # --- connecting and reconnecting (RELIABILITY R22) ---

    def connect_all(self) -> None:
        """On the constructing thread, before the loops start: every reducer's streams."""
        cfg = self.config
        deadline = time.monotonic() + cfg.connect_timeout
        for r in range(len(cfg.reducers)):
            streams: list[Stream] = []
            self.streams.append(streams)
            for index in range(cfg.streams_per_reducer):
                streams.append(self._new_stream(r, index, deadline))
                self.owner(r).set_events(streams[-1], selectors.EVENT_READ)  # before the loop starts: no race
            if len({st.channel.incarnation for st in streams}) != 1:
                raise PeerLostError(f"reducer {cfg.reducers[r]} restarted while connecting", peer=cfg.reducers[r],
                                    job=cfg.job, rank=cfg.rank, phase="connect")
            self.core.connected(r, [st.channel for st in streams])

    def _new_stream(self, reducer: int, index: int, deadline: float) -> Stream:
        sock, incarnation, heartbeat = self.connector.connect(reducer, deadline)
        channel = Channel(reducer, index, incarnation, peer_name(sock), loop=self.owner(reducer).index,
                          kernels=self.kernels)
        return Stream(channel, sock, heartbeat, time.monotonic(), self.config.max_frame_payload,
                      (self.on_header, self.on_payload, self.on_error, self.on_count, self.on_fast))

    def _start_reconnecting(self) -> None:
        """A reducer was lost (the core decided): start the reconnect thread if it is not running."""
        with self.lock:
            if self.reconnector is None and not self.stop.is_set():
                self.reconnector = threading.Thread(target=self._reconnect_loop, name="redsrv-reconnect", daemon=True)
                self.reconnector.start()

    def _reconnect_loop(self) -> None:
        """The reconnect thread: reconnects to each reducer the core lists as lost, with backoff,
        until its window closes; runs only while some reducer is lost."""
        cfg, stop = self.config, self.stop
        backoff = C.CONNECT_BACKOFF_INITIAL_S
        while not stop.is_set():
            with self.lock:
                if not self.core.recovering or self.core.broken is not None:
                    self.reconnector = None
                    return
                handed = {done for done, _ in self.reconnected}
                lost = {r: d for r, d in self.core.recovering.items() if r not in handed}
            for reducer, deadline in lost.items():
                address = cfg.reducers[reducer]
                now = time.monotonic()
                if now >= deadline:
                    self.call("window_closed", reducer, now)
                    with self.lock:
                        self.reconnector = None
                    return
                streams: list[Stream] = []
                try:
                    attempt_deadline = min(deadline, now + cfg.connect_timeout)
                    for index in range(cfg.streams_per_reducer):
                        streams.append(self._new_stream(reducer, index, attempt_deadline))
                    if len({st.channel.incarnation for st in streams}) != 1:
                        raise PeerLostError(f"reducer {address} restarted while we reconnected", peer=address)
                except (AuthenticationError, JobMismatchError) as exc:
                    close_streams(streams)
                    self.fail(exc)  # reconnecting cannot fix these
                    with self.lock:
                        self.reconnector = None
                    return
                except RedsrvError as exc:
                    close_streams(streams)
                    log.info("rank %d: reconnecting to %s: %s", cfg.rank, address, exc)
                    continue
                with self.lock:
                    if stop.is_set():
                        close_streams(streams)
                        return
                    self.reconnected.append((reducer, streams))
                self.owner(reducer).waker.wake()
                backoff = C.CONNECT_BACKOFF_INITIAL_S
            # Never sleep past a window: ranks that lost a reducer together give up together, and
            # the error comes when the window closes, not up to a backoff later.
            first_deadline = min(lost.values(), default=math.inf)
            stop.wait(max(0.0, min(backoff, first_deadline - time.monotonic())))
            backoff = min(backoff * 2, C.CONNECT_BACKOFF_MAX_S)

    def close_reconnector(self, deadline: float) -> None:
        """After the loops stopped: wait for the reconnect thread (it sees the stop within a
        connect attempt) and close the streams it made that no loop installed."""
        reconnector = self.reconnector
        if reconnector is not None and reconnector is not threading.current_thread():
            reconnector.join(max(0.0, deadline - time.monotonic()))
        with self.lock:
            for _reducer, streams in self.reconnected:
                close_streams(streams)
            self.reconnected.clear()

    # --- failures ---

    def fail(self, error: BaseException) -> None:
        """The client is broken: fail everything, close every stream. Any thread."""
        self.call("fail_all", error)

    def connection_failed(self, stream: Stream, exc: ConnectionBroken, direction: str) -> None:
        """A stream broke while pushing or pulling: the core decides (reconnect or fail)."""
        if self.stop.is_set():
            return
        self.call("connection_lost", stream.channel, exc.kind, exc.detail, direction, time.monotonic())

    def install_reconnected(self, loop: IOLoop) -> None:
        """On ``loop``: serve the streams the reconnect thread made for the reducers it owns; the
        core says what to resend."""
        while True:
            with self.lock:
                mine = next((entry for entry in self.reconnected if self.owner(entry[0]) is loop), None)
                if mine is None:
                    return
                self.reconnected.remove(mine)
            reducer, streams = mine
            for stream in streams:
                loop.set_events(stream, selectors.EVENT_READ)
            with self.lock:
                self.streams[reducer] = streams
                actions = self.core.reconnected(reducer, [stream.channel for stream in streams])
            self.run(actions)

    # --- closing ---

    def say_failed(self, error: BaseException) -> None:
        """The client broke: end each connection still open with a goodbye that says why. Its
        reducers then drop the rank at once and tell the job's other ranks the cause (a rank that
        lost reducer A hears it from reducer B, perhaps before it sees A's loss itself), instead
        of keeping the rank's place for a reconnect that will not come."""
        self._say_goodbye_everywhere(time.monotonic() + C.FAILED_GOODBYE_S,
                                     goodbye_frame(f"it failed: {type(error).__name__}: {error}"))

    def _say_goodbye_everywhere(self, deadline: float, frame: bytes) -> None:
        """``frame`` as the last frame of every stream not closing yet (``say_goodbye``)."""
        for loop in self.loops:
            callbacks: list[tuple[Any, bool]] = []
            with loop.lock:  # one loop's lock at a time: a thread never holds two
                for stream in loop.own_streams():
                    if not stream.closing:
                        callbacks += say_goodbye(stream, deadline, frame)
                    # The goodbye is the client's last frame: an ACK the loop was about to send
                    # is dropped (send_frame), not written after it.
                    stream.closing = True
            run_callbacks(callbacks)

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
        self._say_goodbye_everywhere(deadline, goodbye_frame())
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

    def __init__(self, engine: ClientEngine, index: int, name: str) -> None:
        self.engine = engine
        self.config = engine.config
        self.index = index
        self.name = name
        self.lock = threading.Lock()  # its streams' writers, want_write, dead, closing, wants_write
        self.stop = engine.stop
        self.selector = selectors.DefaultSelector()
        self.waker = Waker()
        self.selector.register(self.waker.read_end, selectors.EVENT_READ, None)
        self.wants_write: list[Stream] = []  # streams whose writer a caller's thread left with frames
        self.handed_off: list[Stream] = []  # streams a caller's thread left a push to write (loop_writes)
        self.now = time.monotonic()
        self.thread: threading.Thread | None = None
        self.teardown_on_loop = False

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self.thread.start()

    def on_loop(self) -> bool:
        return self.thread is threading.current_thread()

    def own_streams(self) -> list[Stream]:
        engine = self.engine
        return [stream for r, streams in enumerate(engine.streams) if engine.owner(r) is self for stream in streams]

    def _run(self) -> None:
        selector, engine = self.selector, self.engine
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
                if self.handed_off:
                    self._write_handed_off()
                if self.wants_write:
                    self._watch_writes()
                if engine.reconnected:
                    engine.install_reconnected(self)
                if self.now >= next_tick:
                    next_tick = self.now + C.TICK_INTERVAL_S
                    self._tick()
        except Exception as exc:  # never let a bug leave a future unresolved
            log.exception("the I/O loop %s of rank %d failed", self.name, self.config.rank)
            engine.fail(PeerError(f"internal error in the client's I/O loop: {exc!r}", job=self.config.job,
                                  rank=self.config.rank))
        finally:
            for stream in self.own_streams():
                if self.stop.is_set() and not stream.dead:
                    # The client is closing (ClientEngine.close) and this loop saw it first: say
                    # the goodbye close() would have said, before the stream is dropped here.
                    with self.lock:
                        callbacks = [] if stream.closing else say_goodbye(stream, engine.goodbye_deadline)
                        stream.closing = True
                    run_callbacks(callbacks)
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
                if stream.channel.bytes_unacked >= C.PROMPT_ACK_BYTES:
                    with self.engine.lock:
                        ack = self.engine.core.acknowledge(stream.channel)
                    if ack is not None:
                        self.engine.run([ack])
        except ConnectionBroken as exc:
            self.stream_broken(stream, exc, direction)
        except Exception as exc:  # a bug while serving one stream must still fail its operations
            log.exception("serving reducer %s failed", stream.peer)
            self.stream_broken(stream, ConnectionBroken("internal", f"internal error: {exc!r}"), direction)

    def _tick(self) -> None:
        """Deadlines: the core's (operations, on loop 0: they span the reducers; ACKs due), and
        the sockets': its reducers that went silent or stopped reading; heartbeats."""
        now, engine = self.now, self.engine
        silent_for = self.config.heartbeat_timeout
        live: list[Stream] = []
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
            live.append(stream)
        with engine.lock:
            actions = engine.core.tick(now, [stream.channel for stream in live], self.index == 0)
        acked = {id(action.channel) for action in actions if isinstance(action, SendFrame)}
        engine.run(actions)
        if self.index == 0:
            engine.outputs.release_idle(now)
        for stream in live:
            writer = stream.writer
            if id(stream.channel) not in acked and not writer.out and now - writer.last_send >= stream.heartbeat:
                self.send_frame(stream, [memoryview(_HEARTBEAT)], None)

    def send_frame(self, stream: Stream, views: Any, done: Any, *, ahead: bool = False,
                   loop_writes: bool = False) -> None:
        """Write a frame from any thread: now, as far as the socket takes it without blocking,
        the rest from the loop as the socket drains. ``done(ok)`` runs once the frame is out.
        ``ahead``: the frame overtakes those queued (``FrameWriter.send``). ``loop_writes``: from
        a caller's thread, leave the whole frame to this loop, which writes it on its next turn
        (``C.LOOP_WRITES_MIN_BYTES``)."""
        finished: list[Any] = []
        broken: ConnectionBroken | None = None
        wake = dropped = False
        defer = loop_writes and not self.on_loop()
        with self.lock:
            if stream.dead:
                broken = ConnectionBroken("reset", "stream closed")
            elif stream.closing:
                dropped = True
            else:
                try:
                    stream.writer.send(views, done, time.monotonic(), finished, ahead=ahead, defer=defer)
                except ConnectionBroken as exc:
                    broken = exc
                if broken is None and stream.writer.out and not stream.want_write:
                    stream.want_write = True
                    if self.on_loop():
                        self.set_events(stream, selectors.EVENT_READ | selectors.EVENT_WRITE)
                    else:
                        (self.handed_off if defer else self.wants_write).append(stream)
                        wake = True
        for callback in finished:
            callback(True)
        if dropped and done is not None:
            done(False)
        if broken is not None:
            if done is not None:
                done(False)
            if not stream.dead:
                self.engine.connection_failed(stream, broken, "push")  # the loop cleans up
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

    def _write_handed_off(self) -> None:
        """Write the pushes callers' threads left (``loop_writes``) at once: their sockets had
        nothing queued, so they most likely have room. What they do not take waits for the
        socket to drain, as any frame does."""
        with self.lock:
            streams, self.handed_off = self.handed_off, []
        for stream in streams:
            if stream.want_write and not stream.dead:
                self._serve(stream, selectors.EVENT_WRITE)
        with self.lock:
            for stream in streams:
                if stream.want_write and not stream.dead:
                    self.set_events(stream, selectors.EVENT_READ | selectors.EVENT_WRITE)

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
        """On the loop: stop serving ``stream`` and tell the core (one broken stream means the
        reducer, or the path to it, is gone)."""
        self.abandon(stream)
        self.engine.connection_failed(stream, exc, direction)

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
