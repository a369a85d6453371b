"""core.fusion: grouping arrays by dtype, fusing each group into one vector and splitting it back."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redsrv.core import fusion

DTYPES = [np.dtype(d) for d in ("float32", "float64", "float16", "int32", "int64", "bool")] + [np.dtype(ml_dtypes.bfloat16)]

shapes = st.lists(st.integers(0, 4), max_size=3).map(tuple)
arrays = st.lists(st.tuples(st.sampled_from(DTYPES), shapes), max_size=8)


@settings(max_examples=200, deadline=None)
@given(arrays, st.integers(0, 2**32 - 1))
def test_fuse_then_split_gives_back_every_array_in_its_group(specs: list, seed: int) -> None:  # type: ignore[type-arg]
    rng = np.random.default_rng(seed)
    given_arrays = [rng.integers(-100, 100, size=shape).astype(dtype) for dtype, shape in specs]
    groups = fusion.group_by_dtype(given_arrays)
    assert sorted(i for g in groups for i in g.members) == list(range(len(given_arrays)))  # each array once
    assert len({g.dtype for g in groups}) == len(groups)  # one group per dtype
    firsts = [g.members[0] for g in groups]
    assert firsts == sorted(firsts)  # in order of first appearance: the same on every rank
    for group in groups:
        assert list(group.members) == sorted(group.members)
        flat = fusion.fuse(given_arrays, group)
        assert flat.dtype == group.dtype and flat.shape == (group.total,)
        for index, part in zip(group.members, fusion.split(flat, group)):
            assert part.dtype == given_arrays[index].dtype and part.shape == given_arrays[index].shape
            assert part.tobytes() == given_arrays[index].tobytes()


@settings(max_examples=200, deadline=None)
@given(arrays, st.integers(1, 64))
def test_unfuse_large_puts_each_large_array_alone_and_keeps_the_rest_fused(specs: list, min_bytes: int) -> None:  # type: ignore[type-arg]
    given_arrays = [np.zeros(shape, dtype) for dtype, shape in specs]
    groups = fusion.unfuse_large(fusion.group_by_dtype(given_arrays), min_bytes)
    assert sorted(i for g in groups for i in g.members) == list(range(len(given_arrays)))  # each array once
    for group in groups:
        assert all(given_arrays[i].dtype == group.dtype for i in group.members)
        large = [i for i in group.members if given_arrays[i].nbytes >= min_bytes]
        assert not large or group.members == tuple(large[:1])  # a large array is alone in its group
        assert list(group.members) == sorted(group.members)
    fused = [g for g in groups if not (len(g.members) == 1 and given_arrays[g.members[0]].nbytes >= min_bytes)]
    assert len({g.dtype for g in fused}) == len(fused)  # what stays fused: one group per dtype
    with pytest.raises(ValueError):
        fusion.unfuse_large(groups, 0)


def test_split_gives_views_and_ignores_padding() -> None:
    arrays = [np.zeros((2, 3), np.float32), np.zeros(4, np.float32)]
    (group,) = fusion.group_by_dtype(arrays)
    assert (group.sizes, group.offsets, group.total) == ((6, 4), (0, 6), 10)
    padded = np.arange(12, dtype=np.float32)  # two elements of padding past the group
    first, second = fusion.split(padded, group)
    assert np.shares_memory(first, padded) and np.shares_memory(second, padded)
    assert first.tolist() == [[0, 1, 2], [3, 4, 5]] and second.tolist() == [6, 7, 8, 9]


def test_fuse_copies_so_the_callers_arrays_never_change() -> None:
    arrays = [np.ones(3, np.int32)]
    (group,) = fusion.group_by_dtype(arrays)
    flat = fusion.fuse(arrays, group)
    flat += 1
    assert arrays[0].tolist() == [1, 1, 1]


def test_arrays_that_do_not_fit_the_group_are_refused() -> None:
    (group,) = fusion.group_by_dtype([np.zeros(3, np.float32)])
    with pytest.raises(ValueError, match=r"array 0 is float64\[3\], the group was made for float32\[3\]"):
        fusion.fuse([np.zeros(3, np.float64)], group)
    with pytest.raises(ValueError, match=r"array 0 is float32\[4\]"):
        fusion.fuse([np.zeros(4, np.float32)], group)
    with pytest.raises(ValueError, match="a fused vector of 2 elements cannot hold the group's 3"):
        fusion.split(np.zeros(2, np.float32), group)

