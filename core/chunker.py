"""Pure arithmetic: which elements of a flat buffer go to which reducer, in which chunks.

A buffer of ``n`` elements is split into ``m`` contiguous spans whose lengths differ by at most
one (span ``i`` belongs to reducer ``i``, so reducers carry equal load by construction), and
each span into pipeline chunks of at most ``chunk_elements`` elements, again near-equal so the
last chunk is never a sliver.

A long span (at least :data:`RAMP_MIN_CHUNKS` full chunks) starts and ends with a ramp of
smaller chunks (1/8, 1/4, 1/2 of a full one, then the reverse). A reducer can return a chunk's
sum only once every worker's copy of it arrived, so the results of the first chunk start
flowing, and those of the last one finish, one small chunk's time after the pushes do instead
of one full chunk's: on a 1 Gbit/s link that is ~30 ms saved on a 64 MiB all-reduce over four
reducers.

>>> [(c.reducer, c.index, c.start, c.stop) for c in plan(10, 3, 3)]
[(0, 0, 0, 2), (0, 1, 2, 4), (1, 0, 4, 7), (2, 0, 7, 10)]
>>> [c.count for c in plan(80, 1, 8)]
[1, 2, 4, 8, 8, 8, 7, 7, 7, 7, 7, 7, 4, 2, 1]
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Chunk", "spans", "plan", "RAMP_MIN_CHUNKS"]

#: Spans of at least this many full chunks get the ramp of small chunks at both ends.
RAMP_MIN_CHUNKS = 6


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
        for index, (a, b) in enumerate(_span_chunks(stop - start, chunk_elements)):
            chunks.append(Chunk(reducer, index, start + a, start + b))
    return chunks


def _ramp(chunk_elements: int) -> list[int]:
    """Sizes of the small chunks that open a long span (reversed, they close it)."""
    if chunk_elements < 8:
        return []
    return [chunk_elements // 8, chunk_elements // 4, chunk_elements // 2]


def _span_chunks(length: int, chunk_elements: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each chunk of a span of ``length`` elements."""
    if length == 0:
        return []
    ramp = _ramp(chunk_elements) if length >= RAMP_MIN_CHUNKS * chunk_elements else []
    middle = length - 2 * sum(ramp)
    sizes = ramp + [b - a for a, b in _even_splits(middle, -(-middle // chunk_elements))] + ramp[::-1]
    bounds = []
    position = 0
    for size in sizes:
        bounds.append((position, position + size))
        position += size
    return bounds
