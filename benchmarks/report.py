"""Bounds, summaries, the terminal table and the plot of ``redsrv bench emulate``.

Pure functions of the measured blocks (the plot imports matplotlib when asked for). A *block* is
one implementation's timed reps at one size in one round: ``times`` holds, per rep, the slowest
rank's time (an all-reduce is done when the last rank has its result).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["ring_bound", "server_bound", "theory_speedup", "bound_of", "Row", "summarise", "format_table", "format_size",
           "plot", "CPU_BOUND_BUSY", "OTHER_LOAD_BOUND", "BANDWIDTH_BOUND_BYTES"]

#: Whole-machine CPU busy above which a result measures the CPU, not the network.
CPU_BOUND_BUSY = 0.85
#: The performance smoke tests judge a run only when processes other than the run's own used at
#: most this share of the machine (harness.OtherLoad); above it the run measured them: a miss.
OTHER_LOAD_BOUND = 0.10

#: Below this size an all-reduce is bound by latency, not bandwidth: no bandwidth theory.
BANDWIDTH_BOUND_BYTES = 2**20


def ring_bound(goodput: float, n: int) -> float:
    """Best algbw of ring all-reduce: each host sends (and receives) 2(n-1)/n of the buffer.

    >>> round(ring_bound(0.1196, 4), 4)
    0.0797
    """
    return goodput * n / (2 * (n - 1))


def server_bound(goodput: float, n: int, m: int, colocated: bool = False, compression: float = 1.0) -> float:
    """Best algbw of a reduction server with ``m`` reducers and ``n`` workers.

    On their own hosts, every worker sends and receives the buffer once and each reducer host
    carries n/m of it: G·min(1, m/n). Reducer j colocated on worker host j mod n adds its
    traffic to that host's link, so the busiest host decides. ``compression`` is the buffer's
    itemsize over the wire's (2 for float32 sent as bf16): fewer bytes cross the links.

    >>> server_bound(0.1, 4, 4), server_bound(0.1, 4, 2)
    (0.1, 0.05)
    >>> round(server_bound(0.1, 4, 4, colocated=True), 4) == round(ring_bound(0.1, 4), 4)
    True
    """
    if not colocated:
        return goodput * compression * min(1.0, m / n)
    load = 0.0
    for host in range(n):
        k = sum(1 for j in range(m) if j % n == host)
        # own buffer minus the part reduced at home, plus n-1 contributions per reducer span
        load = max(load, 1 - k / m + k * (n - 1) / m)
    return goodput * compression / load


def theory_speedup(n: int, m: int, colocated: bool = False, compression: float = 1.0) -> float:
    """Ring time over reduction-server time at the bounds: 2(n-1)/n·min(1, m/n)·compression.

    >>> theory_speedup(4, 4), round(theory_speedup(3, 3), 3), theory_speedup(2, 2), theory_speedup(4, 4, compression=2)
    (1.5, 1.333, 1.0, 3.0)
    """
    return server_bound(1.0, n, m, colocated, compression) / ring_bound(1.0, n)


def bound_of(impl: str, goodput: float, n: int, m: int, per_host: int = 1, colocated: bool = False,
             compression: float = 1.0) -> float:
    """The bound of one implementation's row, with ``per_host`` workers on each of ``n`` hosts:
    gloo's ring over the n·L ranks crosses each host's link once in each direction (consecutive
    ranks share a host); redsrv with host-level reduction sends each host's buffer once, the
    flat path ("redsrv-flat") every worker's.

    >>> round(bound_of("gloo", 0.1, 4, 4, per_host=2) / ring_bound(0.1, 8), 3), bound_of("redsrv", 0.1, 4, 4, per_host=2)
    (1.0, 0.1)
    >>> bound_of("redsrv-flat", 0.1, 4, 4, per_host=2)
    0.05
    """
    if impl == "gloo":
        return ring_bound(goodput, n * per_host)
    bound = server_bound(goodput, n, m, colocated, compression)
    return bound / per_host if impl == "redsrv-flat" else bound


@dataclass
class Row:
    n: int
    m: int
    size_bytes: int
    impl: str
    reps: int
    rounds: int
    median_s: float
    min_s: float
    max_s: float
    algbw_gbps: float
    bound_gbps: float
    fraction_of_bound: float
    round_medians_s: list[float]
    cpu_busy: float  # whole machine, median over this row's blocks
    cpu_busy_max: float
    cpu_steal: float  # hypervisor steal, part of cpu_busy
    own_cpu_share: float  # our processes' CPU time / (wall time x cores)
    cpu_s_per_gb: float  # CPU seconds of workers (+ reducers) per GB of input reduced
    correct: bool
    # The workers' share alone: what the training hosts pay, reducers being hosts of their own on
    # a real cluster (here the kernel's softirq work lands in whichever process's context runs it).
    worker_cpu_s_per_gb: float = 0.0
    # Of our processes' CPU (workers, plus reducers where counted), the share spent in user space:
    # the interpreter, NumPy and the plane's C, what a faster data plane can save. The rest is the
    # kernel's (copies, TCP, the emulated links' softirqs), paid per byte whatever moves it.
    user_share: float = 0.0
    speedup: float | None = None  # gloo median / redsrv median, redsrv rows only
    speedup_min: float | None = None  # over rounds
    speedup_max: float | None = None
    theory: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    per_host: int = 1  # worker processes on each of the n worker hosts

    @property
    def cpu_bound(self) -> bool:
        return self.cpu_busy > CPU_BOUND_BUSY

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cpu_bound"] = self.cpu_bound
        return d


def summarise(blocks: Sequence[dict[str, Any]], *, goodput: float, colocated: bool, compression: float = 1.0) -> list[Row]:
    """One row per (n, size, implementation), redsrv rows with the speedup over gloo.
    ``compression``: redsrv's wire compression factor (gloo always sends the buffer's dtype)."""
    groups: dict[tuple[int, int, int, str], list[dict[str, Any]]] = {}
    for b in blocks:
        groups.setdefault((b["n"], b["m"], b["size_bytes"], b["impl"]), []).append(b)
    rows = []
    for (n, m, size, impl), bs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][3] != "gloo", kv[0][3])):
        times = [t for b in bs for t in b["times"]]
        med = statistics.median(times)
        per_host = bs[0].get("per_host", 1)
        bound = bound_of(impl, goodput, n, m, per_host, colocated, compression)
        busy = [b["cpu_busy"] for b in bs]
        wall = sum(b.get("metered_s", b["wall_s"]) for b in bs)
        cpu = sum(b["cpu_s"] for b in bs)
        cores = bs[0].get("cores", 1)
        reduced_gb = size * n * per_host * len(times) / 1e9
        rows.append(Row(
            n=n, m=m, size_bytes=size, impl=impl, reps=len(times), rounds=len(bs), median_s=med, min_s=min(times),
            max_s=max(times), algbw_gbps=size / med / 1e9, bound_gbps=bound, fraction_of_bound=size / med / 1e9 / bound,
            round_medians_s=[statistics.median(b["times"]) for b in sorted(bs, key=lambda b: b["round"])],
            cpu_busy=statistics.median(busy), cpu_busy_max=max(busy),
            cpu_steal=statistics.median(b.get("cpu_steal", 0.0) for b in bs), own_cpu_share=cpu / (wall * cores) if wall else 0.0,
            cpu_s_per_gb=cpu / reduced_gb if reduced_gb else 0.0, correct=all(b["correct"] for b in bs),
            worker_cpu_s_per_gb=sum(sum(b.get("worker_cpu_s", [])) for b in bs) / reduced_gb if reduced_gb else 0.0,
            user_share=sum(b.get("cpu_user_s", 0.0) for b in bs) / cpu if cpu else 0.0, per_host=per_host))
    by_key = {(r.n, r.size_bytes, r.impl): r for r in rows}
    for r in rows:
        ring = by_key.get((r.n, r.size_bytes, "gloo"))
        if r.impl != "gloo":
            r.theory = (bound_of(r.impl, 1.0, r.n, r.m, r.per_host, colocated, compression)
                        / bound_of("gloo", 1.0, r.n, r.m, r.per_host)) if r.size_bytes >= BANDWIDTH_BOUND_BYTES else None
            if ring is not None:
                r.speedup = ring.median_s / r.median_s
                pairs = [g / s for g, s in zip(ring.round_medians_s, r.round_medians_s, strict=False)]
                r.speedup_min, r.speedup_max = min(pairs), max(pairs)
    return rows


def format_size(nbytes: int) -> str:
    """Bytes in binary units.

    >>> format_size(64 * 2**20), format_size(4096), format_size(1536)
    ('64 MiB', '4 KiB', '1.5 KiB')
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _time(s: float) -> str:
    return f"{s * 1000:.2f} ms" if s < 0.1 else f"{s:.3f} s"


