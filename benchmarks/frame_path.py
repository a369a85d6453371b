"""``redsrv bench frame-path``: what a client's I/O thread spends per RESULT frame, with the native
plane's result receiver (``native/receiver.c``) and without it (every frame through the decoder
and the core's per-frame callbacks, as on the Python plane).

One reducer process on 127.0.0.1 and one client in this process (world size 1, so every result
is the client's own input, checked bit for bit after every operation). Both paths run on the
native plane, alternated round by round; the path without the receiver is the same client with
the plane's ``result_receiver`` withheld. For each size the table gives the operation's median
time, the RESULT frames per operation, and the CPU of the client's I/O thread (which reads every
result) per operation and per frame, from the thread's CPU clock; the process's CPU per
operation adds the caller's thread (which writes the pushes) and the checks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

import redsrv
from redsrv.cli.fleet import readline_within, stop_processes
from redsrv.cli.units import parse_size
from redsrv.core import client_engine, plane

from .harness import command_line, provenance

_LISTEN = re.compile(r"listening on (\S+):(\d+) incarnation")
PATHS = ("receiver", "decoder")


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("frame-path", help="a client's CPU per RESULT frame, with and without the native receiver",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["64KiB", "1MiB", "16MiB"], help="all-reduce sizes (default 64KiB 1MiB 16MiB)")
    p.add_argument("--reps", type=int, default=200, help="operations per size, path and round (default 200)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the two paths alternate within each (default 3)")
    p.add_argument("--op", choices=["sum", "mean"], default="sum", help="the reduction (default sum)")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.set_defaults(func=main)


class _WithoutReceiver(plane.NativeKernels):
    """The native plane with its result receiver withheld: every frame goes through the decoder."""

    def __init__(self) -> None:
        super().__init__()
        self.result_receiver = self.result_slot = None


def _kernels(path: str) -> Any:
    def choose(name: str) -> plane.Kernels:
        return plane.NativeKernels() if path == "receiver" else _WithoutReceiver()
    return choose


def _thread_cpu(clocks: list[int]) -> float:
    return sum(time.clock_gettime(clock) for clock in clocks)


def _measure(address: str, path: str, nbytes: int, reps: int, op: str) -> dict[str, float]:
    original = client_engine.kernels_for
    client_engine.kernels_for = _kernels(path)  # type: ignore[assignment]
    try:
        client = redsrv.Client([address], rank=0, world_size=1, job=f"frame-path-{path}", data_plane="native")
    finally:
        client_engine.kernels_for = original  # type: ignore[assignment]
    try:
        x = (np.arange(nbytes // 4) % 4093).astype(np.float32)
        out = np.empty_like(x)
        for _ in range(3):  # warm-up
            client.allreduce(x, op=op, out=out)
        clocks = [time.pthread_getcpuclockid(t.ident) for t in client.io_threads if t.ident is not None]
        channels = [c for reducer in client._machine.channels for c in reducer]
        frames_before = sum(c.frames_received for c in channels)
        io_before, cpu_before = _thread_cpu(clocks), time.process_time()
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            client.allreduce(x, op=op, out=out)
            times.append(time.perf_counter() - started)
            if not np.array_equal(out, x):
                raise SystemExit(f"frame-path: a wrong result on the {path} path at {nbytes} bytes")
        io = _thread_cpu(clocks) - io_before
        cpu = time.process_time() - cpu_before
        frames = sum(c.frames_received for c in channels) - frames_before
    finally:
        client.close()
    return {"median_ms": statistics.median(times) * 1e3, "frames_per_op": frames / reps,
            "io_us_per_op": io / reps * 1e6, "io_us_per_frame": io / max(frames, 1) * 1e6,
            "process_us_per_op": cpu / reps * 1e6}


def main(args: argparse.Namespace) -> int:
    why = plane.native_unavailable()
    if why is not None:
        print(f"frame-path needs the native plane: {why}", file=sys.stderr)
        return 2
    sizes = [parse_size(s) for s in args.sizes]
    reducer = subprocess.Popen([sys.executable, "-m", "redsrv", "reducer", "--host", "127.0.0.1", "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "REDSRV_DATA_PLANE": "native"})
    try:
        match = None
        for _ in range(50):
            line = readline_within(reducer, 30.0)
            if not line:
                break
            match = _LISTEN.search(line)
            if match:
                break
        if match is None:
            print("frame-path: the reducer did not start", file=sys.stderr)
            return 1
        address = f"{match.group(1)}:{match.group(2)}"
        runs: dict[tuple[int, str], list[dict[str, float]]] = {}
        for round_index in range(args.rounds):
            order = PATHS if round_index % 2 == 0 else PATHS[::-1]
            for nbytes in sizes:
                for path in order:
                    runs.setdefault((nbytes, path), []).append(_measure(address, path, nbytes, args.reps, args.op))
    finally:
        stop_processes([reducer], 10.0)
    print(f"{'size':>9} {'path':>9} {'median ms':>10} {'frames/op':>10} {'I/O thread us/op':>17} "
          f"{'us/frame':>9} {'process us/op':>14}   ({args.op}; median of {args.rounds} rounds, {args.reps} ops each)")
    table = []
    for (nbytes, path), rows in runs.items():
        row = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        table.append({"bytes": nbytes, "path": path, **row, "rounds": rows})
        print(f"{nbytes / 1024:>7.0f}Ki {path:>9} {row['median_ms']:>10.3f} {row['frames_per_op']:>10.1f} "
              f"{row['io_us_per_op']:>17.0f} {row['io_us_per_frame']:>9.1f} {row['process_us_per_op']:>14.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command_line("frame-path"), "op": args.op, **provenance(None), "rows": table}, f, indent=1)
    return 0
