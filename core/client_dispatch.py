"""The client's send side: turns an operation's chunks into PUSH frames, in order, each to the
least-loaded stream of its reducer that has room in its push window. Runs on whichever thread
submits or finishes writing a chunk: a caller's, the I/O loop, the reconnect path.

See :mod:`client` for the locking rule.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from . import chunker, wire
from .client_ops import Op, PendingPush, label
from .timeline import Timeline

if TYPE_CHECKING:
    from .client_io import IOLoops, Stream
    from .client_session import Session
    from .config import Config

__all__ = ["Dispatcher"]


class Dispatcher:
    """The chunks not yet handed to a stream (:attr:`pending`, in sending order) and the push
    windows. :attr:`lock` is the client's outermost lock (see :mod:`client`); ``session`` is set
    by the client."""

    def __init__(self, config: Config, io: IOLoops, timeline: Timeline | None,
                 pushed_at: dict[tuple[int, int, int], float]) -> None:
        self.config = config
        self.io = io
        self.session: Session
        self.timeline = timeline
        self.pushed_at = pushed_at  # (key, reducer, chunk) -> push end, for the timeline
        # Re-entrant: a stream that fails inside send() runs its chunk's ``written`` callback,
        # which takes this lock again.
        self.lock = threading.RLock()
        self.pending: collections.deque[PendingPush] = collections.deque()
        self._dispatching = False
        self.bytes_pushed = 0

    def submit(self, pushes: Iterable[PendingPush]) -> None:
        with self.lock:
            self.pending.extend(pushes)
            self.dispatch()

    def clear(self) -> None:
        with self.lock:
            self.pending.clear()

    def dispatch(self) -> None:
        """Hand queued chunks, in order, to streams with room in their push window. Called after
        a submission and whenever a stream finished writing a chunk."""
        window = self.config.push_window_chunks
        with self.lock:
            if self._dispatching:
                return  # a chunk written inline by the loop below: the loop goes on by itself
            self._dispatching = True
            try:
                pending = self.pending
                while pending:
                    push = pending[0]
                    if push.op.future.done():  # failed or timed out meanwhile: its chunks stay home
                        pending.popleft()
                        continue
                    if push.chunk.reducer in self.session.recovering:
                        return  # in order: everything waits until that reducer is back
                    stream = min(self.io.streams[push.chunk.reducer], key=lambda s: s.queued)
                    if window and stream.queued >= window:
                        return  # in order: a chunk for another reducer must not overtake this one
                    pending.popleft()
                    stream.queued += 1
                    self._send_push(stream, push)
            finally:
                self._dispatching = False

    def _send_push(self, stream: Stream, p: PendingPush) -> None:
        c, wire_dt = p.chunk, p.wire_dt
        if p.saved is not None:  # the input was overwritten by part of its result: send the copy
            arr, c = p.saved, chunker.Chunk(c.reducer, c.index, 0, c.count)
        else:
            arr = p.arr
        nbytes = c.count * wire_dt.itemsize if p.sends_payload else 0
        header = wire.push_header(wire.Push(p.op.key, stream.incarnation, p.arr.size, p.chunk.start, c.count, c.index,
                                            p.wire_code, p.op_code, p.root), nbytes)
        payload: Any
        if not p.sends_payload:
            payload = None
        elif wire_dt == arr.dtype:
            payload = arr.view(np.uint8)[c.start * arr.itemsize : c.stop * arr.itemsize].data
        else:
            payload = _Converter(arr, c.start, c.stop, wire_dt, stream)
        timed_done = None
        if self.timeline is not None:
            payload, timed_done = self._timed_push(payload, p.op, c, stream)

        def written(ok: bool) -> None:
            with self.lock:
                stream.queued -= 1
            if timed_done is not None:
                timed_done(ok)
            if ok:
                self.dispatch()

        views: Any
        if payload is None:
            views = [memoryview(header)]
        elif callable(payload):
            views = _Frame(header, payload)
        else:
            views = [memoryview(header), payload]
        # The calling thread writes what the socket takes at once (a small operation then leaves
        # without waking the loop); the loop writes the rest as the socket drains.
        self.io.send_frame(stream, views, written)
        self.bytes_pushed += nbytes

    def _timed_push(self, payload: Any, op: Op, c: chunker.Chunk, stream: Stream) -> tuple[Any, Callable[[bool], None]]:
        timeline = self.timeline
        assert timeline is not None
        box: list[float] = []

        def produce() -> Any:
            box.append(timeline.now())
            return payload() if callable(payload) else payload

        def done(ok: bool) -> None:
            end = timeline.now()
            self.pushed_at[(op.key, c.reducer, c.index)] = end
            if box:
                timeline.span(f"push {label(op.label)}", f"reducer {c.reducer} stream {stream.index}", box[0], end,
                              chunk=c.index, elements=c.count, ok=ok)

        return (produce if payload is not None else None), done


class _Frame:
    """A push whose payload is produced when the frame is about to be written (on the writing
    thread: a conversion to the wire dtype then overlaps with sending the previous chunk)."""

    __slots__ = ("header", "produce")

    def __init__(self, header: bytes, produce: Any) -> None:
        self.header, self.produce = header, produce

    def __call__(self) -> list[memoryview]:
        return [memoryview(self.header), memoryview(self.produce()).cast("B")]


class _Converter:
    """Converts one chunk to its wire dtype on the writing thread, into that stream's scratch."""

    __slots__ = ("arr", "start", "stop", "dtype", "stream")

    def __init__(self, arr: np.ndarray, start: int, stop: int, dtype: np.dtype, stream: Stream) -> None:
        self.arr, self.start, self.stop, self.dtype, self.stream = arr, start, stop, dtype, stream

    def __call__(self) -> memoryview:
        count = self.stop - self.start
        buf = self.stream.take_scratch(count * self.dtype.itemsize, push=True).view(self.dtype)
        np.copyto(buf, self.arr[self.start : self.stop], casting="unsafe")
        return buf.view(np.uint8).data
