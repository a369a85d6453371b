"""``redsrv bench local``: loopback all-reduce throughput per size, and worker and reducer CPU per GB.

Workers and reducers are processes on 127.0.0.1, so this measures the implementation's CPU
efficiency (memory copies on shared cores), not a network speed-up: use it as a quick
regression check. Comparisons with ring all-reduce belong on an emulated network.

CPU per GB divides CPU seconds by the GB reduced (each worker's buffer size x workers x reps):
the reducers' column is their processes' CPU, the workers' column all worker processes' CPU
(each worker pushes its buffer once and pulls the result once per GB of its own). Both count
only the timed repetitions.

Every result, warm-ups included, is compared bit for bit with the exact sum (small integers,
exact in float32 and on 16-bit wires; ``harness.exact_data``), outside the timed region. A wrong
result is reported per size and makes the command exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from redsrv.bench.report import format_size
from redsrv.cli.fleet import _Fleet, start_reducers, stop_processes
from redsrv.cli.units import size_in

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    b = subparsers.add_parser(
        "local", help="loopback throughput per size, worker and reducer CPU per GB (quick regression check)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    b.add_argument("--reducers", type=int, default=2, help="reducer processes (default 2)")
    b.add_argument("--sizes", type=size_in("MiB"), nargs="+", default=[1, 4, 16, 64, 256], metavar="SIZE",
                   help="sizes, e.g. 4KiB 64MiB; a bare number is MiB (default 1 4 16 64 256)")
    b.add_argument("--reps", type=int, default=5, help="timed repetitions per size (default 5, after 2 warm-ups)")
    b.add_argument("--wire-dtype", choices=["bf16", "fp16"], default=None, help="compress float32 on the wire")
    b.add_argument("--op", choices=["sum", "mean"], default="sum",
                   help="the reduction (default sum; DDP and JAX's pmean use mean, which divides on the workers)")
    b.add_argument("--io-threads", type=int, default=None,
                   help="each worker's client I/O threads (default: REDSRV_IO_THREADS, else 1)")
    b.add_argument("--json", metavar="PATH", help="write every rep to this JSON file")
    b.set_defaults(func=lambda a: run_local_bench(workers=a.workers, reducers=a.reducers, sizes_mib=a.sizes, reps=a.reps,
                                                  wire_dtype=a.wire_dtype, json_path=a.json, io_threads=a.io_threads,
                                                  op=a.op))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc; 0 where unavailable)."""
    return sum(cpu_times(pid))


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, every thread (Linux /proc; zeros where
    unavailable). User time is the interpreter, NumPy and the plane's C; system time is the
    kernel's share: copies, TCP, and the softirqs of the emulated links that run in its context."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) / _CLOCK_TICKS, int(fields[12]) / _CLOCK_TICKS
    except (OSError, IndexError, ValueError):
        return 0.0, 0.0


