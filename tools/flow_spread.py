"""How far apart one emulated host's TCP flows run during each operation of a benchmark.

A reducer can send a piece's sum only once every worker's copy of it arrived, so a worker whose
flows to the reducers progress unevenly stalls the reducer its slowest flow feeds; the stall
lengthens the operation's tail (docs/performance.md, "Several workers per host"). This runs a
command (normally `redsrv bench emulate ... --out DIR`), samples `ss -tin` in one host's network
namespace while it runs, and prints, per operation, the largest gap between that host's flows in
bytes acknowledged and their congestion windows; given the benchmark's result folder it pairs each
timed operation with its time. Needs root (ip netns).

    sudo python3 tools/flow_spread.py --op-bytes 8388608 --results DIR -- \\
        redsrv bench emulate --workers 4 --rate 300mbit --sizes 32 --rounds 1 --reps 20 --no-baseline --out DIR

--op-bytes is what one flow carries per operation (the message over the reducers: 32 MiB over 4);
operations are told apart by each flow's bytes acknowledged, so a run of one message size only.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import time

_FLOW = re.compile(r"cwnd:(\d+).*?bytes_acked:(\d+)")


def sample(namespace: str) -> list[tuple[int, int]] | None:
    """(cwnd, bytes_acked) of every established TCP flow in `namespace`; None if it is gone."""
    got = subprocess.run(["ip", "netns", "exec", namespace, "ss", "-tin", "state", "established"],
                         capture_output=True, text=True, timeout=5)
    if got.returncode != 0:
        return None
    return [(int(cwnd), int(acked)) for cwnd, acked in _FLOW.findall(got.stdout.replace("\n\t", " "))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--namespace", default="redsrv-h0", help="the host to watch (default: the first worker's)")
    parser.add_argument("--flows", type=int, default=4, help="its data flows (default 4: one per reducer)")
    parser.add_argument("--op-bytes", type=int, required=True, help="bytes one flow carries per operation")
    parser.add_argument("--warmup", type=int, default=2, help="untimed operations before the timed ones (emulate's --warmup)")
    parser.add_argument("--results", help="the benchmark's --out folder: pair each timed operation with its time")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between samples (default 0.1)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    started = time.time()
    child = subprocess.Popen(command)
    per_op: dict[int, tuple[int, list[int]]] = {}  # operation -> (largest gap, windows seen)
    seen = False
    try:
        while child.poll() is None:
            flows = sample(args.namespace)
            if flows is not None and len(flows) >= args.flows:
                seen = True
                # The data flows carry the most; the rendezvous and control flows little.
                flows = sorted(flows, key=lambda f: f[1])[-args.flows:]
                acked = [a for _, a in flows]
                low = min(acked)
                op, into = divmod(low, args.op_bytes)
                if into > args.op_bytes // 100:  # not at an operation's boundary, where every flow is level
                    gap, windows = per_op.get(op, (0, []))
                    per_op[op] = (max(gap, max(acked) - low), windows + [c for c, _ in flows])
            time.sleep(args.interval)
    finally:
        if child.poll() is None:
            child.terminate()
            child.wait(timeout=30)
    if not seen:
        print(f"no sample of {args.flows} flows in {args.namespace}", file=sys.stderr)
        return 1
    times: list[float] = []
    if args.results:
        files = [f for f in glob.glob(os.path.join(args.results, "*.json")) if os.path.getmtime(f) >= started]
        if files:
            times = json.load(open(max(files, key=os.path.getmtime)))["blocks"][0]["times"]
    print(f"{'operation':>9} {'time s':>7} {'largest gap MB':>15} {'cwnd (packets) min-max':>23}")
    paired = []
    rows = []
    for op in sorted(per_op):
        gap, windows = per_op[op]
        rep = op - args.warmup
        when = times[rep] if 0 <= rep < len(times) else None
        if when is not None:
            paired.append((gap, when))
        shown = f"{when:7.3f}" if when is not None else f"{'':>7}"
        print(f"{op:9d} {shown} {gap / 1e6:15.3f} {min(windows):>11d}-{max(windows):<11d}")
        rows.append({"operation": op, "time_s": when, "largest_gap_bytes": gap, "cwnd_min": min(windows),
                     "cwnd_max": max(windows)})
    correlation = None
    if len(paired) > 2:
        correlation = statistics.correlation([g for g, _ in paired], [t for _, t in paired])
        print(f"correlation of gap and time over {len(paired)} timed operations: {correlation:.2f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"command": command, "namespace": args.namespace, "op_bytes": args.op_bytes, "rows": rows,
                       "correlation": correlation}, out, indent=1)
    return child.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
