"""``redsrv bench allreduce``: redsrv against gloo's ring all-reduce on your own cluster, size by size.

Start one process per worker with the launcher you train with; each finds its rank and the
world size where the redsrv client does (torchrun's ``RANK``/``WORLD_SIZE``, Open MPI's
``OMPI_COMM_WORLD_*``, SLURM's ``SLURM_PROCID``/``SLURM_NTASKS``, or ``TF_CONFIG``), the reducers
from ``--reducers`` or ``REDSRV_REDUCERS``, and the gloo group from ``MASTER_ADDR`` and
``MASTER_PORT`` (torchrun sets them; with mpirun or srun export the first host and a free port).
No root, no namespaces: it measures the network you have.

    torchrun --nnodes 4 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 \\
        -m redsrv bench allreduce --reducers r0:29600,r1:29600,r2:29600,r3:29600 --line-gbit 25

Per size (default 4 KiB to 256 MiB, float32) both implementations run on the same processes in
blocks, two rounds of (gloo, redsrv): a block is its warm-ups, then its reps, each a barrier and
the all-reduce timed on every rank; a rep's time is the slowest rank's; the table gives the
median over both rounds' reps. Blocks, not alternating reps, because a connection idle for
longer than TCP's retransmission timeout (200 ms and up) restarts in slow start: alternating
reps would time each implementation's connections cold after the other's rep, which back-to-back
all-reduces in a training step are not (and which ``redsrv bench emulate`` does not do either:
``redsrv bench emulate --crosscheck`` compares the two).
Every result is checked against the exact sum. Figures in the nccl-tests style: algbw = size /
time; busbw = algbw · 2(n-1)/n for both implementations, so the columns compare (a ring moves
2(n-1)/n of the buffer over each NIC each way; a reduction server moves it once, so its busbw
can pass the line rate). With ``--line-gbit``, "NIC use" is the bytes each worker's NIC carries
each way per second over the line rate: busbw for gloo, algbw for redsrv. Rank 0 prints the
table and writes JSON (and a PNG if matplotlib is installed).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time
from typing import Any

import numpy as np

from redsrv.cli.units import size_in
from redsrv.core.errors import ConfigError

__all__ = ["add_parser", "run", "reps_for"]

#: 4 KiB to 256 MiB in steps of 4x.
SIZES_KIB = tuple(4 * 4**i for i in range(10))
IMPLEMENTATIONS = ("gloo", "redsrv")


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    b = subparsers.add_parser(
        "allreduce", help="redsrv vs gloo all-reduce on your own cluster (run under torchrun, mpirun or srun)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--reducers", help="reducer addresses host:port,... (default: REDSRV_REDUCERS or TF_CONFIG)")
    b.add_argument("--sizes", "--sizes-kib", dest="sizes_kib", type=size_in("KiB", whole=True), nargs="+",
                   default=list(SIZES_KIB), metavar="SIZE",
                   help="per-rank float32 sizes, e.g. 4KiB 64MiB; a bare number is KiB (default 4 16 64 ... 262144)")
    b.add_argument("--reps", type=int, help="timed reps per size and implementation (default: 50 up to 1 MiB, "
                                            "fewer above, at least 5)")
    b.add_argument("--warmup", type=int, default=2, help="untimed reps per size and implementation first (default 2)")
    b.add_argument("--line-gbit", type=float, help="the workers' NIC line rate, Gbit/s: adds the NIC use column")
    b.add_argument("--job", default="bench-allreduce", help="redsrv job name (default bench-allreduce)")
    b.add_argument("--timeout", type=float, default=300.0, help="per-operation timeout, seconds (default 300)")
    b.add_argument("--json", default="redsrv-allreduce.json", help="rank 0 writes the results here "
                                                                    "(default redsrv-allreduce.json)")
    b.add_argument("--png", help="rank 0 plots busbw here if matplotlib is installed (default: the JSON path, .png)")
    b.set_defaults(func=_main)


def reps_for(size_bytes: int) -> int:
    """Timed reps for one size: enough for a stable median of small messages, about 512 MiB of
    traffic per implementation for large ones, never fewer than 5.

    >>> reps_for(4096), reps_for(64 << 20), reps_for(256 << 20)
    (50, 8, 5)
    """
    return max(5, min(50, (512 << 20) // size_bytes))


def _main(args: argparse.Namespace) -> int:
    if args.reps is not None and args.reps < 1 or args.warmup < 0 or any(s < 1 for s in args.sizes_kib):
        raise ConfigError("--reps must be >= 1, --warmup >= 0 and every size >= 1 KiB")
    if args.line_gbit is not None and args.line_gbit <= 0:
        raise ConfigError(f"--line-gbit must be positive, got {args.line_gbit}")
    return run(reducers=args.reducers, sizes_kib=args.sizes_kib, reps=args.reps, warmup=args.warmup,
               line_gbit=args.line_gbit, job=args.job, timeout=args.timeout, json_path=args.json, png_path=args.png)


def run(*, reducers: str | None, sizes_kib: list[int], reps: int | None, warmup: int, line_gbit: float | None,
        job: str, timeout: float, json_path: str, png_path: str | None) -> int:
    """One rank's part of the sweep; rank 0 reports. Returns the exit code."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        print("redsrv bench allreduce needs torch for the gloo baseline: pip install torch", file=sys.stderr)
        return 2
    import redsrv
    from redsrv.core.config import Config

    config = Config.from_env(reducers=reducers, job=job, op_timeout=timeout)
    n, rank = config.world_size, config.rank
    if n < 2:
        raise ConfigError("redsrv bench allreduce needs at least 2 ranks: start it with torchrun, mpirun or srun "
                          "(world size came out as 1: no RANK/WORLD_SIZE, OMPI_COMM_WORLD_* or SLURM_* variables)")
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise ConfigError(f"the gloo baseline needs {' and '.join(missing)}: torchrun sets them; with mpirun or srun "
                          f"export MASTER_ADDR=<rank 0's host> MASTER_PORT=<a free port> on every rank")
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        with redsrv.Client(config=config) as client:
            rows = []
            for kib in sizes_kib:
                times = _sweep_one(dist, torch, client, kib * 1024 // 4, rank, n, reps or reps_for(kib * 1024), warmup)
                rows += [_row(impl, kib * 1024, n, times[impl], line_gbit) for impl in IMPLEMENTATIONS]
        if rank == 0:
            doc = {"world_size": n, "reducers": list(config.reducers), "line_gbit": line_gbit, "dtype": "float32",
                   "host": socket.gethostname(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                   "command": " ".join(["redsrv", *sys.argv[1:]]), "rows": rows}
            print_table(doc)
            _write(doc, json_path, png_path or os.path.splitext(json_path)[0] + ".png")
    finally:
        dist.destroy_process_group()
    return 0


def _sweep_one(dist: Any, torch: Any, client: Any, elements: int, rank: int, n: int, reps: int,
               warmup: int) -> dict[str, list[float]]:
    """Time ``reps`` all-reduces of ``elements`` float32 per implementation, in blocks; returns
    per implementation each rep's slowest-rank time (on every rank)."""
    pattern = np.arange(elements, dtype=np.int64) % 13
    # Small integers: every sum is exact in float32 whatever the order, so both must match bitwise.
    source = (pattern + rank).astype(np.float32)
    expected = (pattern * n + n * (n - 1) // 2).astype(np.float32)
    work_tensor = torch.empty(elements, dtype=torch.float32)
    work = work_tensor.numpy()  # the same memory: both implementations reduce in place

    def once(impl: str) -> float:
        np.copyto(work, source)
        dist.barrier()
        started = time.perf_counter()
        if impl == "gloo":
            dist.all_reduce(work_tensor)
        else:
            client.allreduce(work, out=work)
        elapsed = time.perf_counter() - started
        if not np.array_equal(work, expected):
            wrong = int(np.count_nonzero(work != expected))
            raise RuntimeError(f"{impl} all-reduce of {elements} float32 on rank {rank} of {n}: {wrong} element(s) differ "
                               f"from the exact sum")
        return elapsed

    mine: dict[str, list[float]] = {impl: [] for impl in IMPLEMENTATIONS}
    rounds = 2 if reps >= 2 else 1
    for r in range(rounds):
        for impl in IMPLEMENTATIONS:
            for _ in range(warmup):
                once(impl)
            for _ in range(reps // rounds + (r < reps % rounds)):
                mine[impl].append(once(impl))
    slowest = torch.tensor([t for impl in IMPLEMENTATIONS for t in mine[impl]], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    values = slowest.tolist()
    return {impl: values[i * reps:(i + 1) * reps] for i, impl in enumerate(IMPLEMENTATIONS)}


def _row(impl: str, size_bytes: int, n: int, times: list[float], line_gbit: float | None) -> dict[str, Any]:
    median = statistics.median(times)
    algbw = size_bytes / median / 1e9
    busbw = algbw * 2 * (n - 1) / n
    # Bytes each worker's NIC carries each way per second: the ring's busbw; redsrv's algbw.
    nic = busbw if impl == "gloo" else algbw
    return {"impl": impl, "size_bytes": size_bytes, "reps": len(times), "times_s": times, "median_s": median,
            "min_s": min(times), "max_s": max(times), "algbw_gbps": algbw, "busbw_gbps": busbw,
            "nic_use": nic / (line_gbit / 8) if line_gbit else None}


def _size_label(size_bytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size_bytes >= scale:
            return f"{size_bytes / scale:g} {unit}"
    return f"{size_bytes} B"


def print_table(doc: dict[str, Any]) -> None:
    n = doc["world_size"]
    print(f"redsrv bench allreduce: {n} ranks, {len(doc['reducers'])} reducers, float32"
          + (f", line rate {doc['line_gbit']:g} Gbit/s" if doc["line_gbit"] else "")
          + f"; busbw = algbw x 2(n-1)/n = algbw x {2 * (n - 1) / n:.3f}")
    head = f"{'size':>9} {'impl':<7} {'reps':>4} {'median':>10} {'min':>10} {'algbw GB/s':>10} {'busbw GB/s':>10}"
    head += f" {'NIC use':>7}" if doc["line_gbit"] else ""
    print(head + f" {'speedup':>8}")
    by_size: dict[int, dict[str, dict[str, Any]]] = {}
    for row in doc["rows"]:
        by_size.setdefault(row["size_bytes"], {})[row["impl"]] = row
    for size, impls in by_size.items():
        speedup = impls["gloo"]["median_s"] / impls["redsrv"]["median_s"]
        for impl in IMPLEMENTATIONS:
            r = impls[impl]
            line = (f"{_size_label(size):>9} {impl:<7} {r['reps']:>4} {r['median_s'] * 1e3:>8.3f}ms {r['min_s'] * 1e3:>8.3f}ms "
                    f"{r['algbw_gbps']:>10.4f} {r['busbw_gbps']:>10.4f}")
            line += f" {r['nic_use']:>7.1%}" if doc["line_gbit"] else ""
            print(line + (f" {speedup:>7.2f}x" if impl == "redsrv" else ""))
    print("speedup = gloo median / redsrv median; NIC use = bytes each worker's NIC carries each way per second / line "
          "rate (gloo: busbw, redsrv: algbw)")


def _write(doc: dict[str, Any], json_path: str, png_path: str) -> None:
    import json

    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {json_path}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for impl in IMPLEMENTATIONS:
        rows = [r for r in doc["rows"] if r["impl"] == impl]
        ax.plot([r["size_bytes"] for r in rows], [r["busbw_gbps"] for r in rows], marker="o", label=impl)
    if doc["line_gbit"]:
        ax.axhline(doc["line_gbit"] / 8, color="black", lw=0.8, ls=":", label=f"line rate {doc['line_gbit']:g} Gbit/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size per rank (bytes)")
    ax.set_ylabel("busbw = algbw x 2(n-1)/n (GB/s)")
    ax.set_title(f"all-reduce, {doc['world_size']} ranks, {len(doc['reducers'])} reducers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    print(f"wrote {png_path}")
