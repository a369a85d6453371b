"""A chunk's life in the reducer: its states, the transitions allowed between them, and the three
ways an open chunk accumulates its contributions.

States, in the manner of h11: a chunk is :attr:`ChunkState.OPEN` while contributions join it,
then :attr:`~ChunkState.CLOSED` (its result went out) or :attr:`~ChunkState.FAILED` (an error
went out), and is remembered in that state so that late or repeated pushes are answered, not
summed. :data:`CHUNK_TRANSITIONS` is the whole table; :meth:`_OpenChunk.transition` and
:meth:`_Closed.expect` consult it and raise :class:`ChunkStateError` on anything else. Such an
error is a bug in the core, never a peer's fault: what peers do wrong (a push to a closed chunk, a
duplicate, a mismatch) is answered on the wire by ``ReducerCore``'s rules before any transition
is attempted.

Accumulation, one type per mode, behind one interface (``add``, ``outcome``, ``free``, ``has``,
``writing``):

- :class:`_CutThroughChunk`: every rank must contribute (straggler mode "all") to a sum-like op.
  Each rank's receive buffer joins the chunk at its push's header (a :class:`_Part`), and
  ``_forward`` (``reducer_results``) combines in rank order and sends each piece every rank has.
- :class:`_RankOrderChunk`: whole payloads (the straggler modes, and empty operations). Rank r's
  payload is added once ranks 0..r-1 are in; earlier arrivals wait in their buffers until then,
  or until the chunk closes with the contributors it has (deadline, first m).
- :class:`_BroadcastChunk`: the root's payload is the result; the other ranks send none.

Which type a chunk is follows from its first push's shape and the job's mode; a later push whose
shape differs is refused as a mismatch before it could reach the wrong type.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .combine import ACCUMULATION_DTYPES
from .reducer_buffers import _SharedBuffer
from .wire import DType, Error, ReduceOp, numpy_dtype

if TYPE_CHECKING:
    from .reducer_jobs import _Job
    from .reducer_memory import _MemoryRules

__all__ = ["ChunkState", "ChunkStateError", "CHUNK_TRANSITIONS"]


class ChunkState(enum.Enum):
    """Where a chunk is in its life (``docs/architecture.md`` draws it)."""

    OPEN = "open"
    CLOSED = "closed"
    FAILED = "failed"

    # Members are singletons compared by identity; Enum's own hash is a Python call (of the
    # name's hash), and the table is consulted once a push.
    __hash__ = object.__hash__


OPEN, CLOSED, FAILED = ChunkState.OPEN, ChunkState.CLOSED, ChunkState.FAILED

#: state -> event -> the state that event leads to. ``contribute``: a rank's push joins the chunk
#: (at its header for cut-through, with its whole payload otherwise); ``close``: the result goes
#: out; ``fail``: an error goes out; ``answer``: a late or repeated push of a chunk that is over is
#: answered from what was remembered (the kept result, the error, or STALE). A chunk may also
#: begin CLOSED: a restarted reducer is handed a chunk's result by a rank that has it
#: (``ReduceOp.SETTLED``). Forgetting a remembered chunk (retention, the per-job key limit) is no
#: event: nothing is left to check.
CHUNK_TRANSITIONS: dict[ChunkState, dict[str, ChunkState]] = {
    OPEN: {"contribute": OPEN, "close": CLOSED, "fail": FAILED},
    CLOSED: {"answer": CLOSED},
    FAILED: {"answer": FAILED},
}


class ChunkStateError(RuntimeError):
    """The reducer core tried an event its chunk's state does not allow. A bug in the core, not a
    caller's or a peer's mistake (those are answered on the wire, never raised), so not one of
    ``errors``' types: the daemon contains it like any internal error, ending the connection it
    was serving. The chunk is left as it was."""


def _illegal(what: str, state: ChunkState, event: str) -> ChunkStateError:
    allowed = ", ".join(CHUNK_TRANSITIONS[state]) or "none"
    return ChunkStateError(f"{what} is {state.value}: it cannot {event} (allowed there: {allowed})")


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


@dataclass(eq=False)
class _OpenChunk:
    """What every open chunk has, whatever its accumulation: who contributed, whom to answer."""

    key: int
    chunk: int
    shape: _Shape
    first_rank: int
    opened_at: float
    contributors: int = 0  # bitmap
    conns: dict[int, int] = field(default_factory=dict)  # rank -> connection to answer on
    stall_warned: bool = False
    active_at: float = 0.0  # when a byte of a contribution last arrived (a chunk that stalls holds memory)
    state: ChunkState = OPEN

    def transition(self, event: str) -> ChunkState:
        """Take ``event`` (a key of :data:`CHUNK_TRANSITIONS`); raises :class:`ChunkStateError`
        if this chunk's state does not allow it."""
        new = CHUNK_TRANSITIONS[self.state].get(event)
        if new is None:
            raise _illegal(f"chunk {self.chunk} of key {self.key:#x}", self.state, event)
        self.state = new
        return new

    def missing(self, world_size: int) -> str:
        """The ranks not in yet, for messages."""
        return ", ".join(str(r) for r in range(world_size) if not self.contributors >> r & 1) or "none"

    # --- the accumulation interface ---

    def has(self, rank: int) -> bool:
        """Rank ``rank`` contributed, or its contribution is arriving."""
        return bool(self.contributors >> rank & 1)

    def writing(self) -> bool:
        """A push still receives into this chunk's memory."""
        return False

    def add(self, funds: _MemoryRules, job: _Job, rank: int, raw: np.ndarray | None) -> None:
        """Rank ``rank``'s push is in whole, its payload in ``raw`` (pool memory the chunk now
        owns; ``None``: it sends none, a broadcast's other ranks and empty operations)."""
        raise ChunkStateError(f"chunk {self.chunk} of key {self.key:#x}: a {type(self).__name__} takes no whole payloads")

    def outcome(self, funds: _MemoryRules, job: _Job) -> np.ndarray | None:
        """The result's bytes in the wire dtype as the chunk closes (the caller owns them from
        here); ``None``: there is none (a broadcast whose root did not contribute)."""
        raise ChunkStateError(f"chunk {self.chunk} of key {self.key:#x}: a {type(self).__name__} does not close whole")

    def free(self, funds: _MemoryRules, job: _Job) -> None:
        """Give back what the chunk holds (it failed, or its job is dropped)."""


