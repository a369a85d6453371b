"""``redsrv bench plan-check``: `redsrv plan`'s model against the emulated cluster, on a grid.

For every worker count n, reducer count m (n and n/2 by default) and per-host rate, a short
``redsrv bench emulate`` run (redsrv alone, one size, one round) measures the all-reduce time, and
``redsrv.cli.plan.plan`` predicts it for the same fleet: worker and reducer NICs at the
emulation's TCP goodput, one core per reducer host at the model's default summing rate, the
model's default data-path ceilings, the switch ports' queue. The emulation runs with the settings
the plan advises (the reducers' receive window where they are the bottleneck). The table gives
predicted and measured time per point and the error (measured / predicted - 1), and the median
and worst absolute error over every point. Points that ran with the machine over 85% busy are
marked CPU-bound: every emulated host shares this machine's cores, which a model of hosts with
cores of their own does not describe. They stay in the headline: on a slower machine of the same
kind the headline points are themselves CPU-bound, and leaving such points out would hide exactly
that regression (docs/performance.md, "`redsrv plan` against the emulation").

Needs root and iproute2, like ``redsrv bench emulate``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from redsrv.bench import report
from redsrv.bench.emulate import Options, run_emulate
from redsrv.bench.netns import DEFAULT_PREFIX, format_rate, parse_rate, port_queue_bytes, tcp_goodput_bps
from redsrv.cli.plan import Plan, plan
from redsrv.cli.units import size_in

__all__ = ["add_parser", "Point", "predict_seconds", "measure_point", "summarise_points", "format_points",
           "MEDIAN_BOUND", "WORST_BOUND"]

#: The issue's bounds on the model's error over network-bound points.
MEDIAN_BOUND = 0.05
WORST_BOUND = 0.10


@dataclass(frozen=True)
class Point:
    n: int
    m: int
    rate_bps: int
    size_bytes: int
    predicted_s: float
    measured_s: float
    bottleneck: str
    cpu_busy: float
    recv_buffer_bytes: int = 0  # the reducers' receive window the plan advised and the emulation ran with

    @property
    def error(self) -> float:
        return self.measured_s / self.predicted_s - 1

    @property
    def cpu_bound(self) -> bool:
        return self.cpu_busy > report.CPU_BOUND_BUSY

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "error": self.error, "cpu_bound": self.cpu_bound}


def plan_for(*, n: int, m: int, rate_bps: int, mtu: int = 1500) -> Plan:
    """`redsrv plan` for an emulated fleet: NICs at the TCP goodput of ``rate_bps``, the switch
    ports' queue (``--switch-buffer-kib``), the reducers' default cut-through piece."""
    gbit = tcp_goodput_bps(rate_bps, mtu) / 1e9
    return plan(workers=n, worker_gbit=gbit, reducer_gbit=gbit, reducer_cores=1, reducers=m,
                port_buffer_bytes=port_queue_bytes(rate_bps))


def predict_seconds(*, n: int, m: int, rate_bps: int, size_bytes: int, mtu: int = 1500) -> tuple[float, str]:
    """The model's all-reduce time for ``size_bytes`` per worker (:meth:`Plan.seconds`: the bytes
    at the bottleneck's rate and the results' lag behind the pushes), and its bottleneck.

    >>> seconds, bottleneck = predict_seconds(n=4, m=2, rate_bps=10**9, size_bytes=64 * 2**20)
    >>> round(seconds, 3), bottleneck
    (1.149, 'reducer NIC')
    """
    p = plan_for(n=n, m=m, rate_bps=rate_bps, mtu=mtu)
    return p.seconds(size_bytes), p.bottleneck


def measure_point(*, n: int, m: int, rate_bps: int, size_bytes: int, reps: int, out: str, prefix: str,
                  quiet: bool = True) -> Point:
    """One short emulation (redsrv alone, with the settings the plan advises for the fleet) and the
    model's prediction for it."""
    p = plan_for(n=n, m=m, rate_bps=rate_bps)
    doc = run_emulate(Options(workers=(n,), reducers=m, rate_bps=rate_bps, sizes_bytes=(size_bytes,), reps=reps, warmup=1,
                              rounds=1, baseline=False, recv_buffer_bytes=p.recv_buffer_bytes, out=out, prefix=prefix,
                              quiet=quiet))
    if not doc["ok"]:
        raise RuntimeError(f"n={n} m={m} at {format_rate(rate_bps)}: wrong sums in the emulation ({doc.get('json')})")
    [row] = [r for r in doc["rows"] if r["impl"] == "redsrv"]
    return Point(n, m, rate_bps, size_bytes, p.seconds(size_bytes), row["median_s"], p.bottleneck, row["cpu_busy"],
                 p.recv_buffer_bytes)


