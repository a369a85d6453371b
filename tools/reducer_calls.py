"""Python and C function calls the reducers' event loops make per all-reduce: the interpreter's work
that the reducer's C loop is meant to take over (docs/architecture.md, "The socket loops in C"). A
count, not a time, so it does not move with the machine's load; what it leaves out is the work
below the calls (the kernel's copies, the plane's loops).

    python tools/reducer_calls.py [--ranks 2] [--reducers 2] [--mib 64] [--ops 10] [--top 0]

Reducers run in this process (their loop threads are the ones counted), clients too; every result
is checked against the exact sum.
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
from typing import Any

import numpy as np

import redsrv


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reducers", type=int, default=2)
    parser.add_argument("--mib", type=int, default=64, help="the all-reduce's size in MiB of float32")
    parser.add_argument("--ops", type=int, default=10, help="operations counted, after three untimed ones")
    parser.add_argument("--top", type=int, default=0, help="also list the most called functions")
    args = parser.parse_args()
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    counting = threading.Event()

    def count(frame: Any, event: str, arg: Any) -> None:
        if not counting.is_set():
            return
        if event == "call":
            counts[(frame.f_code.co_filename.rsplit("/redsrv/", 1)[-1], frame.f_code.co_name)] += 1
        elif event == "c_call":
            counts[("C", getattr(arg, "__qualname__", repr(arg)))] += 1

    threading.setprofile(count)  # only threads started from here on: the reducers' loops
    daemons = [redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, close_timeout=2))
               for _ in range(args.reducers)]
    addresses = [f"{host}:{port}" for host, port in (d.start() for d in daemons)]
    threading.setprofile(None)  # type: ignore[arg-type]
    elements = args.mib << 18
    try:
        clients = [redsrv.Client(addresses, rank=rank, world_size=args.ranks, job="calls") for rank in range(args.ranks)]
        inputs = [np.arange(elements, dtype=np.float32) % 1000 + rank for rank in range(args.ranks)]
        want = sum(inputs[1:], inputs[0].copy())
        for key in range(3 + args.ops):
            if key == 3:
                counting.set()
            futures = [c.allreduce_async(x, key=key) for c, x in zip(clients, inputs, strict=True)]
            for client, future in zip(clients, futures, strict=True):
                if not np.array_equal(client.wait(future), want):
                    print(f"operation {key}: a wrong sum", file=sys.stderr)
                    return 1
        counting.clear()
        for client in clients:
            client.close()
    finally:
        for d in daemons:
            d.stop()
    engaged = sum(getattr(d.core, "engaged_chunks", 0) for d in daemons)
    total = sum(counts.values())
    print(f"{args.ranks} ranks, {args.reducers} reducers, {args.mib} MiB float32: "
          f"{total / args.ops:.0f} calls per operation on the reducers' loops; chunks a native forwarder sent: {engaged}")
    for (where, name), n in counts.most_common(args.top):
        print(f"{n / args.ops:10.1f}  {where} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
