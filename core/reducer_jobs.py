"""The records the reducer's state machine keeps besides chunks: a job (its parameters, members,
open and remembered chunks, the results kept for ranks that reconnect), a joined connection, a
push whose payload is arriving (:class:`PushTicket`, also the daemon's handle on it), a push
waiting for memory, and the counters and memory figures the metrics read.

Plain data with no rules of their own beyond bookkeeping helpers: the rules are ``ReducerCore``'s
(``reducer.py``) and, for memory, ``reducer_memory``'s.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import constants as C
from .reducer_actions import Action
from .reducer_buffers import _SharedBuffer
from .reducer_chunks import _Closed, _OpenChunk, _Part
from .wire import Hello, Push, StragglerMode

__all__ = ["JobParams", "JobStats", "LATENCY_BUCKETS", "MemoryState", "PushTicket"]


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
    # The chunk's native forwarder, made as this push joined it last, and the (connection, rank) of
    # each push whose landed bytes it must be told (the daemon's receivers' feed).
    forwarder: Any = None
    feeds: list[tuple[int, int]] = field(default_factory=list)
    # Bytes of ``buffer`` funded so far: the daemon lands no further before :meth:`ReducerCore.extend`
    # funds more (a push announcing more than constants.ARRIVAL_STEP_BYTES is funded as it arrives).
    limit: int = 0
    # The state machine's own bookkeeping of the push's rate (the slow-push rule, tick):
    received: int = 0  # payload bytes in, as last reported
    window_at: float = 0.0  # the current measuring window began then, with ``window_bytes`` in
    window_bytes: int = 0
    slow_rate: float | None = None  # bytes/s over the last whole window, when under the minimum
    paused_at: float | None = None  # since when it waits for memory mid-payload

    @property
    def next_step(self) -> int:
        """Bytes :meth:`ReducerCore.extend` funds next: a step, or what the payload has left
        beyond ``limit`` (0 with no buffer)."""
        return 0 if self.buffer is None else min(C.ARRIVAL_STEP_BYTES, self.buffer.nbytes - self.limit)


@dataclass
class _Wait:
    """A push waiting for memory (the daemon stopped reading its connection)."""

    job: str
    rank: int
    since: float
    limit: float  # seconds it may wait before it is refused with OVERLOADED
    claim: int  # the bytes it waits for
    why: str
    within_share: bool  # the claim is within its job's fair share (_MemoryRules._room): the budget owes it


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
    # RESULT frames sent on this connection, counted as the client counts them: one int64 that a
    # native forwarder counts its frames in too (ReducerCore._engage), so it is read as frames_sent[0].
    frames_sent: array[int] = field(default_factory=lambda: array("q", [0]))
    unacked: deque[_Delivery] = field(default_factory=deque)
    # Deliveries on this connection, in frame order, until every rank of their chunk has them;
    # ``safe_frames``: the frame count the worker was last told is safe (wire.Safe).
    safe_pending: deque[_Delivery] = field(default_factory=deque)
    safe_frames: int = 0


