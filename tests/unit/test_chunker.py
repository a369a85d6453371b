"""Chunker properties: spans cover the buffer exactly, are balanced, and chunks respect the cap."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redsrv.core import chunker


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10**7), st.integers(1, 64), st.integers(1, 10**6))
def test_plan_covers_every_element_once_balanced(n: int, m: int, chunk: int) -> None:
    chunk = max(chunk, n // 5000)  # keep each example to a few thousand chunks
    plan = chunker.plan(n, m, chunk)
    # contiguous cover of [0, n) in order
    position = 0
    for c in plan:
        assert c.start == position and c.count > 0 and c.count <= chunk
        position = c.stop
    assert position == n
    # spans per reducer differ by at most one element
    per_reducer = [sum(c.count for c in plan if c.reducer == r) for r in range(m)]
    assert max(per_reducer) - min(per_reducer) <= 1
    # chunk indices per reducer are 0..k-1; a short span is cut into near-equal chunks, a long
    # one into near-equal full chunks between two ramps of 1/8, 1/4, 1/2 of a chunk
    for r in range(m):
        mine = [c for c in plan if c.reducer == r]
        assert [c.index for c in mine] == list(range(len(mine)))
        if not mine:
            continue
        sizes = [c.count for c in mine]
        if per_reducer[r] >= chunker.RAMP_MIN_CHUNKS * chunk and chunk >= 8:
            ramp = [chunk // 8, chunk // 4, chunk // 2]
            assert sizes[:3] == ramp and sizes[-3:] == ramp[::-1]
            middle = sizes[3:-3]
            assert len(middle) == -(-(per_reducer[r] - 2 * sum(ramp)) // chunk)
        else:
            middle = sizes
            assert len(middle) == -(-per_reducer[r] // chunk)
        assert max(middle) - min(middle) <= 1


@pytest.mark.parametrize(
    ("n", "m", "expected"),
    [
        (0, 3, []),
        (1, 3, [(0, 0, 0, 1)]),
        (2, 3, [(0, 0, 0, 1), (1, 0, 1, 2)]),
        (7, 2, [(0, 0, 0, 2), (0, 1, 2, 4), (1, 0, 4, 6), (1, 1, 6, 7)]),
    ],
)
def test_small_cases(n: int, m: int, expected: list[tuple[int, int, int, int]]) -> None:
    assert [(c.reducer, c.index, c.start, c.stop) for c in chunker.plan(n, m, 2)] == expected


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        chunker.plan(10, 0, 4)
    with pytest.raises(ValueError):
        chunker.plan(10, 2, 0)
    with pytest.raises(ValueError):
        chunker.spans(-1, 2)


def test_doctests() -> None:
    import doctest

    failures, _ = doctest.testmod(chunker)
    assert failures == 0
