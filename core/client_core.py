"""The worker client's decisions as one sans-IO state machine: ``ClientCore``.

In the image of :class:`~reducer.ReducerCore`: it holds every operation in flight, where each
chunk goes (push windows), where each result frame lands, the ACK/SAFE bookkeeping of kept
results, reconnect and resend decisions and the operations' deadlines, and it touches no
socket, thread, lock or clock (time is passed in). The engine (:mod:`client_engine`) feeds it
events and executes the actions it returns; ``tests/unit/test_client_core.py`` drives it
without a network.

Events (methods) and the actions they return:

- ``submit(op, pushes)``: an operation is registered; :class:`SendFrame` for each chunk that
  fits its stream's push window.
- ``written(channel, kind, ok)``: a frame the core asked for left (or could not); more
  :class:`SendFrame` as the window frees up.
- ``frame_header(channel, header, now)``: a RESULT header is in; where its payload lands
  (a :class:`Landing`, or ``SKIP``), and :class:`Fail` for a frame that does not fit.
- ``payload_landed(channel)``: the payload is in; :class:`Complete` with the last chunk.
- ``results_landed(channel, landed, frames, nbytes, safe)``: what the native plane's result
  receiver landed (``native/receiver.c``): whole chunks, frame counts and the last SAFE;
  :class:`Complete` with the last chunk.
- ``error_frame(channel, frame, now)``, ``safe(channel, frames)``: ERROR and SAFE frames.
- ``connection_lost(channel, kind, detail, direction, now)``: :class:`Reconnect` (within the
  reconnect window) or :class:`Fail` for every operation and :class:`Broken`.
- ``connected(reducer, channels)``: the first connections, before any operation.
- ``reconnected(reducer, channels)``: :class:`Retire` the old streams, SETTLED pushes of
  kept results to a restarted reducer, and the unanswered chunks again.
- ``tick(now, channels, expire)``: :class:`Fail` for operations past their deadline, ACKs due.
- ``acknowledge(channel)``, ``window_closed(reducer, now)``, ``fail_all(error)``, ``close(error)``.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import chunker, wire
from . import constants as C
from .buffer_pool import OutputPool
from .client_channel import SKIP, Channel, ConvertedFrame, Landing
from .client_ops import Contributors, Copy, Op, PendingPush, label
from .config import Config
from .errors import (
    AuthenticationError,
    ClientClosedError,
    ContributionMismatchError,
    JobMismatchError,
    LocalProtocolError,
    PeerError,
    PeerLostError,
    PeerTimeoutError,
    RedsrvError,
    ReducerShutdownError,
    RemoteProtocolError,
    StaleContributionError,
)

__all__ = ["ClientCore", "Channel", "Landing", "SendFrame", "Complete", "Fail", "Reconnect", "Retire", "Broken",
           "TracePull", "Action", "SKIP", "EVENTS", "QUERIES"]

log = logging.getLogger("redsrv.client")

# --- actions ---

@dataclass(slots=True)  # not frozen: one per chunk, and a frozen dataclass costs more to make
class SendFrame:
    """Write a frame on ``channel``'s connection, then report it with ``written(channel, kind, ok)``.
    ``views``: memoryviews, or a callable that makes them on the writing thread (a push converted
    to its wire dtype); ``ahead``: overtake the frames queued (an ACK); ``push``: the chunk, for
    the timeline."""

    channel: Channel
    views: Any
    kind: str  # "push", "ack" or "settled"
    ahead: bool = False
    push: PendingPush | None = None


@dataclass(frozen=True, slots=True)
class Complete:
    """Settle ``op``'s future with ``result`` (outside the engine's lock)."""

    op: Op
    result: np.ndarray
    contributors: Contributors


@dataclass(frozen=True, slots=True)
class Fail:
    """Settle ``op``'s future with ``error`` (outside the engine's lock)."""

    op: Op
    error: BaseException


@dataclass(frozen=True, slots=True)
class Reconnect:
    """Close ``reducer``'s connections and reconnect to it (the window is the core's)."""

    reducer: int
    why: str


@dataclass(frozen=True, slots=True)
class Retire:
    """These connections were replaced by a reconnect: stop serving and close them."""

    channels: tuple[Channel, ...]


@dataclass(frozen=True, slots=True)
class Broken:
    """The client is broken by ``error`` (every operation already failed): close every connection."""

    error: BaseException


@dataclass(frozen=True, slots=True)
class TracePull:
    """A chunk's whole result is in (only with a timeline): record its spans."""

    op: Op
    channel: Channel
    chunk: int
    arrived: float
    contributors: int


