"""The reducer's payload memory: a pool of reusable byte buffers, and the reference-counted
buffer that a chunk, the push receiving into it and the writers sending its result share.

Thread-safe, unlike the rest of the reducer core: a result's buffer is released by whichever
connection writer finishes with it last. What counts against the budgets is the state machine's
business (``reducer_memory``); these only hold the bytes.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable

import numpy as np

from . import constants as C

__all__ = ["BufferPool"]

#: Anonymous private mappings: pages exist once written, so a buffer funded as its bytes arrive
#: is resident as far as they arrived, not for its announced size.
_LAZY_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)


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

