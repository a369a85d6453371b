"""``redsrv bench core-path``: what the reducer's state machine (``core/reducer.py``) spends on
its decisions per chunk on the steady cut-through path, without sockets, a daemon or a loop.

The core is sans-IO, so this drives it as the daemon does for ``--world`` ranks of one job: each
chunk gets every rank's push header (``begin_push``), half of every payload reported
(``progress``), every payload finished (``finish_push``), then each rank's ACK of the RESULT
frames sent to it (``ack``). The payload bytes are written outside the timed calls; every result
piece sent is checked against the expected sum. What it prints per chunk: the CPU of the core's
calls (the plane's combine included; each call is timed with the thread's CPU clock), the
function calls they make (counted in a separate pass with ``sys.setprofile``, C functions
included: a figure that does not depend on the machine's speed), and the RESULT
and SAFE frames they send. The daemon's part (the loop, the push receiver's callbacks, writing)
is not in it: ``redsrv bench local`` and ``emulate`` measure whole processes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

from redsrv.cli.units import size_in
from redsrv.core.plane import kernels_for
from redsrv.core.reducer import ReducerCore, SendResult, SendSafe
from redsrv.core.wire import DType, Hello, Push

from .harness import command_line, provenance

_JOB = "core-path"


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("core-path", help="the reducer core's CPU and function calls per chunk (sans-IO)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4, help="ranks of the job (default 4)")
    p.add_argument("--chunk-kib", type=size_in("KiB", whole=True), default=64, metavar="KIB",
                   help="chunk size in KiB, or with a unit (default 64: small, so that the combine does not hide "
                        "the decisions)")
    p.add_argument("--piece-kib", type=size_in("KiB", whole=True), default=32, metavar="KIB",
                   help="the cut-through piece in KiB, or with a unit (default 32)")
    p.add_argument("--chunks", type=int, default=5000, help="timed chunks per round (default 5000)")
    p.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--data-plane", choices=["native", "python"], default=None,
                   help="the kernels the core combines with (default: as REDSRV_DATA_PLANE, auto)")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.set_defaults(func=main)


class _Driver:
    """One job of ``world`` ranks on one core; ``run`` pushes ``count`` chunks through it."""

    def __init__(self, world: int, chunk_bytes: int, piece_bytes: int, plane: str) -> None:
        self.world, self.chunk_bytes = world, chunk_bytes
        self.core = ReducerCore(1, kernels=kernels_for(plane), piece_bytes=piece_bytes)
        for rank in range(world):
            self.core.join(rank, Hello(_JOB, rank, world, 1000 + rank, b"", reconnect_window_ms=30_000), now=0.0)
        self.frames = [0] * world  # RESULT frames sent to each rank's connection
        self.expected = np.float32(world * (world + 1) // 2)  # rank r pushes r + 1 everywhere
        self.next_chunk = 0
        self.results = self.safes = self.wrong = 0
        self.spent = 0  # nanoseconds of the core's calls in the current run
        self.inside = False  # a call into the core is running (what the call count counts)

    def run(self, count: int) -> float:
        """Push ``count`` chunks; returns the CPU seconds of the core's calls."""
        core, world, half, elements = self.core, self.world, self.chunk_bytes // 2, self.chunk_bytes // 4
        call, now = self._call, 1.0
        self.spent = 0
        for _ in range(count):
            c = self.next_chunk
            self.next_chunk += 1
            push = Push(1, 1, elements * (1 << 30), c * elements, elements, c, DType.FLOAT32)
            tickets = [call(core.begin_push, rank, push, self.chunk_bytes, now) for rank in range(world)]
            for step in (1, 2):
                for rank, ticket in enumerate(tickets):
                    buffer = getattr(ticket, "buffer", None)
                    if buffer is None:
                        raise SystemExit(f"core-path: rank {rank}'s push of chunk {c} was not given a buffer: {ticket}")
                    buffer[(step - 1) * half: step * half].view(np.float32)[:] = rank + 1
                    if step == 1:
                        self._deliver(call(core.progress, ticket, half, now))
                    else:
                        self._deliver(call(core.finish_push, ticket, now))
            for rank in range(world):
                actions = call(core.ack, rank, self.frames[rank])
                self.safes += sum(isinstance(action, SendSafe) for action in actions)
        return self.spent / 1e9

    def _call(self, method: Any, *args: Any) -> Any:
        """One call into the core, its CPU added to ``spent``; ``inside`` while it runs."""
        started = time.thread_time_ns()
        self.inside = True
        outcome = method(*args)
        self.inside = False
        self.spent += time.thread_time_ns() - started
        return outcome

    def _deliver(self, actions: list[Any]) -> None:
        for action in actions:
            if not isinstance(action, SendResult):
                raise SystemExit(f"core-path: unexpected action on the steady path: {action}")
            sums = np.frombuffer(action.data, dtype=np.float32)
            self.wrong += int(not (sums == self.expected).all())
            for conn in action.conns:
                self.frames[conn] += 1
                self.results += 1
                action.release()


def _calls_per_chunk(driver: _Driver, count: int) -> float:
    calls = 0

    def count_calls(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if driver.inside and event in ("call", "c_call"):
            calls += 1

    sys.setprofile(count_calls)
    try:
        driver.run(count)
    finally:
        sys.setprofile(None)
    return calls / count


def main(args: argparse.Namespace) -> int:
    if args.world < 1 or args.chunks < 1 or args.rounds < 1:
        print("core-path: --world, --chunks and --rounds must be at least 1", file=sys.stderr)
        return 2
    if args.chunk_kib < 1 or args.piece_kib < 1 or args.piece_kib > args.chunk_kib:
        print("core-path: --piece-kib must be 1..--chunk-kib", file=sys.stderr)
        return 2
    plane = args.data_plane or "auto"
    driver = _Driver(args.world, args.chunk_kib << 10, args.piece_kib << 10, plane)
    driver.run(200)  # warm-up: the pool's buffers, the interpreter's caches
    rounds = []
    for _ in range(args.rounds):
        results, safes = driver.results, driver.safes
        seconds = driver.run(args.chunks)
        rounds.append({"us_per_chunk": seconds / args.chunks * 1e6,
                       "results_per_chunk": (driver.results - results) / args.chunks,
                       "safes_per_chunk": (driver.safes - safes) / args.chunks})
    calls = _calls_per_chunk(driver, min(args.chunks, 1000))
    if driver.wrong:
        print(f"core-path: {driver.wrong} result pieces were not the expected sum", file=sys.stderr)
        return 1
    median = statistics.median(r["us_per_chunk"] for r in rounds)
    plane_name = driver.core._combiner.kernels.name
    print(f"reducer core, {args.world} ranks, {args.chunk_kib} KiB chunks in {args.piece_kib} KiB pieces, "
          f"{plane_name} plane: {median:.1f} us of CPU per chunk (rounds "
          + ", ".join(f"{r['us_per_chunk']:.1f}" for r in rounds)
          + f"), {calls:.0f} function calls (Python and C), {rounds[0]['results_per_chunk']:.0f} RESULT and "
          f"{rounds[0]['safes_per_chunk']:.1f} SAFE frames per chunk; every sum checked")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command_line("core-path"), "world": args.world, "chunk_bytes": args.chunk_kib << 10,
                       "piece_bytes": args.piece_kib << 10, "plane": plane_name, "us_per_chunk": median,
                       "calls_per_chunk": calls, "rounds": rounds, **provenance(None)}, f, indent=1)
    return 0
