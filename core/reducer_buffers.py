"""The reducer's payload memory: pooled byte buffers (:class:`buffer_pool.BufferPool`), and the
reference-counted buffer that a chunk, the push receiving into it and the writers sending its
result share.

Thread-safe, unlike the rest of the reducer core: a result's buffer is released by whichever
connection writer finishes with it last. What counts against the budgets is the state machine's
business (``reducer_memory``); these only hold the bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from .buffer_pool import BufferPool

__all__ = ["_SharedBuffer"]

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