def expected_result(nbytes: int, rank: int, n: int, op: str, wire_dtype: str | None) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s float32 input and what every rank must receive: the exact sum, or for
    ``mean`` that sum divided by ``n`` as the client divides what came off the wire.

    >>> x, want = expected_result(16, rank=1, n=2, op="mean", wire_dtype=None)
    >>> x.tolist(), want.tolist()
    ([1.0, 4.0, 3.0, 2.0], [0.5, 3.5, 2.5, 1.5])
    """
    from redsrv.bench.harness import exact_data  # harness imports this module (cpu_times)

    x, total = exact_data(np.dtype(np.float32), nbytes, rank, n)
    if op == "sum":
        return x, total
    import ml_dtypes

    on_wire = {None: np.float32, "bf16": ml_dtypes.bfloat16, "fp16": np.float16}[wire_dtype]
    mean = np.empty_like(total)
    np.divide(total.astype(on_wire), n, out=mean, casting="unsafe")  # the sum is exact on every wire
    return x, mean


def run_local_bench(*, workers: int, reducers: int, sizes_mib: list[float], reps: int, wire_dtype: str | None,
                    json_path: str | None, warmup: int = 2, io_threads: int | None = None, op: str = "sum",
                    fleet: _Fleet | None = None) -> int:
    """Run the benchmark; 0 when every result was right, 1 otherwise. ``fleet``: reducers that
    are already running (their processes, for their CPU), instead of ``reducers`` new ones."""
    from redsrv import Config

    threads = Config.from_env(io_threads=io_threads).io_threads  # the flag, else REDSRV_IO_THREADS, validated
    print(f"redsrv bench local: {workers} workers ({threads} I/O thread(s) each), {reducers} reducers on 127.0.0.1, "
          f"{op} of float32"
          + (f" ({wire_dtype} on the wire)" if wire_dtype else "") + f", {reps} reps after {warmup} warm-ups", flush=True)
    print("  loopback measures CPU efficiency, not network speed-ups (see `redsrv bench emulate`)", flush=True)
    owned = fleet is None
    if fleet is None:
        fleet = start_reducers(reducers)
    procs: list[subprocess.Popen] = []  # type: ignore[type-arg]
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="redsrv-bench-") as tmp:
            outs = [os.path.join(tmp, f"rank{r}.json") for r in range(workers)]
            spec = {"sizes": sizes_mib, "reps": reps, "warmup": warmup, "wire_dtype": wire_dtype, "io_threads": threads,
                    "op": op}
            for r in range(workers):
                procs.append(subprocess.Popen([
                    sys.executable, "-m", "redsrv.bench.local", "worker", json.dumps(spec), str(r), str(workers),
                    ",".join(fleet.addresses), outs[r], ",".join(str(p.pid) for p in fleet.procs)]))
            print(f"  {'size':>9} {'median':>10} {'min':>9} {'max':>9} {'algbw GB/s':>11} {'reducer CPU s/GB':>17} "
                  f"{'worker CPU s/GB':>16}  check")
            for p in procs:
                p.wait(timeout=600)
            if any(p.returncode for p in procs):
                print("redsrv bench local: a worker failed", file=sys.stderr)
                return 1
            reports = []
            for path in outs:
                with open(path) as f:
                    reports.append(json.load(f))
            for i, size in enumerate(sizes_mib):
                times = [max(rep["sizes"][i]["times"][k] for rep in reports) for k in range(reps)]
                cpu = reports[0]["sizes"][i]["reducer_cpu"]  # only rank 0 measures the reducers
                worker_cpu = sum(rep["sizes"][i]["worker_cpu"] for rep in reports)
                nbytes = int(size * 2**20) // 4 * 4
                reduced_gb = nbytes * workers * reps / 1e9
                median = statistics.median(times)
                wrong = {r: rep["sizes"][i]["wrong_results"] for r, rep in enumerate(reports) if rep["sizes"][i]["wrong_results"]}
                row = {"size_bytes": nbytes, "times": times, "median_s": median, "algbw_gbps": nbytes / median / 1e9,
                       "reducer_cpu_s_per_gb": cpu / reduced_gb if reduced_gb else 0.0,
                       "worker_cpu_s_per_gb": worker_cpu / reduced_gb if reduced_gb else 0.0,
                       "correct": not wrong, "wrong_results_by_rank": wrong}
                rows.append(row)
                print(f"  {format_size(nbytes):>9} {median * 1000:>8.2f}ms {min(times) * 1000:>7.2f}ms "
                      f"{max(times) * 1000:>7.2f}ms "
                      f"{row['algbw_gbps']:>11.3f} {row['reducer_cpu_s_per_gb']:>17.3f} {row['worker_cpu_s_per_gb']:>16.3f}  "
                      + ("exact" if not wrong else "WRONG"))
        if json_path:
            with open(json_path, "w") as f:
                json.dump({"workers": workers, "reducers": reducers, "io_threads": threads, "wire_dtype": wire_dtype, "op": op,
                           "correct": all(row["correct"] for row in rows), "rows": rows}, f, indent=1)
            print(f"  wrote {json_path}")
        wrong_rows = [row for row in rows if not row["correct"]]
        for row in wrong_rows:
            print(f"redsrv bench local: WRONG SUMS at {row['size_bytes']} bytes: wrong results (of {warmup + reps} per rank) "
                  f"by rank {row['wrong_results_by_rank']}", file=sys.stderr)
        return 1 if wrong_rows else 0
    finally:
        stop_processes(procs, timeout=5)
        if owned:
            stop_processes(fleet.procs)


def _worker(spec_json: str, rank: str, world: str, reducers: str, out: str, reducer_pids_csv: str) -> int:
    import redsrv

    spec = json.loads(spec_json)
    r, n = int(rank), int(world)
    result: dict = {"sizes": []}  # type: ignore[type-arg]
    with redsrv.Client(reducers.split(","), rank=r, world_size=n, job="bench-local", wire_dtype=spec["wire_dtype"],
                       io_threads=spec["io_threads"]) as client:
        # Rank 0 reads the reducers' CPU time around the timed loop (all ranks are in lockstep).
        reducer_pids = [int(p) for p in reducer_pids_csv.split(",")] if r == 0 else []
        for size in spec["sizes"]:
            x, expected = expected_result(int(size * 2**20) // 4 * 4, r, n, spec["op"], spec["wire_dtype"])
            times = []
            wrong = 0
            for _ in range(spec["warmup"]):
                client.barrier()
                wrong += not np.array_equal(client.allreduce(x, op=spec["op"]), expected)
            cpu_before = sum(cpu_seconds(p) for p in reducer_pids)
            own_before = _own_cpu_seconds()
            check_s = 0.0  # the checks run between timed reps: not the workers' CPU per GB
            for _ in range(spec["reps"]):
                client.barrier()
                start = time.perf_counter()
                summed = client.allreduce(x, op=spec["op"])
                times.append(time.perf_counter() - start)
                checked_from = _own_cpu_seconds()
                wrong += not np.array_equal(summed, expected)
                check_s += _own_cpu_seconds() - checked_from
            client.barrier()
            own = _own_cpu_seconds() - own_before - check_s
            cpu = sum(cpu_seconds(p) for p in reducer_pids) - cpu_before
            result["sizes"].append({"size": size, "times": times, "reducer_cpu": cpu, "worker_cpu": own, "wrong_results": wrong})
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


def _own_cpu_seconds() -> float:
    """User + system CPU seconds of this process, every thread (the client's I/O loops included)."""
    t = os.times()
    return t.user + t.system


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        sys.exit(_worker(*sys.argv[2:]))
    sys.exit("usage: redsrv bench local")
