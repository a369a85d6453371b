"""The client's receive side: turns RESULT frames into finished chunks and finished operations,
ERROR frames into typed errors, and expires operations past their deadline. Runs on the I/O
loops (:mod:`client_io`), called by each stream's :class:`~transport.FrameReader` on the loop
that owns the stream; with several loops, one operation's chunks may finish on several at once
(each writes its own slice of the result and its own ``Op.received`` places).

See :mod:`client` for the locking rule.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import chunker, wire
from .client_ops import Contributors, Copy, Op, OpTable, label
from .errors import (
    AuthenticationError,
    ContributionMismatchError,
    JobMismatchError,
    PeerError,
    PeerLostError,
    PeerTimeoutError,
    RedsrvError,
    ReducerShutdownError,
    RemoteProtocolError,
    StaleContributionError,
)
from .timeline import Timeline
from .transport import SKIP, ConnectionBroken, HeaderStep

if TYPE_CHECKING:
    from .client_io import Stream
    from .client_session import Session
    from .config import Config

__all__ = ["Receiver", "Copy", "Incoming"]

log = logging.getLogger("redsrv.client")


@dataclass
class Incoming:
    """A result frame whose header is in and whose payload is being received."""

    op: Op
    chunk: chunker.Chunk
    start: int  # the elements this frame carries: all of the chunk or its next piece
    stop: int
    contributors: int
    bitmap_len: int
    data_len: int
    arrived: float  # when the chunk's first piece arrived
    in_bitmap: bool
    into_copy: bool = False  # the payload lands in the chunk's kept copy, not in ``out``


class Receiver:
    """Where each result lands, and what finishes an operation. ``session`` is set by the client."""

    def __init__(self, config: Config, ops: OpTable, timeline: Timeline | None,
                 pushed_at: dict[tuple[int, int, int], float]) -> None:
        self.config = config
        self.ops = ops
        self.session: Session
        self.timeline = timeline
        self.pushed_at = pushed_at  # (key, reducer, chunk) -> push end, written by the dispatcher
        # Keep each result until every rank has it, for a reducer that restarts before they do.
        self.keep_copies = config.reconnect_window > 0 and config.mode is wire.StragglerMode.ALL
        self.pulled = [0] * config.io_threads  # result bytes by I/O loop: each slot has one writer, no lock

    @property
    def bytes_pulled(self) -> int:
        return sum(self.pulled)

    def on_error(self, stream: Stream, frame: wire.Error) -> None:
        self._on_error_frame(stream, frame)
        if frame.fatal:
            stream.reader.stopped = True  # the reducer closes the connection after a fatal error

    def on_result_header(self, stream: Stream, header: wire.FrameHeader) -> HeaderStep:
        """A result header is in: where its bitmap and data go."""
        arrived = time.monotonic()
        key, offset, count, chunk_index, raw_dtype, contributors, bitmap_len = header.fields
        op = self.ops.get(key)
        chunk = op.chunks.get((stream.reducer, chunk_index)) if op is not None else None
        if op is None or chunk is None:
            stream.frames_received += 1
            return SKIP  # an operation that already failed or timed out
        # A chunk's result comes whole or in pieces that tile it in order.
        done, first_arrived = op.received.get((stream.reducer, chunk_index), (0, arrived))
        if (offset != chunk.start + done or not (0 < count <= chunk.count - done or count == chunk.count == 0)
                or wire.NUMPY_DTYPE_BY_CODE[raw_dtype] != op.wire_dtype):
            self.ops.fail(op, RemoteProtocolError(
                f"reducer {stream.peer} answered with {count} elements at offset {offset}, expected at most "
                f"{chunk.count - done} at {chunk.start + done}", peer=stream.peer, job=self.config.job,
                rank=self.config.rank, key=label(op.label), chunk=chunk_index))
            stream.frames_received += 1
            return SKIP
        if not done and op.in_place and self.config.reconnect_window > 0:
            push = op.pushes.get((stream.reducer, chunk_index))
            if push is not None and push.saved is None:  # keep the input this result overwrites (R22)
                push.saved = push.arr[chunk.start : chunk.stop].copy()
        incoming = stream.result = Incoming(op, chunk, offset, offset + count, contributors, bitmap_len,
                                            header.payload_len - bitmap_len, first_arrived, in_bitmap=bitmap_len > 0)
        if incoming.in_bitmap:
            if len(stream.bitmap) < bitmap_len:
                stream.bitmap = bytearray(bitmap_len)
            return memoryview(stream.bitmap)[:bitmap_len], "a result bitmap"
        return self._result_target(stream, incoming)

    def _result_target(self, stream: Stream, incoming: Incoming) -> tuple[memoryview, str]:
        op, chunk = incoming.op, incoming.chunk
        what = f"result (key {op.label!r} chunk {chunk.index})"
        if op.wire_dtype != op.out.dtype:
            return stream.take_scratch(incoming.data_len).data, what
        if op.mean and self.keep_copies:
            # The copy kept for recovery is the sum as it came: receive it there, and taking the
            # mean into ``out`` is the only other pass over the bytes.
            incoming.into_copy = True
            kept = self._kept(stream, incoming)
            return kept.data[incoming.start - chunk.start : incoming.stop - chunk.start].view(np.uint8).data, what
        return op.out[incoming.start : incoming.stop].view(np.uint8).data, what

    def on_payload(self, stream: Stream) -> tuple[memoryview, str] | None:
        incoming = stream.result
        assert incoming is not None
        if incoming.in_bitmap:
            incoming.in_bitmap = False
            return self._result_target(stream, incoming)
        stream.result = None
        stream.frames_received += 1
        self.finish_result(stream, incoming)
        if incoming.stop < incoming.chunk.stop:  # more pieces of this chunk: one wake-up for all of them
            stream.reader.expect_at_least((incoming.chunk.stop - incoming.stop) * incoming.op.wire_dtype.itemsize)
        return None

    def finish_result(self, stream: Stream, incoming: Incoming) -> None:
        """A result frame is in: widen it, take the mean, and complete the chunk (and the
        operation, with its last chunk)."""
        op, chunk, contributors, chunk_index = incoming.op, incoming.chunk, incoming.contributors, incoming.chunk.index
        target = op.out[incoming.start : incoming.stop]
        if incoming.into_copy:
            kept = stream.partial_copies[(op.key, chunk_index)]
            as_came = kept.data[incoming.start - chunk.start : incoming.stop - chunk.start]
            if contributors > 1:
                np.divide(as_came, contributors, out=target, casting="unsafe")
            else:
                np.copyto(target, as_came)
        else:
            if op.wire_dtype != op.out.dtype:
                np.copyto(target, stream.take_scratch(incoming.data_len).view(op.wire_dtype), casting="unsafe")
            if self.keep_copies:
                self._copy_piece(stream, incoming, target)
            if op.mean and contributors > 1:
                np.divide(target, contributors, out=target, casting="unsafe")
        self.pulled[stream.loop] += incoming.data_len
        stream.bytes_unacked += incoming.data_len
        place = (stream.reducer, chunk_index)
        whole = incoming.stop == chunk.stop
        if whole:
            op.received.pop(place, None)
            whole_copy = stream.partial_copies.pop((op.key, chunk_index), None)
            if whole_copy is not None:
                whole_copy.frame = stream.frames_received
                stream.copies[(op.key, chunk_index)] = whole_copy
        else:  # more pieces of this chunk to come
            op.received[place] = (incoming.stop - chunk.start, incoming.arrived)
        if whole and self.timeline is not None:
            track = f"reducer {stream.reducer} stream {stream.index}"
            pushed = self.pushed_at.pop((op.key, stream.reducer, chunk_index), None)
            if pushed is not None and pushed < incoming.arrived:
                self.timeline.span(f"wait {label(op.label)}", track, pushed, incoming.arrived, chunk=chunk_index)
            self.timeline.span(f"pull {label(op.label)}", track, incoming.arrived, time.monotonic(), chunk=chunk_index,
                               contributors=contributors)
        ranks = int.from_bytes(stream.bitmap[: incoming.bitmap_len], "little")
        with op.lock:
            op.min_count = min(op.min_count, contributors)
            op.max_count = max(op.max_count, contributors)
            op.all_ranks &= ranks
            if not whole or op.chunks.pop(place, None) is None:
                return
            op.pushes.pop(place, None)
            done = not op.chunks
        if done:
            self._complete(op)

    def _complete(self, op: Op) -> None:
        if not self.ops.remove(op):
            return  # failed or timed out meanwhile; the future already holds that error
        if self.timeline is not None:
            self.timeline.span(f"allreduce {label(op.label)}", "operations", op.started, time.monotonic(),
                               bytes=op.out.nbytes, contributors=op.min_count)
        op.future.contributors = Contributors(
            op.min_count, op.max_count, tuple(r for r in range(self.config.world_size) if op.all_ranks >> r & 1))
        # Wakes the waiters here; the future's done-callbacks run on the completion thread (ReduceFuture).
        op.take_back_lent()  # the caller may overwrite ``out`` from now on
        if op.future.set_running_or_notify_cancel():
            op.future.set_result(op.out.reshape(op.shape) if op.given_out is None else op.given_out)

    def _kept(self, stream: Stream, incoming: Incoming) -> Copy:
        """The copy kept of this piece's chunk for recovery, made at its first piece: lent from
        ``out`` where the result lands there as it came (see :class:`Copy`), else a buffer."""
        op, chunk = incoming.op, incoming.chunk
        place = (op.key, chunk.index)
        kept = stream.partial_copies.get(place)
        if kept is None:
            as_landed = op.wire_dtype == op.out.dtype and not op.mean
            kept = Copy(op.key, op.out.size, chunk.start, chunk.index, wire.dtype_code(op.wire_dtype),
                        op.out[chunk.start : chunk.stop] if as_landed else np.empty(chunk.count, op.wire_dtype))
            if as_landed and not op.lend(kept):
                kept.data = np.empty(chunk.count, op.wire_dtype)  # ``out`` is the caller's again (the op failed)
            stream.partial_copies[place] = kept
        return kept

    def _copy_piece(self, stream: Stream, incoming: Incoming, target: np.ndarray) -> None:
        """Keep this piece of a result as it came off the wire (before a mean is taken)."""
        kept = self._kept(stream, incoming)
        if kept.lender is not None:
            return  # the piece is in ``out``, which ``kept.data`` views
        chunk, wire_dtype = incoming.chunk, incoming.op.wire_dtype
        piece = kept.data[incoming.start - chunk.start : incoming.stop - chunk.start]
        if wire_dtype != incoming.op.out.dtype:
            np.copyto(piece, stream.take_scratch(incoming.data_len).view(wire_dtype))
        else:
            np.copyto(piece, target)

    def on_count(self, stream: Stream, frame_type: wire.FrameType, frames: int) -> None:
        """A SAFE from the reducer: every rank has the results up to ``frames``; drop their copies."""
        if frame_type is not wire.FrameType.SAFE:
            raise ConnectionBroken("protocol", f"unexpected {frame_type.name} frame from a reducer")
        for place in [place for place, kept in stream.copies.items() if kept.frame <= frames]:
            stream.copies.pop(place).settled = True

    def _on_error_frame(self, stream: Stream, frame: wire.Error) -> None:
        if frame.code is wire.ErrorCode.SHUTDOWN and self.config.reconnect_window > 0:
            # The reducer is stopping (a restart, a rolling update): what it failed is resent to
            # it, or to its successor on the same address, once we are back (R22).
            if frame.fatal:
                self.session.lose_reducer(stream.reducer, f"reducer {stream.peer} is shutting down: {frame.message}")
            return
        exc = self._error_from_frame(stream, frame)
        if frame.fatal:
            self.session.fail(exc)
            return
        op = self.ops.get(frame.key)
        if op is not None:
            self.ops.fail(op, exc)
        else:
            # Usually the other chunks of an operation that already failed: one error is enough.
            log.debug("reducer %s reported an error for no pending operation: %s", stream.peer, frame.message)

    def _error_from_frame(self, stream: Stream, frame: wire.Error) -> RedsrvError:
        op = self.ops.get(frame.key)
        ctx: dict[str, Any] = dict(peer=stream.peer, job=self.config.job, rank=self.config.rank,
                                   key=None if op is None else label(op.label),
                                   chunk=None if frame.chunk == 0xFFFFFFFF else frame.chunk)
        elapsed = None if op is None else time.monotonic() - op.started
        code = frame.code
        text = f"reducer {stream.peer}: {frame.message}"
        if code is wire.ErrorCode.TIMEOUT:
            return PeerTimeoutError(text, phase="wait for contributions", elapsed=elapsed, timeout=self.config.op_timeout, **ctx)
        if code is wire.ErrorCode.PEER_LOST:
            also = self.session.reconnecting_to()
            return PeerLostError(f"{text}; {also}" if also else text, phase="wait for contributions", elapsed=elapsed, **ctx)
        if code is wire.ErrorCode.SHUTDOWN:
            return ReducerShutdownError(text, elapsed=elapsed, **ctx)
        if code in (wire.ErrorCode.CONTRIBUTION_MISMATCH, wire.ErrorCode.DUPLICATE):
            return ContributionMismatchError(text, **ctx)
        if code is wire.ErrorCode.STALE:
            return StaleContributionError(text, **ctx)
        if code is wire.ErrorCode.JOB_MISMATCH:
            return JobMismatchError(text, **ctx)
        if code is wire.ErrorCode.AUTHENTICATION:
            return AuthenticationError(f"authentication with reducer {stream.peer} failed", **ctx)
        if code is wire.ErrorCode.PROTOCOL:
            return RemoteProtocolError(f"{text} (the reducer rejected our frame: version mismatch?)", **ctx)
        return PeerError(text, elapsed=elapsed, **ctx)

    def expire(self, now: float) -> None:
        """Fail every operation past its deadline, naming the reducers it still waits for."""
        expired = [op for op in self.ops.snapshot() if now > op.deadline]
        for op in expired:
            with op.lock:
                missing = sorted(op.chunks)
            reducers = sorted({r for r, _ in missing})
            where = ", ".join(f"{self.config.reducers[r]} ({sum(1 for x, _ in missing if x == r)} chunk(s))" for r in reducers)
            self.ops.fail(op, PeerTimeoutError(
                f"all-reduce did not complete: still waiting for {where}",
                peer=self.config.reducers[reducers[0]] if reducers else None, job=self.config.job, rank=self.config.rank,
                key=label(op.label), chunk=missing[0][1] if missing else None, phase="wait for result",
                elapsed=now - op.started, timeout=op.deadline - op.started))
