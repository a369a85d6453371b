"""``redsrv bench emulate --crosscheck``: run ``redsrv bench allreduce`` on the emulated cluster
too, and compare its figures with the emulation's own.

``redsrv bench allreduce`` is what users run on their own hosts; ``redsrv bench emulate`` is how
this project measures. Both time a float32 all-reduce on every rank after a barrier and report
the slowest rank's median, but they are separate programs (torchrun-style environment and the
client's own defaults on one side, the emulation's worker on the other), so on the same cluster
their figures should agree: the check is that they do, size by size, within
:data:`AGREEMENT` (5%). After each worker count's emulation blocks, the same worker hosts run
``python -m redsrv bench allreduce`` with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``
set as torchrun would, against fresh reducers on the same reducer hosts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from redsrv.bench import harness, report
from redsrv.bench.netns import Cluster, EmulationError

__all__ = ["AGREEMENT", "run_allreduce_bench", "compare", "format_comparison"]

#: The largest relative difference of the two benchmarks' medians that counts as agreement.
AGREEMENT = 0.05

#: A port of its own for the allreduce bench's gloo rendezvous: the emulation's workers used
#: harness.GLOO_PORT moments before, and its sockets may linger in TIME_WAIT.
_RENDEZVOUS_PORT = harness.GLOO_PORT + 7


def run_allreduce_bench(cluster: Cluster, *, n: int, reducer_hosts: Sequence[int], sizes_bytes: Sequence[int],
                        warmup: int, secret: str, tmp: str, timeout_s: float) -> list[dict[str, Any]]:
    """``redsrv bench allreduce`` on worker hosts h0..h{n-1} against fresh reducers on
    ``reducer_hosts``; returns rank 0's rows (see ``redsrv.bench.allreduce``)."""
    if any(size % 1024 for size in sizes_bytes):
        raise EmulationError("--crosscheck needs sizes in whole KiB (redsrv bench allreduce takes sizes in KiB)")
    env = harness.child_env(secret)
    procs: list[subprocess.Popen] = []  # type: ignore[type-arg]
    try:
        _, addresses = harness.start_reducers(cluster, reducer_hosts, env=env, logdir=tmp, tag=f"x{n}", procs=procs)
        json_path = os.path.join(tmp, f"allreduce-n{n}.json")
        logs = []
        workers = []
        for rank in range(n):
            rank_env = dict(env, RANK=str(rank), WORLD_SIZE=str(n), MASTER_ADDR=cluster.hosts[0].ip,
                            MASTER_PORT=str(_RENDEZVOUS_PORT))
            argv = [sys.executable, "-m", "redsrv", "bench", "allreduce", "--reducers", ",".join(addresses),
                    "--sizes", *[f"{size // 1024}KiB" for size in sizes_bytes], "--warmup", str(warmup),
                    "--json", json_path, "--png", os.path.join(tmp, f"allreduce-n{n}.png")]
            log_path = os.path.join(tmp, f"allreduce-n{n}-{rank}.log")
            logs.append(log_path)
            with open(log_path, "w") as log:
                proc = cluster.spawn(rank, argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=rank_env)
            procs.append(proc)
            workers.append(proc)
        deadline = time.monotonic() + timeout_s
        for rank, proc in enumerate(workers):
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise EmulationError(f"redsrv bench allreduce rank {rank} of {n} did not finish within {timeout_s:.0f}s; "
                                     f"{harness.tail(logs[rank])}") from None
            if code:
                raise EmulationError(f"redsrv bench allreduce rank {rank} of {n} exited with {code}; {harness.tail(logs[rank])}")
        with open(json_path) as f:
            rows: list[dict[str, Any]] = json.load(f)["rows"]
        return rows
    finally:
        cluster.stop(procs)


def compare(rows: Sequence[report.Row], allreduce_rows: Sequence[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """Per size and implementation: both medians, their ratio (allreduce / emulate) and whether
    they agree; and per size the two speed-ups."""
    emulated = {(r.size_bytes, r.impl): r for r in rows if r.n == n}
    out = []
    for row in allreduce_rows:
        mine = emulated.get((row["size_bytes"], row["impl"]))
        if mine is None:
            continue
        ratio = row["median_s"] / mine.median_s
        out.append({"n": n, "size_bytes": row["size_bytes"], "impl": row["impl"], "emulate_median_s": mine.median_s,
                    "allreduce_median_s": row["median_s"], "ratio": ratio, "agrees": abs(ratio - 1) <= AGREEMENT})
    return out


def format_comparison(comparison: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'n':>2} {'size':>8} {'impl':<7} {'emulate':>10} {'allreduce':>10} {'allreduce/emulate':>18}"]
    for c in comparison:
        lines.append(f"{c['n']:>2} {report.format_size(c['size_bytes']):>8} {c['impl']:<7} {c['emulate_median_s'] * 1e3:>8.2f}ms "
                     f"{c['allreduce_median_s'] * 1e3:>8.2f}ms {c['ratio']:>17.3f}{'' if c['agrees'] else '  (over 5%)'}")
    agreeing = sum(c["agrees"] for c in comparison)
    lines.append(f"{agreeing} of {len(comparison)} within {AGREEMENT:.0%}")
    return "\n".join(lines)
