"""``redsrv bench train``: DDP training steps with the redsrv hook against gloo DDP, on the emulated
cluster of ``redsrv bench emulate``.

Every worker process holds two DDP wrappers of identically initialised models, a stack of square
``nn.Linear`` layers (tanh between them) with tens of millions of parameters fed a batch of a few
rows, so that a step is bound by communication, not arithmetic. One reduces its gradients with gloo's ring all-reduce
(the baseline), the other through ``redsrv.torch.redsrv_hook`` (gloo carries only DDP's control
traffic there). Both use ``gradient_as_bucket_view=True`` and the same bucket cap, and train with
SGD on the same generated data (fixed seeds, nothing downloaded). Each round runs four blocks:

  gloo     DDP steps, gradients all-reduced by gloo
  hook     DDP steps, gradients all-reduced by the reducers through the hook
  raw      no DDP and no torch: the client's allreduce_async of arrays with exactly the sizes and
           dtypes of the buckets DDP handed the hook, all issued back to back, then waited
  compute  forward, backward and SGD step under no_sync(): no communication at all

Every step is timed on every rank after a barrier; a step takes as long as its slowest rank.
Reported per mode: median and min-max step time, steps per second, gradient bytes per step /
step time as a fraction of G. Then the speedup gloo step / hook step beside the all-reduce theory
2(n-1)/n·min(1, m/n), and the hook's overhead over raw, bracketed: hook step / raw step - 1 is
an upper bound of what the hook and DDP add, since it also contains the compute that DDP could
not hide behind communication; (hook - raw - compute) / raw is a lower bound, as if DDP had
hidden none of it (assuming compute and communication cost as much together as apart). After
each gloo and hook block the parameters are compared: identical on every rank, equal within
tolerance to a NumPy float64 replay of the same data-parallel training (:class:`ReferenceModel`,
on rank 0: every rank's batch, the mean gradient, the same SGD steps; so an all-reduce that is
wrong the same way on every rank fails too, ``--no-baseline`` included), and the hook-trained model
equal to the gloo-trained one. The compute-only block is compared with the replay of its local
steps; the raw block's sums with their exact means. A wrong block makes the command exit 1.

``--framework jax`` and ``--framework tf`` run the same four blocks, timing rule and checks with
the same model family (square dense layers, tanh, one CPU device per process) against each
framework's own cross-process all-reduce: JAX's gloo CPU collectives through ``jax.distributed``
(:mod:`redsrv.bench.train_jax`), TensorFlow's ``MultiWorkerMirroredStrategy`` with ring collectives
(:mod:`redsrv.bench.train_tf`). There, "gloo" names that baseline and "hook" redsrv's adapter
(``redsrv.jax.pmean``, ``ReductionServerStrategy``). The strategy sends one fused vector per
dtype after the backward pass; ``pmean`` sends each gradient of 4 MiB or more alone as XLA
produces it and fuses the rest. The raw block replays what each sends.

Needs root, iproute2 and the framework; removes every namespace and process it created on every exit path.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import math
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from redsrv.bench import harness, report
from redsrv.bench.netns import DEFAULT_PREFIX, IFNAME, Cluster, EmulationError, format_rate, parse_rate, tcp_goodput_bps
from redsrv.cli.units import size_in

__all__ = ["add_parser", "Options", "run_train", "model_shape", "init_params", "summarise", "Summary", "ModeRow",
           "format_summary"]

#: Frameworks with a worker here: torch in this module, jax in :mod:`redsrv.bench.train_jax`, tf in
#: :mod:`redsrv.bench.train_tf`.
FRAMEWORKS = ("torch", "jax", "tf")
#: The module each framework's worker needs, for a clear error where it is missing.
FRAMEWORK_MODULES = {"torch": "torch", "jax": "jax", "tf": "tensorflow"}

#: Blocks of a round, in the order they run. "gloo" is left out with --no-baseline. The names are
#: the torch run's; with another framework "gloo" is that framework's own cross-process all-reduce
#: and "hook" its redsrv adapter (:data:`LABELS`).
MODES = ("gloo", "hook", "raw", "compute")

#: Layer width: wide enough that a layer is one large matrix (few, big gradient tensors, as in
#: the large layers that make real models communication-bound) and a batch of a few rows costs
#: little arithmetic.
DEFAULT_WIDTH = 2048
#: At least two layers, so that backward produces gradients while earlier buckets are in flight.
MIN_LAYERS = 2
MIN_PARAMS = 10_000

#: SGD on loss = sum of squared errors / batch: measured stable over 21 steps at 25M parameters,
#: moving the weights by up to 0.03 (the largest initial weight is 0.022), far more than a
#: wrong all-reduce (a sum instead of a mean, a missing bucket) needs to show in the comparison.
LEARNING_RATE = 1e-3

#: Largest |hook model - gloo model| over the largest |gloo model - initial model| that still
#: counts as the same training. Float32 wire: both sum 4-byte floats, in a different order
#: (ring vs rank order), ~1e-7 relative per step. 16-bit wires round every gradient (bf16 keeps
#: 8 significant bits, fp16 11): the bounds are that rounding with a margin.
MATCH_TOLERANCE: dict[str | None, float] = {None: 1e-4, "fp16": 1e-2, "bf16": 5e-2}

#: The raw block's inputs repeat with this prime period and start at a per-bucket offset.
RAW_PERIOD = 1021
RAW_BUCKET_STRIDE = 389
#: Tolerance of the raw block's results: float32 sums of these small integers differ from the
#: exact mean only in the last bit of the division; 16-bit wires round the inputs and the sums.
RAW_RTOL: dict[str | None, float] = {None: 1e-6, "fp16": 2e-3, "bf16": 1.6e-2}

#: Redsrv and gloo deadline for one operation inside the workers: minutes above any step here,
#: so that a hung peer fails the run instead of stalling it.
OP_TIMEOUT_S = 120.0

#: Share of the machine that other processes may use during a compute-only block before the
#: round is reported as shared (a few % is the system's own background).
OTHER_LOAD_WARNING = 0.10

#: The issue's targets for this benchmark.
SPEEDUP_TARGET = 1.3
OVERHEAD_TARGET = 0.05


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    b = subparsers.add_parser(
        "train", help="training steps/s with redsrv vs the framework's own all-reduce (gloo DDP, JAX gloo, TF MWMS ring) "
                      "on an emulated rate-limited cluster (root)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--framework", default="torch",
                   help=f"training framework: {', '.join(FRAMEWORKS)} (default torch)")
    b.add_argument("--workers", type=int, default=4, metavar="N", help="worker host count n (default 4)")
    b.add_argument("--workers-per-host", type=int, default=1, metavar="L",
                   help="worker processes per worker host (default 1; torch): the hook's client reduces inside each host "
                        "first, gloo's DDP runs over all n*L ranks placed the same way")
    b.add_argument("--reducers", type=int, default=None, metavar="M",
                   help="reducer count m, each on its own host (default: m = n)")
    b.add_argument("--rate", default="1gbit",
                   help="per-host line rate, both directions, e.g. 1gbit, 500mbit, none (default 1gbit)")
    b.add_argument("--params", type=float, default=25.0, metavar="MILLIONS",
                   help=f"model size in millions of parameters (default 25: {DEFAULT_WIDTH}-wide layers)")
    b.add_argument("--batch", type=int, default=8, help="rows per worker per step (default 8)")
    b.add_argument("--steps", type=int, default=5, help="timed steps per block (default 5)")
    b.add_argument("--warmup", type=int, default=2,
                   help="untimed steps before each block (default 2; at least 1: DDP rebuilds its buckets after the first)")
    b.add_argument("--rounds", type=int, default=3, help="rounds of gloo/hook/raw/compute blocks (default 3)")
    b.add_argument("--wire-dtype", choices=["bf16", "fp16"], default=None,
                   help="the hook compresses float32 gradients to this on the wire (gloo keeps float32)")
    b.add_argument("--bucket-cap-mb", type=size_in("MiB"), default=25.0, help="DDP's bucket_cap_mb, for both models (default 25)")
    b.add_argument("--no-baseline", action="store_true", help="leave out the gloo DDP blocks")
    b.add_argument("--piece-kib", type=size_in("KiB", whole=True), default=None, metavar="KIB",
                   help="the reducers' cut-through piece in KiB (REDSRV_RESULT_PIECE_BYTES; default: the reducer's, "
                        "512); 1024 sends whole chunks: less CPU per byte, a little less bandwidth")
    harness.add_run_arguments(b)
    b.set_defaults(func=_main)


@dataclass(frozen=True)
class Options:
    framework: str = "torch"
    workers: int = 4
    workers_per_host: int = 1
    reducers: int | None = None
    rate_bps: int = 10**9
    params: int = 25_000_000
    batch: int = 8
    steps: int = 5
    warmup: int = 2
    rounds: int = 3
    wire_dtype: str | None = None
    bucket_cap_mb: float = 25.0
    baseline: bool = True
    result_piece_bytes: int | None = None  # the reducers'
    out: str = "bench-results"
    prefix: str = DEFAULT_PREFIX
    quiet: bool = False

    @property
    def m(self) -> int:
        return self.reducers if self.reducers is not None else self.workers

    @property
    def hosts(self) -> int:
        return self.workers + self.m

    @property
    def modes(self) -> tuple[str, ...]:
        return MODES if self.baseline else tuple(m for m in MODES if m != "gloo")

    def validate(self) -> None:
        if self.framework not in FRAMEWORKS:
            raise EmulationError(f"--framework {self.framework}: implemented are {', '.join(FRAMEWORKS)}")
        if self.workers < 2:
            raise EmulationError("--workers: need at least 2 worker hosts")
        if self.workers_per_host < 1 or (self.workers_per_host > 1 and self.framework != "torch"):
            raise EmulationError("--workers-per-host: at least 1, and above 1 for --framework torch only")
        if self.reducers is not None and self.reducers < 1:
            raise EmulationError("--reducers must be >= 1")
        if self.params < MIN_PARAMS:
            raise EmulationError(f"--params: at least {MIN_PARAMS / 1e6:g} million parameters")
        for name in ("batch", "steps", "rounds", "warmup"):
            if getattr(self, name) < 1:
                why = " (DDP rebuilds its buckets after the first step, which must not be timed)" if name == "warmup" else ""
                raise EmulationError(f"--{name} must be >= 1{why}")
        if not self.bucket_cap_mb > 0:
            raise EmulationError("--bucket-cap-mb must be positive")
        if self.result_piece_bytes is not None and self.result_piece_bytes < 0:
            raise EmulationError("--piece-kib must be >= 0")
        if self.wire_dtype not in MATCH_TOLERANCE:
            raise EmulationError(f"--wire-dtype {self.wire_dtype}: use bf16 or fp16")
        # Per worker, in units of the gradient size: two models, their gradients (the buckets),
        # the initial and the saved parameters, the raw block's inputs and results, the hook's
        # results in flight.
        need = self.workers * self.workers_per_host * 9 * 4 * self.params
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else need
        if need > 0.8 * avail:
            raise EmulationError(f"{self.workers} workers with {self.params / 1e6:g}M parameters need about "
                                 f"{need / 2**30:.1f} GiB of memory; {avail / 2**30:.1f} GiB is free")


def model_shape(params: int, max_width: int = DEFAULT_WIDTH) -> tuple[int, int]:
    """(layers, width) of a stack of square Linear layers (weight and bias) with about ``params``
    parameters: ``max_width`` wide with as many layers as fit, or narrower layers for small models.

    >>> model_shape(25_000_000), model_shape(2_000_000)
    ((6, 2048), (2, 992))
    """
    width = max_width
    if params < MIN_LAYERS * width * (width + 1):
        # Multiples of 16 keep the matrices friendly to vectorised kernels.
        width = max(16, math.isqrt(params // MIN_LAYERS) // 16 * 16)
    layers = max(MIN_LAYERS, round(params / (width * (width + 1))))
    return layers, width


def init_params(np: Any, layers: int, width: int, seed: int = 1234) -> list[Any]:
    """[W0, b0, W1, b1, ...] of the JAX and TensorFlow workers' model (W is out x in, as torch's), float32
    numpy arrays identical for a given seed: uniform in +-1/sqrt(width), the scale of torch's
    ``nn.Linear`` (so the torch worker's learning rate holds).

    >>> import numpy as np
    >>> [p.shape for p in init_params(np, 2, 4)]
    [(4, 4), (4,), (4, 4), (4,)]
    """
    rng = np.random.default_rng(seed)
    bound = 1 / math.sqrt(width)
    out = []
    for _ in range(layers):
        out.append(rng.uniform(-bound, bound, (width, width)).astype(np.float32))
        out.append(rng.uniform(-bound, bound, (width,)).astype(np.float32))
    return out


def rank_batch(np: Any, rank: int, batch: int, width: int) -> tuple[Any, Any]:
    """Rank ``rank``'s inputs and targets (float32), the same in the JAX and TensorFlow workers."""
    rng = np.random.default_rng(1000 + rank)
    x = rng.standard_normal((batch, width), dtype=np.float32)
    return x, rng.standard_normal((batch, width), dtype=np.float32)


def _main(a: argparse.Namespace) -> int:
    def run() -> bool:
        opts = Options(workers_per_host=a.workers_per_host,
            framework=a.framework, workers=a.workers, reducers=a.reducers, rate_bps=parse_rate(a.rate),
            params=int(a.params * 1e6), batch=a.batch, steps=a.steps, warmup=a.warmup, rounds=a.rounds,
            wire_dtype=a.wire_dtype, bucket_cap_mb=a.bucket_cap_mb, baseline=not a.no_baseline, out=a.out, prefix=a.prefix,
            result_piece_bytes=None if a.piece_kib is None else a.piece_kib * 1024)
        return bool(run_train(opts)["ok"])

    status: int = harness.run_command("train", a, run=run, rereport=_rereport)
    return status


def _say(opts: Options, text: str) -> None:
    harness.say(opts.quiet, text)


# --- report maths: pure functions of the merged blocks -----------------------------------------


@dataclass
class ModeRow:
    mode: str
    steps: int  # timed steps over every round
    median_s: float
    min_s: float
    max_s: float
    round_medians_s: list[float]
    steps_per_s: float
    grad_gbps: float | None  # gradient bytes per step / step time; None for compute (nothing sent)
    of_goodput: float | None  # grad_gbps / G; None without a rate limit or for compute
    cpu_busy: float  # whole machine, median over the blocks
    cpu_busy_max: float
    own_cpu_share: float  # our processes' CPU time / (wall time x cores)
    correct: bool

    @property
    def cpu_bound(self) -> bool:
        return bool(self.cpu_busy > report.CPU_BOUND_BUSY)


@dataclass
class Summary:
    rows: list[ModeRow]
    n: int
    m: int
    grad_bytes: int
    goodput: float
    theory: float  # all-reduce speedup at the bounds, 2(n-1)/n·min(1, m/n)·compression
    speedup: float | None = None  # gloo median step / hook median step
    speedup_rounds: list[float] = field(default_factory=list)
    overhead: float | None = None  # hook median step / raw median step - 1: an upper bound
    overhead_rounds: list[float] = field(default_factory=list)
    # (hook - raw - compute) / raw: a lower bound, as if DDP had hidden none of the compute.
    overhead_floor: float | None = None
    overhead_floor_rounds: list[float] = field(default_factory=list)
    compute_s: float | None = None
    # Per round, the share of the machine other processes used during the compute-only block,
    # when nothing of ours communicates (whole-machine busy minus our workers' CPU).
    other_load_rounds: list[float] = field(default_factory=list)
    correct: bool = True
    framework: str = "torch"

    @property
    def speedup_met(self) -> bool | None:
        return None if self.speedup is None else self.speedup >= SPEEDUP_TARGET

    @property
    def overhead_met(self) -> bool | None:
        """True when even the upper bound meets the target, False when even the lower bound
        misses it, None when the two bounds straddle it (or nothing was measured)."""
        if self.overhead is None:
            return None
        if self.overhead <= OVERHEAD_TARGET:
            return True
        if self.overhead_floor is not None and self.overhead_floor > OVERHEAD_TARGET:
            return False
        return None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rows"] = [dict(asdict(r), cpu_bound=r.cpu_bound) for r in self.rows]
        d.update(speedup_target=SPEEDUP_TARGET, speedup_met=self.speedup_met, overhead_target=OVERHEAD_TARGET,
                 overhead_met=self.overhead_met)
        return d


def summarise(blocks: Sequence[dict[str, Any]], *, n: int, m: int, grad_bytes: int, goodput: float,
              compression: float = 1.0, framework: str = "torch", per_host: int = 1) -> Summary:
    """One row per mode in :data:`MODES` order, and the speedup and overhead as ratios of medians
    (with the same ratio per round, for the spread). ``compression``: the hook's wire
    compression factor, for the theory (gloo always sends float32); ``per_host``: workers on
    each of the ``n`` hosts (report.bound_of)."""
    rows = []
    for mode in MODES:
        bs = sorted((b for b in blocks if b["mode"] == mode), key=lambda b: b["round"])
        if not bs:
            continue
        times = [t for b in bs for t in b["times"]]
        med = statistics.median(times)
        busy = [b["cpu_busy"] for b in bs]
        wall = sum(b["wall_s"] for b in bs)
        cpu = sum(b["cpu_s"] for b in bs)
        sends = mode != "compute"
        grad_gbps = grad_bytes / med / 1e9 if sends else None
        rows.append(ModeRow(
            mode=mode, steps=len(times), median_s=med, min_s=min(times), max_s=max(times),
            round_medians_s=[statistics.median(b["times"]) for b in bs], steps_per_s=1.0 / med, grad_gbps=grad_gbps,
            of_goodput=grad_gbps / goodput if grad_gbps is not None and goodput else None,
            cpu_busy=statistics.median(busy), cpu_busy_max=max(busy),
            own_cpu_share=cpu / (wall * bs[0].get("cores", 1)) if wall else 0.0, correct=all(b["correct"] for b in bs)))
    by_mode = {r.mode: r for r in rows}
    summary = Summary(rows=rows, n=n, m=m, grad_bytes=grad_bytes, goodput=goodput,
                      theory=report.bound_of("redsrv", 1.0, n, m, per_host, compression=compression)
                      / report.bound_of("gloo", 1.0, n, m, per_host), correct=all(r.correct for r in rows),
                      framework=framework)
    gloo, hook, raw, compute = (by_mode.get(k) for k in MODES)
    if gloo and hook:
        summary.speedup = gloo.median_s / hook.median_s
        summary.speedup_rounds = [g / h for g, h in zip(gloo.round_medians_s, hook.round_medians_s, strict=False)]
    if hook and raw:
        summary.overhead = hook.median_s / raw.median_s - 1
        summary.overhead_rounds = [h / r - 1 for h, r in zip(hook.round_medians_s, raw.round_medians_s, strict=False)]
    if compute:
        summary.compute_s = compute.median_s
        summary.other_load_rounds = [max(0.0, b["cpu_busy"] - _own_share(b))
                                     for b in sorted((b for b in blocks if b["mode"] == "compute"), key=lambda b: b["round"])]
    if hook and raw and compute:
        summary.overhead_floor = (hook.median_s - raw.median_s - compute.median_s) / raw.median_s
        summary.overhead_floor_rounds = [(h - r - c) / r for h, r, c in zip(
            hook.round_medians_s, raw.round_medians_s, compute.round_medians_s, strict=False)]
    return summary


def _time(s: float) -> str:
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.3f} s"


