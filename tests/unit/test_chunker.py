"""Chunker properties: spans cover the buffer exactly, are balanced, and chunks respect the cap."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redsrv.core import chunker


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10**7), st.integers(1, 64), st.integers(1, 10**6), st.integers(1, 10**5),
       st.none() | st.integers(1, 10**6))
def test_plan_covers_every_element_once_balanced(n: int, m: int, chunk: int, first: int, until: int | None) -> None:
    chunk = max(chunk, n // 5000)  # keep each example to a few thousand chunks
    plan = chunker.plan(n, m, chunk, first, ramp_until=until)
    assert plan == chunker.plan(n, m, chunk, first, ramp_until=until)  # every rank computes the same plan
    cap = chunk if until is None else min(chunk, until)
    # contiguous cover of [0, n) in order
    position = 0
    for c in plan:
        assert c.start == position and c.count > 0 and c.count <= chunk
        position = c.stop
    assert position == n
    # spans per reducer differ by at most one element
    per_reducer = [sum(c.count for c in plan if c.reducer == r) for r in range(m)]
    assert max(per_reducer) - min(per_reducer) <= 1
    # chunk indices per reducer are 0..k-1; each span opens with first, 2*first, ... below a full
    # chunk, closes with the mirror image, and cuts what is between into near-equal chunks, none
    # smaller than twice the last ramp chunk (no slivers)
    for r in range(m):
        mine = [c for c in plan if c.reducer == r]
        assert [c.index for c in mine] == list(range(len(mine)))
        if not mine:
            continue
        sizes = [c.count for c in mine]
        ramp = chunker.ramp(per_reducer[r], chunk, first, until)
        assert ramp == [first << i for i in range(len(ramp))] and all(s < cap for s in ramp)
        assert sizes[: len(ramp)] == ramp and sizes[len(sizes) - len(ramp):] == ramp[::-1]
        middle = sizes[len(ramp): len(sizes) - len(ramp)]
        assert middle and len(middle) == -(-(per_reducer[r] - 2 * sum(ramp)) // chunk)
        assert max(middle) - min(middle) <= 1
        if ramp:
            assert min(middle) >= 2 * ramp[-1] or min(middle) >= chunk // 2
        # the ramp stops only at the full chunk size (or ``until``) or when the middle would get too short
        grows = first << len(ramp)
        assert grows >= cap or per_reducer[r] - 2 * sum(ramp) < 4 * grows


def test_a_64_mib_float32_all_reduce_over_four_reducers_ramps_from_64_kib_to_1_mib() -> None:
    kib = 1024 // 4  # float32 elements per KiB
    sizes = [c.count / kib for c in chunker.plan(16 * 2**20, 4, 1024 * kib, 64 * kib) if c.reducer == 0]
    assert sizes[:4] == [64, 128, 256, 512] and sizes[-4:] == [512, 256, 128, 64]
    assert len(sizes) == 23 and all(960 < s <= 1024 for s in sizes[4:-4])  # 16 MiB - 2 x 960 KiB in 15


def test_a_ramp_told_to_stop_below_a_result_piece_leaves_the_rest_of_the_span_to_full_chunks() -> None:
    """The plan of a 64 MiB float32 all-reduce over four reducers that cut through in 512 KiB
    pieces (Client._cuts_through): 64, 128 and 256 KiB, then chunks of up to 4 MiB, not a ramp on
    to 2 MiB."""
    kib = 1024 // 4
    plan = chunker.plan(64 * 2**18, 4, 4096 * kib, 64 * kib, ramp_until=512 * kib)
    sizes = [c.count / kib for c in plan if c.reducer == 0]
    assert sizes == [64, 128, 256, 3872, 3872, 3872, 3872, 256, 128, 64]
    assert len(plan) == 40 and len(chunker.plan(64 * 2**18, 4, 4096 * kib, 64 * kib)) == 60


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
    with pytest.raises(ValueError):
        chunker.plan(10, 2, 4, 1, ramp_until=0)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**34), st.integers(1, 64), st.integers(1, 2**20), st.integers(0, 2**64 - 1))
def test_placement_uses_distinct_reducers_with_spans_of_at_least_the_minimum(
        nbytes: int, m: int, min_span: int, key: int) -> None:
    reducers = chunker.placement(nbytes, m, min_span, key)
    assert reducers == chunker.placement(nbytes, m, min_span, key)  # every rank agrees
    assert 1 <= len(reducers) <= m and len(set(reducers)) == len(reducers)
    assert all(0 <= r < m for r in reducers)
    if len(reducers) > 1:
        assert nbytes // len(reducers) >= min_span
    if nbytes >= m * min_span:
        assert reducers == list(range(m))
    else:
        assert len(reducers) == max(1, nbytes // min_span)


def test_small_messages_spread_over_the_fleet_by_key() -> None:
    firsts = [chunker.placement(4096, 4, 65536, key)[0] for key in range(400)]
    assert [firsts.count(r) for r in range(4)] == [100, 100, 100, 100]
    spans = chunker.plan(1024, 1, 64, reducers=chunker.placement(4096, 4, 65536, key=6))
    assert {c.reducer for c in spans} == {2}


def test_plan_rejects_a_placement_of_the_wrong_length() -> None:
    with pytest.raises(ValueError, match="names 1 reducers for 2 spans"):
        chunker.plan(10, 2, 4, reducers=[0])