@dataclass(eq=False)
class _RankOrderChunk(_OpenChunk):
    """Whole payloads combined in ascending rank order, each as soon as every lower rank is in."""

    acc: np.ndarray | None = None  # accumulation buffer (pool memory, accumulation dtype)
    acc_raw: np.ndarray | None = None  # the pool buffer behind acc
    next_rank: int = 0  # ranks below this are summed into acc
    pending: dict[int, np.ndarray] = field(default_factory=dict)  # rank -> raw payload, not yet summed

    def add(self, funds: _MemoryRules, job: _Job, rank: int, raw: np.ndarray | None) -> None:
        self.transition("contribute")
        if raw is None:
            return
        self.pending[rank] = raw
        while self.next_rank in self.pending:  # sum what every lower rank is in for
            self._accumulate(funds, job, self.pending.pop(self.next_rank))
            self.next_rank += 1

    def _accumulate(self, funds: _MemoryRules, job: _Job, raw: np.ndarray) -> None:
        wire = numpy_dtype(self.shape.dtype)
        acc_dtype = ACCUMULATION_DTYPES.get(self.shape.dtype, wire)
        data = raw.view(wire)
        if self.acc is None:
            if acc_dtype == wire:
                self.acc_raw, self.acc = raw, data  # take ownership: no copy for the first one
                return
            self.acc_raw = funds._take(job, self.shape.count * acc_dtype.itemsize)
            assert self.acc_raw is not None
            self.acc = self.acc_raw.view(acc_dtype)
            funds._combiner.kernels.cast(self.acc, data)
        else:
            funds._combiner.kernels.combine(self.shape.op, self.acc, data)
        funds._give(job, raw)

    def outcome(self, funds: _MemoryRules, job: _Job) -> np.ndarray | None:
        for rank in sorted(self.pending):  # ranks that are in, above a gap left by stragglers
            self._accumulate(funds, job, self.pending.pop(rank))
        acc, acc_raw = self.acc, self.acc_raw
        assert acc is not None and acc_raw is not None
        self.acc = self.acc_raw = None  # the caller's now
        wire = numpy_dtype(self.shape.dtype)
        if acc.dtype == wire:
            return acc_raw
        rounded = funds._take(job, self.shape.count * wire.itemsize)
        assert rounded is not None
        funds._combiner.kernels.cast(rounded.view(wire), acc)
        funds._give(job, acc_raw)
        return rounded

    def free(self, funds: _MemoryRules, job: _Job) -> None:
        for raw in self.pending.values():
            funds._give(job, raw)
        self.pending.clear()
        if self.acc_raw is not None:
            funds._give(job, self.acc_raw)
            self.acc_raw = self.acc = None