def _spread(values: Sequence[float], fmt: str) -> str:
    return f"{fmt.format(min(values))} to {fmt.format(max(values))}" if values else "-"


#: Per framework, what each block is, for the table and the plot.
LABELS = {
    "torch": {"gloo": "gloo DDP", "hook": "redsrv hook DDP", "raw": "raw allreduce", "compute": "compute only"},
    "jax": {"gloo": "jax gloo pmean", "hook": "redsrv.jax pmean", "raw": "raw allreduce", "compute": "compute only"},
    "tf": {"gloo": "MWMS ring", "hook": "redsrv strategy", "raw": "raw allreduce", "compute": "compute only"},
}


def format_summary(s: Summary) -> str:
    """The terminal table, then the speedup and the overhead against their targets."""
    what = LABELS[s.framework]
    head = (f"{'mode':<16} {'median step':>11} {'min-max':>19} {'steps/s':>8} {'grad GB/s':>9} {'of G':>6} "
            f"{'CPU busy/ours':>13}  note")
    lines = [head, "-" * len(head)]
    for r in s.rows:
        notes = []
        if r.cpu_bound:
            notes.append(f"CPU-bound (max {r.cpu_busy_max:.0%})")
        if not r.correct:
            notes.append("WRONG RESULTS")
        lines.append(
            f"{what[r.mode]:<16} {_time(r.median_s):>11} {_time(r.min_s) + '-' + _time(r.max_s):>19} {r.steps_per_s:>8.3f} "
            f"{'-' if r.grad_gbps is None else f'{r.grad_gbps:.4f}':>9} "
            f"{'-' if r.of_goodput is None else f'{r.of_goodput:.3f}':>6} "
            f"{f'{r.cpu_busy:.0%}/{r.own_cpu_share:.0%}':>13}  {'; '.join(notes)}")
    lines.append("")
    if s.speedup is not None:
        met = "met" if s.speedup_met else "NOT met"
        lines.append(f"speedup, {what['hook']} over {what['gloo']}: {s.speedup:.2f}x (theory {s.theory:.2f}x for the "
                     f"all-reduce alone at its bounds; rounds {_spread(s.speedup_rounds, '{:.2f}')}x). "
                     f"Target >= {SPEEDUP_TARGET:.1f}x: {met}")
    if s.overhead is not None:
        verdict = {True: "met", False: "NOT met", None: "not decided (the bounds straddle it)"}[s.overhead_met]
        lines.append(f"{what['hook']} overhead over a raw allreduce of the same buckets: at most {s.overhead:+.1%} = "
                     f"hook / raw - 1 (rounds {_spread([100 * o for o in s.overhead_rounds], '{:+.1f}')}%), which includes "
                     "the compute not hidden behind communication")
        if s.overhead_floor is not None and s.compute_s is not None:
            lines.append(f"  and at least {s.overhead_floor:+.1%} = (hook - raw - compute) / raw (rounds "
                         f"{_spread([100 * o for o in s.overhead_floor_rounds], '{:+.1f}')}%), as if none of the "
                         f"{_time(s.compute_s)} compute-only step were hidden")
        lines.append(f"  Target <= {OVERHEAD_TARGET:.0%}: {verdict}")
    shared = [f"round {i + 1}: {load:.0%}" for i, load in enumerate(s.other_load_rounds) if load > OTHER_LOAD_WARNING]
    if shared:
        lines.append(f"\nOther processes used the machine during the compute-only blocks ({', '.join(shared)} of it): "
                     "those rounds measure the other load too; rerun on an idle machine")
    return "\n".join(lines)


