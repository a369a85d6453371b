"""Every benchmark checks what it times: a run that returns a wrong sum says so and exits 1.

The wrong sums are real: a proxy in front of a real reducer flips one byte in the middle of a
result's data (tests/fault_proxy.py, ``corrupt``), which no protocol check can see.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from redsrv.bench import local
from redsrv.cli.fleet import _Fleet

from fault_proxy import Fault, FaultProxy

pytestmark = pytest.mark.timeout(120)


def corrupting_proxy(reducer) -> FaultProxy:  # type: ignore[no-untyped-def]
    proxy = FaultProxy((reducer.host, reducer.port), Fault("corrupt", "reducer", "pull", reducer.proc.pid, {}))
    proxy.arm()
    return proxy


def test_bench_local_reports_a_wrong_sum_and_exits_1(procs, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    reducer = procs.start_reducer()
    proxy = corrupting_proxy(reducer)
    try:
        status = local.run_local_bench(workers=2, reducers=1, sizes_mib=[1], reps=2, wire_dtype=None, warmup=1,
                                       json_path=str(tmp_path / "local.json"), fleet=_Fleet([reducer.proc], [proxy.address]))
    finally:
        proxy.close()
    assert proxy.fault.fired_at is not None, "the proxy never corrupted a result"
    assert status == 1
    assert "WRONG SUMS at 1048576 bytes" in capsys.readouterr().err
    doc = json.loads((tmp_path / "local.json").read_text())
    assert doc["correct"] is False and sum(doc["rows"][0]["wrong_results_by_rank"].values()) == 1


def test_bench_local_checks_every_result_of_a_clean_run(procs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    reducer = procs.start_reducer()
    for op in ("sum", "mean"):
        status = local.run_local_bench(workers=3, reducers=1, sizes_mib=[0.25], reps=2, wire_dtype="bf16", warmup=1, op=op,
                                       json_path=str(tmp_path / f"{op}.json"), fleet=_Fleet([reducer.proc], [reducer.address]))
        assert status == 0
        assert json.loads((tmp_path / f"{op}.json").read_text())["correct"] is True
