"""The reducer's aggregation logic as a state machine: no sockets, no threads, no clock.

The daemon feeds it events (a worker joined, a push header arrived, its payload is in, a
connection died, time passed) and executes the :class:`Action` objects it returns. Everything is
keyed by job, so one reducer serves many jobs; a job's trouble (a mismatch, a lost rank, an
exhausted budget) produces errors for that job only.

Determinism: the contributions to a chunk are summed in ascending rank order, whatever order
they arrive in. 16-bit floats accumulate in float32 and are rounded once.

Cut-through: where every rank must contribute (``StragglerMode.ALL``) and the op is a sum, a
rank's receive buffer joins its chunk as soon as the push's header is in, the daemon reports how
much of each payload has arrived (:meth:`ReducerCore.progress`), and the sum of every piece that
all ranks have is sent as soon as it reaches ``piece_bytes``. Results then trail the pushes by
about one piece instead of one whole chunk. In the straggler modes the set of contributors is
only known when a chunk closes, so there rank ``r``'s data is added once ranks ``0..r-1`` are
in (earlier arrivals wait in their buffers) and the result leaves whole.

This module holds :class:`ReducerCore` itself: its events (:data:`EVENTS`) and queries
(:data:`QUERIES`), the data path (a push's header, its payload arriving, its end) and time. Its
other rules are in base classes, one module each, so that every part reads in one go; a method
found through the base classes costs what one on the class does (Python caches the lookup):

- ``reducer_members``: joining and leaving (``_MembershipRules``);
- ``reducer_results``: how a chunk ends, results kept and acknowledged (``_ResultRules``);
- ``reducer_memory``: budgets, fair shares, waits for memory, reclaiming (``_MemoryRules``).

And the records they share, plain data:

- ``reducer_chunks``: a chunk's states and their transition table, and its three accumulation
  modes (cut-through, rank order, broadcast);
- ``reducer_jobs``: jobs, connections, push tickets, counters;
- ``reducer_buffers``: the buffer pool and shared, reference-counted buffers;
- ``reducer_actions``: the :data:`Action` types the events return (what the daemon executes).

Every name other modules import from the core is re-exported here (``__all__``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from . import constants as C
from .buffer_pool import BufferPool
from .combine import ACCUMULATION_DTYPES, Combiner
from .plane import Kernels
from .reducer_actions import (
    DISCARD,
    WAIT_FOR_MEMORY,
    Action,
    CloseConnection,
    Log,
    SendError,
    SendResult,
    SendSafe,
)
from .reducer_buffers import _SharedBuffer
from .reducer_chunks import (
    CHUNK_TRANSITIONS,
    ChunkState,
    ChunkStateError,
    _BroadcastChunk,
    _CutThroughChunk,
    _OpenChunk,
    _Part,
    _RankOrderChunk,
    _Shape,
)
from .reducer_jobs import (
    LATENCY_BUCKETS,
    JobParams,
    JobStats,
    MemoryState,
    PushTicket,
    _Job,
)
from .reducer_members import _MembershipRules
from .reducer_results import ResultSink  # re-exported: the daemon's side of a native forwarder
from .wire import (
    Error,
    ErrorCode,
    Push,
    ReduceOp,
    Result,
    StragglerMode,
    bitmap_from_ranks,
    numpy_dtype,
    result_header,
)

__all__ = [
    "ReducerCore",
    "Action",
    "SendError",
    "SendResult",
    "CloseConnection",
    "SendSafe",
    "Log",
    "PushTicket",
    "JobParams",
    "BufferPool",
    "ACCUMULATION_DTYPES",
    "JobStats",
    "MemoryState",
    "LATENCY_BUCKETS",
    "DISCARD",
    "WAIT_FOR_MEMORY",
    "ChunkState",
    "ChunkStateError",
    "ResultSink",
    "CHUNK_TRANSITIONS",
    "EVENTS",
    "QUERIES",
]

NO_CHUNK = 0xFFFFFFFF

#: The methods the daemon calls when something happens, in the order docs/architecture.md lists
#: them; each returns what the daemon must do (a list of actions, or a ticket, a connection or a
#: limit). tests/unit/test_architecture_docs.py holds the docs' table to this, and every public
#: method of :class:`ReducerCore` to being an event or a query.
EVENTS = ("join", "ack", "leave", "superseded", "begin_push", "progress", "extend", "finish_push", "abort_push",
          "tick", "shutdown")
#: The methods that only read the state (settings for the daemon, figures for the metrics).
QUERIES = ("report_piece_bytes", "fair_share", "memory", "stats", "connections", "job_names", "open_chunks",
           "bytes_held")


class ReducerCore(_MembershipRules):
    """Aggregation state for every job on one reducer. Not thread-safe: the daemon serialises
    calls. ``now`` arguments are seconds from a monotonic clock the caller owns. The events and
    rules of its base classes are listed in this module's docstring; every attribute they
    declare is set here."""

    def __init__(
        self,
        incarnation: int,
        *,
        job_budget_bytes: int = C.DEFAULT_JOB_BUDGET_BYTES,
        memory_budget_bytes: int = C.DEFAULT_MEMORY_BUDGET_BYTES,
        stall_warning: float = C.DEFAULT_STALL_WARNING_S,
        piece_bytes: int = C.DEFAULT_RESULT_PIECE_BYTES,
        rejoin_grace: float = C.DEFAULT_REJOIN_GRACE_S,
        budget_wait_timeout: float = C.DEFAULT_OP_TIMEOUT_S,
        min_push_rate: int = C.DEFAULT_MIN_PUSH_RATE,
        slow_push_grace: float = C.DEFAULT_SLOW_PUSH_GRACE_S,
        pool: BufferPool | None = None,
        kernels: Kernels | None = None,
        result_sinks: Callable[[int], ResultSink | None] | None = None,
    ) -> None:
        self.incarnation = incarnation
        self.job_budget_bytes = job_budget_bytes
        self.memory_budget_bytes = memory_budget_bytes
        self.bytes_held_total = 0  # (the memory rules' attributes are described in reducer_memory)
        self.budget_wait_timeout = budget_wait_timeout
        self.min_push_rate = min_push_rate
        self.slow_push_grace = slow_push_grace
        self.memory_epoch = 0
        self._active = {}
        self._waiting = {}
        self._receiving = {}
        self._next_contention_log = 0.0
        self.stall_warning = stall_warning
        self.piece_bytes = piece_bytes  # 0: forward whole chunks only
        self.rejoin_grace = rejoin_grace  # the longest a rank's place is kept for its reconnect
        self.pool = pool or BufferPool(max_free_bytes=memory_budget_bytes)
        self._combiner = Combiner(kernels)  # the data plane's arithmetic; its float32 scratch sums 16-bit pieces
        # Where a native forwarder writes a connection's RESULT frames (the daemon's writer and
        # its two callbacks, ``_engage``); None: the state machine forwards every piece itself.
        self.result_sinks = result_sinks if self._combiner.kernels.forwarder is not None else None
        self.engaged_chunks = 0  # chunks a native forwarder summed and sent, for tests and figures
        self._jobs = {}
        self._conns = {}
        self.job_stats = OrderedDict()  # survives the job's state, bounded

    # --- data path ---

    def begin_push(self, conn: int, push: Push, payload_len: int, now: float) -> PushTicket | list[Action] | None:
        """A push header arrived. Returns a ticket saying where to receive its payload, a list of
        actions when it is rejected (its payload must then be read and discarded), or ``None``
        when it must wait for memory (the caller stops reading the connection, TCP
        backpressure, and asks again once memory was freed or a tick passed; :meth:`tick`
        refuses it once it waited its operation timeout).

        Memory (docs/reliability.md, "Fair shares"): a push that opens a chunk needs room in its
        job's budget and in the reducer-wide one (:meth:`_room_evicting`: a claim ending within
        its job's fair share needs only the memory to be there; its part beyond the share, only
        what leaves every other active job room to reach its own share; such a push is owed while
        its job holds less than the share; results kept for the job's own reconnect give way
        first). Pushes to an open chunk join it whatever the budgets. A push announcing more than
        ``constants.WHOLE_FUNDING_MAX_BYTES`` is funded one step (``constants.ARRIVAL_STEP_BYTES``)
        at a time as its bytes arrive (:meth:`extend`) where its bytes join the chunk as they come
        (every rank contributes, a sum-like op: cut-through). Every other push is funded whole at
        its header, or waits there for memory with none of its payload read: a chunk's push never
        pauses mid-payload, where the fair-share rules would judge it paused and drop it."""
        info = self._conns.get(conn)
        if info is None:
            return [SendError(conn, Error(ErrorCode.PROTOCOL, True, "push before a completed handshake"), close_after=True)]
        job = self._jobs[info.job]
        self._mark_active(job, now)
        chunk_key = (push.key, push.chunk)
        reject = self._check_push(job, info.rank, push, now)
        if reject is not None:
            self._waiting.pop(conn, None)
            stats = self.stats(job.name)
            stats.rejected[reject.code.name] = stats.rejected.get(reject.code.name, 0) + 1
            return [SendError(conn, reject)]
        if push.op is ReduceOp.SETTLED:
            if job.params.mode is not StragglerMode.ALL:
                return [SendError(conn, Error(ErrorCode.PROTOCOL, False, "a settled result is only for jobs where every "
                                                                          "rank contributes", push.key, push.chunk))]
            return self._receive(PushTicket(conn, info.job, info.rank, push, self._take(job, payload_len), settled=True),
                                 now)
        closed = job.closed.get(chunk_key)
        if closed is not None:  # its payload is read and dropped: it needs no memory
            self._waiting.pop(conn, None)
            return PushTicket(conn, info.job, info.rank, push, None, late=True, skip=payload_len)
        chunk = job.open.get(chunk_key)
        if chunk is not None:
            resumed = self._resume(job, chunk, conn, info.rank, push, payload_len)
            if resumed is not None:
                self._waiting.pop(conn, None)
                return self._receive(resumed, now)
        cut_through = job.params.mode is StragglerMode.ALL and push.op is not ReduceOp.BROADCAST and push.count > 0
        stepwise = cut_through and payload_len > C.WHOLE_FUNDING_MAX_BYTES
        grant = C.ARRIVAL_STEP_BYTES if stepwise else payload_len
        # Over a budget: no new chunks until held memory (open chunks, results still being sent,
        # results kept for stragglers) drains. Pushes to open chunks always proceed: they are
        # what closes chunks and frees memory.
        if chunk is None:
            if job.bytes_held > 0 and job.bytes_held + grant > self.job_budget_bytes:
                self._evict_deliveries([job], lambda: job.bytes_held + grant <= self.job_budget_bytes)
            if self.bytes_held_total + grant > self.memory_budget_bytes:
                self._evict_deliveries(list(self._jobs.values()),
                                       lambda: self.bytes_held_total + grant <= self.memory_budget_bytes)
            if job.bytes_held > 0 and job.bytes_held + grant > self.job_budget_bytes:
                self._wait(conn, job, info.rank, now, self.budget_wait_timeout, grant, False,
                           f"job {job.name!r} holds {job.bytes_held} bytes of its budget of {self.job_budget_bytes}")
                return None
            short = self._room_evicting(job, grant, opening=True, conn=conn)
            if short is not None:
                self._wait(conn, job, info.rank, now, min(self.budget_wait_timeout, job.params.op_timeout_ms / 1000), grant,
                           *short)
                return None
        self._waiting.pop(conn, None)
        ticket = PushTicket(conn, info.job, info.rank, push, self._take(job, payload_len, charge=grant, lazy=stepwise),
                            limit=grant)
        if cut_through:  # combined as it arrives
            refused = self._attach(job, ticket, now)
            if refused:
                return refused
        return self._receive(ticket, now)

    def _receive(self, ticket: PushTicket, now: float) -> PushTicket:
        """Hand ``ticket`` out; while its payload arrives its rate is watched (:meth:`tick`)."""
        if ticket.buffer is not None:
            if ticket.part is None:
                ticket.limit = ticket.buffer.nbytes  # funded whole
            ticket.received = ticket.window_bytes = ticket.skip
            ticket.window_at = now
            self._receiving[ticket.conn] = ticket
        return ticket

    def extend(self, ticket: PushTicket, now: float) -> int:
        """The daemon landed ``ticket.limit`` bytes of a payload funded as it arrives: fund the
        next step. Returns the new limit, :data:`WAIT_FOR_MEMORY` (the push waits for memory as
        :meth:`begin_push`'s ``None`` does) or :data:`DISCARD` (the chunk failed meanwhile:
        read the rest and drop it; the buffer is already given back)."""
        buffer, part = ticket.buffer, ticket.part
        if buffer is None or ticket.limit >= buffer.nbytes:
            return ticket.limit
        job = self._jobs.get(ticket.job)
        if part is None or part.chunk is None or job is None:
            self._detach(ticket)
            return DISCARD
        self._mark_active(job, now)
        step = ticket.next_step
        short = self._room_evicting(job, step, opening=False, conn=ticket.conn)
        if short is not None:
            if ticket.paused_at is None:
                ticket.paused_at = now
            self._wait(ticket.conn, job, ticket.rank, now, min(self.budget_wait_timeout, job.params.op_timeout_ms / 1000),
                       step, *short)
            return WAIT_FOR_MEMORY
        self._waiting.pop(ticket.conn, None)
        self._charge(job, step)
        part.shared.charged += step
        ticket.limit += step
        if ticket.paused_at is not None:  # a pause is measured apart from the push's rate (tick)
            ticket.paused_at, ticket.slow_rate = None, None
            ticket.window_at, ticket.window_bytes = now, ticket.received
        return ticket.limit

    def _detach(self, ticket: PushTicket) -> None:
        """The rest of a push's payload is read and dropped: its buffer goes now."""
        part = ticket.part
        self._receiving.pop(ticket.conn, None)
        self._waiting.pop(ticket.conn, None)
        ticket.buffer, ticket.part, ticket.resent = None, None, True  # finish_push then has nothing to do
        if part is not None:
            part.writing = False
            part.shared.release()  # the push's reference


    def superseded(self, conn: int, push: Push) -> int | None:
        """The connection that ``push`` makes obsolete, if any: another connection of the same
        client that carried this chunk, which the client gave up on when it reconnected (it
        never sends one chunk on two live connections). A frozen reducer may not have noticed
        yet that it ended; the daemon closes it before handling the push (R22)."""
        info = self._conns.get(conn)
        job = None if info is None else self._jobs.get(info.job)
        member = None if job is None or info is None else job.members.get(info.rank)
        if info is None or job is None or member is None or member.grace <= 0:
            return None
        chunk_key = (push.key, push.chunk)
        chunk = job.open.get(chunk_key)
        if chunk is not None:
            old = chunk.conns.get(info.rank)
            old_info = None if old is None or old == conn else self._conns.get(old)
            return old if old_info is not None and old_info.session == info.session else None
        if chunk_key in job.closed:
            for other in member.conns:
                other_info = self._conns.get(other)
                if other != conn and other_info is not None and any(d.chunk_key == chunk_key for d in other_info.unacked):
                    return other
        return None

    def _resume(self, job: _Job, chunk: _OpenChunk, conn: int, rank: int, push: Push, payload_len: int) -> PushTicket | None:
        """A rank pushes to an open chunk it already contributed to, or began to, on a new
        connection of the same client: it reconnected and resends what it has no result for
        (R22). Its contribution continues where the broken connection left it (what is already
        in is read and dropped), its answers go to the new connection, and the sums the chunk
        already sent are sent again there. ``None``: not such a resend (the usual rules apply,
        which report a mismatch or a duplicate)."""
        if rank not in chunk.conns and not chunk.contributors >> rank & 1:
            return None  # the rank's first push to this chunk (a part is attached with its connection)
        member = job.members.get(rank)
        shape = _Shape(push.total, push.offset, push.count, push.dtype, push.op, push.root)
        if member is None or member.grace <= 0 or chunk.shape != shape or chunk.conns.get(rank) == conn:
            return None
        part = chunk.parts.get(rank) if isinstance(chunk, _CutThroughChunk) else None
        if part is not None:
            assert isinstance(chunk, _CutThroughChunk)
            self._disengage(job, chunk)
            if part.writing:
                return None  # a push of this rank is still arriving: a real duplicate
            part.writing = True
            part.shared.retain(1)  # the new push's reference, released when it ends
            chunk.conns[rank] = conn
            ticket = PushTicket(conn, job.name, rank, push, part.shared.buffer, part=part, skip=part.received,
                                limit=part.shared.charged)
            if chunk.forwarded:
                out = chunk.parts[0].shared  # rank 0's buffer holds the sums sent so far
                item = numpy_dtype(shape.dtype).itemsize
                world = job.params.world_size
                result = Result(chunk.key, shape.offset, chunk.forwarded // item, chunk.chunk, shape.dtype, world,
                                bitmap_from_ranks((1 << world) - 1, world))
                ticket.replay.append(self._send_to([conn], result_header(result, chunk.forwarded),
                                                   out.buffer[: chunk.forwarded].data, out))
            return ticket
        if chunk.contributors >> rank & 1:  # its whole contribution is in: read the resend and drop it
            chunk.conns[rank] = conn
            return PushTicket(conn, job.name, rank, push, None, skip=payload_len, resent=True)
        return None

    def report_piece_bytes(self, mode: StragglerMode) -> int:
        """How much of a push's payload the daemon should let arrive between :meth:`progress`
        reports on a connection of a job in ``mode``; 0: report whole payloads only. Only where
        every rank must contribute are sums forwarded before whole chunks are in."""
        return self.piece_bytes if mode is StragglerMode.ALL else 0

    def _attach(self, job: _Job, ticket: PushTicket, now: float) -> list[Action]:
        """Make a push's buffer part of its chunk as its header arrives (cut-through), after the
        checks that otherwise wait for the payload: nothing is forwarded before every rank's
        push was found consistent."""
        push, rank, buffer = ticket.push, ticket.rank, ticket.buffer
        chunk_key = (push.key, push.chunk)
        shape = _Shape(push.total, push.offset, push.count, push.dtype, push.op, push.root)
        chunk = job.open.get(chunk_key)
        if chunk is None:
            chunk = job.open[chunk_key] = _CutThroughChunk(push.key, push.chunk, shape, rank, now)
        refusal = self._refusal(chunk, rank, shape, 0 if buffer is None else buffer.nbytes)
        if refusal is not None:
            self._give(job, buffer, ticket.limit)
            ticket.buffer = None
            return self._refuse(job, chunk, rank, ticket.conn, *refusal, now)
        assert isinstance(chunk, _CutThroughChunk) and buffer is not None  # same shape: a sum, with a payload
        part = _Part(rank, _SharedBuffer(buffer, self.pool, 2, self._freer(job), ticket.limit), chunk)
        chunk.attach(part, ticket.conn, now)
        ticket.part = part
        if len(chunk.parts) == job.params.world_size:
            self._engage(job, chunk, ticket)
        return []

    def _refusal(self, chunk: _OpenChunk, rank: int, shape: _Shape, got: int) -> tuple[ErrorCode, str] | None:
        """Why rank ``rank``'s contribution of ``got`` payload bytes cannot join ``chunk``."""
        if chunk.shape != shape:
            return ErrorCode.CONTRIBUTION_MISMATCH, (f"ranks disagree: rank {chunk.first_rank} sent {chunk.shape.describe()}, "
                                                     f"rank {rank} sent {shape.describe()}")
        if chunk.has(rank):
            return ErrorCode.DUPLICATE, f"rank {rank} contributed twice"
        silent = shape.op is ReduceOp.BROADCAST and rank != shape.root
        expected = 0 if silent else shape.count * numpy_dtype(shape.dtype).itemsize
        if got != expected:
            return ErrorCode.CONTRIBUTION_MISMATCH, f"rank {rank} sent {got} payload bytes for {shape.describe()}, " \
                                                    f"expected {expected}"
        return None

    def _refuse(self, job: _Job, chunk: _OpenChunk, rank: int, conn: int, code: ErrorCode, why: str, now: float) -> list[Action]:
        """Fail ``chunk`` for everyone in it; the offender hears it too (unless it is a rank
        contributing twice, already answered on its first connection)."""
        if code is not ErrorCode.DUPLICATE:
            chunk.conns.setdefault(rank, conn)
        return self._fail(job, (chunk.key, chunk.chunk), code, why, now)


    def _check_push(self, job: _Job, rank: int, push: Push, now: float) -> Error | None:
        if push.incarnation != self.incarnation:
            return Error(ErrorCode.STALE, False, f"push for incarnation {push.incarnation:#x} reached incarnation "
                         f"{self.incarnation:#x} (the reducer restarted)", push.key, push.chunk)
        if push.count == 0 and push.total != 0:
            return Error(ErrorCode.CONTRIBUTION_MISMATCH, False, f"push of zero elements of a {push.total}-element operation "
                         "(only an empty operation sends an empty chunk)", push.key, push.chunk)
        if push.op is ReduceOp.BROADCAST and push.root >= job.params.world_size:
            return Error(ErrorCode.CONTRIBUTION_MISMATCH, False,
                         f"broadcast root {push.root} is not a rank of a {job.params.world_size}-rank job", push.key, push.chunk)
        if job.lost and job.params.mode is StragglerMode.ALL and (push.key, push.chunk) not in job.closed:
            return Error(ErrorCode.PEER_LOST, False, "; ".join(job.lost[r] for r in sorted(job.lost)), push.key, push.chunk)
        return None

    def abort_push(self, ticket: PushTicket) -> None:
        """The connection failed while the payload was being received."""
        if self._receiving.get(ticket.conn) is ticket:
            del self._receiving[ticket.conn]
        part = ticket.part
        if part is None:
            self._give(self._jobs.get(ticket.job), ticket.buffer)
            return
        ticket.buffer = None
        chunk = part.chunk
        job = self._jobs.get(ticket.job)
        if chunk is not None and job is not None:
            self._disengage(job, chunk)
        member = None if job is None else job.members.get(part.rank)
        info = self._conns.get(ticket.conn)
        if chunk is not None and member is not None and member.grace > 0 and info is not None and info.session == member.session:
            part.writing = False  # kept, with what arrived, for the rank's reconnect (R22)
            part.shared.release()  # the push's reference
            return
        if chunk is not None:  # the chunk now lacks this rank: the rank's departure fails it
            del chunk.parts[part.rank]
            part.chunk = None
            part.shared.release()
        part.shared.release()

    def progress(self, ticket: PushTicket, received: int, now: float) -> list[Action]:
        """``received`` bytes of a push's payload are in its buffer (the push's rate is watched,
        :meth:`tick`); for a cut-through push, send the sums of what every rank has sent, once
        there is a piece's worth."""
        ticket.received = received
        part = ticket.part
        if part is None or part.chunk is None:
            return []
        part.received = received
        chunk = part.chunk
        chunk.active_at = now
        if chunk.engine is not None and chunk.engine.active:
            return []  # its forwarder sent what was due as the bytes landed
        if not self.piece_bytes or received - chunk.forwarded < self.piece_bytes:
            return []  # this rank is not a piece ahead, so nobody's frontier moved a piece
        job = self._jobs.get(ticket.job)
        return [] if job is None else self._forward(job, chunk, now)

    def finish_push(self, ticket: PushTicket, now: float) -> list[Action]:
        """The payload is in ``ticket.buffer``: sum it (in rank order) and close the chunk if it
        is complete."""
        if self._receiving.get(ticket.conn) is ticket:
            del self._receiving[ticket.conn]
        job = self._jobs.get(ticket.job)
        if ticket.part is not None:
            return self._finish_part(job, ticket, now)
        if ticket.resent:
            return []  # the chunk had this contribution; its answer now goes to this connection
        if ticket.settled:
            return self._settle(job, ticket, now)
        if job is None or ticket.conn not in self._conns:
            self._give(job, ticket.buffer)
            return []
        push, rank = ticket.push, ticket.rank
        chunk_key = (push.key, push.chunk)
        # A late push was read and dropped without a buffer: its bytes still came in.
        self.stats(job.name).bytes_in += ticket.skip if ticket.late else 0 if ticket.buffer is None else ticket.buffer.nbytes
        if ticket.late or chunk_key in job.closed:
            self._give(job, ticket.buffer)
            return self._answer_late(job, chunk_key, rank, ticket.conn, now)
        shape = _Shape(push.total, push.offset, push.count, push.dtype, push.op, push.root)
        chunk = job.open.get(chunk_key)
        if chunk is None:
            kind = _BroadcastChunk if push.op is ReduceOp.BROADCAST else _RankOrderChunk
            chunk = job.open[chunk_key] = kind(push.key, push.chunk, shape, rank, now)
        refusal = self._refusal(chunk, rank, shape, 0 if ticket.buffer is None else ticket.buffer.nbytes)
        if refusal is not None:
            self._give(job, ticket.buffer)
            return self._refuse(job, chunk, rank, ticket.conn, *refusal, now)
        chunk.add(self, job, rank, ticket.buffer)  # summed now if every lower rank is in
        chunk.contributors |= 1 << rank
        chunk.conns[rank] = ticket.conn
        chunk.active_at = now
        self.stats(job.name).observe_lateness(rank, now - chunk.opened_at)
        return self._maybe_close(job, chunk, now)

    def _finish_part(self, job: _Job | None, ticket: PushTicket, now: float) -> list[Action]:
        part = ticket.part
        assert part is not None
        ticket.buffer = None
        part.writing = False
        part.shared.release()  # the daemon is done writing into it
        chunk = part.chunk
        if job is None or chunk is None or ticket.conn not in self._conns:
            return []  # the chunk failed meanwhile, and this rank was told when it did
        part.received = part.shared.buffer.nbytes
        self.stats(job.name).bytes_in += part.received
        chunk.active_at = now
        chunk.contributors |= 1 << part.rank
        self.stats(job.name).observe_lateness(part.rank, now - chunk.opened_at)
        return self._forward(job, chunk, now)

    # --- time ---

    def tick(self, now: float) -> list[Action]:
        """Deadlines: straggler deadlines, operation timeouts, stall warnings, retention; pool
        buffers nobody used for a while go back to the system; memory: pushes that waited too
        long for it are refused, and under pressure slow pushes and stalled chunks of jobs over
        their fair share give theirs back (:meth:`_reclaim`)."""
        actions = self._deadlines(now)
        actions += self._reclaim(now)
        actions += self._refuse_waits(now)
        for name, job in list(self._active.items()):
            if self._jobs.get(name) is not job or (not job.bytes_held and now - job.active_at > C.FAIR_SHARE_IDLE_S):
                del self._active[name]
                self.memory_epoch += 1
        return actions

    def _deadlines(self, now: float) -> list[Action]:
        actions: list[Action] = []
        self.pool.release_idle(now)
        for job in list(self._jobs.values()):
            for rank, member in list(job.members.items()):
                if member.left_at is not None and now - member.left_at >= member.grace and job.name in self._jobs:
                    actions += self._lose(job, rank, f"rank {rank} of job {job.name!r} lost its connection and did not "
                                                     f"reconnect within {member.grace:.1f}s", now)
            if job.name not in self._jobs:
                continue
            params = job.params
            for chunk_key, chunk in list(job.open.items()):
                age = now - chunk.opened_at
                count = bin(chunk.contributors).count("1")
                if params.mode is StragglerMode.DEADLINE and age * 1000 >= params.deadline_ms and count >= params.quorum:
                    actions += self._close(job, chunk, now)
                elif age * 1000 >= params.op_timeout_ms:
                    actions += self._fail(job, chunk_key, ErrorCode.TIMEOUT,
                                          f"timed out after {age:.3f}s (op timeout {params.op_timeout_ms / 1000:.3f}s) "
                                          f"waiting for rank(s) {chunk.missing(job.params.world_size)}", now)
                elif age >= self.stall_warning and not chunk.stall_warned:
                    chunk.stall_warned = True
                    actions.append(Log("warning", f"job {job.name!r} key {chunk.key:#x} chunk {chunk.chunk} open for {age:.1f}s; "
                                                  f"waiting for rank(s) {chunk.missing(job.params.world_size)}"))
            retained = job.retained
            while retained and (retained[0].result is None or now >= retained[0].expires_at):
                self._drop_retained(retained.popleft())
            if not job.members and not self._keeps_results(job):
                self._drop_job(job)  # everyone left and nothing is kept for a late rank
        return actions


    def shutdown(self, why: str) -> list[Action]:
        """Fail every open chunk of every job (the daemon is stopping)."""
        actions: list[Action] = []
        for job in list(self._jobs.values()):
            for chunk_key in list(job.open):
                actions += self._fail(job, chunk_key, ErrorCode.SHUTDOWN, why, 0.0)
        return actions

    # --- introspection ---

    def connections(self, job: str) -> int:
        j = self._jobs.get(job)
        return 0 if j is None else sum(len(m.conns) for m in j.members.values())

    def job_names(self) -> list[str]:
        return sorted(self._jobs)

    def open_chunks(self, job: str) -> int:
        j = self._jobs.get(job)
        return 0 if j is None else len(j.open)

    def bytes_held(self, job: str) -> int:
        j = self._jobs.get(job)
        return 0 if j is None else j.bytes_held
