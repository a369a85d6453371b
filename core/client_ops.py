"""Operations in flight on a client: the futures callers hold, what each operation still waits
for (:class:`Op`, :class:`PendingPush`, :class:`Copy`: plain data, owned by
:class:`~client_core.ClientCore`, which the engine calls under its one lock), and the thread
that runs futures' done-callbacks (:class:`Completions`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import chunker, wire

__all__ = ["Contributors", "ReduceFuture", "Op", "Copy", "PendingPush", "Completions", "label", "set_exception"]

log = logging.getLogger("redsrv.client")

Callback = Callable[[concurrent.futures.Future], object]  # type: ignore[type-arg]


@dataclass(frozen=True)
class Contributors:
    """Who contributed to an operation. In straggler modes chunks may close with different
    sets of ranks; ``min_count`` is the smallest set, ``ranks`` those present in every chunk."""

    min_count: int
    max_count: int
    ranks: tuple[int, ...]


class ReduceFuture(concurrent.futures.Future):  # type: ignore[type-arg]
    """A :class:`concurrent.futures.Future` of the reduced array, plus who contributed.

    Its done-callbacks run in completion order on the client's completion thread
    (``redsrv-done``), never on the I/O loop: a callback that blocks (a device copy, a user's
    hook) delays the callbacks queued after it, not the operations in flight. A callback added
    to a future that is already done runs at once in the adding thread, as for any future."""

    key: Any = None
    contributors: Contributors | None = None
    _completions: Completions | None = None

    def add_done_callback(self, fn: Callback) -> None:
        completions = self._completions
        if completions is None or self.done():
            super().add_done_callback(fn)
        else:
            super().add_done_callback(lambda future: completions.submit(fn, future))


class Completions:
    """Runs done-callbacks in the order their futures completed, on one thread per client,
    started at the first callback (a client whose futures nobody watches costs no thread) and
    ended by :meth:`close` once the callbacks queued before it have run."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._ready = threading.Condition(threading.Lock())
        self._queue: collections.deque[tuple[Callback, concurrent.futures.Future]] = collections.deque()  # type: ignore[type-arg]
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def submit(self, fn: Callback, future: concurrent.futures.Future) -> None:  # type: ignore[type-arg]
        with self._ready:
            if not self._closed:
                self._queue.append((fn, future))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
                self._ready.notify()
                return
        _call(fn, future)  # closed (close() ran the queue and ended the thread): run it here rather than never

    def close(self, timeout: float) -> None:
        """Run what is queued, then end the thread (waits at most ``timeout``; not when called
        from a callback, which would wait for itself)."""
        with self._ready:
            self._closed = True
            self._ready.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if not self._queue:
                    return
                fn, future = self._queue.popleft()
            _call(fn, future)


def _call(fn: Callback, future: concurrent.futures.Future) -> None:  # type: ignore[type-arg]
    try:
        fn(future)
    except Exception:  # as concurrent.futures does: a failing callback must not stop the others
        log.exception("exception calling callback for %r", future)


@dataclass
class Copy:
    """A chunk's result as it came off the wire (wire dtype, before any mean is taken), with what
    it takes to push it as ReduceOp.SETTLED to a reducer that restarted before every rank had it
    (R22).

    Where the result lands in the operation's ``out`` as it came (no mean, no widening), ``data``
    starts as a view of ``out``: the result is *lent*, and copied only when ``out`` goes back to
    the caller (:meth:`Op.take_back_lent`) or the result must be resent. Most chunks' SAFE comes
    before their operation ends, so most results are never copied at all."""

    key: int
    total: int
    offset: int
    index: int
    dtype: wire.DType
    data: np.ndarray
    frame: int = 0  # the stream's RESULT frame count once the chunk was whole
    lender: Op | None = None  # the operation whose ``out`` ``data`` views, while it does
    settled: bool = False  # the reducer said every rank has it: nobody needs it any more

    def own(self, copy: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """``data`` in a buffer of its own: copied (by ``copy``) out of the lender's ``out`` first
        if it is still lent (by the core, so not after ``out`` went back to the caller)."""
        if self.lender is not None:
            self.data, self.lender = copy(self.data), None
        return self.data


@dataclass
class Op:
    """One all-reduce or broadcast in flight."""

    key: int
    label: Any  # the caller's key, for messages
    out: np.ndarray  # flat result, caller's dtype
    wire_dtype: np.dtype
    mean: bool
    chunks: dict[tuple[int, int], chunker.Chunk]  # (reducer, index) -> chunk, still outstanding
    future: ReduceFuture
    deadline: float
    started: float
    shape: tuple[int, ...] = ()  # the caller's shape, restored on the result
    given_out: np.ndarray | None = None  # the caller's ``out`` array, returned as it was passed
    min_count: int = 1 << 30
    max_count: int = 0
    all_ranks: int = -1  # intersection of contributor bitmaps
    # Chunks whose result is arriving in pieces (cut-through): (reducer, index) -> elements
    # received so far, and when the first piece arrived.
    received: dict[tuple[int, int], tuple[int, float]] = field(default_factory=dict)
    # What it takes to send each outstanding chunk again after a reconnect (R22).
    pushes: dict[tuple[int, int], PendingPush] = field(default_factory=dict)
    in_place: bool = False  # results land in the input: keep a chunk's input before its result lands
    # Chunks whose result the native receiver lands: (reducer, index) -> (channel, ResultSlot).
    slots: dict[tuple[int, int], tuple[Any, Any]] = field(default_factory=dict)
    # Results kept for recovery as views of ``out`` (see Copy), until ``out`` goes back to the
    # caller; ``returned`` once it has, after which nothing more is lent.
    lent: list[Copy] = field(default_factory=list)
    returned: bool = False

    def lend(self, kept: Copy) -> bool:
        """Keep ``kept`` as a view of ``out`` until ``out`` goes back to the caller; False if it
        already has (the caller then makes a copy of its own)."""
        if self.returned:
            return False
        kept.lender = self
        self.lent.append(kept)
        return True

    def take_back_lent(self, copy: Callable[[np.ndarray], np.ndarray]) -> None:
        """Before the caller gets ``out`` back (the operation completes or fails): each result
        still lent that some rank may lack gets a copy of its own (made by ``copy``), since the
        caller may now overwrite ``out``."""
        self.returned = True
        for kept in self.lent:
            if kept.lender is self:
                if not kept.settled:
                    kept.data = copy(kept.data)
                kept.lender = None
        self.lent.clear()


@dataclass
class PendingPush:
    """A chunk waiting for room in its reducer's push window."""

    op: Op
    chunk: chunker.Chunk
    arr: np.ndarray
    wire_dt: np.dtype
    wire_code: wire.DType
    op_code: wire.ReduceOp
    root: int
    sends_payload: bool
    # The chunk's input, copied before an in-place result overwrote it, for a resend (R22).
    saved: np.ndarray | None = None


def label(key: Any) -> Any:
    return key if key is not None else "auto"


def set_exception(future: concurrent.futures.Future, error: BaseException) -> None:  # type: ignore[type-arg]
    try:
        if future.set_running_or_notify_cancel():
            future.set_exception(error)
    except (concurrent.futures.InvalidStateError, RuntimeError):
        pass
