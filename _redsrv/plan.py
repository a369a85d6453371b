"""``redsrv plan``: how many reducers a job needs, and what it gains over ring all-reduce.

The model: in one all-reduce of G bytes every worker sends and receives G (ring: 2(n-1)/n G), and
each of m reducers receives and sends n·G/m and sums n·G/m. The all-reduce takes as long as the
slowest of the worker NIC, the reducer NIC and the reducer CPU:

    T_redsrv = max(G / W,  n·G / (m·R),  n·G / (m·c·S))      T_ring = 2(n-1)/n · G / W

with W and R the worker and reducer NIC bandwidths, c the cores per reducer and S the bytes of
contributions one core reduces per second (network stack included). The rule every vendor
states and nobody automates: aggregate reducer bandwidth m·R must reach aggregate worker
bandwidth n·W, or the reducers become the bottleneck.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass

import numpy as np

#: Bytes of contributions one reducer core sums per second, TCP included, when not measured:
#: `redsrv bench local` on a 2-vCPU VM spent ~1.2 CPU-seconds per GB reduced (loopback, both
#: ends' copies on the same cores), i.e. ~0.85 GB/s per core; servers with real NICs do better.
DEFAULT_CORE_GBPS = 0.85


@dataclass(frozen=True)
class Plan:
    workers: int
    worker_gbps: float
    reducer_gbps: float
    reducer_cores: int
    core_gbps: float
    reducers: int
    bottleneck: str
    algbw_gbps: float  # gigabytes per second of gradient per worker
    line_rate_fraction: float
    ring_algbw_gbps: float
    speedup: float
    theory_max_speedup: float
    warnings: tuple[str, ...]
    reducer_cost_fraction: float | None


def plan(*, workers: int, worker_gbit: float, reducer_gbit: float, reducer_cores: int, core_gbps: float = DEFAULT_CORE_GBPS,
         reducers: int | None = None, worker_price: float | None = None, reducer_price: float | None = None) -> Plan:
    """Recommend a reducer count (or evaluate ``reducers``) for ``workers`` workers.

    >>> p = plan(workers=8, worker_gbit=100, reducer_gbit=100, reducer_cores=32)
    >>> p.reducers, p.bottleneck, round(p.speedup, 2)
    (8, 'worker NIC', 1.75)
    """
    if workers < 2 or worker_gbit <= 0 or reducer_gbit <= 0 or reducer_cores < 1 or core_gbps <= 0:
        raise ValueError("need workers >= 2 and positive bandwidths, cores and core throughput")
    w = worker_gbit / 8  # GB/s
    r = reducer_gbit / 8
    per_reducer = min(r, reducer_cores * core_gbps)  # what one reducer can take in per second
    m = reducers if reducers is not None else max(1, math.ceil(workers * w / per_reducer - 1e-9))
    limits = {"worker NIC": w, "reducer NIC": m * r / workers, "reducer CPU": m * reducer_cores * core_gbps / workers}
    bottleneck = min(limits, key=lambda k: limits[k])
    algbw = limits[bottleneck]
    ring = w * workers / (2 * (workers - 1))
    warnings = []
    if m * r < workers * w:
        warnings.append(f"aggregate reducer bandwidth {m * reducer_gbit:g} Gbit/s is below aggregate worker bandwidth "
                        f"{workers * worker_gbit:g} Gbit/s: the reducers are the bottleneck")
    if m * reducer_cores * core_gbps < workers * w:
        warnings.append(f"{m} reducer(s) x {reducer_cores} cores cannot sum at the workers' line rate: add cores or reducers")
    if algbw <= ring:
        warnings.append("with this fleet ring all-reduce is as fast or faster")
    cost = None
    if worker_price is not None and reducer_price is not None and worker_price > 0:
        cost = m * reducer_price / (workers * worker_price)
    return Plan(workers, worker_gbit, reducer_gbit, reducer_cores, core_gbps, m, bottleneck, algbw, algbw / w, ring,
                algbw / ring, 2 * (workers - 1) / workers, tuple(warnings), cost)


def measure_core_gbps(seconds: float = 1.0, workers: int = 4, chunk_bytes: int = 512 * 1024) -> float:
    """Bytes of contributions per second one core pushes through the reducer state machine
    (receive copy + rank-order sum + result), excluding the kernel's TCP work."""
    from redsrv.core import wire
    from redsrv.core.reducer import PushTicket, ReducerCore, SendResult

    core = ReducerCore(1)
    for rank in range(workers):
        core.join(rank, wire.Hello("probe", rank, workers, rank + 1, bytes(32)))
    payload = np.random.default_rng(0).standard_normal(chunk_bytes // 4).astype(np.float32).view(np.uint8)
    count = chunk_bytes // 4
    done = 0
    started = time.perf_counter()
    key = 0
    while time.perf_counter() - started < seconds:
        for rank in range(workers):
            push = wire.Push(key, 1, count, 0, count, 0, wire.DType.FLOAT32)
            ticket = core.begin_push(rank, push, chunk_bytes, 0.0)
            assert isinstance(ticket, PushTicket) and ticket.buffer is not None
            ticket.buffer[:] = payload  # what recv_into does
            for action in core.finish_push(ticket, 0.0):
                if isinstance(action, SendResult):
                    for _ in action.conns:
                        action.release()
            done += chunk_bytes
        key += 1
    return done / (time.perf_counter() - started) / 1e9


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("plan", help="recommend the number of reducers and predict the speed-up over ring all-reduce",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, required=True, help="number of workers (n)")
    p.add_argument("--worker-gbit", type=float, required=True, help="worker NIC bandwidth, Gbit/s")
    p.add_argument("--reducer-gbit", type=float, required=True, help="reducer NIC bandwidth, Gbit/s")
    p.add_argument("--reducer-cores", type=int, default=8, help="cores per reducer host (default 8)")
    p.add_argument("--reducers", type=int, help="evaluate this many reducers instead of recommending")
    p.add_argument("--core-gbps", type=float, help=f"GB/s of contributions one core reduces (default {DEFAULT_CORE_GBPS})")
    p.add_argument("--measure", action="store_true", help="measure this machine's reduce throughput per core first")
    p.add_argument("--worker-price", type=float, help="price of a worker per hour (any currency)")
    p.add_argument("--reducer-price", type=float, help="price of a reducer per hour (same currency)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    core_gbps = args.core_gbps
    if args.measure:
        measured = measure_core_gbps()
        print(f"measured: one core moves {measured:.2f} GB/s of contributions through the reducer state machine "
              f"(TCP excluded; planning with {measured / 2:.2f}, half of it, to leave room for the network stack)")
        core_gbps = measured / 2
    p = plan(workers=args.workers, worker_gbit=args.worker_gbit, reducer_gbit=args.reducer_gbit,
             reducer_cores=args.reducer_cores, core_gbps=core_gbps or DEFAULT_CORE_GBPS, reducers=args.reducers,
             worker_price=args.worker_price, reducer_price=args.reducer_price)
    if args.json:
        print(json.dumps(asdict(p), indent=1))
        return 0
    rows = [
        ("workers x NIC", f"{p.workers} x {p.worker_gbps:g} Gbit/s"),
        ("reducers x NIC x cores", f"{p.reducers} x {p.reducer_gbps:g} Gbit/s x {p.reducer_cores}"
         + ("  (recommended)" if args.reducers is None else "")),
        ("reduce throughput per core", f"{p.core_gbps:.2f} GB/s"),
        ("bottleneck", p.bottleneck),
        ("predicted algbw (redsrv)", f"{p.algbw_gbps:.3f} GB/s = {p.line_rate_fraction:.0%} of the worker line rate"),
        ("ring all-reduce algbw", f"{p.ring_algbw_gbps:.3f} GB/s"),
        ("predicted speed-up", f"{p.speedup:.2f}x (at most {p.theory_max_speedup:.2f}x for {p.workers} workers)"),
    ]
    if p.reducer_cost_fraction is not None:
        rows.append(("reducer cost", f"{p.reducer_cost_fraction:.1%} of the workers' cost"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    for w in p.warnings:
        print(f"  warning: {w}")
    return 0