def format_table(rows: Sequence[Row]) -> str:
    head = (f"{'n':>2} {'m':>2} {'size':>8} {'impl':<11} {'median':>10} {'min-max':>19} {'algbw GB/s':>10} "
            f"{'of bound':>8} {'speedup (theory)':>17} {'rounds':>13} {'CPU busy/ours':>13} {'CPU s/GB (workers)':>18} "
            f"{'in user':>7}  note")
    lines = [head, "-" * len(head)]
    for r in rows:
        spd = ""
        if r.speedup is not None:
            spd = f"{r.speedup:.2f}x ({r.theory:.2f}x)" if r.theory is not None else f"{r.speedup:.2f}x (latency)"
        rng = f"{r.speedup_min:.2f}-{r.speedup_max:.2f}x" if r.speedup_min is not None else ""
        notes = []
        if r.cpu_bound:
            notes.append(f"CPU-bound (max {r.cpu_busy_max:.0%})")
        if not r.correct:
            notes.append("WRONG SUMS")
        lines.append(
            f"{r.n:>2} {r.m:>2} {format_size(r.size_bytes):>8} {r.impl:<11} {_time(r.median_s):>10} "
            f"{_time(r.min_s) + '-' + _time(r.max_s):>19} {r.algbw_gbps:>10.4f} {r.fraction_of_bound:>8.3f} {spd:>17} "
            f"{rng:>13} {f'{r.cpu_busy:.0%}/{r.own_cpu_share:.0%}':>13} "
            f"{f'{r.cpu_s_per_gb:.2f} ({r.worker_cpu_s_per_gb:.2f})':>18} {f'{r.user_share:.0%}':>7}  "
            f"{'; '.join(notes)}")
    return "\n".join(lines)