def plot(s: Summary, path: str, *, title: str) -> None:
    """Median step time per mode with its min-max, the speedup and overhead in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    xs = list(range(len(s.rows)))
    meds = [r.median_s for r in s.rows]
    err = [[r.median_s - r.min_s for r in s.rows], [r.max_s - r.median_s for r in s.rows]]
    bars = ax.bar(xs, meds, yerr=err, capsize=4, color=[colors[i % len(colors)] for i in xs])
    for bar, r in zip(bars, s.rows, strict=True):
        # Above the error bar, not inside it.
        ax.annotate(f"{_time(r.median_s)}\n{r.steps_per_s:.2f} steps/s", (bar.get_x() + bar.get_width() / 2, r.max_s),
                    ha="center", va="bottom", fontsize=8, xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(xs, [LABELS[s.framework][r.mode] for r in s.rows])
    ax.set_ylabel("step time, slowest rank (s)")
    notes = []
    if s.speedup is not None:
        notes.append(f"speedup redsrv vs baseline {s.speedup:.2f}x (all-reduce theory {s.theory:.2f}x)")
    if s.overhead is not None:
        floor = f"{s.overhead_floor:+.1%} to " if s.overhead_floor is not None else "at most "
        notes.append(f"hook over raw {floor}{s.overhead:+.1%}")
    ax.set_title(title + ("\n" + "; ".join(notes) if notes else ""), fontsize=9)
    ax.set_ylim(top=max(r.max_s for r in s.rows) * 1.25)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _compression(wire_dtype: str | None) -> float:
    """Gradient bytes per wire byte for the hook (the gradients are float32)."""
    return 2.0 if wire_dtype else 1.0


def _title(opts: dict[str, Any], model: dict[str, Any], day: str, cpus: int | None) -> str:
    framework = {"torch": "DDP", "jax": "JAX", "tf": "Keras"}[opts.get("framework", "torch")]
    return (f"{framework}, {model['params'] / 1e6:.1f}M params ({model['layers']} x {model['width']}^2 dense), "
            f"n={opts['workers']} m={opts['reducers'] or opts['workers']}, {format_rate(opts['rate_bps'])} per host"
            + (f", {opts['wire_dtype']} on the redsrv wire" if opts["wire_dtype"] else "") + f", {day}, {cpus} CPUs")


def _rereport(path: str) -> int:
    try:
        with open(path) as f:
            doc = json.load(f)
        blocks, opts, model = doc["blocks"], doc["options"], doc["model"]
    except (OSError, ValueError, KeyError) as exc:
        raise EmulationError(f"cannot read results from {path}: {exc}") from None
    s = summarise(blocks, n=opts["workers"], m=opts["reducers"] or opts["workers"], grad_bytes=model["grad_bytes"],
                  per_host=opts.get("workers_per_host", 1),
                  goodput=doc["goodput_gbps"], compression=_compression(opts["wire_dtype"]),
                  framework=opts.get("framework", "torch"))
    print(format_summary(s))
    png = os.path.splitext(path)[0] + ".png"
    plot(s, png, title=_title(opts, model, doc["started"][:10], doc["machine"]["cpus"]))
    print(f"\n  wrote {png}")
    return 0


# --- the run ---------------------------------------------------------------------------------


def run_train(opts: Options) -> dict[str, Any]:
    """Build the cluster, run every round, write the JSON and PNG, remove the cluster. Returns the
    result document (also written to ``opts.out``)."""
    opts.validate()
    module = FRAMEWORK_MODULES[opts.framework]
    if importlib.util.find_spec(module) is None:
        raise EmulationError(f"--framework {opts.framework}: {module} is not installed (pip install 'redsrv[{opts.framework}]')")
    cluster = Cluster(opts.hosts, opts.rate_bps, prefix=opts.prefix)
    cluster.check()
    layers, width = model_shape(opts.params)
    goodput = tcp_goodput_bps(opts.rate_bps) / 8 / 1e9 if opts.rate_bps else 0.0
    started = datetime.datetime.now()
    source = harness.provenance(harness.torch_version())  # what the workers import, before other work changes it
    source["machine"][opts.framework] = _version(module)
    stamp = started.strftime("%Y%m%d-%H%M%S")
    os.makedirs(opts.out, exist_ok=True)
    json_path = os.path.join(opts.out, f"train-{stamp}.json")
    png_path = os.path.join(opts.out, f"train-{stamp}.png")
    n, m = opts.workers, opts.m
    step = (f"DDP gradient_as_bucket_view=True, bucket_cap_mb {opts.bucket_cap_mb:g}" if opts.framework == "torch"
            else LABELS[opts.framework]["gloo"] + " vs " + LABELS[opts.framework]["hook"])
    _say(opts, f"redsrv bench train --framework {opts.framework}: n={n} worker hosts h0..h{n - 1}"
               + (f" with {opts.workers_per_host} workers each" if opts.workers_per_host > 1 else "") + f", m={m} reducers on "
               f"h{n}..h{n + m - 1}, {format_rate(opts.rate_bps)} per link (both directions); model {layers} x "
               f"{width}x{width} dense, batch {opts.batch}; {step}"
               + (f"; {opts.wire_dtype} on the redsrv wire" if opts.wire_dtype else "")
               + ("" if opts.result_piece_bytes is None else f"; reducers' result_piece_bytes={opts.result_piece_bytes}")
               + f"; {opts.rounds} round(s) of {' / '.join(opts.modes)}, {opts.warmup} warm-up + {opts.steps} timed steps each")
    _say(opts, "  " + harness.describe_speed(source["machine"]["speed"]))
    if goodput:
        _say(opts, f"  G = {goodput:.4f} GB/s (assumed: rate x (MTU-52)/(MTU+14))")
    with harness.raise_on_signals(), tempfile.TemporaryDirectory(prefix="redsrv-train-") as tmp:
        try:
            t0 = time.monotonic()
            cluster.up()
            _say(opts, f"  cluster up in {time.monotonic() - t0:.1f}s: {', '.join(f'{h.ns}={h.ip}' for h in cluster.hosts)}")
            blocks, built = _run_cluster(cluster, opts, layers, width, goodput, tmp)
        finally:
            removed = cluster.down()
            _say(opts, f"  cluster removed ({len(removed)} namespaces)")
    model = {"layers": layers, "width": width, "params": built["params"], "grad_bytes": built["grad_bytes"],
             "buckets": next((b["buckets"] for b in blocks if b["mode"] == "raw"), None)}
    summary = summarise(blocks, n=n, m=m, grad_bytes=model["grad_bytes"], goodput=goodput,
                        compression=_compression(opts.wire_dtype), framework=opts.framework, per_host=opts.workers_per_host)
    doc: dict[str, Any] = {
        "benchmark": "redsrv bench train",
        "started": started.isoformat(timespec="seconds"),
        "command": harness.command_line("train"),
        **source,
        "options": {k: v for k, v in opts.__dict__.items() if k != "quiet"},
        "model": model,
        **_setup(opts),
        "host_gso_bytes": cluster.gso_bytes,
        "goodput_gbps": goodput,
        "summary": summary.as_dict(),
        "blocks": blocks,
        "ok": summary.correct and bool(summary.rows),
    }
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    _say(opts, "\n" + format_summary(summary))
    if any(r.cpu_bound for r in summary.rows):
        _say(opts, f"\n  rows flagged CPU-bound ran with the machine over {report.CPU_BOUND_BUSY:.0%} busy: they measure the "
                   "CPU, not the network (other load, or too many processes for the cores)")
    if not summary.correct:
        _say(opts, "\n  WRONG RESULTS: see 'correct' and 'checks' of the blocks in the JSON")
    title = _title(doc["options"], model, f"{started:%Y-%m-%d}", os.cpu_count())
    harness.finish_files(doc, json_path, png_path, lambda path: plot(summary, path, title=title), quiet=opts.quiet)
    return doc


def _setup(opts: Options) -> dict[str, Any]:
    """How the framework's training step is set up, for the result file."""
    if opts.framework == "torch":
        return {"ddp": {"gradient_as_bucket_view": True, "bucket_cap_mb": opts.bucket_cap_mb, "optimizer": "SGD",
                        "learning_rate": LEARNING_RATE, "zero_grad": "set_to_none=False"}}
    from redsrv.bench import train_jax, train_tf

    return {"training": {"jax": train_jax.SETUP, "tf": train_tf.SETUP}[opts.framework]}


