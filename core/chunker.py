"""Pure arithmetic: which elements of a flat buffer go to which reducer, in which chunks.

A buffer of ``n`` elements is split into ``m`` contiguous spans whose lengths differ by at most
one (span ``i`` belongs to reducer ``i``, so reducers carry equal load by construction), and
each span into pipeline chunks of at most ``chunk_elements`` elements, again near-equal so the
last chunk is never a sliver.

>>> [(c.reducer, c.index, c.start, c.stop) for c in plan(10, 3, 3)]
[(0, 0, 0, 2), (0, 1, 2, 4), (1, 0, 4, 7), (2, 0, 7, 10)]
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Chunk", "spans", "plan"]


@dataclass(frozen=True)
class Chunk:
    """Elements ``[start, stop)`` of the buffer; chunk ``index`` of reducer ``reducer``."""

    reducer: int
    index: int
    start: int
    stop: int

    @property
    def count(self) -> int:
        return self.stop - self.start


def _even_splits(length: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(length, parts)
    bounds = []
    start = 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def spans(num_elements: int, num_reducers: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each reducer's span; lengths differ by at most one.

    >>> spans(5, 2)
    [(0, 3), (3, 5)]
    """
    if num_elements < 0 or num_reducers < 1:
        raise ValueError(f"need num_elements >= 0 and num_reducers >= 1, got {num_elements}, {num_reducers}")
    return _even_splits(num_elements, num_reducers)


def plan(num_elements: int, num_reducers: int, chunk_elements: int) -> list[Chunk]:
    """Every non-empty chunk of the buffer, grouped by reducer and ordered by index.

    Reducers whose span is empty (fewer elements than reducers) get no chunk at all; an empty
    buffer has no chunks.
    """
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
    chunks = []
    for reducer, (start, stop) in enumerate(spans(num_elements, num_reducers)):
        length = stop - start
        if length == 0:
            continue
        pieces = -(-length // chunk_elements)
        for index, (a, b) in enumerate(_even_splits(length, pieces)):
            chunks.append(Chunk(reducer, index, start + a, start + b))
    return chunks
