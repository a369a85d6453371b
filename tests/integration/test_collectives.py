"""All-gather, all-to-all and reduce-scatter built on the reducers (core/collectives.py), with
in-process reducers and one client per rank on its own thread."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import redsrv
from redsrv.core import collectives

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def reducers() -> Iterator[list[str]]:
    daemons = [redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, close_timeout=2)) for _ in range(2)]
    try:
        yield [f"{host}:{port}" for host, port in (d.start() for d in daemons)]
    finally:
        for d in daemons:
            d.stop()


def on_every_rank(reducers: list[str], n: int, body: Callable[[redsrv.Client], Any], job: str) -> list[Any]:
    """``body(client)`` on n ranks at once; the results in rank order (or the first error)."""
    clients = [redsrv.Client(reducers, rank=r, world_size=n, job=job, op_timeout=10) for r in range(n)]
    try:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            return [f.result(timeout=30) for f in [pool.submit(body, c) for c in clients]]
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("dtype", [np.float32, np.int64, ml_dtypes.bfloat16, np.bool_, np.uint8,
                                   np.int16, np.complex64])  # the last two are not wire dtypes: they travel as bytes
def test_allgather_with_different_first_dimensions_is_exact(reducers: list[str], dtype: Any) -> None:
    n = 3
    inputs = [(np.random.default_rng(r).standard_normal((r * 7 + 1, 3)) * 100).astype(dtype) for r in range(n)]
    inputs[1][0, 0] = np.array(-0.0).astype(dtype)  # a negative zero must survive (an all-reduce would lose it)
    results = on_every_rank(reducers, n, lambda c: collectives.allgather(c, inputs[c.rank], key="g"), f"ag-{np.dtype(dtype)}")
    for got in results:
        assert [g.shape for g in got] == [x.shape for x in inputs]
        assert all(g.dtype == x.dtype and g.tobytes() == x.tobytes() for g, x in zip(got, inputs, strict=True))


def test_allgather_of_an_empty_rank_and_a_scalar(reducers: list[str]) -> None:
    inputs = [np.zeros((0, 2), np.float32), np.ones((4, 2), np.float32)]
    results = on_every_rank(reducers, 2, lambda c: collectives.allgather(c, inputs[c.rank], key=1), "ag-empty")
    for got in results:
        assert [g.shape for g in got] == [(0, 2), (4, 2)]
    scalars = on_every_rank(reducers, 2, lambda c: collectives.allgather(c, np.float64(c.rank + 0.5), key=2), "ag-scalar")
    assert [[float(g) for g in got] for got in scalars] == [[0.5, 1.5], [0.5, 1.5]]


def test_ranks_that_disagree_on_dtype_or_trailing_dimensions_fail_on_every_rank(reducers: list[str]) -> None:
    inputs = [np.zeros((2, 3), np.float32), np.zeros((2, 4), np.float32)]

    def body(c: redsrv.Client) -> str:
        with pytest.raises(redsrv.ContributionMismatchError, match=r"rank 0 has float32\[2, 3\], rank 1 has float32\[2, 4\]"):
            collectives.allgather(c, inputs[c.rank], key="bad")
        return "raised"

    assert on_every_rank(reducers, 2, body, "ag-mismatch") == ["raised", "raised"]


def test_a_dtype_off_the_wire_against_another_dtype_fails_on_every_rank(reducers: list[str]) -> None:
    """int16 is not a wire dtype; a rank with float16 (same item size) is still a mismatch."""
    inputs = [np.zeros((2, 3), np.int16), np.zeros((2, 3), np.float16)]

    def body(c: redsrv.Client) -> str:
        # rank 1 knows rank 0's dtype only as "not float16, not a wire dtype"
        first = "int16" if c.rank == 0 else "a dtype the wire does not carry"
        with pytest.raises(redsrv.ContributionMismatchError, match=rf"rank 0 has {first}\[2, 3\], rank 1 has float16\[2, 3\]"):
            collectives.allgather(c, inputs[c.rank], key="bad")
        return "raised"

    assert on_every_rank(reducers, 2, body, "ag-off-wire-mismatch") == ["raised", "raised"]


def test_allgather_into_lands_every_slot(reducers: list[str]) -> None:
    n = 3

    def body(c: redsrv.Client) -> np.ndarray:
        out = np.empty(n * 5, np.int32)
        assert collectives.allgather_into_async(c, np.full(5, c.rank, np.int32), out, key="into").result(timeout=20) is out
        return out

    for out in on_every_rank(reducers, n, body, "ag-into"):
        assert out.tolist() == [r for r in range(n) for _ in range(5)]


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int16, np.complex64])  # the last two travel as bytes
def test_an_in_place_broadcast_leaves_the_roots_bytes_in_every_ranks_array(reducers: list[str], dtype: Any) -> None:
    n = 3
    inputs = [(np.random.default_rng(r).standard_normal((4, 5)) * 100).astype(dtype) for r in range(n)]
    inputs[1][0, 0] = np.array(-0.0).astype(dtype)  # bit for bit: a negative zero survives

    def body(c: redsrv.Client) -> np.ndarray:
        mine = inputs[c.rank].copy()
        landed = collectives.broadcast_exact_in_place_async(c, mine, root=1, key="bc").result(timeout=20)
        assert np.shares_memory(landed, mine)  # the client's own future, settled with a view of the array
        return mine

    for got in on_every_rank(reducers, n, body, f"bc-in-place-{np.dtype(dtype)}"):
        assert got.dtype == inputs[1].dtype and got.tobytes() == inputs[1].tobytes()


def test_alltoall_with_splits_matches_the_definition(reducers: list[str]) -> None:
    n = 3
    splits = [[1, 2, 0], [0, 0, 3], [2, 1, 1]]
    inputs = [np.arange(sum(s) * 2, dtype=np.float32).reshape(-1, 2) + 100 * r for r, s in enumerate(splits)]
    results = on_every_rank(reducers, n, lambda c: collectives.alltoall(c, inputs[c.rank], splits[c.rank], key="a2a"), "a2a")
    for rank, (rows, counts) in enumerate(results):
        expected = []
        for src in range(n):
            start = sum(splits[src][:rank])
            expected.append(inputs[src][start : start + splits[src][rank]])
        assert counts == [splits[src][rank] for src in range(n)]
        assert rows.tobytes() == np.concatenate(expected).tobytes()


def test_alltoall_refuses_splits_that_do_not_add_up(reducers: list[str]) -> None:
    with redsrv.Client(reducers, rank=0, world_size=1, job="a2a-bad") as c, pytest.raises(ValueError, match="adding up"):
        collectives.alltoall(c, np.zeros((4, 1)), [1, 2], key=0)


def test_reducescatter_keeps_each_ranks_rows_of_the_rank_order_result(reducers: list[str]) -> None:
    n = 3
    inputs = [np.random.default_rng(r).standard_normal((10, 2)).astype(np.float32) for r in range(n)]
    def body(c: redsrv.Client) -> np.ndarray:
        return collectives.reducescatter_async(c, inputs[c.rank], op="max", key="rs").result(timeout=20)

    results = on_every_rank(reducers, n, body, "rs")
    total = np.maximum(np.maximum(inputs[0], inputs[1]), inputs[2])
    assert [r.shape[0] for r in results] == collectives.split_sizes(10, n) == [4, 3, 3]
    assert np.concatenate(results).tobytes() == total.tobytes()


@pytest.mark.parametrize("empty_rank", [0, 1])
def test_an_empty_contribution_against_a_non_empty_one_is_a_mismatch_on_every_rank(reducers: list[str], empty_rank: int) -> None:
    def body(c: redsrv.Client) -> str:
        x = np.zeros(0 if c.rank == empty_rank else 100, np.float32)
        with pytest.raises(redsrv.ContributionMismatchError, match="ranks disagree"):
            c.allreduce(x, key="uneven")
        return "raised"

    assert on_every_rank(reducers, 2, body, f"uneven-{empty_rank}") == ["raised", "raised"]
    both_empty = on_every_rank(reducers, 2, lambda c: c.allreduce(np.zeros((0, 3), np.int32), key="e").shape, "both-empty")
    assert both_empty == [(0, 3), (0, 3)]
