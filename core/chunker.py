"""Pure arithmetic: which elements of a flat buffer go to which reducer, in which chunks.

A buffer of ``n`` elements is split into ``m`` contiguous spans whose lengths differ by at most
one (span ``i`` belongs to reducer ``i``, so reducers carry equal load by construction), and
each span into pipeline chunks of at most ``chunk_elements`` elements, again near-equal so the
last chunk is never a sliver.

A span starts and ends with a ramp of small chunks: ``ramp_from`` elements, then doubling up
to the full chunk size, or to ``ramp_until`` where that is smaller (the reverse at the end), as
far as the span's length allows. A reducer that returns a chunk's sum only once every worker's
copy of it arrived starts the results of the first chunk one small chunk's time after the
pushes do; the middle of the span travels in full chunks sized by :func:`full_chunk`, which
bounds the tail. A reducer that cuts through returns a chunk's sum in pieces as every worker's
bytes arrive, so a chunk larger than a piece starts and ends its results no sooner than one of a
piece: there the ramp stops below the piece size (``ramp_until``, ``Client._submit``).

>>> [(c.reducer, c.index, c.start, c.stop) for c in plan(10, 3, 3)]
[(0, 0, 0, 2), (0, 1, 2, 4), (1, 0, 4, 7), (2, 0, 7, 10)]
>>> [c.count for c in plan(80, 1, 8)]
[1, 2, 4, 8, 8, 8, 7, 7, 7, 7, 7, 7, 4, 2, 1]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Chunk", "spans", "plan", "ramp", "full_chunk", "placement"]


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


def plan(num_elements: int, num_reducers: int, chunk_elements: int, ramp_from: int | None = None,
         reducers: Sequence[int] | None = None, ramp_until: int | None = None) -> list[Chunk]:
    """Every non-empty chunk of the buffer, grouped by reducer and ordered by index.

    ``chunk_elements`` caps every chunk; ``ramp_from`` is the size of the first and last chunk
    of a span long enough for a ramp (default: an eighth of a full chunk); the ramp's chunks stay
    below ``ramp_until`` (default: ``chunk_elements``; see :func:`ramp`). ``reducers`` (see
    :func:`placement`) names the reducer of each of the ``num_reducers`` spans; by default span
    ``i`` goes to reducer ``i``.

    Reducers whose span is empty (fewer elements than reducers) get no chunk at all; an empty
    buffer has no chunks.

    >>> [(c.reducer, c.start, c.stop) for c in plan(10, 2, 8, ramp_from=8, reducers=[3, 0])]
    [(3, 0, 5), (0, 5, 10)]
    """
    if reducers is not None and len(reducers) != num_reducers:
        raise ValueError(f"reducers names {len(reducers)} reducers for {num_reducers} spans")
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
    if ramp_from is not None and ramp_from < 1:
        raise ValueError(f"ramp_from must be >= 1, got {ramp_from}")
    if ramp_until is not None and ramp_until < 1:
        raise ValueError(f"ramp_until must be >= 1, got {ramp_until}")
    first = chunk_elements // 8 if ramp_from is None else ramp_from
    chunks = []
    for span, (start, stop) in enumerate(spans(num_elements, num_reducers)):
        reducer = span if reducers is None else reducers[span]
        for index, (a, b) in enumerate(_span_chunks(stop - start, chunk_elements, first, ramp_until)):
            chunks.append(Chunk(reducer, index, start + a, start + b))
    return chunks


def placement(num_bytes: int, num_reducers: int, min_span_bytes: int, key: int) -> list[int]:
    """The reducers that carry a message of ``num_bytes``, one span each, in span order.

    A large message is spread over every reducer. A small one goes to only as many as keep each
    span at least ``min_span_bytes``: below that, a span's transfer time is dwarfed by the cost
    of one more frame each way on every worker and reducer (a wake-up, a header, a round of
    packets), so fewer and larger spans finish sooner. The first reducer is ``key`` modulo the
    fleet, so many small messages still share the load evenly.

    >>> placement(64 * 2**20, 4, 16384, key=7)
    [0, 1, 2, 3]
    >>> placement(4096, 4, 16384, key=7), placement(4096, 4, 16384, key=8)
    ([3], [0])
    >>> placement(40960, 4, 16384, key=3)
    [3, 0]
    """
    if num_reducers < 1 or min_span_bytes < 1:
        raise ValueError(f"need num_reducers >= 1 and min_span_bytes >= 1, got {num_reducers}, {min_span_bytes}")
    used = max(1, min(num_reducers, num_bytes // min_span_bytes))
    if used == num_reducers:
        return list(range(num_reducers))
    first = key % num_reducers
    return [(first + i) % num_reducers for i in range(used)]


def full_chunk(num_elements: int, num_reducers: int, largest: int, smallest: int, per_span: int) -> int:
    """The size of a span's full (middle) chunks: about ``per_span`` of them per span, within
    ``[smallest, largest]`` (``largest`` wins if they cross).

    Where a reducer forwards a chunk's sum only once the chunk is in from every worker (the
    straggler modes, or cut-through turned off), and its results leave at the rate pushes arrive,
    that delay never drains: an all-reduce ends about one full chunk's transfer after its last
    push, ramp or not. Cutting each span into ``per_span`` chunks bounds that tail to
    ~1/``per_span`` of the transfer; ``smallest`` stops small messages from paying more per
    chunk than the tail saves.

    >>> full_chunk(64 * 2**20, 4, 2**20, 2**18, 32)   # 16 Mi elements per span: 512 Ki each
    524288
    >>> full_chunk(2**30, 4, 2**20, 2**18, 32), full_chunk(2**20, 4, 2**20, 2**18, 32)
    (1048576, 262144)
    """
    span = -(-num_elements // max(1, num_reducers))
    return max(1, min(largest, max(smallest, span // max(1, per_span))))


def ramp(length: int, chunk_elements: int, first: int, until: int | None = None) -> list[int]:
    """Sizes of the small chunks that open a span of ``length`` elements (reversed, they close
    it): ``first``, doubling, while below ``chunk_elements`` (and below ``until`` where given)
    and while what is left between the two ramps still holds a chunk twice the last one (so the
    middle never holds slivers).

    >>> ramp(10_000, 1024, 128)
    [128, 256, 512]
    >>> ramp(10_000, 1024, 128, until=512)
    [128, 256]
    >>> ramp(1_000, 1024, 128)
    [128]
    >>> ramp(300, 1024, 128)
    []
    """
    sizes: list[int] = []
    if first < 1:
        return sizes
    size, left = first, length
    cap = chunk_elements if until is None else min(chunk_elements, until)
    while size < cap and left - 2 * size >= 2 * size:
        sizes.append(size)
        left -= 2 * size
        size *= 2
    return sizes


def _span_chunks(length: int, chunk_elements: int, first: int, until: int | None) -> list[tuple[int, int]]:
    """``[start, stop)`` of each chunk of a span of ``length`` elements."""
    if length == 0:
        return []
    opening = ramp(length, chunk_elements, first, until)
    middle = length - 2 * sum(opening)
    sizes = opening + [b - a for a, b in _even_splits(middle, -(-middle // chunk_elements))] + opening[::-1]
    bounds = []
    position = 0
    for size in sizes:
        bounds.append((position, position + size))
        position += size
    return bounds
