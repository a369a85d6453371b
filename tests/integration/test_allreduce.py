"""Real ``redsrv reducer`` processes and 2-4 worker processes on 127.0.0.1."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tests_support import make_input, rank_order_sum

pytestmark = pytest.mark.timeout(120)

#: Tolerances for compressed or 16-bit data, relative to the largest magnitude of the exact
#: sum: one rounding of each input to 16 bits plus one of the float32 sum.
TOLERANCE = {"bfloat16": 2 ** -7, "float16": 2 ** -10}


def ops(*specs: dict) -> dict:  # type: ignore[type-arg]
    return {"ops": list(specs)}


@pytest.mark.parametrize(("n", "m"), [(2, 1), (3, 2), (4, 3)])
def test_float32_sums_are_bitwise_the_rank_order_sum(fleet, workers, n: int, m: int) -> None:  # type: ignore[no-untyped-def]
    sizes = [0, 1, 1001, 300_007]
    reducers = fleet(m)
    results, reports = workers(reducers, n, ops(*({"size": s, "seed": i} for i, s in enumerate(sizes)))).wait()
    assert all(r["error"] is None for r in reports), reports
    for i, size in enumerate(sizes):
        expected = rank_order_sum([make_input(i, r, size, "float32") for r in range(n)])
        for rank in range(n):
            assert results[rank][f"r{i}"].tobytes() == expected.tobytes(), (size, rank)


@pytest.mark.parametrize("io_threads", [1, 2, 3])
def test_sums_stay_the_rank_order_sum_whatever_the_number_of_io_threads(fleet, workers, io_threads: int) -> None:  # type: ignore[no-untyped-def]
    n, sizes = 3, [1, 300_007, 3_000_001]
    env = {"REDSRV_IO_THREADS": str(io_threads), "REDSRV_STREAMS_PER_REDUCER": "2"}
    spec = ops(*({"size": s, "seed": 20 + i} for i, s in enumerate(sizes)), {"size": sizes[1], "seed": 30, "op": "mean"})
    results, reports = workers(fleet(3), n, spec, env=env).wait()
    assert all(r["error"] is None for r in reports), reports
    loops = ["redsrv-io"] if io_threads == 1 else [f"redsrv-io-{i}" for i in range(io_threads)]
    assert all(r["io_threads"] == loops for r in reports), reports
    for i, size in enumerate(sizes):
        expected = rank_order_sum([make_input(20 + i, r, size, "float32") for r in range(n)])
        for rank in range(n):
            assert results[rank][f"r{i}"].tobytes() == expected.tobytes(), (size, rank)
    mean = rank_order_sum([make_input(30, r, sizes[1], "float32") for r in range(n)]) / n
    for rank in range(n):
        assert results[rank][f"r{len(sizes)}"].tobytes() == mean.tobytes(), rank


def test_tens_of_mib(fleet, workers) -> None:  # type: ignore[no-untyped-def]
    size = 24 * 2**20 // 4
    results, reports = workers(fleet(2), 2, ops({"size": size, "seed": 7})).wait()
    assert all(r["error"] is None for r in reports), reports
    expected = rank_order_sum([make_input(7, r, size, "float32") for r in range(2)])
    for rank in range(2):
        assert results[rank]["r0"].tobytes() == expected.tobytes()


@pytest.mark.parametrize("wire", [None, "bf16"])
def test_results_land_in_a_given_or_the_input_array(fleet, workers, wire: str | None) -> None:  # type: ignore[no-untyped-def]
    n, size = 3, 700_001
    spec = ops({"size": size, "seed": 5, "out": "given", "wire_dtype": wire},
               {"size": size, "seed": 6, "out": "inplace", "wire_dtype": wire, "op": "mean"})
    results, reports = workers(fleet(2), n, spec).wait()
    assert all(r["error"] is None for r in reports), reports
    assert all(r["out_is_target"] == [True, True] for r in reports), "the future must return the caller's array"
    total = rank_order_sum([make_input(5, r, size, "float32") for r in range(n)])
    mean = rank_order_sum([make_input(6, r, size, "float32") for r in range(n)]) / n
    for rank in range(n):
        if wire is None:
            assert results[rank]["r0"].tobytes() == total.tobytes()
        else:
            assert np.abs(results[rank]["r0"] - total).max() <= TOLERANCE["bfloat16"] * np.abs(total).max()
        assert np.allclose(results[rank]["r1"], mean, rtol=0, atol=TOLERANCE["bfloat16"] * np.abs(mean).max())
        assert results[rank]["r1"].tobytes() == results[0]["r1"].tobytes()


def test_an_out_array_that_does_not_fit_is_refused_before_anything_is_sent(fleet) -> None:  # type: ignore[no-untyped-def]
    import redsrv

    x = np.arange(12, dtype=np.float32)
    bad = {
        "wrong dtype": np.empty(12, np.float64),
        "wrong size": np.empty(13, np.float32),
        "not contiguous": np.empty(24, np.float32)[::2],
        "read-only": np.frombuffer(bytes(48), np.float32),
        "not an array": bytearray(48),
    }
    with redsrv.Client([r.address for r in fleet(1)], rank=0, world_size=1, job="out-checks") as client:
        for out in bad.values():
            with pytest.raises(redsrv.LocalProtocolError, match="out must"):
                client.allreduce(x, out=out)  # type: ignore[arg-type]
        shaped = np.empty((3, 4), np.float32)
        assert client.allreduce(x, out=shaped) is shaped  # any shape with the right size
        assert shaped.tobytes() == x.tobytes()


@pytest.mark.parametrize("dtype", ["float64", "int32", "int64", "float16", "bfloat16"])
def test_other_dtypes(fleet, workers, dtype: str) -> None:  # type: ignore[no-untyped-def]
    n, size = 3, 10_001
    results, reports = workers(fleet(2), n, ops({"size": size, "dtype": dtype, "seed": 3})).wait()
    assert all(r["error"] is None for r in reports), reports
    inputs = [make_input(3, r, size, dtype) for r in range(n)]
    for rank in range(n):
        out = results[rank]["r0"]
        assert out.dtype == inputs[0].dtype
        assert out.tobytes() == results[0]["r0"].tobytes()  # identical on every worker
    if dtype in TOLERANCE:
        exact = rank_order_sum([x.astype(np.float32) for x in inputs])
        assert np.abs(out.astype(np.float32) - exact).max() <= TOLERANCE[dtype] * np.abs(exact).max()
        # accumulated in float32 and rounded once: exactly the rounded float32 sum
        assert out.tobytes() == exact.astype(inputs[0].dtype).tobytes()
    else:
        assert out.tobytes() == rank_order_sum(inputs).tobytes()


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_wire_compression_returns_float32_within_tolerance(fleet, workers, wire: str) -> None:  # type: ignore[no-untyped-def]
    n, size = 3, 100_003
    plain = {"size": size, "seed": 5, "wire_dtype": wire}
    results, reports = workers(fleet(2), n, ops(plain, {**plain, "op": "mean"})).wait()
    assert all(r["error"] is None for r in reports), reports
    exact = rank_order_sum([make_input(5, r, size, "float32") for r in range(n)])
    tol = TOLERANCE["bfloat16" if wire == "bf16" else "float16"] * 2 * np.abs(exact).max()
    for rank in range(n):
        assert results[rank]["r0"].dtype == np.float32
        assert np.abs(results[rank]["r0"] - exact).max() <= tol
        assert np.abs(results[rank]["r1"] - exact / n).max() <= tol / n * 1.01
        assert results[rank]["r0"].tobytes() == results[0]["r0"].tobytes()


def test_many_keys_in_flight_submitted_in_different_orders(fleet, workers) -> None:  # type: ignore[no-untyped-def]
    n, count = 4, 24
    spec = ops(*({"size": 5000 + 37 * i, "seed": 100 + i, "key": ["layer", i]} for i in range(count)))
    spec.update(concurrent=True, reverse_on_odd_ranks=True)
    results, reports = workers(fleet(2), n, spec).wait()
    assert all(r["error"] is None for r in reports), reports
    for i in range(count):
        expected = rank_order_sum([make_input(100 + i, r, 5000 + 37 * i, "float32") for r in range(n)])
        for rank in range(n):
            assert results[rank][f"r{i}"].tobytes() == expected.tobytes()


def test_two_jobs_share_a_fleet(fleet, workers) -> None:  # type: ignore[no-untyped-def]
    reducers = fleet(2)
    run_a = workers(reducers, 2, {"job": "job-a", **ops(*({"size": 20_000, "seed": s} for s in range(5)))})
    run_b = workers(reducers, 3, {"job": "job-b", **ops(*({"size": 30_000, "seed": 50 + s} for s in range(5)))})
    (res_a, rep_a), (res_b, rep_b) = run_a.wait(), run_b.wait()
    assert all(r["error"] is None for r in rep_a + rep_b)
    for s in range(5):
        a = rank_order_sum([make_input(s, r, 20_000, "float32") for r in range(2)])
        b = rank_order_sum([make_input(50 + s, r, 30_000, "float32") for r in range(3)])
        assert all(res_a[r][f"r{s}"].tobytes() == a.tobytes() for r in range(2))
        assert all(res_b[r][f"r{s}"].tobytes() == b.tobytes() for r in range(3))


def test_broadcast_is_exact(fleet, workers) -> None:  # type: ignore[no-untyped-def]
    results, reports = workers(fleet(2), 3, ops({"kind": "broadcast", "size": 9999, "root": 2, "seed": 8})).wait()
    assert all(r["error"] is None for r in reports)
    root_data = make_input(8, 2, 9999, "float32")
    for rank in range(3):
        assert results[rank]["r0"].tobytes() == root_data.tobytes()


def test_first_m_mode_excludes_the_straggler_and_averages_over_contributors(fleet, workers, tmp_path) -> None:  # type: ignore[no-untyped-def]
    n = 4
    go = tmp_path / "rank3-may-push"
    spec = ops({"size": 20_000, "seed": 9, "op": "mean"})
    spec.update(config={"straggler_mode": "first_m", "min_contributors": 3}, start_after={"3": str(go)})
    run = workers(fleet(2), n, spec)
    for proc in run.procs[:3]:  # the first three have their average, and have left, before rank 3 pushes
        proc.wait(timeout=60)
    go.touch()
    results, reports = run.wait()
    assert all(r["error"] is None for r in reports), [r["error"] for r in reports]
    expected = rank_order_sum([make_input(9, r, 20_000, "float32") for r in range(3)]) / np.float32(3)
    for rank in range(n):  # the straggler receives the same average, without its own data
        assert results[rank]["r0"].tobytes() == expected.tobytes()
        assert reports[rank]["results"][0]["contributors"] == 3


def test_deadline_mode_closes_without_the_absent_rank(fleet, workers) -> None:  # type: ignore[no-untyped-def]
    n = 3
    spec = ops({"size": 5000, "seed": 11, "op": "mean"})
    spec.update(config={"straggler_mode": "deadline", "min_contributors": 2, "deadline": 0.5})
    run = workers(fleet(1), n, spec, ranks=[0, 2])  # rank 1 never shows up
    results, reports = run.wait()
    assert all(r["error"] is None for r in reports), reports
    expected = rank_order_sum([make_input(11, r, 5000, "float32") for r in (0, 2)]) / np.float32(2)
    for out in results:
        assert out["r0"].tobytes() == expected.tobytes()


def test_bfloat16_inputs_keep_their_dtype(fleet, workers) -> None:  # type: ignore[no-untyped-def]
    results, _ = workers(fleet(1), 2, ops({"size": 10, "dtype": "bfloat16", "seed": 1})).wait()
    assert results[0]["r0"].dtype == np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize(("op", "dtype"), [("max", "float32"), ("min", "float32"), ("product", "float64"),
                                           ("band", "int32"), ("bor", "int64"), ("bxor", "int32")])
def test_every_op_through_real_reducers_is_the_rank_order_result(fleet, workers, op: str, dtype: str) -> None:  # type: ignore[no-untyped-def]
    n, size = 3, 200_003
    ufunc = {"max": np.maximum, "min": np.minimum, "product": np.multiply, "band": np.bitwise_and, "bor": np.bitwise_or,
             "bxor": np.bitwise_xor}[op]
    results, reports = workers(fleet(2), n, ops({"size": size, "seed": 11, "dtype": dtype, "op": op})).wait()
    assert all(r["error"] is None for r in reports), reports
    inputs = [make_input(11, r, size, dtype) for r in range(n)]
    expected = ufunc(ufunc(inputs[0], inputs[1]), inputs[2])
    for rank in range(n):
        assert results[rank]["r0"].tobytes() == expected.tobytes(), rank
