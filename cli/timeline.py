"""``redsrv timeline``: merge the per-rank timelines (``REDSRV_TIMELINE``) into one file, and
optionally draw it as a PNG (the JSON opens in chrome://tracing or Perfetto)."""

from __future__ import annotations

import argparse
import json

from redsrv.core.timeline import merge

COLOURS = {"push": "#1f77b4", "wait": "#d3d3d3", "pull": "#2ca02c", "allreduce": "#ff7f0e"}


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("timeline", help="merge per-rank timelines and draw them",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="timeline files written by workers with REDSRV_TIMELINE")
    p.add_argument("-o", "--output", required=True, help="merged Chrome-trace JSON to write")
    p.add_argument("--png", help="also draw the merged timeline to this PNG (needs matplotlib)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    count = merge(args.files, args.output)
    print(f"wrote {args.output}: {count} events from {len(args.files)} file(s); open it in chrome://tracing or Perfetto")
    if args.png:
        draw(args.output, args.png)
        print(f"wrote {args.png}")
    return 0


def draw(trace_path: str, png_path: str) -> None:
    """A Gantt chart of the trace: one row per (rank, track), spans coloured by phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    if not events:
        raise SystemExit("the timeline has no events")
    origin = min(e["ts"] for e in events)
    rows = sorted({(e["pid"], str(e["tid"])) for e in events}, key=lambda r: (r[0], r[1] != "operations", r[1]))
    index = {row: i for i, row in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.5))
    for e in events:
        phase = e["name"].split(" ", 1)[0]
        ax.barh(index[(e["pid"], str(e["tid"]))], e["dur"] / 1000, left=(e["ts"] - origin) / 1000, height=0.7,
                color=COLOURS.get(phase, "#9467bd"), edgecolor="none")
    ax.set_yticks(range(len(rows)), [f"rank {pid}: {tid}" for pid, tid in rows])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper right", ncol=4)
    ax.set_title("redsrv timeline: each all-reduce, and each chunk's push, wait and pull per reducer stream")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