def _version(module: str) -> str | None:
    """The installed version of a framework's distribution, for the result file."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in {"tensorflow": ("tensorflow", "tensorflow-cpu")}.get(module, (module,)):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def _run_cluster(cluster: Cluster, opts: Options, layers: int, width: int, goodput: float,
                 tmp: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Reducers, workers, and every block merged over the ranks; also what rank 0 built (the
    parameter count and gradient bytes)."""
    n, m, per_host = opts.workers, opts.m, opts.workers_per_host
    world = n * per_host  # rank r on host r // per_host: the block placement of torchrun and mpirun
    env = harness.child_env(harness.write_secret(tmp))
    if opts.result_piece_bytes is not None:
        env["REDSRV_RESULT_PIECE_BYTES"] = str(opts.result_piece_bytes)
    if opts.framework == "jax":
        from redsrv.bench import train_jax

        env = train_jax.worker_env(env)
    elif opts.framework == "tf":
        from redsrv.bench import train_tf

        env = train_tf.worker_env(env)
    procs: list[subprocess.Popen] = []  # type: ignore[type-arg]
    pumps: list[threading.Thread] = []
    try:
        reducers, addresses = harness.start_reducers(cluster, range(n, n + m), env=env, logdir=tmp, tag="", procs=procs)
        spec_base = {
            "framework": opts.framework, "world": world, "per_host": per_host, "modes": list(opts.modes), "layers": layers,
            "width": width,
            "batch": opts.batch, "steps": opts.steps, "warmup": opts.warmup, "rounds": opts.rounds,
            "wire_dtype": opts.wire_dtype, "bucket_cap_mb": opts.bucket_cap_mb, "reducers": addresses,
            "master": f"{cluster.hosts[0].ip}:{harness.GLOO_PORT}", "job": f"bench-train-{uuid.uuid4().hex[:8]}",
            "op_timeout": OP_TIMEOUT_S, "tolerance": MATCH_TOLERANCE[opts.wire_dtype], "interface": IFNAME,
            "tf_workers": [f"{cluster.hosts[r].ip}:{harness.GLOO_PORT}" for r in range(n)],
        }
        specs = [dict(spec_base, rank=rank, reducer_pids=[p.pid for p in reducers] if rank == 0 else [])
                 for rank in range(world)]
        events: queue.Queue[tuple[int, dict[str, Any] | None]] = queue.Queue()
        workers, logs = harness.spawn_workers(cluster, "redsrv.bench.train", specs, env=env, logdir=tmp, tag="",
                                              procs=procs, pumps=pumps, events=events,
                                              hosts=[rank // per_host for rank in range(world)])
        gather = harness.RankGather(world)
        blocks: list[dict[str, Any]] = []
        built: dict[str, Any] = {}
        total = opts.rounds * len(opts.modes)

        def on_message(rank: int, msg: dict[str, Any]) -> str | None:
            if msg["event"] == "model":
                if rank == 0:
                    built.update(params=msg["params"], grad_bytes=msg["grad_bytes"])
                return None
            got = gather.add((msg["round"], msg["mode"]), rank, msg)
            if got is None:
                return None
            block = _merge(got)
            blocks.append(block)
            _say(opts, _progress(block, len(blocks), total, built["grad_bytes"], goodput, opts.framework))
            return f"the block after round {block['round'] + 1} {block['mode']}"

        # A hang detector, not a prediction: float32 gradients at 10% of G, a second of compute a step.
        speed = goodput * 1e9 * 0.1 if goodput else 1e8
        stall = 120.0 + (opts.warmup + opts.steps) * (2 * 4 * layers * width * (width + 1) / speed + 1.0)
        harness.collect(workers, logs, events, stall_s=stall, label=f"n={n}", on_message=on_message)
        return blocks, built
    finally:
        harness.terminate_and_drain(cluster, procs, pumps)


def _merge(got: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Slowest rank per step; a block is correct when every rank's check passed. The hook's and
    the raw block's CPU include the reducers'."""
    r0 = got[0]
    block = {"round": r0["round"], "mode": r0["mode"],
             **harness.merge_ranks(got, count_reducers=r0["mode"] in ("hook", "raw")),
             "checks": [got[r]["check"] for r in sorted(got)]}
    if "buckets" in r0:
        block["buckets"] = r0["buckets"]
    return block


def _progress(block: dict[str, Any], k: int, total: int, grad_bytes: int, goodput: float, framework: str) -> str:
    med = statistics.median(block["times"])
    rate = ""
    if block["mode"] != "compute":
        rate = f"  {grad_bytes / med / 1e9:.4f} GB/s of gradients"
        if goodput:
            rate += f" ({grad_bytes / med / 1e9 / goodput:.3f} G)"
    flag = " CPU-bound" if block["cpu_busy"] > report.CPU_BOUND_BUSY else ""
    wrong = f" WRONG: {block['checks'][0]}" if not block["correct"] else ""
    return (f"  [{k:>2}/{total}] round {block['round'] + 1} {LABELS[framework][block['mode']]:<16} median {_time(med):>9}  "
            f"({_time(min(block['times']))}-{_time(max(block['times']))}){rate}  CPU busy {block['cpu_busy']:.0%} "
            f"(ours {_own_share(block):.0%}){flag}{wrong}")


def _own_share(block: dict[str, Any]) -> float:
    """Our processes' CPU time over the machine's capacity during the block's timed steps."""
    return float(block["cpu_s"] / (block["wall_s"] * block.get("cores", 1))) if block["wall_s"] else 0.0


# --- inside the worker processes -------------------------------------------------------------


def _worker(spec_json: str) -> int:
    spec = json.loads(spec_json)
    if spec["framework"] == "jax":
        from redsrv.bench import train_jax

        return int(train_jax.worker(spec))
    if spec["framework"] == "tf":
        from redsrv.bench import train_tf

        return int(train_tf.worker(spec))
    workers: dict[str, Callable[[dict[str, Any]], int]] = {"torch": _torch_worker}
    return workers[spec["framework"]](spec)


class _BucketRecorder:
    """Notes each bucket's element count and dtype as DDP hands it to the hook; ``layout`` is the
    last complete step's, which the raw block replays. Left on in every hook step: a dict write
    per bucket (microseconds against a step of ~a second) counts against the hook, not for it."""

    def __init__(self) -> None:
        self.layout: list[tuple[int, str]] = []
        self._current: dict[int, tuple[int, str]] = {}

    def wrap(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        def recording_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations against real torch types
            buffer = bucket.buffer()
            self._current[bucket.index()] = (buffer.numel(), str(buffer.dtype).removeprefix("torch."))
            if bucket.is_last():
                self.layout = [self._current[i] for i in sorted(self._current)]
                self._current = {}
            return hook(state, bucket)

        return recording_hook


def raw_data_for(np: Any, layout: Sequence[tuple[int, str]], *, rank: int, n: int) -> tuple[list[Any], list[Any]]:
    """The raw block's inputs and expected means for every bucket of ``layout`` (elements, dtype
    name), as :func:`_raw_data` makes them; every framework's worker replays its buckets so."""
    pairs = [_raw_data(np, numel, np.dtype(dtype), bucket=b, rank=rank, n=n) for b, (numel, dtype) in enumerate(layout)]
    return [base for base, _ in pairs], [mean for _, mean in pairs]


def run_blocks(spec: dict[str, Any], blocks: dict[str, Callable[[str, int], dict[str, Any]]]) -> None:
    """A worker's rounds: each mode's block in turn, each reported as it ends, then "done"."""
    for rnd in range(spec["rounds"]):
        for mode in spec["modes"]:
            harness.emit(event="block", round=rnd, mode=mode, **blocks[mode](mode, rnd))
    harness.emit(event="done")


class RawReplay:
    """Every framework worker's raw block: the client's all-reduce of exactly the buckets the
    adapter sent (``layout``: elements and dtype name of each), timed like the training blocks and
    checked against the expected means (:func:`raw_data_for`, made again when the layout changes)."""

    def __init__(self, *, rank: int, n: int) -> None:
        self.rank, self.n = rank, n
        self.inputs: list[Any] = []
        self.expected: list[Any] = []

    def block(self, client: Any, layout: Sequence[tuple[int, str]], *, params: int, wire_dtype: str | None,
              timeout: float, rnd: int, timed: Callable[[Callable[[int], None]], tuple[list[float], harness.CpuMeter]],
              ) -> dict[str, Any]:
        import numpy as np

        layout = list(layout)
        if [(a.size, a.dtype.name) for a in self.inputs] != layout:
            self.inputs, self.expected = raw_data_for(np, layout, rank=self.rank, n=self.n)
        results: list[Any] = []

        def step(i: int) -> None:
            futures = [client.allreduce_async(a, op="mean", key=("raw", rnd, i, b), wire_dtype=wire_dtype, timeout=timeout)
                       for b, a in enumerate(self.inputs)]
            results[:] = [client.wait(f, timeout=timeout) for f in futures]

        times, meter = timed(step)
        sizes_ok = sum(numel for numel, _ in layout) == params
        values_ok = all(np.allclose(r, e, rtol=RAW_RTOL[wire_dtype], atol=0) for r, e in zip(results, self.expected, strict=True))
        return {"times": times, "correct": sizes_ok and values_ok, **meter.fields(), "buckets": layout,
                "check": {"bucket_elements_equal_params": sizes_ok, "results_exact": values_ok}}


def agreement(name: str, got: Sequence[Any], want: Sequence[Any], initial: Sequence[Any], tolerance: float) -> dict[str, Any]:
    """The largest |got - want| parameter difference over the largest distance training moved
    ``want`` from ``initial``, against ``tolerance``, as ``{name: relative, ..., "match": ...}``.
    Any array type with ``-``, ``abs`` and ``.max()`` (numpy, torch).

    >>> import numpy as np
    >>> agreement("vs", [np.array([1.0, 2.5])], [np.array([1.0, 3.0])], [np.array([0.0, 1.0])], 0.5)["vs"]
    0.25
    """
    diff = moved = 0.0
    for pg, pw, p0 in zip(got, want, initial, strict=True):
        diff = max(diff, float(abs(pg - pw).max()))
        moved = max(moved, float(abs(pw - p0).max()))
    relative = diff / moved if moved else math.inf
    return {"name": name, name: relative, "moved": moved, "tolerance": tolerance, "match": relative <= tolerance}


def hook_vs_gloo(hook: Sequence[Any], gloo: Sequence[Any], initial: Sequence[Any], tolerance: float) -> dict[str, Any]:
    """The hook model against the gloo model trained on the same steps (:func:`agreement`)."""
    return agreement("hook_vs_gloo", hook, gloo, initial, tolerance)


class ReferenceModel:
    """The training every block must reproduce, computed without any framework or network: the
    benchmarks' model (square dense layers ``[W0, b0, W1, b1, ...]``, W out x in, tanh between
    them, loss = sum of squared errors / batch, SGD) in NumPy float64.

    A data-parallel step on every rank's batch is one step on the batches stacked: the gradient of
    the summed loss over all rows / rows is the mean over ranks of each rank's gradient, which is
    what every all-reduce here must deliver. Float64 rounds far less than the float32 training it
    checks, so the comparison's tolerance is the training's own.

    >>> import numpy as np
    >>> ref = ReferenceModel([np.eye(2, dtype=np.float32), np.zeros(2, np.float32)], learning_rate=0.5)
    >>> ref.step(np.array([[1.0, 0.0]]), np.array([[0.0, 0.0]]))
    >>> [p.tolist() for p in ref.params]
    [[[0.0, 0.0], [0.0, 1.0]], [-1.0, 0.0]]
    """

    def __init__(self, params: Sequence[Any], *, learning_rate: float = LEARNING_RATE) -> None:
        import numpy as np

        self.np = np
        self.params = [np.asarray(p, dtype=np.float64).copy() for p in params]
        self.learning_rate = learning_rate
        self.steps = 0

    def step(self, x: Any, y: Any) -> None:
        """One SGD step on rows ``x`` with targets ``y`` (every rank's batch, stacked)."""
        np = self.np
        x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        layers = len(self.params) // 2
        outputs = [x]
        for i in range(layers):
            z = outputs[-1] @ self.params[2 * i].T + self.params[2 * i + 1]
            outputs.append(np.tanh(z) if i < layers - 1 else z)
        grad_out = 2 * (outputs[-1] - y) / x.shape[0]
        for i in reversed(range(layers)):
            grad_z = grad_out if i == layers - 1 else grad_out * (1 - outputs[i + 1] ** 2)
            weight = self.params[2 * i]
            grad_out = grad_z @ weight  # before the update: backward uses this step's weights
            weight -= self.learning_rate * (grad_z.T @ outputs[i])
            self.params[2 * i + 1] -= self.learning_rate * grad_z.sum(axis=0)
        self.steps += 1

    def advance_to(self, steps: int, x: Any, y: Any) -> None:
        """Take steps on ``x``, ``y`` until ``steps`` have been taken in all."""
        while self.steps < steps:
            self.step(x, y)


def trained_block(times: list[float], meter: harness.CpuMeter, ranks_identical: bool,
                  agreements: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """A training block's report: correct when the model is bit-identical on every rank and
    within tolerance of each of ``agreements`` (:func:`agreement`: the reference replay on rank 0;
    for the hook block of a round whose gloo block ran first, the gloo model)."""
    given = [a for a in agreements if a is not None]
    check: dict[str, Any] = {"ranks_identical": ranks_identical, **{a["name"]: a for a in given}}
    correct = ranks_identical and all(bool(a["match"]) for a in given)
    return {"times": times, "correct": correct, "check": check, **meter.fields()}


def local_block(times: list[float], meter: harness.CpuMeter, trained: Sequence[Any], start: Sequence[Any], x: Any, y: Any,
                steps: int, tolerance: float) -> dict[str, Any]:
    """A compute-only block's report: the ``steps`` local SGD steps from ``start`` on this rank's
    own batch (no communication) must give ``trained``, as the reference replays them."""
    ref = ReferenceModel(start)
    ref.advance_to(steps, x, y)
    check = agreement("vs_local_reference", trained, ref.params, start, tolerance)
    return {"times": times, "correct": bool(check["match"]), "check": check, **meter.fields()}


def params_digest(arrays: Sequence[Any]) -> str:
    """A hash of the parameters' bytes (numpy arrays): equal on two ranks only if the models are identical."""
    import numpy as np

    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
    return h.hexdigest()


def _raw_data(np: Any, numel: int, dtype: Any, *, bucket: int, rank: int, n: int) -> tuple[Any, Any]:
    """The raw block's input for one bucket and the mean over ranks. Values depend on the position
    with a prime period (no power-of-two chunk boundary lines up with it) and on the bucket, so a
    chunk delivered to the wrong place or the wrong operation shows as an O(1) error.

    >>> import numpy as np
    >>> base, mean = _raw_data(np, 3, np.dtype("float32"), bucket=0, rank=1, n=2)
    >>> base.tolist(), mean.tolist()
    ([2.0, 3.0, 4.0], [1.5, 2.5, 3.5])
    """
    position = (np.arange(numel, dtype=np.int64) + RAW_BUCKET_STRIDE * bucket) % RAW_PERIOD
    base = (position + rank % 4 + 1).astype(dtype)
    mean = (position + sum(r % 4 for r in range(n)) / n + 1).astype(dtype)
    return base, mean


def _torch_worker(spec: dict[str, Any]) -> int:
    worker = _TorchWorker(spec)
    try:
        worker.run()
    finally:
        worker.close()
    return 0


class _TorchWorker:
    """One rank: the two DDP models, the generated batch, the redsrv client; runs the blocks and
    emits one ``block`` line per block."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import datetime as dt

        import torch
        import torch.distributed as dist

        import redsrv

        self.torch, self.dist = torch, dist
        self.spec = spec
        self.rank, self.n = spec["rank"], spec["world"]
        self.timeout = spec["op_timeout"]
        # One compute thread each: the workers and reducers share the machine's cores.
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://{spec['master']}", rank=self.rank, world_size=self.n,
                                timeout=dt.timedelta(seconds=self.timeout))
        per_host = spec.get("per_host", 1)
        where = {"host_reduce": "host", "local_rank": self.rank % per_host, "local_size": per_host} if per_host > 1 else {}
        self.client = redsrv.Client(spec["reducers"], rank=self.rank, world_size=self.n, job=spec["job"],
                                    op_timeout=self.timeout, **where)
        self.recorder = _BucketRecorder()
        self.models: dict[str, Any] = {}
        self.optimizers: dict[str, Any] = {}
        self.raw = RawReplay(rank=self.rank, n=self.n)

    def close(self) -> None:
        self.client.close()
        if self.dist.is_initialized():
            self.dist.destroy_process_group()

    def _build(self) -> None:
        import redsrv.torch as rtorch

        torch, spec = self.torch, self.spec
        if "gloo" in spec["modes"]:
            self.models["gloo"] = self._ddp()
        self.models["hook"] = self._ddp()
        hook = rtorch.redsrv_hook
        if spec["wire_dtype"] == "bf16":
            hook = rtorch.bf16_compress_wrapper(hook)
        elif spec["wire_dtype"] == "fp16":
            hook = rtorch.fp16_compress_wrapper(hook)
        state = rtorch.HookState(client=self.client, key_prefix="hook", timeout=self.timeout)
        self.models["hook"].register_comm_hook(state, self.recorder.wrap(hook))
        for name, ddp in self.models.items():
            self.optimizers[name] = torch.optim.SGD(ddp.parameters(), lr=LEARNING_RATE)
        self.initial = [p.detach().clone() for p in self.models["hook"].parameters()]
        self.params = sum(p.numel() for p in self.initial)
        # Every rank its own data, as in data parallelism; each can make every rank's (the reference's).
        batches = [self._batch(r) for r in range(self.n)]
        self.x, self.y = batches[self.rank]
        self.reference = None
        if self.rank == 0:
            self.reference = ReferenceModel([p.numpy() for p in self.initial])
            self.all_x = torch.cat([x for x, _ in batches]).numpy()
            self.all_y = torch.cat([y for _, y in batches]).numpy()

    def _batch(self, rank: int) -> tuple[Any, Any]:
        g = self.torch.Generator().manual_seed(1000 + rank)
        x = self.torch.randn(self.spec["batch"], self.spec["width"], generator=g)
        return x, self.torch.randn(self.spec["batch"], self.spec["width"], generator=g)

    def _ddp(self) -> Any:
        from torch import nn
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.torch.manual_seed(1234)  # identical on every rank and for both wrappers
        stack: list[nn.Module] = []
        for i in range(self.spec["layers"]):
            stack.append(nn.Linear(self.spec["width"], self.spec["width"]))
            if i < self.spec["layers"] - 1:
                # Smooth on purpose. gloo and redsrv sum the ranks in different orders, so the two
                # models differ by float rounding; with ReLU a pre-activation that close to zero
                # flips between them and their parameters then differ by a whole unit's update
                # (measured: 5e-3 of the update after 21 steps at n=4), hiding real errors.
                stack.append(nn.Tanh())
        return DDP(nn.Sequential(*stack), gradient_as_bucket_view=True, bucket_cap_mb=self.spec["bucket_cap_mb"])

    def run(self) -> None:
        self._build()
        harness.emit(event="ready")
        harness.emit(event="model", params=self.params, grad_bytes=sum(p.numel() * p.element_size() for p in self.initial))
        blocks = {"gloo": self._ddp_block, "hook": self._ddp_block, "raw": self._raw_block, "compute": self._compute_block}
        run_blocks(self.spec, blocks)

    def _timed(self, step: Callable[[int], None]) -> tuple[list[float], harness.CpuMeter]:
        return harness.timed_steps(step, warmup=self.spec["warmup"], steps=self.spec["steps"], barrier=self.dist.barrier,
                                   reducer_pids=self.spec["reducer_pids"])

    def _train_step(self, name: str) -> None:
        opt = self.optimizers[name]
        # set_to_none=False keeps each gradient a view of its DDP bucket: with None, autograd
        # allocates fresh gradients that DDP copies into the buckets every step, the copies
        # gradient_as_bucket_view exists to avoid.
        opt.zero_grad(set_to_none=False)
        loss = ((self.models[name](self.x) - self.y) ** 2).sum() / self.x.shape[0]
        loss.backward()
        opt.step()

    def _ddp_block(self, mode: str, rnd: int) -> dict[str, Any]:
        times, meter = self._timed(lambda _i: self._train_step(mode))
        same = self._ranks_identical(list(self.models[mode].parameters()))
        return trained_block(times, meter, same, [self._vs_reference(mode, rnd),
                                                  self._hook_vs_gloo() if mode == "hook" and "gloo" in self.models else None])

    def _vs_reference(self, mode: str, rnd: int) -> dict[str, Any] | None:
        """Rank 0: the model against the reference replay of as many steps (the other ranks hold
        the same model, which ranks_identical checks)."""
        if self.reference is None:
            return None
        self.reference.advance_to((rnd + 1) * (self.spec["warmup"] + self.spec["steps"]), self.all_x, self.all_y)
        return agreement("vs_reference", [p.detach().numpy() for p in self.models[mode].parameters()],
                         self.reference.params, [p.numpy() for p in self.initial], self.spec["tolerance"])

    def _raw_block(self, mode: str, rnd: int) -> dict[str, Any]:
        return self.raw.block(self.client, self.recorder.layout, params=self.params, wire_dtype=self.spec["wire_dtype"],
                              timeout=self.timeout, rnd=rnd, timed=self._timed)

    def _compute_block(self, mode: str, rnd: int) -> dict[str, Any]:
        ddp = self.models["hook"]
        saved = [p.detach().clone() for p in ddp.parameters()]
        with ddp.no_sync():
            times, meter = self._timed(lambda _i: self._train_step("hook"))
        trained = [p.detach().numpy().copy() for p in ddp.parameters()]
        with self.torch.no_grad():
            for p, s in zip(ddp.parameters(), saved, strict=True):
                p.copy_(s)  # no_sync steps trained each rank on its own gradients: undo them
        block = local_block(times, meter, trained, [s.numpy() for s in saved], self.x.numpy(), self.y.numpy(),
                            self.spec["warmup"] + self.spec["steps"], self.spec["tolerance"])
        restored = all(self.torch.equal(p, s) for p, s in zip(ddp.parameters(), saved, strict=True))
        block["check"]["parameters_restored"] = restored
        block["correct"] = block["correct"] and restored
        return block

    def _ranks_identical(self, params: Sequence[Any]) -> bool:
        """Bit-identical models on every rank: a gloo all_gather of each rank's digest."""
        torch = self.torch
        mine = torch.frombuffer(bytearray(bytes.fromhex(params_digest([p.detach().numpy() for p in params]))), dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(self.n)]
        self.dist.all_gather(gathered, mine)
        return all(torch.equal(t, mine) for t in gathered)

    def _hook_vs_gloo(self) -> dict[str, Any]:
        return hook_vs_gloo([p.detach() for p in self.models["hook"].parameters()],
                            [p.detach() for p in self.models["gloo"].parameters()], self.initial, self.spec["tolerance"])


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "worker":
        sys.exit("usage: redsrv bench train (this module's worker mode is started by it)")
    sys.exit(_worker(sys.argv[2]))