def plot(rows: Sequence[Row], path: str, *, goodput: float, rate_bps: int, title: str, colocated: bool,
         compression: float = 1.0) -> None:
    """algbw vs size (both implementations, with the line rate, G and the bounds), and the
    speedup vs n beside its theory when several n were run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted({r.n for r in rows})
    several = len(ns) > 1
    fig, axes = plt.subplots(1, 2 if several else 1, figsize=(13 if several else 7.5, 5.2), squeeze=False)
    ax = axes[0][0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    if rate_bps:
        ax.axhline(rate_bps / 8 / 1e9, color="black", lw=1, label=f"line rate {rate_bps / 8 / 1e9:.3f} GB/s")
        ax.axhline(goodput, color="black", lw=1, ls=":", label=f"TCP goodput G {goodput:.4f} GB/s")
    for i, n in enumerate(ns):
        color = colors[i % len(colors)]
        for impl, style, marker in (("gloo", "--", "s"), ("redsrv", "-", "o")):
            if not several:  # one n: tell the implementations apart by colour too
                color = colors[0] if impl == "redsrv" else colors[1]
            rs = sorted((r for r in rows if r.n == n and r.impl == impl), key=lambda r: r.size_bytes)
            if not rs:
                continue
            xs = [r.size_bytes / 2**20 for r in rs]
            ys = [r.algbw_gbps for r in rs]
            lo = [max(0.0, r.algbw_gbps - r.size_bytes / r.max_s / 1e9) for r in rs]
            hi = [max(0.0, r.size_bytes / r.min_s / 1e9 - r.algbw_gbps) for r in rs]
            label = f"{'gloo ring' if impl == 'gloo' else 'redsrv'} n={n}" + (f" m={rs[0].m}" if impl == "redsrv" else "")
            ax.errorbar(xs, ys, yerr=[lo, hi], ls=style, marker=marker, color=color, capsize=3, label=label)
        if rate_bps:
            ax.axhline(ring_bound(goodput, n), color=colors[i % len(colors)] if several else colors[1], lw=0.8, ls="-.",
                       label=f"ring bound G·n/(2(n-1)), n={n}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (MiB)")
    ax.set_ylabel("algbw = size / time (GB/s)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    values = [r.algbw_gbps for r in rows]
    if values and min(values) < 0.05 * max(values + [goodput]):
        ax.set_yscale("log")  # latency-bound sizes sit orders of magnitude below the line rate
    else:
        ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="lower right")
    if several:
        ax2 = axes[0][1]
        sizes = sorted({r.size_bytes for r in rows if r.speedup is not None})
        for i, size in enumerate(sizes):
            rs = sorted((r for r in rows if r.size_bytes == size and r.speedup is not None), key=lambda r: r.n)
            xs = [r.n for r in rs]
            ys = [r.speedup or 0.0 for r in rs]
            # The speed-up is the ratio of pooled medians, so it may sit outside the per-round range.
            err = [[max(0.0, (r.speedup or 0) - (r.speedup_min or 0)) for r in rs],
                   [max(0.0, (r.speedup_max or 0) - (r.speedup or 0)) for r in rs]]
            ax2.errorbar(xs, ys, yerr=err, marker="o", capsize=3, color=colors[i % len(colors)],
                         label=f"measured, {format_size(size)}")
        theory_rows = sorted({(r.n, r.m) for r in rows if r.impl == "redsrv"})
        ax2.plot([n for n, _ in theory_rows], [theory_speedup(n, m, colocated, compression) for n, m in theory_rows], "k--",
                 label="theory 2(n-1)/n·min(1, m/n)" + (f"·{compression:g} (wire compression)" if compression != 1 else ""))
        ax2.axhline(1.0, color="gray", lw=0.8)
        ax2.set_xticks(ns)
        ax2.set_xlabel("workers n")
        ax2.set_ylabel("speedup = gloo time / redsrv time")
        ax2.set_title("speedup over gloo ring all-reduce (median, min-max over rounds)", fontsize=9)
        ax2.grid(True, alpha=0.3)
        ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
