"""`redsrv plan`'s model against a fresh short emulation (benchmarks/plan_check.py).

The emulated point is network-bound by design (2 workers, 2 reducers, 300 Mbit/s): there the
model must hold within the issue's worst-case bound. If other load keeps the machine CPU-bound
during the run, the point measures that load, not the model, and the test is an expected failure
(as in test_emulate_smoke.py)."""

from __future__ import annotations

import pytest

from redsrv.bench import plan_check
from redsrv.bench.plan_check import Point

from tests_support import why_no_namespaces

REASON = why_no_namespaces()


def test_errors_are_judged_over_network_bound_points_only() -> None:
    points = [Point(2, 2, 10**9, 1 << 20, predicted_s=1.0, measured_s=1.04, bottleneck="worker NIC", cpu_busy=0.5),
              Point(4, 2, 10**9, 1 << 20, predicted_s=1.0, measured_s=1.02, bottleneck="reducer NIC", cpu_busy=0.6),
              Point(8, 8, 10**9, 1 << 20, predicted_s=1.0, measured_s=1.60, bottleneck="worker NIC", cpu_busy=0.97)]
    summary = plan_check.summarise_points(points)
    assert summary["judged"] == 2 and summary["within_bounds"] is True
    assert summary["median_error"] == pytest.approx(0.03) and summary["worst_error"] == pytest.approx(0.04)
    text = plan_check.format_points(points)
    assert "CPU-bound: not judged" in text and "within bounds" in text
    worse = [*points, Point(6, 3, 10**9, 1 << 20, predicted_s=1.0, measured_s=1.2, bottleneck="reducer NIC", cpu_busy=0.5)]
    assert plan_check.summarise_points(worse)["within_bounds"] is False


@pytest.mark.netns
@pytest.mark.timeout(120)
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
@pytest.mark.parametrize(("n", "m", "rate_bps", "size_mib"), [
    (2, 2, 300 * 10**6, 16),
    # Fewer reducers than workers: the workers' pushes converge on each reducer's switch port.
    # measure_point runs the reducers' receive window the plan advises for such a fleet; with the
    # kernel's autotuned windows they overflowed the port's queue and this point ran 18-24% over
    # the model (docs/performance.md, "Fewer reducers than workers").
    (4, 2, 10**9, 64),
    # Eight workers' flows into each reducer port at a slow rate: 26-28% over the model while the
    # emulated hosts sent 64 KiB packets (their own queue delayed the reducers' ACKs by ~29 ms),
    # +1.5% to +5.9% since they send packets of 0.5 ms (netns.HOST_GSO_SECONDS).
    (8, 4, 300 * 10**6, 64),
], ids=["n2-m2-300mbit", "n4-m2-1gbit", "n8-m4-300mbit"])
def test_the_model_predicts_a_fresh_network_bound_emulation_within_the_worst_case_bound(
        tmp_path, n: int, m: int, rate_bps: int, size_mib: int) -> None:  # type: ignore[no-untyped-def]
    point = plan_check.measure_point(n=n, m=m, rate_bps=rate_bps, size_bytes=size_mib * 2**20, reps=3, out=str(tmp_path),
                                     prefix="rspt")
    detail = (f"predicted {point.predicted_s:.3f}s ({point.bottleneck}), measured {point.measured_s:.3f}s, error "
              f"{point.error:+.1%}, machine {point.cpu_busy:.0%} busy")
    if point.cpu_bound:
        pytest.xfail(f"machine CPU-bound during the run: {detail}")
    assert abs(point.error) <= plan_check.WORST_BOUND, detail
