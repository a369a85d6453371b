"""`redsrv plan`'s model against a fresh short emulation (benchmarks/plan_check.py).

The emulated points are network-bound by design: there the model must hold within the issue's
worst-case bound. A point is judged only as a measurement of the network: processes other than
the run's own must have used at most report.OTHER_LOAD_BOUND of the machine (harness.OtherLoad),
else it is a miss, never an expected failure (as in test_emulate_smoke.py)."""

from __future__ import annotations

import pytest

from redsrv.bench import harness, plan_check, report
from redsrv.bench.plan_check import Point

from tests_support import why_no_namespaces

REASON = why_no_namespaces()


def test_the_headline_judges_every_point_and_marks_the_cpu_bound_ones() -> None:
    points = [Point(2, 2, 10**9, 1 << 20, predicted_s=1.0, measured_s=1.04, bottleneck="worker NIC", cpu_busy=0.5),
              Point(4, 2, 10**9, 1 << 20, predicted_s=1.0, measured_s=1.02, bottleneck="reducer NIC", cpu_busy=0.6),
              Point(8, 8, 10**9, 1 << 20, predicted_s=1.0, measured_s=1.60, bottleneck="worker NIC", cpu_busy=0.97)]
    summary = plan_check.summarise_points(points)
    # The CPU-bound point is the worst one: the headline keeps it (a slower machine of the same
    # kind would be CPU-bound at the headline points too, and hiding them hides that regression).
    assert summary["judged"] == 3 and summary["cpu_bound"] == 1 and summary["within_bounds"] is False
    assert summary["median_error"] == pytest.approx(0.04) and summary["worst_error"] == pytest.approx(0.60)
    text = plan_check.format_points(points)
    assert "+60.0%  97%  CPU-bound" in text and "over all 3 point(s) (1 CPU-bound)" in text and "OUTSIDE" in text
    assert plan_check.summarise_points(points[:2])["within_bounds"] is True


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
    # Six workers' flows into each pair of reducers at a slow rate: 15% over the model while the
    # emulated hosts sent 64 KiB packets (their own queue delayed the reducers' ACKs), +0.2% to
    # +1.5% since they send packets of 0.5 ms (netns.HOST_GSO_SECONDS). n=8, m=4, the worse point
    # before the cap, runs 62-82% busy on the slower machines of this kind and +2.4% to +14%
    # over the model there, the same on the source that measured it within 6%: its time is partly
    # the shared cores', which the model does not describe (docs/performance.md, "`redsrv plan`
    # against the emulation").
    (6, 3, 300 * 10**6, 64),
], ids=["n2-m2-300mbit", "n4-m2-1gbit", "n6-m3-300mbit"])
def test_the_model_predicts_a_fresh_network_bound_emulation_within_the_worst_case_bound(
        tmp_path, n: int, m: int, rate_bps: int, size_mib: int) -> None:  # type: ignore[no-untyped-def]
    with harness.OtherLoad() as others:
        point = plan_check.measure_point(n=n, m=m, rate_bps=rate_bps, size_bytes=size_mib * 2**20, reps=3, out=str(tmp_path),
                                         prefix="rspt")
    detail = (f"predicted {point.predicted_s:.3f}s ({point.bottleneck}), measured {point.measured_s:.3f}s, error "
              f"{point.error:+.1%}, machine {point.cpu_busy:.0%} busy, other processes {others.share:.0%}")
    # Not a measurement of the network: a miss, never an expected failure.
    assert others.share <= report.OTHER_LOAD_BOUND, f"other processes used the machine during the run: {detail}"
    assert abs(point.error) <= plan_check.WORST_BOUND, detail
