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
"""

from __future__ import annotations

import mmap
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from . import constants as C
from .combine import ACCUMULATION_DTYPES, UFUNCS, Combiner
from .wire import (
    DType,
    Error,
    ErrorCode,
    Hello,
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
]

NO_CHUNK = 0xFFFFFFFF

#: What :meth:`ReducerCore.extend` returns when the rest of a payload is to be read and dropped
#: (its chunk failed meanwhile: nothing will use those bytes).
DISCARD = -1
#: ... or when the push must wait for memory (the daemon stops reading it and asks again later).
WAIT_FOR_MEMORY = -2

#: Anonymous private mappings: pages exist once written, so a buffer funded as its bytes arrive
#: is resident as far as they arrived, not for its announced size.
_LAZY_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)


# --- actions --------------------------------------------------------------------------------


@dataclass
class SendError:
    conn: int
    frame: Error
    close_after: bool = False


@dataclass
class SendResult:
    """Send ``header`` then ``data`` to every connection in ``conns``; each connection's writer
    calls ``release()`` once when it is done with ``data`` (sent or dropped)."""

    conns: list[int]
    header: bytes
    data: memoryview
    release: Callable[[], None]


@dataclass
class CloseConnection:
    conn: int


@dataclass
class SendSafe:
    """Tell the worker on ``conn`` that every rank has the results of its first ``frames``
    RESULT frames (wire.Safe)."""

    conn: int
    frames: int


@dataclass
class Log:
    level: str  # "info", "warning", "error"
    message: str


Action = SendError | SendResult | CloseConnection | SendSafe | Log


# --- buffers --------------------------------------------------------------------------------


class BufferPool:
    """Reusable byte buffers, so steady-state pushes allocate nothing. Thread-safe.

    Bounded twice: at most ``keep_per_size`` free buffers of a size and ``max_free_bytes`` in all,
    and :meth:`release_idle` drops the sizes nobody took for a while, so the memory of a burst
    or an attack goes back to the system (RELIABILITY R21)."""

    def __init__(self, keep_per_size: int = C.POOL_KEEP_PER_SIZE, max_free_bytes: int = C.DEFAULT_MEMORY_BUDGET_BYTES) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._keep = keep_per_size
        self._max_free_bytes = max_free_bytes
        self.free_bytes = 0
        self._last_taken: dict[int, float] = {}  # size -> the release_idle clock when last taken or given
        self._clock = 0.0
        self._lock = threading.Lock()

    def take(self, nbytes: int, *, lazy: bool = False) -> np.ndarray:
        """A buffer of ``nbytes``. ``lazy``: fresh memory whose pages exist only once written,
        never a pooled one (whose pages were all written before), for a buffer funded as its
        bytes arrive."""
        if lazy:
            return np.frombuffer(mmap.mmap(-1, nbytes, flags=_LAZY_FLAGS), dtype=np.uint8)
        with self._lock:
            self._last_taken[nbytes] = self._clock
            free = self._free.get(nbytes)
            if free:
                self.free_bytes -= nbytes
                return free.pop()
        return np.empty(nbytes, dtype=np.uint8)

    def give(self, buffer: np.ndarray) -> None:
        if not buffer.nbytes:
            return
        with self._lock:
            self._last_taken[buffer.nbytes] = self._clock  # idle from now: released if nobody takes it
            free = self._free.setdefault(buffer.nbytes, [])
            if len(free) < self._keep and self.free_bytes + buffer.nbytes <= self._max_free_bytes:
                free.append(buffer)
                self.free_bytes += buffer.nbytes

    def trim(self, max_free_bytes: int) -> None:
        """Drop free buffers until at most ``max_free_bytes`` are kept."""
        with self._lock:
            for nbytes in sorted(self._free, reverse=True):
                free = self._free[nbytes]
                while free and self.free_bytes > max_free_bytes:
                    free.pop()
                    self.free_bytes -= nbytes
                if self.free_bytes <= max_free_bytes:
                    return

    def release_idle(self, now: float, idle: float = C.POOL_IDLE_RELEASE_S) -> int:
        """Drop the free buffers of every size not taken within ``idle`` seconds of ``now``;
        returns the bytes dropped."""
        dropped = 0
        with self._lock:
            self._clock = now
            for nbytes in [n for n, last in self._last_taken.items() if now - last >= idle]:
                del self._last_taken[nbytes]
                free = self._free.pop(nbytes, [])
                dropped += nbytes * len(free)
            self.free_bytes -= dropped
        return dropped


class _SharedBuffer:
    """A pool buffer with a reference count; returns to the pool when the count reaches 0.
    ``charged``: the bytes of it counted against the budgets (less than its size while a push
    funded as it arrives is still coming in); a buffer never wholly funded goes back to the
    system, not to the pool, whose buffers are handed out as wholly written memory."""

    __slots__ = ("buffer", "refs", "pool", "lock", "on_free", "charged")

    def __init__(self, buffer: np.ndarray, pool: BufferPool, refs: int, on_free: Callable[[int], None],
                 charged: int | None = None) -> None:
        self.buffer, self.pool, self.refs, self.on_free = buffer, pool, refs, on_free
        self.charged = buffer.nbytes if charged is None else charged
        self.lock = threading.Lock()

    def retain(self, count: int) -> None:
        with self.lock:
            self.refs += count

    def release(self) -> None:
        with self.lock:
            self.refs -= 1
            done = self.refs == 0
        if done:
            self.on_free(self.charged)
            if self.charged == self.buffer.nbytes:
                self.pool.give(self.buffer)


@dataclass
class _Part:
    """One rank's contribution to a chunk that is summed piece by piece. Its buffer is shared by
    the chunk and by the push still receiving into it, so a chunk that fails mid-payload never
    hands the pool memory the daemon is still writing."""

    rank: int
    shared: _SharedBuffer
    chunk: _OpenChunk | None  # None once the chunk closed or failed
    received: int = 0  # payload bytes in the buffer
    writing: bool = True  # a push is receiving into the buffer (False: its connection broke)


# --- state ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobParams:
    world_size: int
    mode: StragglerMode
    min_contributors: int
    deadline_ms: int
    op_timeout_ms: int

    @classmethod
    def from_hello(cls, hello: Hello) -> JobParams:
        return cls(hello.world_size, hello.mode, hello.min_contributors, hello.deadline_ms, hello.op_timeout_ms)

    @property
    def quorum(self) -> int:
        """Contributions needed to close a chunk early (first_m / deadline)."""
        return self.min_contributors or self.world_size


@dataclass
class _Member:
    session: int
    conns: set[int] = field(default_factory=set)
    grace: float = 0.0  # seconds its place is kept after its last connection ends (0: none)
    left_at: float | None = None  # when its last connection ended, while its place is kept
    peer: str = "?"


@dataclass
class _AckGroup:
    """The deliveries of one chunk's result, one per rank: once none is outstanding, every rank
    has the result, and the copies workers keep of it may go (wire.Safe)."""

    outstanding: int


@dataclass
class _Delivery:
    """A chunk's whole result sent to a rank and not yet acknowledged (wire.Ack). Kept, with a
    reference on its buffer, so that a rank whose connection broke can be answered again (R22)."""

    last_frame: int  # the connection's RESULT frame count once this chunk's last frame was sent
    chunk_key: tuple[int, int]
    header: bytes  # a RESULT header for the whole chunk
    data: memoryview
    shared: _SharedBuffer
    group: _AckGroup
    finished: bool = False

    def done(self) -> None:
        """The rank has the result (it acknowledged it), or will never need it (it is gone)."""
        if not self.finished:
            self.finished = True
            self.group.outstanding -= 1
            self.shared.release()


@dataclass(frozen=True)
class _Shape:
    total: int
    offset: int
    count: int
    dtype: DType
    op: ReduceOp
    root: int

    def describe(self) -> str:
        what = f"{numpy_dtype(self.dtype)}[{self.count}] at offset {self.offset} of {self.total}"
        if self.op is ReduceOp.BROADCAST:
            return f"broadcast from rank {self.root} of {what}"
        return what if self.op is ReduceOp.SUM else f"{self.op.name} of {what}"


@dataclass
class _OpenChunk:
    key: int
    chunk: int
    shape: _Shape
    first_rank: int
    opened_at: float
    acc: np.ndarray | None = None  # accumulation buffer (pool memory, accumulation dtype)
    acc_raw: np.ndarray | None = None  # the pool buffer behind acc
    next_rank: int = 0  # ranks below this are summed into acc
    pending: dict[int, np.ndarray] = field(default_factory=dict)  # rank -> raw payload, not yet summed
    contributors: int = 0  # bitmap
    conns: dict[int, int] = field(default_factory=dict)  # rank -> connection to answer on
    stall_warned: bool = False
    active_at: float = 0.0  # when a byte of a contribution last arrived (a chunk that stalls holds memory)
    broadcast_data: np.ndarray | None = None
    parts: dict[int, _Part] | None = None  # rank -> contribution, when summed piece by piece
    forwarded: int = 0  # payload bytes whose sum was sent (piece by piece)


@dataclass
class _Closed:
    """A closed chunk remembered so that late or repeated pushes are answered, not summed."""

    error: Error | None = None
    result: _SharedBuffer | None = None  # retained for late ranks (first_m / deadline modes)
    header: bytes = b""
    data: memoryview | None = None
    answered: int = 0  # bitmap of ranks that have their answer
    expires_at: float = 0.0


@dataclass
class _Job:
    name: str
    params: JobParams
    members: dict[int, _Member] = field(default_factory=dict)
    lost: dict[int, str] = field(default_factory=dict)  # rank -> why
    # Whole results a rank's connection did not acknowledge before it broke, kept while the
    # rank's place is: rank -> chunk key -> delivery.
    undelivered: dict[int, dict[tuple[int, int], _Delivery]] = field(default_factory=dict)
    open: dict[tuple[int, int], _OpenChunk] = field(default_factory=dict)
    closed: OrderedDict[tuple[int, int], _Closed] = field(default_factory=OrderedDict)
    # The closed chunks that were given a result to keep, oldest first, so that the periodic tick
    # visits only those rather than every remembered key; expiry times are monotone within a job.
    retained: deque[_Closed] = field(default_factory=deque)
    bytes_held: int = 0
    active_at: float = 0.0  # its last push: the job keeps its fair share for FAIR_SHARE_IDLE_S after it


#: Upper bounds (seconds) of the chunk-latency and straggler-lateness histograms.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class JobStats:
    """Counters of one job, kept after the job's state is gone (for metrics); plain numbers, so
    the core needs no metrics library."""

    bytes_in: int = 0
    bytes_out: int = 0
    chunks_closed: int = 0
    chunks_failed: dict[str, int] = field(default_factory=dict)  # by error code name
    rejected: dict[str, int] = field(default_factory=dict)  # contributions rejected, by reason
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0
    lateness_sum: dict[int, float] = field(default_factory=dict)  # rank -> seconds after the first contribution
    lateness_count: dict[int, int] = field(default_factory=dict)
    lateness_max: dict[int, float] = field(default_factory=dict)
    # Memory (docs/reliability.md, "Fair shares"): pushes that had to wait for memory (each wait
    # counted once), refused after waiting their operation timeout, dropped as too slow under
    # pressure; chunks failed to free memory; the bytes those freed.
    memory_waits: int = 0
    memory_refusals: int = 0
    pushes_dropped: int = 0
    chunks_reclaimed: int = 0
    bytes_reclaimed: int = 0

    def observe_latency(self, seconds: float) -> None:
        self.latency_sum += seconds
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.latency_buckets[i] += 1
                return
        self.latency_buckets[-1] += 1

    def observe_lateness(self, rank: int, seconds: float) -> None:
        self.lateness_sum[rank] = self.lateness_sum.get(rank, 0.0) + seconds
        self.lateness_count[rank] = self.lateness_count.get(rank, 0) + 1
        self.lateness_max[rank] = max(self.lateness_max.get(rank, 0.0), seconds)


@dataclass
class PushTicket:
    """Where the daemon receives a push's payload, and what to do with it afterwards."""

    conn: int
    job: str
    rank: int
    push: Push
    buffer: np.ndarray | None  # receive payload_len bytes here (None: no payload)
    late: bool = False  # the chunk already closed; payload is read and dropped
    part: _Part | None = None  # summed piece by piece: report arrivals with ReducerCore.progress
    # A rank resending after a reconnect (R22): the first ``skip`` payload bytes are already in
    # ``buffer`` and are read and dropped; the rest is received at ``buffer[skip:]``.
    skip: int = 0
    resent: bool = False  # a whole contribution the chunk already has: read and dropped
    settled: bool = False  # the payload is the chunk's known result (ReduceOp.SETTLED)
    replay: list[Action] = field(default_factory=list)  # to run when the ticket is handed out
    # Bytes of ``buffer`` funded so far: the daemon lands no further before :meth:`ReducerCore.extend`
    # funds more (a push announcing more than constants.ARRIVAL_STEP_BYTES is funded as it arrives).
    limit: int = 0
    # The state machine's own bookkeeping of the push's rate (the slow-push rule, tick):
    received: int = 0  # payload bytes in, as last reported
    window_at: float = 0.0  # the current measuring window began then, with ``window_bytes`` in
    window_bytes: int = 0
    slow_rate: float | None = None  # bytes/s over the last whole window, when under the minimum
    paused_at: float | None = None  # since when it waits for memory mid-payload


