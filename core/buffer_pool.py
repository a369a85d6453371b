"""Reusable memory: the reducer's payload buffers (:class:`BufferPool`), and what a client
allocates per operation, its results where no ``out`` was given and the copies it keeps for
recovery (:class:`OutputPool`).

A client used to take these from ``np.empty``: above glibc's mmap threshold (which it raises up
to 32 MiB as mapped blocks are freed) each was a new mapping whose pages the kernel faulted in and
zeroed while the result arrived, and unmapped when it was dropped. In a loop of 64 MiB
all-reduces on loopback that was a quarter to a half of a worker's CPU (docs/performance.md,
"Results in reused memory").
"""

from __future__ import annotations

import collections
import mmap
import threading
import time

import numpy as np

from . import constants as C

__all__ = ["BufferPool", "OutputPool"]

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


class _Lease:
    """One pooled block lent to the arrays of a result: NumPy keeps it as their base (every view
    of the result refers to it, directly or through the result), so it goes back only once no
    array uses the memory any more.

    It goes back to a queue, not to the pool: ``__del__`` runs wherever the last reference went,
    which may be a garbage collection started by an allocation inside the pool's own lock on the
    same thread, where taking that lock again would deadlock."""

    __slots__ = ("block", "returned", "__array_interface__")

    def __init__(self, block: np.ndarray, returned: collections.deque[np.ndarray]) -> None:
        self.block, self.returned = block, returned
        self.__array_interface__ = {"data": (block.ctypes.data, False), "shape": (block.nbytes,), "typestr": "|u1",
                                    "version": 3}

    def __del__(self) -> None:
        self.returned.append(self.block)  # atomic, takes no lock


class OutputPool:
    """Memory a client allocates per operation: its results (an operation given no ``out``) and
    the chunk-sized copies it keeps for recovery (R22). An array of at least ``min_bytes`` lands
    in a block that a dropped array of the same size left behind, whose pages are already mapped;
    smaller ones come from ``np.empty`` (the allocator reuses those without new mappings). An
    array still referenced is never reused: its block returns only once every array and view of
    it is gone. Bounded: ``keep_per_size`` free blocks a size, ``max_free_bytes`` in all, and
    sizes nobody took for ``C.POOL_IDLE_RELEASE_S`` go back to the system (:meth:`release_idle`,
    on the client's tick). Thread-safe.

    Pooling the results alone is not enough: glibc raises its mmap threshold to the size of a
    mapped block freed (up to 32 MiB) and trims its heap above twice that, so a loop whose 16 MiB
    results were freed kept its 1 MiB copies on the heap, and one whose results are pooled maps,
    faults in and unmaps each copy unless they are pooled too."""

    def __init__(self, min_bytes: int = C.OUTPUT_POOL_MIN_BYTES, keep_per_size: int = C.OUTPUT_POOL_KEEP_PER_SIZE,
                 max_free_bytes: int = C.OUTPUT_POOL_MAX_FREE_BYTES) -> None:
        self.min_bytes = min_bytes
        self._blocks = BufferPool(keep_per_size, max_free_bytes)
        self._blocks.release_idle(time.monotonic())  # starts the idle clock: a first block is not idle at once
        self._returned: collections.deque[np.ndarray] = collections.deque()  # blocks no array uses any more

    @property
    def free_bytes(self) -> int:
        self._take_back()
        return self._blocks.free_bytes

    def empty(self, count: int, dtype: np.dtype) -> np.ndarray:
        """An uninitialised flat array of ``count`` elements of ``dtype``, as ``np.empty``."""
        nbytes = count * dtype.itemsize
        if nbytes < self.min_bytes:
            return np.empty(count, dtype)
        self._take_back()
        return np.asarray(_Lease(self._blocks.take(nbytes), self._returned)).view(dtype)

    def copy(self, array: np.ndarray) -> np.ndarray:
        """A flat copy of ``array``, as ``array.ravel().copy()``."""
        out = self.empty(array.size, array.dtype)
        np.copyto(out, array.reshape(-1))
        return out

    def release_idle(self, now: float | None = None) -> int:
        """Give the free blocks of sizes not taken for a while back to the system; the bytes dropped."""
        self._take_back()
        return self._blocks.release_idle(time.monotonic() if now is None else now)

    def _take_back(self) -> None:
        returned = self._returned
        while returned:
            try:
                block = returned.popleft()
            except IndexError:  # another thread took the last one
                return
            self._blocks.give(block)
