"""The sizing advisor: the reducer count and the predicted speed-up follow the model."""

from __future__ import annotations

import pytest

from redsrv.plan import measure_core_gbps, plan


def test_recommends_matching_aggregate_bandwidth() -> None:
    p = plan(workers=16, worker_gbit=100, reducer_gbit=50, reducer_cores=64)
    assert p.reducers == 32 and p.bottleneck == "worker NIC" and not p.warnings
    assert p.speedup == pytest.approx(2 * 15 / 16)


def test_too_few_reducers_warns_and_predicts_the_loss() -> None:
    p = plan(workers=4, worker_gbit=1, reducer_gbit=1, reducer_cores=8, reducers=2)
    assert p.bottleneck == "reducer NIC"
    assert p.speedup == pytest.approx(0.75)  # BENCH.md measured 0.65x for this fleet
    assert any("below aggregate worker bandwidth" in w for w in p.warnings)


def test_cpu_bound_reducers_need_more_of_them() -> None:
    p = plan(workers=8, worker_gbit=200, reducer_gbit=200, reducer_cores=4, core_gbps=1.0)
    assert p.reducers == 50  # 8 x 25 GB/s of input over 4 GB/s per reducer
    assert p.bottleneck in ("reducer CPU", "worker NIC")


def test_invalid_inputs() -> None:
    with pytest.raises(ValueError):
        plan(workers=1, worker_gbit=1, reducer_gbit=1, reducer_cores=1)


def test_measure_runs_the_real_state_machine() -> None:
    assert measure_core_gbps(seconds=0.2) > 0.05


def test_doctest() -> None:
    import doctest

    import redsrv.plan

    assert doctest.testmod(redsrv.plan).failed == 0
