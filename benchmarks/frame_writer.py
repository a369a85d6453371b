"""``redsrv bench frame-writer``: the CPU a connection's writer spends per frame, the reference
(``transport.FrameWriter``) against the native plane's (``native/writer.c``).

One process, a Unix socket pair with 4 MiB buffers: the writer under test sends ``--batch``
frames (fewer where 3 MiB holds fewer) of a 52-byte header and a payload of each size, each
taken whole by the socket, and the reader then drains them (outside the measured time). The figure is the writing thread's CPU per
frame (its CPU clock over the batch), the least of ``--reps`` batches, with the two writers
alternated batch by batch. Every batch's bytes are checked. What it leaves out: a frame the
socket takes in parts (the owner's loop then flushes it), and everything around the writer in
the daemon and the client.
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from typing import Any

from redsrv.cli.units import parse_size
from redsrv.core import plane

from .harness import command_line, provenance

HEADER_BYTES = 52  # a RESULT frame's prefix and header with a 4-rank bitmap


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("frame-writer", help="CPU per frame written, the Python and the native frame writer",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["0", "1KiB", "64KiB"], help="payload sizes (default 0 1KiB 64KiB)")
    p.add_argument("--batch", type=int, default=200,
                   help="frames per measured batch, fewer where 3 MiB holds fewer (default 200)")
    p.add_argument("--reps", type=int, default=30, help="batches per writer and size (default 30)")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.set_defaults(func=main)


def _drain(sock: socket.socket, into: bytearray) -> int:
    got = 0
    while True:
        try:
            n = sock.recv_into(into, len(into), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return got
        got += n


def _batch(writer: Any, views: list[memoryview], batch: int, reader: socket.socket, scratch: bytearray) -> float:
    finished: list[Any] = []
    frame_bytes = sum(len(v) for v in views)
    started = time.thread_time_ns()
    for _ in range(batch):
        writer.send(list(views), None, 0.0, finished)
    spent = time.thread_time_ns() - started
    if writer.queued:
        raise SystemExit(f"the socket did not take {batch} frames of {frame_bytes} bytes whole: lower --batch")
    if _drain(reader, scratch) != batch * frame_bytes:
        raise SystemExit("the reader did not get every byte written")
    return spent / batch / 1e3


def main(args: argparse.Namespace) -> int:
    why = plane.native_unavailable()
    if why is not None:
        raise SystemExit(why)
    writers = {"python": plane.kernels_for("python").frame_writer, "native": plane.kernels_for("native").frame_writer}
    rows = []
    print(f"{'payload':>10} {'python us/frame':>16} {'native us/frame':>16} {'saved':>7}")
    for size_text in args.sizes:
        size = int(parse_size(size_text)) if size_text != "0" else 0
        views = [memoryview(bytes(range(HEADER_BYTES))), memoryview(bytes(size))]
        batch = max(1, min(args.batch, (3 << 20) // (HEADER_BYTES + size)))  # what the socket buffer takes whole
        best = {name: float("inf") for name in writers}
        a, b = socket.socketpair()
        with a, b:
            for sock in (a, b):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            a.setblocking(False)
            scratch = bytearray(8 << 20)
            made = {name: cls(a, 0.0) for name, cls in writers.items()}
            for _ in range(args.reps):
                for name, writer in made.items():
                    best[name] = min(best[name], _batch(writer, views, batch, b, scratch))
        saved = best["python"] - best["native"]
        print(f"{size:>10} {best['python']:>16.2f} {best['native']:>16.2f} {saved:>7.2f}")
        rows.append({"payload_bytes": size, "batch": batch, "python_us_per_frame": best["python"],
                     "native_us_per_frame": best["native"]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command_line("frame-writer"), **provenance(None), "rows": rows}, f, indent=1)
    return 0
