"""The two data planes (core/plane.py) on one wire: a client on the compiled plane against reducers
on the Python plane and the reverse give the same bytes as both on the Python plane, for every
kind of byte work the planes do (combining each op and dtype, 16-bit wires widened and narrowed,
means)."""

from __future__ import annotations

import pytest

from redsrv.core import plane

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(plane.native_unavailable() is not None, reason=str(plane.native_unavailable()))]

OPS = [
    {"size": 300_007, "seed": 1},
    {"size": 300_007, "seed": 2, "op": "mean"},
    {"size": 300_007, "seed": 3, "wire_dtype": "bf16"},
    {"size": 300_007, "seed": 4, "wire_dtype": "fp16", "op": "mean"},
    {"size": 100_003, "seed": 5, "dtype": "float16"},
    {"size": 100_003, "seed": 6, "dtype": "bfloat16", "op": "max"},
    {"size": 100_003, "seed": 7, "dtype": "int32", "op": "min"},
    {"size": 100_003, "seed": 8, "dtype": "float64", "op": "product"},
]


def run(fleet, workers, client_plane: str, reducer_plane: str) -> list[bytes]:  # type: ignore[no-untyped-def]
    reducers = fleet(2, env={"REDSRV_DATA_PLANE": reducer_plane})
    results, reports = workers(reducers, 3, {"ops": OPS}, env={"REDSRV_DATA_PLANE": client_plane}).wait()
    assert all(r["error"] is None for r in reports), reports
    outcome = [results[0][f"r{i}"].tobytes() for i in range(len(OPS))]
    for rank in (1, 2):
        assert [results[rank][f"r{i}"].tobytes() for i in range(len(OPS))] == outcome, f"rank {rank} differs"
    return outcome


@pytest.mark.parametrize(("client_plane", "reducer_plane"), [("native", "python"), ("python", "native"),
                                                             ("native", "native")])
def test_a_plane_on_either_side_gives_the_reference_bytes(fleet, workers, client_plane: str,  # type: ignore[no-untyped-def]
                                                           reducer_plane: str) -> None:
    reference = run(fleet, workers, "python", "python")
    mixed = run(fleet, workers, client_plane, reducer_plane)
    for i, (ours, theirs) in enumerate(zip(mixed, reference, strict=True)):
        assert ours == theirs, f"op {OPS[i]}: {client_plane} client, {reducer_plane} reducers"


def test_each_process_runs_the_plane_it_was_given(fleet) -> None:  # type: ignore[no-untyped-def]
    python, native = fleet(1, env={"REDSRV_DATA_PLANE": "python"})[0], fleet(1, env={"REDSRV_DATA_PLANE": "native"})[0]
    assert "plane=python" in python.log[0], python.log[0]
    assert "plane=native" in native.log[0], native.log[0]