def summarise_points(points: Sequence[Point]) -> dict[str, Any]:
    """Median and worst absolute error over every point, CPU-bound ones included (and counted),
    and whether they meet the bounds."""
    judged = [abs(p.error) for p in points]
    cpu_bound = sum(p.cpu_bound for p in points)
    if not judged:
        return {"judged": 0, "cpu_bound": 0, "median_error": None, "worst_error": None, "within_bounds": None}
    median, worst = statistics.median(judged), max(judged)
    return {"judged": len(judged), "cpu_bound": cpu_bound, "median_error": median, "worst_error": worst,
            "within_bounds": median <= MEDIAN_BOUND and worst <= WORST_BOUND}


def format_points(points: Sequence[Point]) -> str:
    lines = [f"{'n':>2} {'m':>2} {'rate':>9} {'size':>8} {'bottleneck':<24} {'window':>7} {'predicted':>10} {'measured':>10} "
             f"{'error':>7}  CPU busy"]
    for p in points:
        window = f"{p.recv_buffer_bytes // 1024}K" if p.recv_buffer_bytes else "auto"
        lines.append(f"{p.n:>2} {p.m:>2} {format_rate(p.rate_bps):>9} {report.format_size(p.size_bytes):>8} {p.bottleneck:<24} "
                     f"{window:>7} "
                     f"{p.predicted_s:>9.3f}s {p.measured_s:>9.3f}s {p.error:>+7.1%}  {p.cpu_busy:.0%}"
                     + ("  CPU-bound" if p.cpu_bound else ""))
    s = summarise_points(points)
    if s["judged"]:
        lines.append(f"over all {s['judged']} point(s) ({s['cpu_bound']} CPU-bound): median |error| {s['median_error']:.1%} "
                     f"(bound {MEDIAN_BOUND:.0%}), worst {s['worst_error']:.1%} (bound {WORST_BOUND:.0%}): "
                     + ("within bounds" if s["within_bounds"] else "OUTSIDE the bounds"))
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    b = subparsers.add_parser("plan-check", help="redsrv plan's model against short emulations on a grid (root)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--workers", type=int, nargs="+", default=[2, 4, 6, 8], metavar="N", help="worker counts (default 2 4 6 8)")
    b.add_argument("--reducer-fractions", type=float, nargs="+", default=[0.5, 1.0], metavar="F",
                   help="m = round(F x n), at least 1 (default 0.5 1)")
    b.add_argument("--rates", nargs="+", default=["300mbit", "1gbit"], help="per-host rates (default 300mbit 1gbit)")
    b.add_argument("--size", type=size_in("MiB"), default=64, help="per worker, e.g. 64MiB; a bare number is MiB (default 64)")
    b.add_argument("--reps", type=int, default=3, help="timed reps per point (default 3)")
    b.add_argument("--out", default="bench-results", help="folder for the emulations' files and plan-check JSON")
    b.add_argument("--prefix", default=DEFAULT_PREFIX, help="namespace name prefix")
    b.set_defaults(func=_main)


def _main(a: argparse.Namespace) -> int:
    points = []
    for rate in a.rates:
        for n in a.workers:
            for m in sorted({max(1, round(f * n)) for f in a.reducer_fractions}):
                point = measure_point(n=n, m=m, rate_bps=parse_rate(rate), size_bytes=int(a.size * 2**20), reps=a.reps,
                                      out=a.out, prefix=a.prefix)
                print(format_points([point]).splitlines()[1], flush=True)
                points.append(point)
    print("\n" + format_points(points))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = f"{a.out}/plan-check-{stamp}.json"
    with open(path, "w") as f:
        json.dump({"benchmark": "redsrv bench plan-check", "points": [p.as_dict() for p in points],
                   "summary": summarise_points(points)}, f, indent=1)
    print(f"wrote {path}")
    return 0
