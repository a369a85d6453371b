"""How a chunk ends, for the reducer's state machine: its result combined and sent (whole, or
piece by piece in cut-through), kept for ranks that come late or reconnect until they acknowledge
it, or its failure sent and remembered; a settled result handed to a restarted reducer; the ACKs
that let kept results go and the SAFE frames that follow.

:class:`_ResultRules` is a base class of ``ReducerCore`` (``reducer.py``), kept apart so that
these rules read in one place. Every transition out of the OPEN state (``reducer_chunks``) is
taken here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import constants as C
from .combine import ACCUMULATION_DTYPES
from .reducer_actions import Action, Log, SendError, SendResult, SendSafe
from .reducer_buffers import _SharedBuffer
from .reducer_chunks import _Closed, _CutThroughChunk, _OpenChunk
from .reducer_jobs import PushTicket, _AckGroup, _Conn, _Delivery, _Job
from .reducer_memory import _MemoryRules
from .wire import Error, ErrorCode, Result, StragglerMode, bitmap_from_ranks, numpy_dtype, result_header, result_header_of

__all__ = ["ResultSink"]

#: What a native forwarder writes one connection's RESULT frames through: the connection's frame
#: writer, a callback for when a frame waits in it (the socket is full: the owner watches it) and
#: one for a write that failed (the owner ends the connection). The daemon's, never the core's.
ResultSink = tuple[Any, Callable[[], None], Callable[[Exception], None]]


class _ResultRules(_MemoryRules):
    """Results and failures, and the records kept of them, for ``ReducerCore``."""

    piece_bytes: int  # 0: forward whole chunks only
    result_sinks: Callable[[int], ResultSink | None] | None
    engaged_chunks: int

    def ack(self, conn: int, frames: int) -> list[Action]:
        """The worker on ``conn`` has the first ``frames`` RESULT frames sent on it: the whole
        results among them need not be kept any longer. Returns a SAFE for every connection of
        the job whose results every rank now has."""
        info = self._conns.get(conn)
        if info is None:
            return []
        unacked = info.unacked
        while unacked and unacked[0].last_frame <= frames:
            unacked.popleft().done()
        job = self._jobs.get(info.job)
        if job is None:
            return []
        actions: list[Action] = []
        for member in job.members.values():
            for other in member.conns:
                other_info = self._conns.get(other)
                if other_info is None:
                    continue
                pending = other_info.safe_pending
                safe = other_info.safe_frames
                while pending and pending[0].group.outstanding <= 0:
                    safe = pending.popleft().last_frame
                if safe > other_info.safe_frames:
                    other_info.safe_frames = safe
                    actions.append(SendSafe(other, safe))
        return actions

    @staticmethod
    def _release_unacked(info: _Conn) -> None:
        while info.unacked:
            info.unacked.popleft().done()

    def _settle(self, job: _Job | None, ticket: PushTicket, now: float) -> list[Action]:
        """A worker pushes a chunk's result it already has to a reducer that restarted before
        every rank had it (ReduceOp.SETTLED, R22): the chunk closes with that result, the ranks
        waiting in it are answered, and the ranks that push later are answered from it. Results
        are bitwise the same on every rank, so any rank's copy is the result."""
        push, buffer = ticket.push, ticket.buffer
        chunk_key = (push.key, push.chunk)
        if job is None or buffer is None or chunk_key in job.closed or ticket.conn not in self._conns:
            self._give(job, buffer)
            return []
        chunk = job.open.get(chunk_key)
        shape = (push.total, push.offset, push.count, push.dtype)
        if chunk is not None and (chunk.shape.total, chunk.shape.offset, chunk.shape.count, chunk.shape.dtype) != shape:
            self._give(job, buffer)
            return self._fail(job, chunk_key, ErrorCode.CONTRIBUTION_MISMATCH,
                              f"rank {ticket.rank}'s settled result does not fit {chunk.shape.describe()}", now)
        world = job.params.world_size
        everyone = bitmap_from_ranks((1 << world) - 1, world)
        item = numpy_dtype(push.dtype).itemsize
        shared = _SharedBuffer(buffer, self.pool, 1, self._freer(job))  # this function's reference
        data = buffer.data
        header = result_header(Result(push.key, push.offset, push.count, push.chunk, push.dtype, world, everyone), len(data))
        closed = _Closed(answered=1 << ticket.rank)
        actions: list[Action] = []
        if chunk is not None:
            if isinstance(chunk, _CutThroughChunk):
                self._disengage(job, chunk)
            del job.open[chunk_key]
            chunk.transition("close")
            targets = self._answer_to(chunk)
            # The ranks in a cut-through chunk have its sums up to here, in pieces.
            done = chunk.forwarded if isinstance(chunk, _CutThroughChunk) else 0
            if targets and done < len(data):
                rest = Result(push.key, push.offset + done // item, push.count - done // item, push.chunk, push.dtype,
                              world, everyone)
                actions.append(self._send_to(targets, result_header(rest, len(data) - done), data[done:], shared))
            for rank, conn in chunk.conns.items():
                if conn in targets:
                    closed.answered |= 1 << rank
            self._track(job, chunk, header, data, shared)
            chunk.free(self, job)
        shared.retain(1)  # kept for the ranks that push later
        closed.result, closed.header, closed.data = shared, header, data
        closed.expires_at = now + job.params.op_timeout_ms / 1000
        job.retained.append(closed)
        self._remember(job, chunk_key, closed)
        shared.release()
        return actions

    def _send_to(self, targets: list[int], header: bytes, data: memoryview, shared: _SharedBuffer) -> SendResult:
        """One RESULT frame to each connection in ``targets``, counted per connection (the count
        that ACK frames acknowledge); takes a reference on ``shared`` for each."""
        shared.retain(len(targets))
        for conn in targets:
            self._conns[conn].frames_sent[0] += 1
        return SendResult(targets, header, data, shared.release)

    def _track(self, job: _Job, chunk: _OpenChunk, header: bytes, data: memoryview, shared: _SharedBuffer) -> None:
        """A chunk's last RESULT frame was sent: keep its whole result for every rank whose client
        reconnects, until that rank acknowledges it, or for the rank's return when its
        connection is already gone."""
        chunk_key = (chunk.key, chunk.chunk)
        ranks = [(rank, conn) for rank, conn in chunk.conns.items()
                 if (member := job.members.get(rank)) is not None and member.grace > 0]
        group = _AckGroup(len(ranks))
        for rank, conn in ranks:
            shared.retain(1)
            info = self._conns.get(conn)
            if info is not None:
                delivery = _Delivery(info.frames_sent[0], chunk_key, header, data, shared, group)
                info.unacked.append(delivery)
                info.safe_pending.append(delivery)
                continue
            undelivered = job.undelivered.setdefault(rank, {})
            kept = undelivered.pop(chunk_key, None)
            if kept is not None:
                kept.done()
            undelivered[chunk_key] = _Delivery(0, chunk_key, header, data, shared, group)

    def _forward(self, job: _Job, chunk: _CutThroughChunk, now: float) -> list[Action]:
        """Sum and send what every rank of a cut-through chunk has sent beyond what was sent:
        whole pieces while payloads arrive, then the rest; close the chunk once every push
        ended and the sum of its last byte left."""
        parts = chunk.parts
        world = job.params.world_size
        if len(parts) < world:
            return []
        item = numpy_dtype(chunk.shape.dtype).itemsize
        size = chunk.shape.count * item
        actions: list[Action] = []
        engine = chunk.engine
        if engine is not None and engine.active:
            self._sync(job, chunk)  # it sent every piece due as the bytes landed, the last one too
            if chunk.contributors == (1 << world) - 1 and chunk.forwarded < size:
                self._disengage(job, chunk)  # bytes it was not told of: the rest is sent from here
        if chunk.engine is None or not chunk.engine.active:
            self._disengage(job, chunk)
            ready = min([part.received for part in parts.values()])
            ready -= ready % item
            start = chunk.forwarded
            if ready > start and (ready == size or (self.piece_bytes and ready - start >= self.piece_bytes)):
                actions += self._send_piece(job, chunk, start, ready)
        if chunk.forwarded == size and chunk.contributors == (1 << world) - 1:  # every push ended
            self._disengage(job, chunk)
            shape = chunk.shape
            chunk.transition("close")
            out = parts[0].shared
            header = result_header_of(chunk.key, shape.offset, shape.count, chunk.chunk, shape.dtype, world,
                                      bitmap_from_ranks((1 << world) - 1, world), size)
            self._track(job, chunk, header, out.buffer[:size].data, out)
            del job.open[(chunk.key, chunk.chunk)]
            stats = self.stats(job.name)
            stats.chunks_closed += 1
            stats.observe_latency(now - chunk.opened_at)
            self._remember(job, (chunk.key, chunk.chunk), _Closed(answered=chunk.contributors))
            chunk.free(self, job)
        return actions

    def _send_piece(self, job: _Job, chunk: _CutThroughChunk, start: int, stop: int) -> list[Action]:
        parts = chunk.parts
        world = job.params.world_size
        shape = chunk.shape
        self._combiner.combine_into_first([parts[rank].shared.buffer[start:stop] for rank in range(world)], shape.dtype,
                                          shape.op)
        chunk.forwarded = stop
        item = numpy_dtype(shape.dtype).itemsize
        targets = self._answer_to(chunk)
        self.stats(job.name).bytes_out += len(targets) * (stop - start)
        if not targets:
            return []
        header = result_header_of(chunk.key, shape.offset + start // item, (stop - start) // item, chunk.chunk,
                                  shape.dtype, world, bitmap_from_ranks((1 << world) - 1, world), stop - start)
        out = parts[0].shared  # rank 0's buffer holds the sum
        return [self._send_to(targets, header, out.buffer[start:stop].data, out)]

    def _engage(self, job: _Job, chunk: _CutThroughChunk, ticket: PushTicket) -> None:
        """Every rank's push joined ``chunk``: from here its pieces are summed and sent by a
        native forwarder as the push receivers land their bytes (``native/forward.c``), under the
        rule of :meth:`_forward`, with the plane's kernels, through each connection's writer and
        counted in each connection's ``frames_sent``. The core reads ``forwarded`` and the bytes
        sent back from it whenever it acts on the chunk (:meth:`_sync`) and takes over at anything
        irregular (:meth:`_disengage`). Not engaged: the Python plane, whole-chunk forwarding,
        16-bit floats (summed through a float32 scratch), an op without a loop, a part whose push
        broke off, a connection with no writer to hand."""
        sinks, make = self.result_sinks, self._combiner.kernels.forwarder
        shape = chunk.shape
        if sinks is None or make is None or not self.piece_bytes or shape.dtype in ACCUMULATION_DTYPES:
            return
        world = job.params.world_size
        parts = [chunk.parts[rank] for rank in range(world)]
        targets = []
        for rank, part in enumerate(parts):
            conn = chunk.conns[rank]
            info = self._conns.get(conn)
            if info is None or not (part.writing or chunk.contributors >> rank & 1):
                return  # gone, or its push broke off: the state machine decides what comes of the chunk
            sink = sinks(conn)
            if sink is None:
                return
            writer, on_queued, on_broken = sink
            targets.append((writer, info.frames_sent, on_queued, on_broken))
        item = numpy_dtype(shape.dtype).itemsize
        everyone = bitmap_from_ranks((1 << world) - 1, world)

        def header(start: int, stop: int) -> bytes:
            return result_header_of(chunk.key, shape.offset + start // item, (stop - start) // item, chunk.chunk,
                                    shape.dtype, world, everyone, stop - start)

        out = parts[0].shared  # rank 0's buffer holds the sums; a reference per frame, as _send_to takes

        def done(ok: bool) -> None:
            out.release()

        try:
            chunk.engine = make([part.shared.buffer for part in parts], shape.count * item, item, int(shape.dtype),
                                int(shape.op), self.piece_bytes, chunk.forwarded, [part.received for part in parts],
                                header, out.retain, done, targets)
        except ValueError:
            return  # no loop for this op and dtype: the state machine forwards
        self.engaged_chunks += 1
        ticket.forwarder = chunk.engine
        # The pushes still arriving; a connection whose push of this chunk ended reads another's now.
        ticket.feeds = [(chunk.conns[rank], rank) for rank, part in enumerate(parts) if part.writing]

    def _sync(self, job: _Job, chunk: _CutThroughChunk) -> None:
        """What the chunk's forwarder sent, into the core's books."""
        engine = chunk.engine
        chunk.forwarded = engine.forwarded
        self.stats(job.name).bytes_out += engine.take_bytes_out()

    def _disengage(self, job: _Job, chunk: _OpenChunk) -> None:
        """The core forwards ``chunk`` from here (its forwarder, if any, is cancelled)."""
        if isinstance(chunk, _CutThroughChunk) and chunk.engine is not None:
            self._sync(job, chunk)
            chunk.engine.cancel()
            chunk.engine = None

    def _disengage_conn(self, job: _Job, conn: int) -> None:
        """``conn`` left: no forwarder writes to it any more."""
        for chunk in job.open.values():
            if isinstance(chunk, _CutThroughChunk) and chunk.engine is not None and conn in chunk.conns.values():
                self._disengage(job, chunk)

    def _answer_to(self, chunk: _OpenChunk) -> list[int]:
        """The connections a chunk's result goes to: each contributor's, while it is open."""
        return [chunk.conns[r] for r in sorted(chunk.conns) if chunk.conns[r] in self._conns]


    def _maybe_close(self, job: _Job, chunk: _OpenChunk, now: float) -> list[Action]:
        count = bin(chunk.contributors).count("1")
        params = job.params
        if count == params.world_size:
            return self._close(job, chunk, now)
        if params.mode is StragglerMode.FIRST_M and count >= params.quorum:
            return self._close(job, chunk, now)
        return []

    def _close(self, job: _Job, chunk: _OpenChunk, now: float) -> list[Action]:
        chunk_key = (chunk.key, chunk.chunk)
        del job.open[chunk_key]
        shape = chunk.shape
        wire = numpy_dtype(shape.dtype)
        if shape.count == 0:  # an empty operation: nothing to combine, every rank agreed on nothing
            out_raw = np.empty(0, dtype=np.uint8)
        else:
            outcome = chunk.outcome(self, job)  # folds in the ranks above a gap left by stragglers
            if outcome is None:
                return self._fail_detached(job, chunk, ErrorCode.CONTRIBUTION_MISMATCH,
                                           f"broadcast root {shape.root} did not contribute", now)
            out_raw = outcome
        chunk.transition("close")
        stats = self.stats(job.name)
        stats.chunks_closed += 1
        stats.observe_latency(now - chunk.opened_at)
        result = Result(chunk.key, shape.offset, shape.count, chunk.chunk, shape.dtype,
                        bin(chunk.contributors).count("1"), bitmap_from_ranks(chunk.contributors, job.params.world_size))
        header = result_header(result, shape.count * wire.itemsize)
        targets = self._answer_to(chunk)
        stats.bytes_out += len(targets) * shape.count * wire.itemsize
        retain = bin(chunk.contributors).count("1") < job.params.world_size
        shared = _SharedBuffer(out_raw, self.pool, 1, self._freer(job))  # this function's reference
        data = out_raw.data
        closed = _Closed(answered=chunk.contributors)
        if retain:
            shared.retain(1)
            closed.result, closed.header, closed.data = shared, header, data
            closed.expires_at = now + job.params.op_timeout_ms / 1000 * C.LATE_RESULT_RETENTION_FACTOR
            job.retained.append(closed)
        self._remember(job, chunk_key, closed)
        actions: list[Action] = [self._send_to(targets, header, data, shared)] if targets else []
        self._track(job, chunk, header, data, shared)
        shared.release()
        return actions

    def _answer_late(self, job: _Job, chunk_key: tuple[int, int], rank: int, conn: int, now: float) -> list[Action]:
        closed = job.closed[chunk_key]
        closed.expect("answer")
        key, chunk = chunk_key
        delivery = job.undelivered.get(rank, {}).pop(chunk_key, None)
        if delivery is not None:  # a reconnected rank asks again for a result its old connection lost
            action = self._send_to([conn], delivery.header, delivery.data, delivery.shared)
            info = self._conns[conn]
            delivery.last_frame = info.frames_sent[0]
            info.unacked.append(delivery)  # its reference moves with it
            info.safe_pending.append(delivery)
            return [action]
        if closed.error is not None:
            return [SendError(conn, closed.error)]
        if closed.answered >> rank & 1:
            stats = self.stats(job.name)
            stats.rejected["STALE"] = stats.rejected.get("STALE", 0) + 1
            return [SendError(conn, Error(ErrorCode.STALE, False, f"rank {rank} pushed again to a closed chunk (key reused?)",
                                          key, chunk))]
        if closed.result is None or closed.data is None:
            return [SendError(conn, Error(ErrorCode.STALE, False,
                                          f"chunk closed without rank {rank}; its result is no longer kept", key, chunk))]
        closed.answered |= 1 << rank
        self.stats(job.name).bytes_out += len(closed.data)
        actions: list[Action] = [self._send_to([conn], closed.header, closed.data, closed.result)]
        if bin(closed.answered).count("1") >= job.params.world_size:
            self._drop_retained(closed)
        return actions

    def _drop_retained(self, closed: _Closed) -> None:
        if closed.result is not None:
            result, closed.result, closed.data = closed.result, None, None
            result.release()

    def _remember(self, job: _Job, chunk_key: tuple[int, int], closed: _Closed) -> None:
        job.closed[chunk_key] = closed
        job.closed.move_to_end(chunk_key)
        while len(job.closed) > C.STALE_KEYS_PER_JOB:
            _, oldest = job.closed.popitem(last=False)
            self._drop_retained(oldest)

    def _fail(self, job: _Job, chunk_key: tuple[int, int], code: ErrorCode, why: str, now: float) -> list[Action]:
        chunk = job.open.pop(chunk_key, None)
        if chunk is None:
            return []
        return self._fail_detached(job, chunk, code, why, now)

    def _fail_detached(self, job: _Job, chunk: _OpenChunk, code: ErrorCode, why: str, now: float) -> list[Action]:
        self._disengage(job, chunk)
        state = chunk.transition("fail")
        chunk.free(self, job)
        message = f"job {job.name!r} key {chunk.key:#x} chunk {chunk.chunk}: {why}"
        stats = self.stats(job.name)
        stats.chunks_failed[code.name] = stats.chunks_failed.get(code.name, 0) + 1
        error = Error(code, False, message, chunk.key, chunk.chunk)
        self._remember(job, (chunk.key, chunk.chunk), _Closed(state, error=error))
        actions: list[Action] = [Log("warning", message)]
        for rank in sorted(chunk.conns):
            if chunk.conns[rank] in self._conns:
                actions.append(SendError(chunk.conns[rank], error))
        return actions
