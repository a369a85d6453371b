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
    # chunk indices per reducer are 0..k-1 and chunk sizes within a span differ by at most one
    for r in range(m):
        mine = [c for c in plan if c.reducer == r]
        assert [c.index for c in mine] == list(range(len(mine)))
        if mine:
            assert max(c.count for c in mine) - min(c.count for c in mine) <= 1
            assert len(mine) == -(-per_reducer[r] // chunk)


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