Action = SendFrame | Complete | Fail | Reconnect | Retire | Broken | TracePull

#: ClientCore's public methods: the events the engine feeds it (each returns actions), in the
#: order docs/architecture.md lists them, and the queries that change nothing
#: (tests/unit/test_architecture_docs.py holds the document to both).
EVENTS = ("connected", "submit", "written", "frame_header", "payload_landed", "results_landed", "error_frame", "safe",
          "connection_lost", "reconnected", "window_closed", "tick", "acknowledge", "fail_all", "close")
QUERIES = ("reconnecting_to",)


class ClientCore:
    """Every decision of one worker client (module docstring). Not thread-safe: the engine
    calls it under one lock."""

    def __init__(self, config: Config, incarnations: Sequence[int], *, tracing: bool = False) -> None:
        self.config = config
        self.tracing = tracing
        self.window = config.push_window_chunks
        # Keep each result until every rank has it, for a reducer that restarts before they do.
        self.keep_copies = config.reconnect_window > 0 and config.mode is wire.StragglerMode.ALL
        # The copies kept for recovery and the inputs saved before an in-place result: reused memory.
        self.chunk_buffers = OutputPool(keep_per_size=C.COPY_POOL_KEEP_PER_SIZE)
        self.ops: dict[int, Op] = {}
        self.pending: collections.deque[PendingPush] = collections.deque()  # chunks not yet handed to a stream
        self.channels: list[list[Channel]] = [[] for _ in incarnations]
        self.incarnations = list(incarnations)
        self.recovering: dict[int, float] = {}  # reducer -> when its reconnect window closes
        self.closed = False
        self.broken: BaseException | None = None
        self.completed = 0  # operations that finished with a result
        self.failed: dict[str, int] = {}  # operations failed, by error type, for metrics
        self.bytes_pushed = 0
        self.bytes_pulled = 0

    # --- submitting and sending ---

    def submit(self, op: Op, pushes: Iterable[PendingPush]) -> list[Action]:
        """Register ``op`` and queue its chunks in sending order."""
        if self.closed:
            raise ClientClosedError(f"client for job {self.config.job!r} rank {self.config.rank} is closed")
        if op.key in self.ops:
            raise LocalProtocolError(f"operation key {op.label!r} is already in flight on this client")
        self.ops[op.key] = op
        pushes = list(pushes)
        op.pushes = {(p.chunk.reducer, p.chunk.index): p for p in pushes}
        self.pending.extend(pushes)
        return self._dispatch()

    def written(self, channel: Channel, kind: str, ok: bool) -> list[Action]:
        """A frame asked for with :class:`SendFrame` is out (``ok``) or was dropped."""
        if kind == "push":
            channel.queued -= 1
            if ok:
                return self._dispatch()
        elif kind == "ack":
            channel.ack_queued = False
        return []

    def _dispatch(self) -> list[Action]:
        """Hand queued chunks, in order, to streams with room in their push window."""
        actions: list[Action] = []
        window, pending, ops = self.window, self.pending, self.ops
        while pending:
            push = pending[0]
            if ops.get(push.op.key) is not push.op:  # failed or timed out meanwhile: its chunks stay home
                pending.popleft()
                continue
            reducer = push.chunk.reducer
            if reducer in self.recovering:
                break  # in order: everything waits until that reducer is back
            channel = min(self.channels[reducer], key=lambda c: c.queued)
            if window and channel.queued >= window:
                break  # in order: a chunk for another reducer must not overtake this one
            pending.popleft()
            channel.queued += 1
            actions.append(self._push_frame(channel, push))
        return actions

    def _push_frame(self, channel: Channel, p: PendingPush) -> SendFrame:
        c, wire_dt = p.chunk, p.wire_dt
        if p.saved is not None:  # the input was overwritten by part of its result: send the copy
            arr, c = p.saved, chunker.Chunk(c.reducer, c.index, 0, c.count)
        else:
            arr = p.arr
        nbytes = c.count * wire_dt.itemsize if p.sends_payload else 0
        header = wire.push_header(wire.Push(p.op.key, channel.incarnation, p.arr.size, p.chunk.start, c.count, c.index,
                                            p.wire_code, p.op_code, p.root), nbytes)
        views: Any
        if not p.sends_payload:
            views = [memoryview(header)]
        elif wire_dt == arr.dtype:
            views = [memoryview(header), arr.view(np.uint8)[c.start * arr.itemsize : c.stop * arr.itemsize].data]
        else:
            views = ConvertedFrame(header, arr, c.start, c.stop, wire_dt, channel)
        self.bytes_pushed += nbytes
        if channel.slots is not None:
            self._register_slot(channel, p)
        return SendFrame(channel, views, "push", push=p)

    def _register_slot(self, channel: Channel, p: PendingPush) -> None:
        """Before the chunk's push leaves: where its result lands, for the native receiver (not
        for traced operations, nor for a chunk some piece of which came already). What
        :meth:`frame_header` and :class:`Landing` do per piece happens here or once the chunk is
        whole (:meth:`_finish_slot`): the input of an in-place operation is kept now (what
        ``Landing.save_input`` keeps at the first piece); a result that is widened, or a mean's
        sum kept for recovery, lands as it came in a buffer of the chunk's own (the copy kept for
        recovery, where one is kept), to be widened or divided into ``out``."""
        op = p.op
        place = (p.chunk.reducer, p.chunk.index)
        chunk = op.chunks.get(place)
        if chunk is None or not chunk.count or self.tracing or place in op.received:
            return
        self._drop_slot(op, place)  # a resend on a new connection: the old one's slot is void
        if op.in_place and self.config.reconnect_window > 0 and p.saved is None:
            p.saved = self.chunk_buffers.copy(p.arr[chunk.start : chunk.stop])
        as_came = None
        if op.wire_dtype != op.out.dtype or (op.mean and self.keep_copies):
            as_came = self.chunk_buffers.empty(chunk.count, op.wire_dtype)
        dest = as_came if as_came is not None else op.out[chunk.start : chunk.stop]
        assert channel.slots is not None
        # A mean divides a chunk by one count: pieces with another count go to the reference.
        slot = channel.kernels.result_slot(dest.view(np.uint8), chunk.start, chunk.count, op.wire_dtype.itemsize,
                                           p.wire_code, (op, chunk, as_came), one_count=op.mean)
        channel.slots[(op.key, chunk.index)] = slot
        op.slots[place] = (channel, slot)

    @staticmethod
    def _finish_slot(channel: Channel, op: Op, chunk: chunker.Chunk, as_came: np.ndarray | None, slot: Any,
                     done: int) -> None:
        """``Landing.finish_bytes`` for the ``done`` elements the receiver landed (a mean's all
        with one count, ``one_count``): widen them into ``out``, and take the mean."""
        if not done or (as_came is None and not op.mean):
            return
        contributors = slot.min_contributors
        target = op.out[chunk.start : chunk.start + done]
        if as_came is None:  # landed in ``out``: a mean divides it there
            if contributors > 1:
                channel.kernels.divide(target, target, contributors)
        elif op.wire_dtype != op.out.dtype:
            channel.kernels.cast(target, as_came[:done])
            if op.mean and contributors > 1:
                channel.kernels.divide(target, target, contributors)
        elif contributors > 1:  # a mean's sum, kept as it came
            channel.kernels.divide(target, as_came[:done], contributors)
        else:
            np.copyto(target, as_came[:done])

    def _drop_slot(self, op: Op, place: tuple[int, int], now: float | None = None) -> None:
        """No more pieces land in ``place``'s slot. With ``now``, the reference takes the chunk over
        where the slot left it (its next piece comes through :meth:`frame_header`)."""
        taken = op.slots.pop(place, None)
        if taken is None:
            return
        channel, slot = taken
        slot.cancel()
        if channel.slots is not None:
            channel.slots.pop((op.key, place[1]), None)
        if now is None or not slot.pieces:
            return
        _, chunk, as_came = slot.tag
        self._fold(op, slot)
        self._finish_slot(channel, op, chunk, as_came, slot, slot.done)
        op.received[place] = (slot.done, now)
        if as_came is not None and self.keep_copies:  # the next pieces' copy goes on after these
            channel.partial_copies[(op.key, chunk.index)] = Copy(op.key, op.out.size, chunk.start, chunk.index,
                                                                 slot.dtype, as_came)

    def _drop_slots(self, op: Op) -> None:
        for place in list(op.slots):
            self._drop_slot(op, place)

    @staticmethod
    def _fold(op: Op, slot: Any) -> None:
        """The landed pieces' contributors, as :meth:`payload_landed` folds each piece's."""
        op.min_count = min(op.min_count, slot.min_contributors)
        op.max_count = max(op.max_count, slot.max_contributors)
        op.all_ranks &= int.from_bytes(slot.bitmap, "little")

    # --- receiving ---

    def frame_header(self, channel: Channel, header: wire.FrameHeader, now: float) -> tuple[Landing | str, list[Action]]:
        """A RESULT header is in: where its bitmap and data go (a :class:`Landing`), or ``SKIP``."""
        key, offset, count, chunk_index, raw_dtype, contributors, bitmap_len = header.fields
        op = self.ops.get(key)
        place = (channel.reducer, chunk_index)
        chunk = op.chunks.get(place) if op is not None else None
        if op is not None and op.slots:
            self._drop_slot(op, place, now)  # a piece the native receiver did not take
        if op is None or chunk is None or channel.gone:
            channel.frames_received += 1
            return SKIP, []  # an operation that already failed or timed out
        # A chunk's result comes whole or in pieces that tile it in order.
        done, first_arrived = op.received.get(place, (0, now))
        if (offset != chunk.start + done or not (0 < count <= chunk.count - done or count == chunk.count == 0)
                or wire.NUMPY_DTYPE_BY_CODE.get(raw_dtype) != op.wire_dtype):
            channel.frames_received += 1
            return SKIP, self._fail(op, RemoteProtocolError(
                f"reducer {channel.peer} answered with {count} elements at offset {offset}, expected at most "
                f"{chunk.count - done} at {chunk.start + done}", peer=channel.peer, job=self.config.job,
                rank=self.config.rank, key=label(op.label), chunk=chunk_index))
        landing = Landing(op, chunk, offset, offset + count, contributors, bitmap_len, header.payload_len - bitmap_len,
                          first_arrived)
        if not done and op.in_place and self.config.reconnect_window > 0:
            landing.save = op.pushes.get(place)
        what = f"result (key {op.label!r} chunk {chunk.index})"
        if self.keep_copies:
            landing.kept = self._kept(channel, landing)
        if op.wire_dtype != op.out.dtype:
            landing.data = channel.take_scratch(landing.data_len).data, what
        elif op.mean and self.keep_copies:
            # The copy kept for recovery is the sum as it came: receive it there, and taking the
            # mean into ``out`` is the only other pass over the bytes.
            assert landing.kept is not None
            landing.into_copy = True
            piece = landing.kept.data[landing.start - chunk.start : landing.stop - chunk.start]
            landing.data = piece.view(np.uint8).data, what
        else:
            landing.data = op.out[landing.start : landing.stop].view(np.uint8).data, what
        channel.result = landing
        if landing.in_bitmap and len(channel.bitmap) < bitmap_len:
            channel.bitmap = bytearray(bitmap_len)
        return landing, []

    def _kept(self, channel: Channel, landing: Landing) -> Copy:
        """The copy kept of this piece's chunk for recovery, made at its first piece: lent from
        ``out`` where the result lands there as it came (see :class:`Copy`), else a buffer."""
        op, chunk = landing.op, landing.chunk
        place = (op.key, chunk.index)
        kept = channel.partial_copies.get(place)
        if kept is None:
            as_landed = op.wire_dtype == op.out.dtype and not op.mean
            kept = Copy(op.key, op.out.size, chunk.start, chunk.index, wire.dtype_code(op.wire_dtype),
                        op.out[chunk.start : chunk.stop] if as_landed else self.chunk_buffers.empty(chunk.count, op.wire_dtype))
            if as_landed and not op.lend(kept):
                kept.data = self.chunk_buffers.empty(chunk.count, op.wire_dtype)  # ``out`` is the caller's again (the op failed)
            channel.partial_copies[place] = kept
        return kept

    def payload_landed(self, channel: Channel) -> tuple[int, list[Action]]:
        """The payload of the frame being received is in (its bytes finished by the engine):
        complete the chunk, and the operation with its last chunk. Returns the bytes of the
        chunk still to come (its next pieces) and the actions."""
        landing = channel.result
        assert landing is not None
        channel.result = None
        channel.frames_received += 1
        op, chunk = landing.op, landing.chunk
        self.bytes_pulled += landing.data_len
        channel.bytes_unacked += landing.data_len
        place = (channel.reducer, chunk.index)
        whole = landing.stop == chunk.stop
        actions: list[Action] = []
        if whole:
            op.received.pop(place, None)
            whole_copy = channel.partial_copies.pop((op.key, chunk.index), None)
            if whole_copy is not None:
                whole_copy.frame = channel.frames_received
                channel.copies[(op.key, chunk.index)] = whole_copy
            if self.tracing:
                actions.append(TracePull(op, channel, chunk.index, landing.arrived, landing.contributors))
        else:  # more pieces of this chunk to come
            op.received[place] = (landing.stop - chunk.start, landing.arrived)
        op.min_count = min(op.min_count, landing.contributors)
        op.max_count = max(op.max_count, landing.contributors)
        op.all_ranks &= int.from_bytes(channel.bitmap[: landing.bitmap_len], "little")
        if not whole:
            return (chunk.stop - landing.stop) * op.wire_dtype.itemsize, actions
        if op.chunks.pop(place, None) is not None:
            op.pushes.pop(place, None)
            if not op.chunks:
                actions += self._complete(op)
        return 0, actions

    def results_landed(self, channel: Channel, landed: list[Any], frames: int, nbytes: int,
                       safe: int | None) -> list[Action]:
        """The native receiver's news since it was last asked: ``frames`` RESULT frames read,
        ``nbytes`` of their data landed, the slots whose last piece is in (in the order they
        completed), and the count of the last SAFE it read. What :meth:`payload_landed` does
        for a chunk's last piece, once per chunk."""
        base = channel.frames_received
        channel.frames_received += frames
        self.bytes_pulled += nbytes
        channel.bytes_unacked += nbytes
        actions: list[Action] = []
        op: Op
        chunk: chunker.Chunk
        as_came: np.ndarray | None
        for slot in landed:
            op, chunk, as_came = slot.tag
            place = (channel.reducer, chunk.index)
            if op.slots.get(place, (None, None))[1] is slot:
                del op.slots[place]
            if channel.slots is not None and channel.slots.get((op.key, chunk.index)) is slot:
                del channel.slots[(op.key, chunk.index)]
            if slot.cancelled or self.ops.get(op.key) is not op:
                continue
            self._fold(op, slot)
            self._finish_slot(channel, op, chunk, as_came, slot, chunk.count)
            if self.keep_copies:
                if as_came is not None:  # widened, or a mean's sum: kept as it came
                    kept = Copy(op.key, op.out.size, chunk.start, chunk.index, slot.dtype, as_came,
                                frame=base + slot.frame)
                else:  # lent from ``out``, where the result is as it came
                    kept = Copy(op.key, op.out.size, chunk.start, chunk.index, slot.dtype,
                                op.out[chunk.start : chunk.stop], frame=base + slot.frame)
                    if not op.lend(kept):
                        kept.data = self.chunk_buffers.copy(kept.data)
                channel.copies[(op.key, chunk.index)] = kept
            if op.chunks.pop(place, None) is not None:
                op.pushes.pop(place, None)
                if not op.chunks:
                    actions += self._complete(op)
        if safe is not None:
            self.safe(channel, safe)
        return actions

    def _complete(self, op: Op) -> list[Action]:
        if self.ops.get(op.key) is not op:
            return []  # failed or timed out meanwhile; the future already holds that error
        del self.ops[op.key]
        self._drop_slots(op)
        self.completed += 1
        op.take_back_lent(self.chunk_buffers.copy)  # the caller may overwrite ``out`` from now on
        contributors = Contributors(op.min_count, op.max_count,
                                    tuple(r for r in range(self.config.world_size) if op.all_ranks >> r & 1))
        return [Complete(op, op.out.reshape(op.shape) if op.given_out is None else op.given_out, contributors)]

    def safe(self, channel: Channel, frames: int) -> None:
        """A SAFE from the reducer: every rank has the results up to ``frames``; drop their copies."""
        for place in [place for place, kept in channel.copies.items() if kept.frame <= frames]:
            channel.copies.pop(place).settled = True

    def error_frame(self, channel: Channel, frame: wire.Error, now: float) -> list[Action]:
        if frame.code is wire.ErrorCode.SHUTDOWN and self.config.reconnect_window > 0:
            # The reducer is stopping (a restart, a rolling update): what it failed is resent to
            # it, or to its successor on the same address, once we are back (R22).
            if frame.fatal:
                return self._lose(channel.reducer, f"reducer {channel.peer} is shutting down: {frame.message}", now)
            return []
        exc = self._error_from_frame(channel, frame, now)
        if frame.fatal:
            return self.fail_all(exc)
        op = self.ops.get(frame.key)
        if op is not None:
            return self._fail(op, exc)
        # Usually the other chunks of an operation that already failed: one error is enough.
        log.debug("reducer %s reported an error for no pending operation: %s", channel.peer, frame.message)
        return []

    def _error_from_frame(self, channel: Channel, frame: wire.Error, now: float) -> RedsrvError:
        op = self.ops.get(frame.key)
        ctx: dict[str, Any] = dict(peer=channel.peer, job=self.config.job, rank=self.config.rank,
                                   key=None if op is None else label(op.label),
                                   chunk=None if frame.chunk == 0xFFFFFFFF else frame.chunk)
        elapsed = None if op is None else now - op.started
        code = frame.code
        text = f"reducer {channel.peer}: {frame.message}"
        if code is wire.ErrorCode.TIMEOUT:
            return PeerTimeoutError(text, phase="wait for contributions", elapsed=elapsed, timeout=self.config.op_timeout, **ctx)
        if code is wire.ErrorCode.PEER_LOST:
            also = self.reconnecting_to(now)
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
            return AuthenticationError(f"authentication with reducer {channel.peer} failed", **ctx)
        if code is wire.ErrorCode.PROTOCOL:
            return RemoteProtocolError(f"{text} (the reducer rejected our frame: version mismatch?)", **ctx)
        return PeerError(text, elapsed=elapsed, **ctx)

    def reconnecting_to(self, now: float) -> str:
        """The reducers this client is reconnecting to and the window each has left, for errors
        whose cause may be that loss (another rank that lost it too gave up first); '' if none."""
        return "; ".join(f"this rank lost reducer {self.config.reducers[r]} too and was reconnecting "
                         f"({max(0.0, deadline - now):.1f}s of its reconnect window left)"
                         for r, deadline in sorted(self.recovering.items()))

    # --- deadlines and acknowledgements ---

    def tick(self, now: float, channels: Iterable[Channel], expire: bool) -> list[Action]:
        """Every 0.1 s per engine loop: operations past their deadline fail (``expire``: one loop
        does it, they span the reducers); ACKs due on ``channels``; pieces of results whose
        operation failed are dropped."""
        actions = self._expire(now) if expire else []
        if expire:
            self.chunk_buffers.release_idle(now)
        for channel in channels:
            if channel.partial_copies:
                for place in [place for place in channel.partial_copies if place[0] not in self.ops]:
                    del channel.partial_copies[place]
            ack = self.acknowledge(channel)
            if ack is not None:
                actions.append(ack)
        return actions

    def _expire(self, now: float) -> list[Action]:
        """Fail every operation past its deadline, naming the reducers it still waits for."""
        actions: list[Action] = []
        for op in [op for op in self.ops.values() if now > op.deadline]:
            missing = sorted(op.chunks)
            reducers = sorted({r for r, _ in missing})
            where = ", ".join(f"{self.config.reducers[r]} ({sum(1 for x, _ in missing if x == r)} chunk(s))" for r in reducers)
            actions += self._fail(op, PeerTimeoutError(
                f"all-reduce did not complete: still waiting for {where}",
                peer=self.config.reducers[reducers[0]] if reducers else None, job=self.config.job, rank=self.config.rank,
                key=label(op.label), chunk=missing[0][1] if missing else None, phase="wait for result",
                elapsed=now - op.started, timeout=op.deadline - op.started))
        return actions

    def acknowledge(self, channel: Channel) -> SendFrame | None:
        """An ACK of the results that arrived since the last one, if any did. The reducer keeps
        each result until every rank has it (R22), and says so with a SAFE."""
        if (channel.frames_received == channel.frames_acked or self.config.reconnect_window <= 0 or channel.gone
                or channel.ack_queued):
            return None
        channel.frames_acked = channel.frames_received
        channel.bytes_unacked = 0
        channel.ack_queued = True
        # Ahead of queued pushes: an ACK behind a push window of chunks would come too late to
        # spare the copies it exists for.
        return SendFrame(channel, [memoryview(wire.encode(wire.Ack(channel.frames_acked)))], "ack", ahead=True)

    # --- failures and recovery (RELIABILITY R22) ---

    def _fail(self, op: Op, error: BaseException) -> list[Action]:
        if self.ops.get(op.key) is not op:
            return []
        del self.ops[op.key]
        self.failed[type(error).__name__] = self.failed.get(type(error).__name__, 0) + 1
        self._drop_slots(op)
        op.take_back_lent(self.chunk_buffers.copy)
        return [Fail(op, error)]

    def fail_all(self, error: BaseException) -> list[Action]:
        """The client is broken: remember why, and fail everything in flight with it."""
        if self.broken is None:
            self.broken = error
        ops = list(self.ops.values())
        self.ops.clear()
        self.pending.clear()
        if ops:
            self.failed[type(error).__name__] = self.failed.get(type(error).__name__, 0) + len(ops)
        actions: list[Action] = []
        for op in ops:
            self._drop_slots(op)
            op.take_back_lent(self.chunk_buffers.copy)
            actions.append(Fail(op, error))
        actions.append(Broken(error))
        return actions

    def close(self, error: BaseException) -> list[Action] | None:
        """The client closes: fail what is in flight with ``error``; None if it already was closed."""
        if self.closed:
            return None
        self.closed = True
        ops = list(self.ops.values())
        self.ops.clear()
        self.pending.clear()
        actions: list[Action] = []
        for op in ops:
            self._drop_slots(op)
            op.take_back_lent(self.chunk_buffers.copy)
            actions.append(Fail(op, error))
        return actions

    def connection_lost(self, channel: Channel, kind: str, detail: str, direction: str, now: float) -> list[Action]:
        """A connection broke while pushing or pulling (``kind``: reset, eof, timeout, protocol,
        internal): reconnect within the reconnect window, or fail."""
        if self.closed or channel.gone:
            return []
        cfg = self.config
        ctx: dict[str, Any] = dict(peer=channel.peer, job=cfg.job, rank=cfg.rank, phase=direction)
        error: RedsrvError
        if kind == "timeout":
            bound = cfg.heartbeat_timeout if direction == "pull" else cfg.op_timeout
            error = PeerTimeoutError(f"reducer {channel.peer} is unresponsive: {detail}", timeout=bound, **ctx)
        elif kind == "protocol":
            error = RemoteProtocolError(f"reducer {channel.peer} sent an invalid frame: {detail}", **ctx)
        else:
            error = PeerLostError(f"lost reducer {channel.peer}: {detail}", **ctx)
        if cfg.reconnect_window > 0 and kind not in ("protocol", "internal"):  # a bug is not a lost reducer
            return self._lose(channel.reducer, str(error), now)
        return self.fail_all(error)

    def _lose(self, reducer: int, why: str, now: float) -> list[Action]:
        if reducer in self.recovering or self.closed or self.broken is not None:
            return []
        self.recovering[reducer] = now + self.config.reconnect_window
        return [Reconnect(reducer, why)]

    def window_closed(self, reducer: int, now: float) -> list[Action]:
        """``reducer`` could not be reached again within its reconnect window."""
        cfg = self.config
        address = cfg.reducers[reducer]
        return self.fail_all(PeerLostError(f"lost reducer {address} and could not reconnect within the reconnect "
                                           f"window of {cfg.reconnect_window:.1f}s", peer=address, job=cfg.job,
                                           rank=cfg.rank, phase="reconnect", timeout=cfg.reconnect_window))

    def connected(self, reducer: int, channels: list[Channel]) -> None:
        """The first connections to ``reducer`` (before any operation)."""
        self.channels[reducer] = channels
        self.incarnations[reducer] = channels[0].incarnation

    def reconnected(self, reducer: int, channels: list[Channel]) -> list[Action]:
        """New connections to a lost reducer: retire the old ones, give a restarted reducer the
        results some ranks may still lack, and resend, in their original order and ahead of
        newer work, the chunks it has not answered."""
        old = self.channels[reducer]
        self.channels[reducer] = channels
        restarted = channels[0].incarnation != self.incarnations[reducer]
        self.incarnations[reducer] = channels[0].incarnation
        copies = [kept for channel in old for kept in channel.copies.values()]
        for channel in old:
            channel.copies.clear()
            channel.partial_copies.clear()
            channel.result = None
            channel.gone = True
            for slot in list(channel.slots.values()) if channel.slots else ():
                op, chunk, _ = slot.tag
                self._drop_slot(op, (reducer, chunk.index))
        actions: list[Action] = [Retire(tuple(old))]
        if restarted:  # it lost what it had: give it the results some ranks may still lack
            for i, kept in enumerate(copies):
                target = channels[i % len(channels)]
                data = kept.own(self.chunk_buffers.copy)  # the frame may leave after ``out`` went back to the caller
                header = wire.push_header(wire.Push(kept.key, target.incarnation, kept.total, kept.offset, data.size,
                                                    kept.index, kept.dtype, wire.ReduceOp.SETTLED), data.nbytes)
                actions.append(SendFrame(target, [memoryview(header), data.view(np.uint8).data], "settled"))
        queued = {(id(p.op), p.chunk.reducer, p.chunk.index) for p in self.pending}
        resend: list[PendingPush] = []
        for op in self.ops.values():
            for place in [place for place in op.chunks if place[0] == reducer]:
                op.received.pop(place, None)  # its result comes again from the chunk's start
                push = op.pushes.get(place)
                if push is not None and (id(op), *place) not in queued:
                    resend.append(push)
        resend.sort(key=lambda p: (p.op.started, p.chunk.index))
        self.pending.extendleft(reversed(resend))
        del self.recovering[reducer]
        log.warning("rank %d: reconnected to reducer %s (%s); resending %d chunk(s)%s", self.config.rank,
                    self.config.reducers[reducer], "restarted" if restarted else "same incarnation", len(resend),
                    f" and {len(copies)} result(s) it may have lost" if restarted else "")
        return actions + self._dispatch()