@dataclass
class _Wait:
    """A push waiting for memory (the daemon stopped reading its connection)."""

    job: str
    rank: int
    since: float
    limit: float  # seconds it may wait before it is refused with OVERLOADED
    why: str
    within_share: bool  # its job would stay within its fair share: a claim the budget owes it


@dataclass(frozen=True)
class MemoryState:
    """The reducer-wide budget at a glance (metrics and logs)."""

    budget: int
    held: int
    active_jobs: int
    fair_share: int
    waiting: int  # pushes waiting for memory
    pressure: bool  # a job within its fair share is waiting for memory


@dataclass
class _Conn:
    job: str
    rank: int
    session: int
    frames_sent: int = 0  # RESULT frames sent on this connection, counted as the client counts them
    unacked: deque[_Delivery] = field(default_factory=deque)
    # Deliveries on this connection, in frame order, until every rank of their chunk has them;
    # ``safe_frames``: the frame count the worker was last told is safe (wire.Safe).
    safe_pending: deque[_Delivery] = field(default_factory=deque)
    safe_frames: int = 0


class ReducerCore:
    """Aggregation state for every job on one reducer. Not thread-safe: the daemon serialises
    calls. ``now`` arguments are seconds from a monotonic clock the caller owns."""

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
    ) -> None:
        self.incarnation = incarnation
        self.job_budget_bytes = job_budget_bytes
        self.memory_budget_bytes = memory_budget_bytes
        self.bytes_held_total = 0  # over every job: contributions, sums and results being sent
        self.budget_wait_timeout = budget_wait_timeout  # the longest a push waits for memory
        self.min_push_rate = min_push_rate  # bytes/s; 0: slow pushes are never dropped
        self.slow_push_grace = slow_push_grace
        #: Bumped whenever memory is freed or shares change: pushes waiting for memory are worth
        #: asking again only then (the daemon retries them on a change, else once a tick).
        self.memory_epoch = 0
        self._active: dict[str, _Job] = {}  # jobs that hold memory or pushed lately: they divide the budget
        self._waiting: dict[int, _Wait] = {}  # connection -> its push waiting for memory
        self._receiving: dict[int, PushTicket] = {}  # connection -> the push whose payload is arriving
        self._next_contention_log = 0.0
        self.stall_warning = stall_warning
        self.piece_bytes = piece_bytes  # 0: forward whole chunks only
        self.rejoin_grace = rejoin_grace  # the longest a rank's place is kept for its reconnect
        self.pool = pool or BufferPool(max_free_bytes=memory_budget_bytes)
        self._combiner = Combiner()  # its float32 scratch sums 16-bit pieces
        self._jobs: dict[str, _Job] = {}
        self._conns: dict[int, _Conn] = {}
        self.job_stats: OrderedDict[str, JobStats] = OrderedDict()  # survives the job's state, bounded

    # --- membership ---

    def join(self, conn: int, hello: Hello, *, peer: str = "?", now: float = 0.0) -> list[Action]:
        """A worker connection completed its handshake. Returns errors if it cannot join.

        One live client per (job, rank) (R23): a connection of another session for a rank
        whose client is still connected is refused, naming both peers. The same session
        joining again is that client reconnecting (R22): the rank keeps its place, and what it
        resends is matched with what the reducer already has."""
        params = JobParams.from_hello(hello)
        job = self._jobs.get(hello.job)
        if job is None:
            job = self._jobs[hello.job] = _Job(hello.job, params)
        elif job.params != params:
            diffs = [
                f"{name}: job has {getattr(job.params, name)}, rank {hello.rank} sent {getattr(params, name)}"
                for name in ("world_size", "mode", "min_contributors", "deadline_ms", "op_timeout_ms")
                if getattr(job.params, name) != getattr(params, name)
            ]
            message = f"job {hello.job!r} parameters differ: " + "; ".join(diffs)
            if not job.members:
                job.params = params  # nobody left to disagree with: the newcomer defines the job
            else:
                return [SendError(conn, Error(ErrorCode.JOB_MISMATCH, True, message), close_after=True)]
        actions: list[Action] = []
        member = job.members.get(hello.rank)
        if member is not None and member.session != hello.session:
            if member.conns:
                message = (f"rank {hello.rank} of job {hello.job!r} is held by a live client at {member.peer} (session "
                           f"{member.session:#x}); a second client at {peer} (session {hello.session:#x}) claimed it: "
                           "each rank needs a client of its own")
                return [SendError(conn, Error(ErrorCode.JOB_MISMATCH, True, message), close_after=True)]
            # The rank's place was kept for a reconnect, and a new client came instead: the
            # worker restarted, and what its old session had sent is void.
            actions += self._lose(job, hello.rank, f"rank {hello.rank} of job {hello.job!r} restarted with a new session", now)
            member = None
            if self._jobs.get(hello.job) is not job:  # that was its last member: the job starts afresh
                job = self._jobs[hello.job] = _Job(hello.job, params)
        if member is None:
            grace = min(hello.reconnect_window_ms / 1000, self.rejoin_grace)
            member = job.members[hello.rank] = _Member(hello.session, grace=grace, peer=peer)
        elif member.left_at is not None:
            actions.append(Log("info", f"rank {hello.rank} of job {hello.job!r} reconnected from {peer} after "
                                       f"{now - member.left_at:.3f}s"))
            member.left_at = None
        member.conns.add(conn)
        member.peer = peer
        job.lost.pop(hello.rank, None)
        self._conns[conn] = _Conn(hello.job, hello.rank, hello.session)
        return actions

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

    def leave(self, conn: int, reason: str, now: float, *, for_good: bool = False) -> list[Action]:
        """A connection closed or failed. A rank whose client reconnects (its HELLO gave a
        reconnect window) keeps its place for the rejoin grace: its open contributions stay, and
        the results it did not acknowledge are kept for it; unless the worker said its client
        closed (``for_good``): nothing will reconnect, and a new client for the rank must not
        look like a restarted worker. Otherwise, when a rank loses its last connection, the
        job's open chunks that still need it fail, naming the rank (modes that tolerate
        stragglers carry on as long as a quorum can still form)."""
        info = self._conns.pop(conn, None)
        self._waiting.pop(conn, None)
        self._receiving.pop(conn, None)
        if info is None:
            return []
        job = self._jobs.get(info.job)
        member = None if job is None else job.members.get(info.rank)
        if job is None or member is None or member.session != info.session:
            self._release_unacked(info)
            return []
        member.conns.discard(conn)
        why = f"rank {info.rank} of job {info.job!r} disconnected ({reason})"
        if member.grace > 0 and not for_good:
            undelivered = job.undelivered.setdefault(info.rank, {})
            for delivery in info.unacked:
                kept = undelivered.pop(delivery.chunk_key, None)
                if kept is not None:
                    kept.done()
                undelivered[delivery.chunk_key] = delivery
            info.unacked.clear()
            if member.conns or member.left_at is not None:
                return []
            member.left_at = now
            return [Log("info", f"{why}; its place is kept for {member.grace:.1f}s while it reconnects")]
        self._release_unacked(info)
        # One broken stream means the client is broken: drop its siblings too.
        actions: list[Action] = []
        for sibling in sorted(member.conns):
            sibling_info = self._conns.pop(sibling, None)
            if sibling_info is not None:
                self._release_unacked(sibling_info)
            actions.append(CloseConnection(sibling))
        member.conns.clear()
        return actions + self._lose(job, info.rank, why, now)

    @staticmethod
    def _release_unacked(info: _Conn) -> None:
        while info.unacked:
            info.unacked.popleft().done()

    def _lose(self, job: _Job, rank: int, why: str, now: float) -> list[Action]:
        """Rank ``rank`` is gone for good: fail what needed it, drop what was kept for it."""
        member = job.members.pop(rank, None)
        if member is not None:
            for conn in member.conns:
                info = self._conns.pop(conn, None)
                if info is not None:
                    self._release_unacked(info)
        for delivery in job.undelivered.pop(rank, {}).values():
            delivery.done()
        for chunk in job.open.values():  # contributions of the old session that never finished
            part = chunk.parts.get(rank) if chunk.parts is not None else None
            if chunk.parts is not None and part is not None and not part.writing and part.received < part.shared.buffer.nbytes:
                del chunk.parts[rank]
                part.chunk = None
                part.shared.release()
        job.lost[rank] = why
        for closed in job.retained:  # results kept for this rank will not be collected
            if closed.result is not None:
                closed.answered |= 1 << rank
                if bin(closed.answered).count("1") >= job.params.world_size:
                    self._drop_retained(closed)
        failed: list[Action] = []
        for chunk_key, chunk in list(job.open.items()):
            if self._can_still_close(job, chunk):
                continue
            failed += self._fail(job, chunk_key, ErrorCode.PEER_LOST, f"{why}; chunk cannot complete", now)
        actions: list[Action] = [Log("warning" if failed else "info", why)]
        actions += failed
        if not job.members and not self._keeps_results(job):
            self._drop_job(job)
        return actions

    @staticmethod
    def _keeps_results(job: _Job) -> bool:
        """Results still kept for ranks that have not collected them (a straggler may connect
        after the others have finished and left)."""
        return any(closed.result is not None for closed in job.retained)

    def _can_still_close(self, job: _Job, chunk: _OpenChunk) -> bool:
        if job.params.mode is StragglerMode.ALL:
            return not job.lost
        alive = chunk.contributors
        for rank in job.members:
            alive |= 1 << rank
        return bin(alive).count("1") >= job.params.quorum

    def _drop_job(self, job: _Job) -> None:
        for chunk in job.open.values():
            self._free_chunk(job, chunk)
        for kept in job.undelivered.values():
            for delivery in kept.values():
                delivery.done()
        job.undelivered.clear()
        for closed in job.retained:
            if closed.result is not None:
                closed.result.release()
        del self._jobs[job.name]
        if self._active.get(job.name) is job:
            del self._active[job.name]
            self.memory_epoch += 1

    # --- data path ---

    def begin_push(self, conn: int, push: Push, payload_len: int, now: float) -> PushTicket | list[Action] | None:
        """A push header arrived. Returns a ticket saying where to receive its payload, a list of
        actions when it is rejected (its payload must then be read and discarded), or ``None``
        when it must wait for memory (the caller stops reading the connection, TCP
        backpressure, and asks again once memory was freed or a tick passed; :meth:`tick`
        refuses it once it waited its operation timeout).

        Memory (docs/reliability.md, "Fair shares"): a push that opens a chunk needs room in its
        job's budget and in the reducer-wide one (:meth:`_room`: within its fair share a job needs
        only the memory to be there; beyond it, only what leaves every other active job room to
        reach its own share). Pushes to an open chunk join it whatever the budgets. A push
        announcing more than ``constants.ARRIVAL_STEP_BYTES`` is funded one step at a time as
        its bytes arrive (:meth:`extend`) where its bytes join the chunk as they come (every
        rank contributes, a sum-like op: cut-through); elsewhere the payload is handed over
        whole, and funded whole."""
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
        stepwise = cut_through and payload_len > C.ARRIVAL_STEP_BYTES
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
                self._wait(conn, job, info.rank, now, self.budget_wait_timeout, False,
                           f"job {job.name!r} holds {job.bytes_held} bytes of its budget of {self.job_budget_bytes}")
                return None
            short = self._room(job, grant)
            if short is not None:
                self._wait(conn, job, info.rank, now, min(self.budget_wait_timeout, job.params.op_timeout_ms / 1000), *short)
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
        step = min(C.ARRIVAL_STEP_BYTES, buffer.nbytes - ticket.limit)
        short = self._room(job, step)
        if short is not None:
            if ticket.paused_at is None:
                ticket.paused_at = now
            self._wait(ticket.conn, job, ticket.rank, now, min(self.budget_wait_timeout, job.params.op_timeout_ms / 1000),
                       *short)
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

    def _wait(self, conn: int, job: _Job, rank: int, now: float, limit: float, within_share: bool, why: str) -> None:
        wait = self._waiting.get(conn)
        if wait is None:
            self._waiting[conn] = _Wait(job.name, rank, now, limit, why, within_share)
            self.stats(job.name).memory_waits += 1
        else:
            wait.why, wait.within_share = why, within_share

    def _mark_active(self, job: _Job, now: float) -> None:
        job.active_at = now
        if self._active.get(job.name) is not job:
            self._active[job.name] = job
            self.memory_epoch += 1

    def fair_share(self) -> int:
        """What each active job may always hold of the reducer-wide budget: an equal part, and
        at least ``constants.MIN_FAIR_SHARE_BYTES``."""
        return max(self.memory_budget_bytes // max(1, len(self._active)), C.MIN_FAIR_SHARE_BYTES)

    def _room(self, job: _Job, nbytes: int) -> tuple[bool, str] | None:
        """``None`` when ``job`` may take ``nbytes`` more of the reducer's memory now; else
        (whether it would stay within its fair share, why it must wait). Within its share a job
        needs only the memory to be there; beyond it, it may use only what leaves every other
        active job room to reach its own share."""
        held, total, budget = job.bytes_held, self.bytes_held_total, self.memory_budget_bytes
        share = self.fair_share()
        within = held + nbytes <= share
        if total + nbytes > budget:
            return within, (f"the reducer holds {total} bytes of its memory budget of {budget} (--memory-budget) over "
                            f"every job; job {job.name!r} holds {held} of its fair share of {share} "
                            f"({len(self._active)} active jobs)")
        if within:
            return None
        kept = sum(max(0, share - other.bytes_held) for other in self._active.values() if other is not job)
        if total + nbytes + kept <= budget:
            return None
        return False, (f"job {job.name!r} holds {held} bytes, over its fair share of {share} of the memory budget of "
                       f"{budget} (--memory-budget, {len(self._active)} active jobs); {kept} bytes are kept for the "
                       "other jobs' shares")

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
        member = job.members.get(rank)
        shape = _Shape(push.total, push.offset, push.count, push.dtype, push.op, push.root)
        if member is None or member.grace <= 0 or chunk.shape != shape or chunk.conns.get(rank) == conn:
            return None
        part = chunk.parts.get(rank) if chunk.parts is not None else None
        if part is not None:
            if part.writing:
                return None  # a push of this rank is still arriving: a real duplicate
            part.writing = True
            part.shared.retain(1)  # the new push's reference, released when it ends
            chunk.conns[rank] = conn
            ticket = PushTicket(conn, job.name, rank, push, part.shared.buffer, part=part, skip=part.received,
                                limit=part.shared.charged)
            if chunk.forwarded:
                assert chunk.parts is not None
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
            del job.open[chunk_key]
            targets = self._answer_to(chunk)
            done = chunk.forwarded  # the ranks in the chunk have its sums up to here, in pieces
            if targets and done < len(data):
                rest = Result(push.key, push.offset + done // item, push.count - done // item, push.chunk, push.dtype,
                              world, everyone)
                actions.append(self._send_to(targets, result_header(rest, len(data) - done), data[done:], shared))
            for rank, conn in chunk.conns.items():
                if conn in targets:
                    closed.answered |= 1 << rank
            self._track(job, chunk, header, data, shared)
            self._free_chunk(job, chunk)
        shared.retain(1)  # kept for the ranks that push later
        closed.result, closed.header, closed.data = shared, header, data
        closed.expires_at = now + job.params.op_timeout_ms / 1000
        job.retained.append(closed)
        self._remember(job, chunk_key, closed)
        shared.release()
        return actions

    def _evict_deliveries(self, jobs: list[_Job], enough: Callable[[], bool]) -> None:
        """Memory is short: drop the results kept for workers that have not acknowledged them yet,
        oldest first, until ``enough()``. They are only insurance for a reconnect (R22), and a
        worker's acknowledgement may be queued behind the very push that waits for this memory."""
        for job in jobs:
            for member in job.members.values():
                for conn in member.conns:
                    info = self._conns.get(conn)
                    while info is not None and info.unacked and not enough():
                        info.unacked.popleft().done()
            if enough():
                return

    def _send_to(self, targets: list[int], header: bytes, data: memoryview, shared: _SharedBuffer) -> SendResult:
        """One RESULT frame to each connection in ``targets``, counted per connection (the count
        that ACK frames acknowledge); takes a reference on ``shared`` for each."""
        shared.retain(len(targets))
        for conn in targets:
            self._conns[conn].frames_sent += 1
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
                delivery = _Delivery(info.frames_sent, chunk_key, header, data, shared, group)
                info.unacked.append(delivery)
                info.safe_pending.append(delivery)
                continue
            undelivered = job.undelivered.setdefault(rank, {})
            kept = undelivered.pop(chunk_key, None)
            if kept is not None:
                kept.done()
            undelivered[chunk_key] = _Delivery(0, chunk_key, header, data, shared, group)

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
            chunk = job.open[chunk_key] = _OpenChunk(push.key, push.chunk, shape, rank, now, parts={})
        refusal = self._refusal(chunk, rank, shape, 0 if buffer is None else buffer.nbytes)
        if refusal is not None:
            self._give(job, buffer, ticket.limit)
            ticket.buffer = None
            return self._refuse(job, chunk, rank, ticket.conn, *refusal, now)
        assert chunk.parts is not None and buffer is not None  # same shape: a sum, with a payload
        part = _Part(rank, _SharedBuffer(buffer, self.pool, 2, self._freer(job), ticket.limit), chunk)
        chunk.active_at = now
        chunk.parts[rank] = part
        chunk.conns[rank] = ticket.conn
        ticket.part = part
        return []

    def _refusal(self, chunk: _OpenChunk, rank: int, shape: _Shape, got: int) -> tuple[ErrorCode, str] | None:
        """Why rank ``rank``'s contribution of ``got`` payload bytes cannot join ``chunk``."""
        if chunk.shape != shape:
            return ErrorCode.CONTRIBUTION_MISMATCH, (f"ranks disagree: rank {chunk.first_rank} sent {chunk.shape.describe()}, "
                                                     f"rank {rank} sent {shape.describe()}")
        if chunk.contributors >> rank & 1 or (chunk.parts is not None and rank in chunk.parts):
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

    def _freer(self, job: _Job) -> Callable[[int], None]:
        def freed(nbytes: int) -> None:
            job.bytes_held -= nbytes
            self.bytes_held_total -= nbytes
            self.memory_epoch += 1

        return freed

    def _take(self, job: _Job, nbytes: int, *, charge: int | None = None, lazy: bool = False) -> np.ndarray | None:
        """A buffer of ``nbytes``, of which ``charge`` (all by default) count against the budgets
        now; ``lazy`` for one funded as its bytes arrive (BufferPool.take)."""
        if nbytes == 0:
            return None
        self._charge(job, nbytes if charge is None else charge)
        return self.pool.take(nbytes, lazy=lazy)

    def _charge(self, job: _Job, nbytes: int) -> None:
        """Count ``nbytes`` more against the budgets. The pool's free buffers are memory too: what
        it keeps shrinks so that held and free memory together stay within the reducer-wide
        budget (a churn of pushes dropped and replaced would otherwise park a budget's worth of
        written buffers in the pool beside the budget held)."""
        job.bytes_held += nbytes
        self.bytes_held_total += nbytes
        room = self.memory_budget_bytes - self.bytes_held_total
        if self.pool.free_bytes > room:
            self.pool.trim(max(0, room))

    def _give(self, job: _Job | None, buffer: np.ndarray | None, charged: int | None = None) -> None:
        if buffer is None:
            return
        charged = buffer.nbytes if charged is None else charged
        if job is not None:  # None: the job was dropped meanwhile, its own count with it
            job.bytes_held -= charged
        self.bytes_held_total -= charged
        self.memory_epoch += 1
        if charged == buffer.nbytes:  # only wholly written memory goes back to the pool
            self.pool.give(buffer)

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
        member = None if job is None else job.members.get(part.rank)
        info = self._conns.get(ticket.conn)
        if chunk is not None and member is not None and member.grace > 0 and info is not None and info.session == member.session:
            part.writing = False  # kept, with what arrived, for the rank's reconnect (R22)
            part.shared.release()  # the push's reference
            return
        if chunk is not None:  # the chunk now lacks this rank: the rank's departure fails it
            assert chunk.parts is not None
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
            chunk = job.open[chunk_key] = _OpenChunk(push.key, push.chunk, shape, rank, now)
        refusal = self._refusal(chunk, rank, shape, 0 if ticket.buffer is None else ticket.buffer.nbytes)
        if refusal is not None:
            self._give(job, ticket.buffer)
            return self._refuse(job, chunk, rank, ticket.conn, *refusal, now)
        chunk.contributors |= 1 << rank
        chunk.conns[rank] = ticket.conn
        chunk.active_at = now
        self.stats(job.name).observe_lateness(rank, now - chunk.opened_at)
        if ticket.buffer is not None:
            if push.op is ReduceOp.BROADCAST:
                chunk.broadcast_data = ticket.buffer
            else:
                chunk.pending[rank] = ticket.buffer
                self._fold_prefix(job, chunk)
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

    def _forward(self, job: _Job, chunk: _OpenChunk, now: float) -> list[Action]:
        """Sum and send what every rank of a cut-through chunk has sent beyond what was sent:
        whole pieces while payloads arrive, then the rest; close the chunk once every push
        ended and the sum of its last byte left."""
        parts = chunk.parts
        assert parts is not None
        world = job.params.world_size
        if len(parts) < world:
            return []
        wire = numpy_dtype(chunk.shape.dtype)
        size = chunk.shape.count * wire.itemsize
        ready = min(part.received for part in parts.values())
        ready -= ready % wire.itemsize
        start = chunk.forwarded
        actions: list[Action] = []
        if ready > start and (ready == size or (self.piece_bytes and ready - start >= self.piece_bytes)):
            actions += self._send_piece(job, chunk, start, ready)
        if chunk.forwarded == size and chunk.contributors == (1 << world) - 1:  # every push ended
            shape = chunk.shape
            whole = Result(chunk.key, shape.offset, shape.count, chunk.chunk, shape.dtype, world,
                           bitmap_from_ranks((1 << world) - 1, world))
            out = parts[0].shared
            self._track(job, chunk, result_header(whole, size), out.buffer[:size].data, out)
            del job.open[(chunk.key, chunk.chunk)]
            stats = self.stats(job.name)
            stats.chunks_closed += 1
            stats.observe_latency(now - chunk.opened_at)
            self._remember(job, (chunk.key, chunk.chunk), _Closed(answered=chunk.contributors))
            self._free_chunk(job, chunk)
        return actions

    def _send_piece(self, job: _Job, chunk: _OpenChunk, start: int, stop: int) -> list[Action]:
        parts = chunk.parts
        assert parts is not None
        world = job.params.world_size
        shape = chunk.shape
        self._combiner.combine_into_first([parts[rank].shared.buffer[start:stop] for rank in range(world)], shape.dtype,
                                          shape.op)
        chunk.forwarded = stop
        item = numpy_dtype(shape.dtype).itemsize
        result = Result(chunk.key, shape.offset + start // item, (stop - start) // item, chunk.chunk, shape.dtype,
                        world, bitmap_from_ranks((1 << world) - 1, world))
        targets = self._answer_to(chunk)
        self.stats(job.name).bytes_out += len(targets) * (stop - start)
        if not targets:
            return []
        out = parts[0].shared  # rank 0's buffer holds the sum
        return [self._send_to(targets, result_header(result, stop - start), out.buffer[start:stop].data, out)]

    def _answer_to(self, chunk: _OpenChunk) -> list[int]:
        """The connections a chunk's result goes to: each contributor's, while it is open."""
        return [chunk.conns[r] for r in sorted(chunk.conns) if chunk.conns[r] in self._conns]

    def _fold_prefix(self, job: _Job, chunk: _OpenChunk) -> None:
        """Sum pending contributions whose lower-ranked predecessors are all in."""
        while chunk.next_rank in chunk.pending:
            self._accumulate(job, chunk, chunk.pending.pop(chunk.next_rank))
            chunk.next_rank += 1

    def _accumulate(self, job: _Job, chunk: _OpenChunk, raw: np.ndarray) -> None:
        wire = numpy_dtype(chunk.shape.dtype)
        acc_dtype = ACCUMULATION_DTYPES.get(chunk.shape.dtype, wire)
        data = raw.view(wire)
        if chunk.acc is None:
            if acc_dtype == wire:
                chunk.acc_raw, chunk.acc = raw, data  # take ownership: no copy for the first one
                return
            chunk.acc_raw = self._take(job, chunk.shape.count * acc_dtype.itemsize)
            assert chunk.acc_raw is not None
            chunk.acc = chunk.acc_raw.view(acc_dtype)
            np.copyto(chunk.acc, data, casting="unsafe")
        else:
            UFUNCS[chunk.shape.op](chunk.acc, data, out=chunk.acc, casting="unsafe")
        self._give(job, raw)

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
        elif shape.op is ReduceOp.BROADCAST:
            if chunk.broadcast_data is None:
                return self._fail_detached(job, chunk, ErrorCode.CONTRIBUTION_MISMATCH,
                                           f"broadcast root {shape.root} did not contribute", now)
            out_raw = chunk.broadcast_data
        else:
            for rank in sorted(chunk.pending):  # ranks that are in, above a gap left by stragglers
                self._accumulate(job, chunk, chunk.pending.pop(rank))
            assert chunk.acc is not None and chunk.acc_raw is not None
            if chunk.acc.dtype == wire:
                out_raw = chunk.acc_raw
            else:
                rounded = self._take(job, shape.count * wire.itemsize)
                assert rounded is not None
                np.copyto(rounded.view(wire), chunk.acc, casting="unsafe")
                self._give(job, chunk.acc_raw)
                out_raw = rounded
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
        key, chunk = chunk_key
        delivery = job.undelivered.get(rank, {}).pop(chunk_key, None)
        if delivery is not None:  # a reconnected rank asks again for a result its old connection lost
            action = self._send_to([conn], delivery.header, delivery.data, delivery.shared)
            info = self._conns[conn]
            delivery.last_frame = info.frames_sent
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

    def _free_chunk(self, job: _Job, chunk: _OpenChunk) -> None:
        for raw in chunk.pending.values():
            self._give(job, raw)
        chunk.pending.clear()
        if chunk.acc_raw is not None:
            self._give(job, chunk.acc_raw)
            chunk.acc_raw = chunk.acc = None
        if chunk.broadcast_data is not None:
            self._give(job, chunk.broadcast_data)
            chunk.broadcast_data = None
        if chunk.parts:
            for part in chunk.parts.values():  # memory a push still writes into is freed when it ends
                part.chunk = None
                part.shared.release()
            chunk.parts.clear()

    def _fail(self, job: _Job, chunk_key: tuple[int, int], code: ErrorCode, why: str, now: float) -> list[Action]:
        chunk = job.open.pop(chunk_key, None)
        if chunk is None:
            return []
        return self._fail_detached(job, chunk, code, why, now)

    def _fail_detached(self, job: _Job, chunk: _OpenChunk, code: ErrorCode, why: str, now: float) -> list[Action]:
        self._free_chunk(job, chunk)
        message = f"job {job.name!r} key {chunk.key:#x} chunk {chunk.chunk}: {why}"
        stats = self.stats(job.name)
        stats.chunks_failed[code.name] = stats.chunks_failed.get(code.name, 0) + 1
        error = Error(code, False, message, chunk.key, chunk.chunk)
        self._remember(job, (chunk.key, chunk.chunk), _Closed(error=error))
        actions: list[Action] = [Log("warning", message)]
        for rank in sorted(chunk.conns):
            if chunk.conns[rank] in self._conns:
                actions.append(SendError(chunk.conns[rank], error))
        return actions

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
                                          f"waiting for rank(s) {self._missing(job, chunk)}", now)
                elif age >= self.stall_warning and not chunk.stall_warned:
                    chunk.stall_warned = True
                    actions.append(Log("warning", f"job {job.name!r} key {chunk.key:#x} chunk {chunk.chunk} open for {age:.1f}s; "
                                                  f"waiting for rank(s) {self._missing(job, chunk)}"))
            retained = job.retained
            while retained and (retained[0].result is None or now >= retained[0].expires_at):
                self._drop_retained(retained.popleft())
            if not job.members and not self._keeps_results(job):
                self._drop_job(job)  # everyone left and nothing is kept for a late rank
        return actions

    def _reclaim(self, now: float) -> list[Action]:
        """Memory pressure (a job within its fair share waits for memory): a push that delivered
        less than ``min_push_rate`` over a whole ``slow_push_grace`` window, or that waited that
        long for memory mid-payload while its job held its share or more, is dropped: its rank
        is told the rate and disconnected, its chunk fails with OVERLOADED for the job's other
        ranks. A chunk of a job over its share that received nothing for the grace and has no push
        arriving (waiting for a rank that hangs) fails too, oldest first, until the job is back
        within its share. Without
        pressure nothing is dropped, however slow."""
        if not self.min_push_rate:
            return []
        grace = self.slow_push_grace
        share = self.fair_share()
        for ticket in self._receiving.values():  # the rate is measured always, acted on only under pressure
            if ticket.paused_at is not None:
                # Paused, a push wants more than its job holds; at its share already, it waits for
                # memory that a job below its share needs first. Where the floor of a share makes
                # the shares add up to more than the budget (more active jobs than budget / floor),
                # every stalled job sits exactly at its share: only ">=" frees room for a new one.
                job = self._jobs.get(ticket.job)
                if job is not None and job.bytes_held >= share and now - ticket.paused_at >= grace:
                    ticket.slow_rate = 0.0
            elif now - ticket.window_at >= grace:
                rate = (ticket.received - ticket.window_bytes) / (now - ticket.window_at)
                ticket.slow_rate = rate if rate < self.min_push_rate else None
                ticket.window_at, ticket.window_bytes = now, ticket.received
        if not any(wait.within_share for wait in self._waiting.values()):
            return []
        actions: list[Action] = []
        for ticket in [t for t in self._receiving.values() if t.slow_rate is not None]:
            actions += self._drop_push(ticket, share, now)
        for job in [j for j in self._active.values() if j.bytes_held > share]:
            for chunk_key, chunk in sorted(job.open.items(), key=lambda item: item[1].opened_at):
                if job.bytes_held <= share or self._jobs.get(job.name) is not job:
                    break
                if now - max(chunk.active_at, chunk.opened_at) < grace or (
                        chunk.parts and any(part.writing for part in chunk.parts.values())):
                    continue  # a push still arriving is judged by its own rate, above
                held = job.bytes_held
                self.stats(job.name).chunks_reclaimed += 1
                actions += self._fail(job, chunk_key, ErrorCode.OVERLOADED,
                                      f"job {job.name!r} holds {held} bytes, over its fair share of {share} of the "
                                      f"reducer's memory budget, while jobs within their share wait for memory; this "
                                      f"chunk received nothing for {now - max(chunk.active_at, chunk.opened_at):.1f}s "
                                      f"(waiting for rank(s) {self._missing(job, chunk)}) and was failed to free its "
                                      "memory", now)
                self.stats(job.name).bytes_reclaimed += max(0, held - job.bytes_held)
        return actions

    def _drop_push(self, ticket: PushTicket, share: int, now: float) -> list[Action]:
        job = self._jobs.get(ticket.job)
        info = self._conns.get(ticket.conn)
        self._receiving.pop(ticket.conn, None)
        if job is None or info is None:
            return []
        push, rank = ticket.push, ticket.rank
        size = 0 if ticket.buffer is None else ticket.buffer.nbytes
        what = f"its push of key {push.key:#x} chunk {push.chunk} ({ticket.received} of {size} bytes in)"
        if ticket.paused_at is not None:
            why = (f"rank {rank} of job {job.name!r}: {what} waited {now - ticket.paused_at:.1f}s for memory while its "
                   f"job held {job.bytes_held} bytes, at or over its fair share of {share}, and jobs within their share waited")
        else:
            why = (f"rank {rank} of job {job.name!r}: {what} arrived at {ticket.slow_rate or 0.0:.0f} B/s over the last "
                   f"{self.slow_push_grace:.1f}s, under the minimum of {self.min_push_rate} B/s (REDSRV_MIN_PUSH_RATE) "
                   "while jobs within their share waited for the reducer's memory")
        why += "; the push was dropped and its memory freed"
        member = job.members.get(rank)
        if member is not None and member.session == info.session:
            member.grace = 0.0  # dropped on purpose: its place is not kept for a reconnect
        stats = self.stats(job.name)
        stats.pushes_dropped += 1
        part = ticket.part
        stats.bytes_reclaimed += part.shared.charged if part is not None else size
        actions: list[Action] = []
        if part is not None and part.chunk is not None:
            part.chunk.conns.pop(rank, None)  # told below, once, as it is disconnected
            actions += self._fail(job, (part.chunk.key, part.chunk.chunk), ErrorCode.OVERLOADED, why, now)
        else:
            actions.append(Log("warning", why))
        # The daemon closes the connection, and its abort_push frees what the push held.
        actions.append(SendError(ticket.conn, Error(ErrorCode.OVERLOADED, True, why, push.key, push.chunk), close_after=True))
        return actions

    def _refuse_waits(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for conn, wait in list(self._waiting.items()):
            if now - wait.since < wait.limit:
                continue
            del self._waiting[conn]
            self.stats(wait.job).memory_refusals += 1
            message = (f"no memory for rank {wait.rank} of job {wait.job!r} after waiting {now - wait.since:.1f}s (its "
                       f"operation timeout, {wait.limit:.1f}s at most): {wait.why}")
            actions += [Log("warning", message), SendError(conn, Error(ErrorCode.OVERLOADED, True, message), close_after=True)]
        if self._waiting and any(w.within_share for w in self._waiting.values()) and now >= self._next_contention_log:
            self._next_contention_log = now + C.CONTENTION_LOG_INTERVAL_S
            actions.append(Log("warning", self._contention_report()))
        return actions

    def _contention_report(self) -> str:
        """Who holds the reducer's memory, for the log while it is contended."""
        mib = 1 << 20
        holders = sorted(self._active.values(), key=lambda j: j.bytes_held, reverse=True)
        waiting: dict[str, int] = {}
        for wait in self._waiting.values():
            waiting[wait.job] = waiting.get(wait.job, 0) + 1
        top = "; ".join(
            f"job {job.name!r} holds {job.bytes_held / mib:.1f} MiB, {waiting.get(job.name, 0)} push(es) waiting, "
            f"{self.stats(job.name).memory_refusals} refused, {self.stats(job.name).pushes_dropped} dropped as slow"
            for job in holders[:5])
        return (f"memory contended: {self.bytes_held_total / mib:.1f} MiB of the {self.memory_budget_bytes / mib:.1f} MiB "
                f"budget held, {len(self._active)} active jobs, fair share {self.fair_share() / mib:.1f} MiB, "
                f"{len(self._waiting)} push(es) waiting for memory; largest holders: {top}")

    def memory(self) -> MemoryState:
        """The reducer-wide budget now."""
        return MemoryState(self.memory_budget_bytes, self.bytes_held_total, len(self._active), self.fair_share(),
                           len(self._waiting), any(w.within_share for w in self._waiting.values()))

    @staticmethod
    def _missing(job: _Job, chunk: _OpenChunk) -> str:
        return ", ".join(str(r) for r in range(job.params.world_size) if not chunk.contributors >> r & 1) or "none"

    def shutdown(self, why: str) -> list[Action]:
        """Fail every open chunk of every job (the daemon is stopping)."""
        actions: list[Action] = []
        for job in list(self._jobs.values()):
            for chunk_key in list(job.open):
                actions += self._fail(job, chunk_key, ErrorCode.SHUTDOWN, why, 0.0)
        return actions

    # --- introspection ---

    def stats(self, job: str) -> JobStats:
        """The counters of ``job`` (created on first use; the 1,000 most recent jobs are kept)."""
        stats = self.job_stats.get(job)
        if stats is None:
            stats = self.job_stats[job] = JobStats()
            while len(self.job_stats) > 1000:
                self.job_stats.popitem(last=False)
        else:
            self.job_stats.move_to_end(job)
        return stats

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