@dataclass(eq=False)
class _BroadcastChunk(_OpenChunk):
    """The root's payload is the result; the other ranks only say they are in."""

    data: np.ndarray | None = None

    def add(self, funds: _MemoryRules, job: _Job, rank: int, raw: np.ndarray | None) -> None:
        self.transition("contribute")
        if raw is not None:
            self.data = raw

    def outcome(self, funds: _MemoryRules, job: _Job) -> np.ndarray | None:
        return self.data

    def free(self, funds: _MemoryRules, job: _Job) -> None:
        if self.data is not None:
            funds._give(job, self.data)
            self.data = None


@dataclass(eq=False)
class _CutThroughChunk(_OpenChunk):
    """Every rank's buffer joins at its push's header; each piece that every rank has is combined
    in rank order into rank 0's buffer and sent (``_forward`` in ``reducer_results``), so the result is
    never whole in one place before it leaves."""

    parts: dict[int, _Part] = field(default_factory=dict)  # rank -> contribution
    forwarded: int = 0  # payload bytes whose sum was sent (piece by piece)
    # The native forwarder that sums and sends its pieces once every rank's push joined
    # (ReducerCore._engage); ``forwarded`` is read back from it whenever the core acts on the chunk.
    engine: Any = None

    def has(self, rank: int) -> bool:
        return bool(self.contributors >> rank & 1) or rank in self.parts

    def writing(self) -> bool:
        return any(part.writing for part in self.parts.values())

    def attach(self, part: _Part, conn: int, now: float) -> None:
        """A rank's push header arrived: its buffer is part of the chunk from here."""
        self.transition("contribute")
        self.active_at = now
        self.parts[part.rank] = part
        self.conns[part.rank] = conn

    def free(self, funds: _MemoryRules, job: _Job) -> None:
        if self.engine is not None:  # the callers hand its counts back first (ReducerCore._disengage)
            self.engine.cancel()
            self.engine = None
        for part in self.parts.values():  # memory a push still writes into is freed when it ends
            part.chunk = None
            part.shared.release()
        self.parts.clear()


@dataclass
class _Part:
    """One rank's contribution to a chunk that is summed piece by piece. Its buffer is shared by
    the chunk and by the push still receiving into it, so a chunk that fails mid-payload never
    hands the pool memory the daemon is still writing."""

    rank: int
    shared: _SharedBuffer
    chunk: _CutThroughChunk | None  # None once the chunk closed or failed
    received: int = 0  # payload bytes in the buffer
    writing: bool = True  # a push is receiving into the buffer (False: its connection broke)


@dataclass
class _Closed:
    """A chunk that is over (CLOSED or FAILED), remembered so that late or repeated pushes are
    answered, not summed."""

    state: ChunkState = CLOSED
    error: Error | None = None  # the error it failed with (FAILED)
    result: _SharedBuffer | None = None  # retained for late ranks (first_m / deadline modes)
    header: bytes = b""
    data: memoryview | None = None
    answered: int = 0  # bitmap of ranks that have their answer
    expires_at: float = 0.0

    def expect(self, event: str) -> None:
        """Raise :class:`ChunkStateError` unless this remembered chunk allows ``event``."""
        if event not in CHUNK_TRANSITIONS[self.state]:
            raise _illegal("a remembered chunk", self.state, event)
