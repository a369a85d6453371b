"""``redsrv bench emulate``: redsrv against ring all-reduce (torch.distributed gloo) on an
emulated cluster, in the same run.

Every worker and every reducer runs in its own network namespace ("host"), cabled into a bridge
with a kernel ``tbf`` rate limit on both ends of every link (:mod:`redsrv.bench.netns`). The
gloo baseline runs on the same worker hosts, interleaved with redsrv (gloo, redsrv, gloo,
redsrv, ... for ``--rounds`` rounds), in the same worker processes. Per rep: barrier, time the
all-reduce on every rank, keep the slowest rank; the input is reset every rep and every result
is checked against the exact sum.

Reported per size: median and min-max time, algbw (size / time) in GB/s and as a fraction of
its bound (ring: G·n/(2(n-1)); redsrv: G·min(1, m/n)), the speedup gloo time / redsrv time
beside its theory 2(n-1)/n·min(1, m/n), and whole-machine CPU busy during the timed reps
(above 85% the result measures the CPU, not the network), CPU seconds per GB reduced (workers
and reducers; the workers alone in brackets), and the share of that CPU spent in user space
(the interpreter, NumPy, the plane's C: what a faster data plane in user space can save; the
rest is the kernel's: copies, TCP, wake-ups and the emulated links' softirqs). G is the best
TCP goodput at the configured rate: rate·(MTU-52)/(MTU+14) unless ``--measure-goodput``.

Needs root and iproute2; removes every namespace and process it created on every exit path.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import queue
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redsrv.bench import crosscheck, harness, report
from redsrv.bench.netns import DEFAULT_PREFIX, Cluster, EmulationError, format_rate, parse_rate, tcp_goodput_bps
from redsrv.cli.units import size_in
from redsrv.core.config import check_recv_buffer, congestion_setting
from redsrv.core.constants import DEFAULT_TCP_CONGESTION
from redsrv.core.errors import ConfigError

__all__ = ["add_parser", "Options", "run_emulate"]

_DTYPES = ("float32", "float64", "float16", "bfloat16")


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    b = subparsers.add_parser(
        "emulate", help="redsrv vs gloo ring all-reduce on an emulated rate-limited cluster (root)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--workers", type=int, nargs="+", default=[4], metavar="N",
                   help="worker host count(s) n; several values also plot the speedup vs n (default 4)")
    b.add_argument("--workers-per-host", type=int, default=1, metavar="L",
                   help="worker processes per worker host (default 1): redsrv reduces inside each host first "
                        "(host-level reduction), gloo runs its ring over all n*L ranks placed the same way")
    b.add_argument("--host-reduce", choices=["auto", "flat"], default="auto",
                   help="redsrv's host-level reduction (REDSRV_HOST_REDUCE): auto uses it with --workers-per-host above 1, "
                        "flat sends every process's buffer")
    b.add_argument("--compare-flat", action="store_true",
                   help="also run redsrv without host-level reduction (every process sends its whole buffer: "
                        "'redsrv-flat') in the same run")
    b.add_argument("--reducers", type=int, default=None, metavar="M",
                   help="reducer count m (default: m = n, on their own hosts)")
    b.add_argument("--rate", default="1gbit",
                   help="per-host line rate, both directions, e.g. 1gbit, 500mbit, none (default 1gbit)")
    b.add_argument("--sizes", type=size_in("MiB"), nargs="+", default=[16, 64], metavar="SIZE",
                   help="message sizes, e.g. 4KiB 16MiB; a bare number is MiB (default 16 64)")
    b.add_argument("--reps", type=int, default=None,
                   help="timed reps per size per round (default: 5 from 64 MiB, 20 for 1-64 MiB, 50 below)")
    b.add_argument("--warmup", type=int, default=2, help="untimed reps before each block (default 2)")
    b.add_argument("--rounds", type=int, default=3, help="gloo/redsrv alternations (default 3)")
    b.add_argument("--dtype", choices=_DTYPES, default="float32", help="data type of the buffer (default float32)")
    b.add_argument("--wire-dtype", choices=["bf16", "fp16"], default=None,
                   help="redsrv compresses float32 to this on the wire (gloo keeps --dtype)")
    b.add_argument("--data-plane", choices=["native", "python"], default=None,
                   help="redsrv's data plane in every worker and reducer (REDSRV_DATA_PLANE; default: native where "
                        "built): compare the compiled plane with the Python reference")
    b.add_argument("--chunk-kib", type=size_in("KiB", whole=True), default=None,
                   help="redsrv pipeline chunk size in KiB (default: the client's)")
    b.add_argument("--chunks-per-span", type=int, default=None, metavar="N",
                   help="redsrv full chunks per reducer span (REDSRV_CHUNKS_PER_SPAN; default: the client's, 1 with "
                        "cut-through): more shortens the one-chunk tail and costs CPU per chunk")
    b.add_argument("--streams", type=int, default=None, help="redsrv TCP streams per reducer (default: the client's)")
    b.add_argument("--host-piece-kib", type=size_in("KiB", whole=True), default=None, metavar="KIB",
                   help="with --workers-per-host: the host-level pipeline's piece in KiB (REDSRV_HOST_PIECE_BYTES; "
                        "default: the client's, max(workers per host, reducers) x chunk)")
    b.add_argument("--send-lowat-kib", type=size_in("KiB", whole=True), default=None, metavar="KIB",
                   help="TCP_NOTSENT_LOWAT of redsrv's data sockets in KiB (REDSRV_SEND_LOWAT_BYTES; default: the "
                        "client's, 1024; 0 leaves it unset)")
    b.add_argument("--piece-kib", type=size_in("KiB", whole=True), default=None, metavar="KIB",
                   help="the reducers' cut-through piece in KiB (REDSRV_RESULT_PIECE_BYTES; default: the reducer's, "
                        "512): a chunk's sum leaves in pieces of this size as they arrive; 0 sends whole chunks")
    b.add_argument("--recv-buffer-kib", type=size_in("KiB", whole=True), default=None, metavar="KIB",
                   help="SO_RCVBUF of the reducers' connections in KiB (REDSRV_RECV_BUFFER_BYTES; default: the "
                        "reducer's, 0 = the kernel's autotuning): bounds each worker's bytes in flight towards a "
                        "reducer; `redsrv plan` advises 256 where the reducers are the bottleneck")
    b.add_argument("--tcp-congestion", default=None, metavar="NAME",
                   help="TCP congestion control of redsrv's connections, e.g. cubic, bbr, or system (default: the "
                        "client's, cubic); gloo keeps the system default")
    b.add_argument("--timeline", default=None, metavar="DIR",
                   help="write every redsrv worker's per-chunk timeline (REDSRV_TIMELINE) to DIR/trace-n{n}-{rank}.json; "
                        "merge and draw them with `redsrv timeline`")
    b.add_argument("--delay-us", type=int, default=0,
                   help="one-way delay per hop in microseconds, added by a userspace Python forwarder between TAP "
                        "devices (this kernel has no netem); for small-message latency runs")
    b.add_argument("--colocate", action="store_true",
                   help="run reducer j inside worker host j mod n (shares its link: the advantage should disappear)")
    b.add_argument("--no-baseline", action="store_true", help="run redsrv alone (no gloo)")
    b.add_argument("--crosscheck", action="store_true",
                   help="also run `redsrv bench allreduce` on the same hosts after each worker count, and compare its "
                        "medians with the emulation's (agreement: within 5%%); float32 and the client's defaults only")
    b.add_argument("--mtu", type=int, default=1500, help="MTU of every link (default 1500)")
    b.add_argument("--host-gso-kib", type=size_in("KiB"), default=None, metavar="KIB",
                   help="largest packet a host sends (gso_max_size), in KiB (default: 0.5 ms of the rate, at most 64; "
                        "64 as before 2026-11-26: hosts then queue tens of ms of their own data at slow rates, "
                        "for less CPU per byte; docs/performance.md, \"Method\")")
    b.add_argument("--measure-goodput", action="store_true",
                   help="measure G with one TCP stream between two hosts instead of rate·(MTU-52)/(MTU+14)")
    b.add_argument("--goodput-flows", type=int, default=1, metavar="K",
                   help="measure G with K streams from K hosts into one (as K workers push into a reducer's port): "
                        "G is their sum, and each stream's share is printed (default 1; more implies --measure-goodput)")
    harness.add_run_arguments(b)
    b.set_defaults(func=_main)


@dataclass(frozen=True)
class Options:
    workers: tuple[int, ...] = (4,)
    workers_per_host: int = 1
    host_reduce: str = "auto"
    compare_flat: bool = False
    reducers: int | None = None
    rate_bps: int = 10**9
    sizes_bytes: tuple[int, ...] = (16 * 2**20, 64 * 2**20)
    reps: int | None = None
    warmup: int = 2
    rounds: int = 3
    dtype: str = "float32"
    wire_dtype: str | None = None
    data_plane: str | None = None  # REDSRV_DATA_PLANE of every redsrv process; None: their default
    chunk_bytes: int | None = None
    chunks_per_span: int | None = None
    streams: int | None = None
    host_piece_bytes: int | None = None
    send_lowat_bytes: int | None = None
    result_piece_bytes: int | None = None  # the reducers'
    recv_buffer_bytes: int | None = None  # the reducers'
    tcp_congestion: str | None = None  # None: redsrv's default
    timeline: str | None = None  # folder for the workers' timelines
    delay_us: int = 0
    colocate: bool = False
    baseline: bool = True
    mtu: int = 1500
    host_gso_bytes: int | None = None  # None: netns.host_gso_bytes(rate)
    measure_goodput: bool = False
    goodput_flows: int = 1  # streams into one host when measuring G
    crosscheck: bool = False  # also run `redsrv bench allreduce` and compare (benchmarks/crosscheck.py)
    out: str = "bench-results"
    prefix: str = DEFAULT_PREFIX
    quiet: bool = False

    @property
    def host_level(self) -> bool:
        """Whether redsrv's workers reduce inside each host first."""
        return self.host_reduce == "auto" and self.workers_per_host > 1

    def m_for(self, n: int) -> int:
        return self.reducers if self.reducers is not None else n

    def reducer_hosts(self, n: int) -> list[int]:
        m = self.m_for(n)
        return [j % n for j in range(m)] if self.colocate else [max(self.workers) + j for j in range(m)]

    def reps_for(self, size: int) -> int:
        if self.reps is not None:
            return self.reps
        return 5 if size >= 64 * 2**20 else 20 if size >= 2**20 else 50

    def client_options(self) -> dict[str, int]:
        """The redsrv client settings this run sets (``Config`` field names); the rest stay the
        client's defaults."""
        chosen = {"chunk_bytes": self.chunk_bytes, "chunks_per_span": self.chunks_per_span,
                  "streams_per_reducer": self.streams, "send_lowat_bytes": self.send_lowat_bytes,
                  "host_piece_bytes": self.host_piece_bytes}
        return {name: value for name, value in chosen.items() if value is not None}

    @property
    def hosts(self) -> int:
        nmax = max(self.workers)
        return nmax if self.colocate else nmax + max(self.m_for(n) for n in self.workers)

    def validate(self) -> None:
        if not self.workers or min(self.workers) < 2:
            raise EmulationError("--workers: need at least 2 worker hosts per run")
        if self.workers_per_host < 1:
            raise EmulationError("--workers-per-host must be >= 1")
        if self.compare_flat and not self.host_level:
            raise EmulationError("--compare-flat compares host-level reduction with the flat path: it needs "
                                 "--workers-per-host 2 or more")
        if self.crosscheck and self.workers_per_host > 1:
            raise EmulationError("--crosscheck runs `redsrv bench allreduce`, one worker per host: leave out "
                                 "--workers-per-host")
        if self.reducers is not None and self.reducers < 1:
            raise EmulationError("--reducers must be >= 1")
        if not self.sizes_bytes or min(self.sizes_bytes) < 8:
            raise EmulationError("--sizes: each size must be at least 8 bytes")
        for name in ("warmup",):
            if getattr(self, name) < 0:
                raise EmulationError(f"--{name} must be >= 0")
        for name in ("rounds", "reps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise EmulationError(f"--{name} must be >= 1")
        if self.chunk_bytes is not None and not 1024 <= self.chunk_bytes <= 64 * 2**20:
            raise EmulationError("--chunk-kib must be in 1..65536")
        if self.chunks_per_span is not None and self.chunks_per_span < 1:
            raise EmulationError("--chunks-per-span must be >= 1")
        if self.host_piece_bytes is not None and not self.host_level:
            raise EmulationError("--host-piece-kib sets the host-level pipeline: it needs --workers-per-host 2 or more")
        if self.streams is not None and not 1 <= self.streams <= 64:
            raise EmulationError("--streams must be in 1..64")
        if self.send_lowat_bytes is not None and self.send_lowat_bytes < 0:
            raise EmulationError("--send-lowat-kib must be >= 0")
        if self.result_piece_bytes is not None and self.result_piece_bytes < 0:
            raise EmulationError("--piece-kib must be >= 0")
        if self.recv_buffer_bytes is not None:
            try:
                check_recv_buffer(self.recv_buffer_bytes)
            except ConfigError as exc:
                raise EmulationError(f"--recv-buffer-kib: {exc}") from None
        if self.tcp_congestion is not None:
            try:
                congestion_setting(self.tcp_congestion)
            except ConfigError as exc:
                raise EmulationError(f"--tcp-congestion: {exc}") from None
        if self.crosscheck and (self.dtype != "float32" or self.wire_dtype or self.client_options() or self.delay_us
                                or self.result_piece_bytes is not None or self.recv_buffer_bytes is not None
                                or self.tcp_congestion is not None or not self.baseline):
            raise EmulationError("--crosscheck compares with `redsrv bench allreduce`, which runs float32 with the client's "
                                 "and reducers' defaults against gloo: leave out --dtype, --wire-dtype, the redsrv "
                                 "settings, --delay-us and --no-baseline")
        if not 1 <= self.goodput_flows < self.hosts:
            raise EmulationError(f"--goodput-flows must be in 1..{self.hosts - 1}: one stream from each other host "
                                 f"into one ({self.hosts} hosts here)")
        if self.wire_dtype and self.dtype not in ("float32", "float64"):
            raise EmulationError(f"--wire-dtype compresses float32/float64 data; --dtype is {self.dtype}")
        # Per worker: the input, the expected sum, gloo's tensor and its reset copy, redsrv's result.
        need = max(self.workers) * self.workers_per_host * 5 * max(self.sizes_bytes)
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else need
        if need > 0.8 * avail:
            raise EmulationError(f"{max(self.workers)} workers at {report.format_size(max(self.sizes_bytes))} need about "
                                 f"{need / 2**30:.1f} GiB of memory; {avail / 2**30:.1f} GiB is free")


def _main(a: argparse.Namespace) -> int:
    def run() -> bool:
        opts = Options(
            workers=tuple(a.workers), workers_per_host=a.workers_per_host, host_reduce=a.host_reduce,
            compare_flat=a.compare_flat, reducers=a.reducers,
            rate_bps=parse_rate(a.rate),
            sizes_bytes=tuple(int(s * 2**20) for s in a.sizes), reps=a.reps, warmup=a.warmup, rounds=a.rounds,
            dtype=a.dtype, wire_dtype=a.wire_dtype, data_plane=a.data_plane,
            chunk_bytes=a.chunk_kib * 1024 if a.chunk_kib else None,
            chunks_per_span=a.chunks_per_span, streams=a.streams,
            host_piece_bytes=None if a.host_piece_kib is None else a.host_piece_kib * 1024,
            send_lowat_bytes=None if a.send_lowat_kib is None else a.send_lowat_kib * 1024,
            result_piece_bytes=None if a.piece_kib is None else a.piece_kib * 1024,
            recv_buffer_bytes=None if a.recv_buffer_kib is None else a.recv_buffer_kib * 1024, tcp_congestion=a.tcp_congestion,
            timeline=a.timeline,
            delay_us=a.delay_us, colocate=a.colocate, baseline=not a.no_baseline, mtu=a.mtu,
            host_gso_bytes=None if a.host_gso_kib is None else int(a.host_gso_kib * 1024),
            measure_goodput=a.measure_goodput, goodput_flows=a.goodput_flows, crosscheck=a.crosscheck, out=a.out, prefix=a.prefix)
        return bool(run_emulate(opts)["ok"])

    status: int = harness.run_command("emulate", a, run=run, rereport=_rereport)
    return status


def _rereport(path: str) -> int:
    try:
        with open(path) as f:
            doc = json.load(f)
        blocks, opts = doc["blocks"], doc["options"]
    except (OSError, ValueError, KeyError) as exc:
        raise EmulationError(f"cannot read results from {path}: {exc}") from None
    goodput = doc["goodput_gbps"]
    compression = _compression(opts["dtype"], opts["wire_dtype"])
    rows = report.summarise(blocks, goodput=goodput, colocated=opts["colocate"], compression=compression)
    print(report.format_table(rows))
    png = os.path.splitext(path)[0] + ".png"
    report.plot(rows, png, goodput=goodput, rate_bps=opts["rate_bps"], colocated=opts["colocate"], compression=compression,
                title=_title(opts, doc["started"][:10], doc["machine"]["cpus"]))
    print(f"\n  wrote {png}")
    return 0


def _compression(dtype: str, wire_dtype: str | None) -> float:
    """Buffer bytes per wire byte for redsrv.

    >>> _compression("float32", "bf16"), _compression("float32", None), _compression("float64", "fp16")
    (2.0, 1.0, 4.0)
    """
    size = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    return size / 2 if wire_dtype and size > 2 else 1.0


def _title(opts: dict[str, Any], day: str, cpus: int | None) -> str:
    return (f"{format_rate(opts['rate_bps'])} per host" + (f", {opts['delay_us']} us one-way delay" if opts["delay_us"] else "")
            + f", {opts['dtype']}" + (f" ({opts['wire_dtype']} on the redsrv wire)" if opts["wire_dtype"] else "")
            + (", reducers colocated" if opts["colocate"] else "") + f", {day}, {cpus} CPUs")


def _say(opts: Options, text: str) -> None:
    harness.say(opts.quiet, text)


def describe_forwarder(report: dict[str, Any], delay_us: int) -> str:
    """One line on how faithfully the delay forwarder kept the delay.

    >>> describe_forwarder({"forwarded": 1200, "dropped": 0, "undeliverable": 3, "scheduling": "SCHED_FIFO 10",
    ...                     "late_us": {"p50": 12, "p99": 80, "max": 400}}, 500)  # doctest: +NORMALIZE_WHITESPACE
    'delay forwarder (SCHED_FIFO 10): 1200 frames, 0 dropped, 3 to a port that was down;
     left 12 us (median), 80 us (p99), 400 us (max) after their 500 us'
    """
    late = report.get("late_us") or {}
    when = ", ".join(f"{late[k]} us ({name})" for k, name in (("p50", "median"), ("p99", "p99"), ("max", "max")) if k in late)
    return (f"delay forwarder ({report.get('scheduling', '?')}): {report.get('forwarded', 0)} frames, "
            f"{report.get('dropped', 0)} dropped, {report.get('undeliverable', 0)} to a port that was down"
            + (f"; left {when} after their {delay_us} us" if when else ""))


def congestion_controls(requested: str | None) -> dict[str, str]:
    """The TCP congestion control each implementation's connections will use: gloo keeps the
    system default (new namespaces inherit it), redsrv picks its own where the kernel has it."""
    def read(name: str) -> str:
        try:
            with open(f"/proc/sys/net/ipv4/{name}") as f:
                return f.read().strip()
        except OSError:
            return ""

    system = read("tcp_congestion_control") or "unknown"
    wanted = congestion_setting(requested) if requested is not None else DEFAULT_TCP_CONGESTION
    if wanted is None:
        return {"redsrv": f"{system} (system default)", "gloo": f"{system} (system default)"}
    available = read("tcp_available_congestion_control").split()
    if available and wanted not in available:
        return {"redsrv": f"{system} (system default; {wanted} is not available)", "gloo": f"{system} (system default)"}
    return {"redsrv": wanted, "gloo": f"{system} (system default)"}


def run_emulate(opts: Options) -> dict[str, Any]:
    """Build the cluster, run every configuration, write the JSON and PNG, remove the cluster.
    Returns the result document (also written to ``opts.out``)."""
    opts.validate()
    cluster = Cluster(opts.hosts, opts.rate_bps, prefix=opts.prefix, mtu=opts.mtu, delay_us=opts.delay_us,
                      gso_bytes=opts.host_gso_bytes)
    cluster.check()
    impls = ["redsrv" if opts.host_level or opts.workers_per_host == 1 else "redsrv-flat"]
    torch_version = None
    if opts.baseline:
        if importlib.util.find_spec("torch") is None:
            _say(opts, "torch is not installed: running redsrv alone, without the gloo baseline "
                       "(install redsrv[torch] for it)")
        else:
            impls = ["gloo", *impls]
            torch_version = harness.torch_version()
    if opts.delay_us and max(opts.sizes_bytes) > 2**20:
        _say(opts, "note: the delay forwarder is Python: above ~1 MiB it, not the rate limit, bounds the throughput")
    assumed = tcp_goodput_bps(opts.rate_bps, opts.mtu) / 8 / 1e9 if opts.rate_bps else 0.0
    started = datetime.datetime.now()
    source = harness.provenance(torch_version)  # what the workers import, before other work changes it
    stamp = started.strftime("%Y%m%d-%H%M%S")
    os.makedirs(opts.out, exist_ok=True)
    json_path = os.path.join(opts.out, f"emulate-{stamp}.json")
    png_path = os.path.join(opts.out, f"emulate-{stamp}.png")
    blocks: list[dict[str, Any]] = []
    crosschecked: dict[int, list[dict[str, Any]]] = {}  # n -> redsrv bench allreduce's rows
    doc: dict[str, Any] = {}
    congestion = congestion_controls(opts.tcp_congestion)
    _say(opts, f"redsrv bench emulate: {opts.hosts} hosts at {format_rate(opts.rate_bps)} per link (both directions), "
               f"MTU {opts.mtu}, packets up to {cluster.gso_bytes} bytes"
               + (f", {opts.delay_us} us one-way delay" if opts.delay_us else "")
               + f"; {opts.dtype}" + (f", {opts.wire_dtype} on the redsrv wire" if opts.wire_dtype else "")
               + (f"; redsrv's {opts.data_plane} data plane" if opts.data_plane else "")
               + f"; {' vs '.join(impls)}; {opts.rounds} round(s)"
               + ("; reducers colocated with workers" if opts.colocate else "")
               + "".join(f"; redsrv {name}={value}" for name, value in opts.client_options().items())
               + ("" if opts.result_piece_bytes is None else f"; redsrv reducers' result_piece_bytes={opts.result_piece_bytes}")
               + ("" if opts.recv_buffer_bytes is None else f"; redsrv reducers' recv_buffer_bytes={opts.recv_buffer_bytes}"))
    _say(opts, "  " + harness.describe_speed(source["machine"]["speed"]))
    flow_shares: list[float] = []
    with harness.raise_on_signals(), tempfile.TemporaryDirectory(prefix="redsrv-emulate-") as tmp:
        try:
            t0 = time.monotonic()
            cluster.up()
            _say(opts, f"  cluster up in {time.monotonic() - t0:.1f}s: {', '.join(f'{h.ns}={h.ip}' for h in cluster.hosts)}")
            goodput, goodput_source = assumed, "assumed: rate x (MTU-52)/(MTU+14)"
            if opts.measure_goodput or opts.goodput_flows > 1 or not opts.rate_bps:
                measured, flow_shares = _measure_goodput(cluster, opts.goodput_flows)
                streams = "one TCP stream h0" if opts.goodput_flows == 1 else f"{opts.goodput_flows} TCP streams"
                _say(opts, f"  measured TCP goodput, {streams} -> h1: {measured:.4f} GB/s"
                           + (f" ({measured / assumed:.3f} of the assumed {assumed:.4f})" if assumed else "")
                           + ("" if opts.goodput_flows == 1 else
                              "; each stream's share: " + " ".join(f"{share:.3f}" for share in flow_shares)))
                goodput, goodput_source = measured, f"measured: {streams} -> h1, 3 s"
            else:
                _say(opts, f"  G = {goodput:.4f} GB/s ({goodput_source})")
            _say(opts, f"  TCP congestion control: redsrv {congestion['redsrv']}, gloo {congestion['gloo']}")
            if opts.host_level:
                impls += ["redsrv-flat"] if opts.compare_flat else []
                _say(opts, f"  {opts.workers_per_host} worker process(es) per worker host: redsrv reduces inside each host "
                           "first" + ("; redsrv-flat sends every process's buffer" if opts.compare_flat else ""))
            secret = harness.write_secret(tmp)
            for n in opts.workers:
                blocks += _run_config(cluster, opts, n, impls, goodput, tmp, secret)
                if opts.crosscheck and "gloo" in impls:
                    _say(opts, f"  n={n}: redsrv bench allreduce on the same hosts (--crosscheck)")
                    crosschecked[n] = crosscheck.run_allreduce_bench(
                        cluster, n=n, reducer_hosts=opts.reducer_hosts(n), sizes_bytes=opts.sizes_bytes, warmup=opts.warmup,
                        secret=secret, tmp=tmp, timeout_s=_allreduce_timeout(opts.sizes_bytes, goodput))
        finally:
            removed = cluster.down()
            _say(opts, f"  cluster removed ({len(removed)} namespaces)")
            if cluster.forwarder_report:
                _say(opts, "  " + describe_forwarder(cluster.forwarder_report, opts.delay_us))
    compression = _compression(opts.dtype, opts.wire_dtype)
    rows = report.summarise(blocks, goodput=goodput, colocated=opts.colocate, compression=compression)
    ok = all(r.correct for r in rows) and bool(rows)
    comparison = [c for n, got in crosschecked.items() for c in crosscheck.compare(rows, got, n)]
    doc = {
        "benchmark": "redsrv bench emulate",
        "started": started.isoformat(timespec="seconds"),
        "command": harness.command_line("emulate"),
        **source,
        "options": {k: v for k, v in opts.__dict__.items() if k != "quiet"},
        "host_gso_bytes": cluster.gso_bytes,
        "goodput_gbps": goodput, "goodput_source": goodput_source, "goodput_assumed_gbps": assumed,
        "goodput_flow_shares": flow_shares,
        "tcp_congestion": congestion,
        "delay_forwarder": cluster.forwarder_report,
        "rows": [r.as_dict() for r in rows],
        "blocks": blocks,
        "crosscheck": comparison,
        "ok": ok,
    }
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    _say(opts, "\n" + report.format_table(rows))
    if comparison:
        _say(opts, "\n  redsrv bench allreduce on the same hosts against this emulation (medians):\n"
                   + crosscheck.format_comparison(comparison))
    flagged = [r for r in rows if r.cpu_bound]
    if flagged:
        _say(opts, f"\n  {len(flagged)} row(s) ran with the machine over {report.CPU_BOUND_BUSY:.0%} busy: they measure the CPU, "
                   "not the network (other load, or too many hosts for the cores)")
    if not ok:
        _say(opts, "\n  WRONG SUMS: at least one all-reduce returned a wrong result (see 'correct' in the JSON)")
    title = _title(doc["options"], f"{started:%Y-%m-%d}", os.cpu_count())
    harness.finish_files(doc, json_path, png_path, lambda path: report.plot(
        rows, path, goodput=goodput, rate_bps=opts.rate_bps, colocated=opts.colocate, compression=compression, title=title),
        quiet=opts.quiet)
    return doc


def _allreduce_timeout(sizes_bytes: Sequence[int], goodput: float) -> float:
    """A generous bound for one `redsrv bench allreduce` sweep: its reps (allreduce.reps_for) of
    both implementations at a tenth of G, plus start-up."""
    from redsrv.bench.allreduce import reps_for

    speed = goodput * 1e9 * 0.1 if goodput else 1e8
    return 120.0 + float(sum(2 * (reps_for(s) + 4) * 2 * s / speed for s in sizes_bytes))


def _run_config(cluster: Cluster, opts: Options, n: int, impls: list[str], goodput: float, tmp: str,
                secret: str) -> list[dict[str, Any]]:
    m = opts.m_for(n)
    per_host = opts.workers_per_host
    ranks = n * per_host  # rank r on host r // per_host: the block placement of torchrun and mpirun
    env = harness.child_env(secret)
    if opts.data_plane is not None:
        env["REDSRV_DATA_PLANE"] = opts.data_plane
    if opts.tcp_congestion is not None:
        env["REDSRV_TCP_CONGESTION"] = opts.tcp_congestion
    if opts.result_piece_bytes is not None:
        env["REDSRV_RESULT_PIECE_BYTES"] = str(opts.result_piece_bytes)
    if opts.recv_buffer_bytes is not None:
        env["REDSRV_RECV_BUFFER_BYTES"] = str(opts.recv_buffer_bytes)
    reducer_hosts = opts.reducer_hosts(n)
    _say(opts, f"\n  n={n} worker hosts h0..h{n - 1}" + (f" with {per_host} workers each" if per_host > 1 else "")
               + f", m={m} reducers on "
               + ", ".join(f"h{h}" for h in reducer_hosts) + (" (colocated)" if opts.colocate else ""))
    procs: list[subprocess.Popen] = []  # type: ignore[type-arg]
    pumps: list[threading.Thread] = []
    try:
        reducers, addresses = harness.start_reducers(cluster, reducer_hosts, env=env, logdir=tmp, tag=str(n), procs=procs)
        spec_base = {
            "world": ranks, "per_host": per_host, "host_level": opts.host_level, "impls": impls, "sizes": list(opts.sizes_bytes),
            "reps": [opts.reps_for(s) for s in opts.sizes_bytes],
            "warmup": opts.warmup, "rounds": opts.rounds, "dtype": opts.dtype, "wire_dtype": opts.wire_dtype,
            "data_plane": opts.data_plane, "client_options": opts.client_options(), "reducers": addresses,
            "master": f"{cluster.hosts[0].ip}:{harness.GLOO_PORT}", "job": f"bench-emulate-n{n}-{uuid.uuid4().hex[:8]}",
        }
        specs = [dict(spec_base, rank=rank, reducer_pids=[p.pid for p in reducers] if rank == 0 else [])
                 for rank in range(ranks)]
        events: queue.Queue[tuple[int, dict[str, Any] | None]] = queue.Queue()
        worker_env = env
        if opts.timeline is not None:
            os.makedirs(opts.timeline, exist_ok=True)
            worker_env = dict(env, REDSRV_TIMELINE=os.path.join(os.path.abspath(opts.timeline), f"trace-n{n}-{{rank}}.json"))
        workers, logs = harness.spawn_workers(cluster, "redsrv.bench.emulate", specs, env=worker_env, logdir=tmp, tag=str(n),
                                              procs=procs, pumps=pumps, events=events,
                                              hosts=[rank // per_host for rank in range(ranks)])
        return _collect(opts, n, m, impls, workers, logs, events, goodput)
    finally:
        harness.terminate_and_drain(cluster, procs, pumps)


def _collect(opts: Options, n: int, m: int, impls: list[str], workers: list[subprocess.Popen], logs: list[str],  # type: ignore[type-arg]
             events: queue.Queue, goodput: float) -> list[dict[str, Any]]:  # type: ignore[type-arg]
    """Gather each block from every rank, print it, and stop on a failed or silent worker."""
    gather = harness.RankGather(n * opts.workers_per_host)
    blocks: list[dict[str, Any]] = []
    total = opts.rounds * len(opts.sizes_bytes) * len(impls)
    speed = goodput * 1e9 * 0.1 if goodput else 1e8  # a pessimistic 10% of G
    slowest = max(2 * s / speed * (opts.warmup + opts.reps_for(s)) for s in opts.sizes_bytes)

    def on_block(rank: int, msg: dict[str, Any]) -> str | None:
        key = (msg["round"], msg["size_bytes"], msg["impl"])
        got = gather.add(key, rank, msg)
        if got is None:
            return None
        block = _merge(n, m, got, opts.workers_per_host)
        blocks.append(block)
        _say(opts, _progress(block, len(blocks), total, goodput, opts))
        return f"the block after round {key[0] + 1} {report.format_size(key[1])} {key[2]}"

    harness.collect(workers, logs, events, stall_s=120.0 + slowest, label=f"n={n}", on_message=on_block)
    return blocks


def _merge(n: int, m: int, got: dict[int, dict[str, Any]], per_host: int = 1) -> dict[str, Any]:
    r0 = got[0]
    return {"n": n, "m": m, "per_host": per_host, "round": r0["round"], "size_bytes": r0["size_bytes"], "impl": r0["impl"],
            **harness.merge_ranks(got, count_reducers=r0["impl"] != "gloo")}


def _progress(block: dict[str, Any], k: int, total: int, goodput: float, opts: Options) -> str:
    n, m, size = block["n"], block["m"], block["size_bytes"]
    med = statistics.median(block["times"])
    bound = report.bound_of(block["impl"], goodput, n, m, block.get("per_host", 1), opts.colocate,
                            _compression(opts.dtype, opts.wire_dtype))
    frac = f"{size / med / 1e9 / bound:.3f} of bound" if bound else ""
    flag = " CPU-bound" if block["cpu_busy"] > report.CPU_BOUND_BUSY else ""
    metered = block.get("metered_s", block["wall_s"])
    ours = block["cpu_s"] / (metered * block["cores"]) if metered else 0.0
    wrong = " WRONG SUMS" if not block["correct"] else ""
    return (f"  [{k:>2}/{total}] n={n} round {block['round'] + 1} {report.format_size(size):>8} {block['impl']:<6} "
            f"median {med * 1000:9.2f} ms  ({min(block['times']) * 1000:.2f}-{max(block['times']) * 1000:.2f})  "
            f"{size / med / 1e9:.4f} GB/s {frac}  CPU busy {block['cpu_busy']:.0%} (ours {ours:.0%}, steal "
            f"{block['cpu_steal']:.0%}){flag}{wrong}")


def _measure_goodput(cluster: Cluster, flows: int = 1, seconds: float = 3.0) -> tuple[float, list[float]]:
    """``flows`` TCP streams into h1 for ``seconds``, from h0 and then h2, h3, ...: GB/s of payload
    after the first half second, summed, and each stream's share of it. With several streams
    this is what a reducer's port gives that many workers pushing at once, however unevenly TCP
    shares it among them."""
    if not 1 <= flows < cluster.count:
        raise EmulationError(f"--goodput-flows {flows}: needs 1 to {cluster.count - 1} streams, one per other host")
    port = 5201
    sink = cluster.hosts[1].ip
    recv = cluster.spawn(1, [sys.executable, "-m", "redsrv.bench.emulate", "goodput-recv", sink, str(port),
                             str(seconds), str(flows)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    senders = [cluster.spawn(h, [sys.executable, "-m", "redsrv.bench.emulate", "goodput-send", sink, str(port),
                                 str(seconds + 1)], stdin=subprocess.DEVNULL)
               for h in [0, *range(2, cluster.count)][:flows]]
    try:
        out, _ = recv.communicate(timeout=seconds + 30)
        for send in senders:
            send.wait(timeout=30)
    except subprocess.TimeoutExpired:
        raise EmulationError("goodput measurement did not finish") from None
    finally:
        cluster.stop([recv, *senders])
    try:
        fields = out.split()
        total = float(fields[fields.index("goodput") + 1])
        counted = [int(v) for v in fields[fields.index("flows") + 1 :]]
    except (ValueError, IndexError):
        raise EmulationError(f"goodput measurement failed: printed {out!r}") from None
    return total, [c / sum(counted) if sum(counted) else 0.0 for c in counted]


# --- inside the namespaces ---------------------------------------------------------------


def _goodput_recv(ip: str, port: str, seconds: str, flows: str = "1") -> int:
    """Accept ``flows`` streams and count what they deliver from half a second in for
    ``seconds``; prints the total GB/s and each stream's bytes."""
    srv = socket.create_server((ip, int(port)))
    srv.settimeout(30)
    conns = []
    for _ in range(int(flows)):
        conn, _ = srv.accept()
        conn.setblocking(False)
        conns.append(conn)
    selector = selectors.DefaultSelector()
    for index, conn in enumerate(conns):
        selector.register(conn, selectors.EVENT_READ, index)
    buf = bytearray(1 << 20)
    counted = [0] * len(conns)
    start = time.perf_counter()
    t_count = None
    end = start + 0.5 + float(seconds)
    while (now := time.perf_counter()) < end:
        for key, _ in selector.select(min(0.1, end - now)):
            try:
                got = key.fileobj.recv_into(buf)  # type: ignore[union-attr]
            except BlockingIOError:
                continue
            if not got:
                selector.unregister(key.fileobj)
                continue
            now = time.perf_counter()
            if now - start >= 0.5:
                if t_count is None:
                    t_count = now
                else:
                    counted[key.data] += got
    elapsed = time.perf_counter() - t_count if t_count else 0.0
    for conn in conns:
        conn.close()
    total = sum(counted)
    print(f"goodput {total / elapsed / 1e9 if elapsed else 0.0:.6f} flows {' '.join(map(str, counted))}", flush=True)
    return 0


def _goodput_send(ip: str, port: str, seconds: str) -> int:
    deadline = time.monotonic() + 20
    while True:
        try:
            sock = socket.create_connection((ip, int(port)), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    data = memoryview(bytearray(1 << 20))
    end = time.monotonic() + float(seconds)
    try:
        while time.monotonic() < end:
            sock.sendall(data)
    except OSError:
        pass  # the receiver has what it needs and closed
    sock.close()
    return 0


class _Buffers:
    """One size's buffers on one rank: the input, the exact expected sum, redsrv's result array
    and gloo's in-place tensor with the copy it is reset from. Both implementations write into
    memory allocated once, as a training loop would (a fresh 64 MiB array per call costs page
    faults that have nothing to do with the network)."""

    def __init__(self, np: Any, torch: Any, dtype: Any, size: int, rank: int, n: int) -> None:
        self.base, self.expected = harness.exact_data(dtype, size, rank, n)
        self.result = np.zeros_like(self.base)
        self.tensor = _as_tensor(torch, self.base) if torch is not None else None
        self.tensor_base = _as_tensor(torch, self.base) if torch is not None else None


def _same_bytes(a: Any, b: Any) -> bool:
    """Bitwise equality of two arrays of equal size, compared as 8-byte words where they allow
    (the check runs between timed reps while other ranks may still be timing: keep it cheap)."""
    import numpy as np

    word = np.uint64 if a.nbytes % 8 == 0 else np.uint8
    return a.nbytes == b.nbytes and bool(np.array_equal(a.reshape(-1).view(word), b.reshape(-1).view(word)))


class _Gloo:
    name = "gloo"

    def __init__(self, dist: Any, torch: Any) -> None:
        self.dist, self.torch = dist, torch

    def reset(self, b: _Buffers) -> None:
        assert b.tensor is not None
        b.tensor.copy_(b.tensor_base)  # all_reduce works in place: repeated sums would overflow

    def barrier(self) -> None:
        self.dist.barrier()

    def reduce(self, b: _Buffers) -> Any:
        self.dist.all_reduce(b.tensor)
        return b.tensor

    def correct(self, b: _Buffers, result: Any) -> bool:
        return _same_bytes(result.view(self.torch.uint8).numpy(), b.expected)


class _Redsrv:
    def __init__(self, client: Any, name: str = "redsrv") -> None:
        self.client = client
        self.name = name

    def reset(self, b: _Buffers) -> None:
        b.result.fill(0)  # so a chunk that never arrived cannot pass for the previous rep's

    def barrier(self) -> None:
        self.client.barrier()

    def reduce(self, b: _Buffers) -> Any:
        return self.client.allreduce(b.base, out=b.result)

    def correct(self, b: _Buffers, result: Any) -> bool:
        return _same_bytes(result, b.expected)


def _block(impl: _Gloo | _Redsrv, b: _Buffers, warmup: int, reps: int, reducer_pids: list[int]) -> dict[str, Any]:
    """Warm-up, then ``reps`` timed all-reduces. CPU is counted over each timed call and the
    barrier before it: reading ``/proc`` between the barrier and the call (rank 0 reads every
    reducer's) delayed rank 0's start, which the slowest-rank time then charged to the
    all-reduce (about 0.3 ms of a 3 ms one at 4 KiB). At 16 MiB and up a barrier's CPU is noise."""
    times: list[float] = []
    correct = True
    meter = harness.CpuMeter(reducer_pids)
    for i in range(warmup + reps):
        impl.reset(b)
        timed = i >= warmup
        if timed:
            meter.start()
        impl.barrier()
        t0 = time.perf_counter()
        result = impl.reduce(b)
        elapsed = time.perf_counter() - t0
        if timed:
            meter.stop()
            times.append(elapsed)
        correct = impl.correct(b, result) and correct
        del result
    return {"times": times, "correct": correct, **meter.fields()}


def _worker(spec_json: str) -> int:
    import numpy as np

    import redsrv

    spec = json.loads(spec_json)
    rank, n = spec["rank"], spec["world"]

    np_dtype = _numpy_dtype(spec["dtype"])
    per_host = spec.get("per_host", 1)
    # "redsrv" reduces inside each host first (with several workers per host), "redsrv-flat" sends
    # every process's buffer
    flat = {"host_reduce": "flat"}
    where = {"redsrv": {"host_reduce": "host", "local_rank": rank % per_host, "local_size": per_host}
             if spec.get("host_level") else flat, "redsrv-flat": flat}
    clients = {name: redsrv.Client(spec["reducers"], rank=rank, world_size=n, job=f"{spec['job']}-{name}",
                                   wire_dtype=spec["wire_dtype"], **where[name], **spec["client_options"])
               for name in spec["impls"] if name in where}
    impls: list[_Gloo | _Redsrv] = []
    dist: Any = None
    torch: Any = None
    try:
        if "gloo" in spec["impls"]:
            import datetime as dt

            torch = importlib.import_module("torch")
            dist = importlib.import_module("torch.distributed")
            torch.set_num_threads(1)
            dist.init_process_group("gloo", init_method=f"tcp://{spec['master']}", rank=rank, world_size=n,
                                    timeout=dt.timedelta(seconds=300))
            impls.append(_Gloo(dist, torch))
        impls += [_Redsrv(client, name) for name, client in clients.items()]
        harness.emit(event="ready")
        buffers: _Buffers | None = None
        for rnd in range(spec["rounds"]):
            for size, reps in zip(spec["sizes"], spec["reps"], strict=True):
                if buffers is None or buffers.base.nbytes != size // np_dtype.itemsize * np_dtype.itemsize:
                    buffers = None  # one size's buffers at a time
                    buffers = _Buffers(np, torch, np_dtype, size, rank, n)
                for impl in impls:
                    result = _block(impl, buffers, spec["warmup"], reps, spec["reducer_pids"])
                    harness.emit(event="block", round=rnd, size_bytes=size, impl=impl.name, **result)
        for client in clients.values():
            client.close()  # before "done": the parent stops the workers then, and close() writes the timeline
        harness.emit(event="done")
    finally:
        for client in clients.values():
            client.close()
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _numpy_dtype(name: str) -> Any:
    import numpy as np

    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _as_tensor(torch: Any, arr: Any) -> Any:
    if arr.dtype.name == "bfloat16":
        import numpy as np

        return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(arr.copy())


if __name__ == "__main__":
    commands: dict[str, Callable[..., int]] = {"worker": _worker, "goodput-recv": _goodput_recv,
                                               "goodput-send": _goodput_send}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit("usage: redsrv bench emulate (this module's worker modes are started by it)")
    sys.exit(commands[sys.argv[1]](*sys.argv[2:]))
