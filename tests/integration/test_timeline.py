"""REDSRV_TIMELINE: a Chrome trace per rank with every operation and each chunk's phases."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import redsrv
from redsrv.core import chunker

pytestmark = pytest.mark.timeout(60)


def test_timeline_records_push_wait_pull_per_chunk(fleet, tmp_path) -> None:  # type: ignore[no-untyped-def]
    reducers = fleet(2)
    path = str(tmp_path / "trace-{rank}.json")

    def run(rank: int) -> None:
        with redsrv.Client([r.address for r in reducers], rank=rank, world_size=2, job="tl", timeline=path,
                           chunk_bytes=64 * 1024) as c:
            for step in range(3):
                c.allreduce(np.ones(100_000, np.float32), key=("step", step))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for rank in range(2):
        with open(tmp_path / f"trace-{rank}.json") as f:
            trace = json.load(f)
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        names = {e["name"] for e in spans}
        assert {"allreduce ('step', 0)", "allreduce ('step', 2)"} <= names
        # two reducers, 50,000 elements each: 8 KiB (2,048 elements), 16, 32, then 64 KiB chunks, and back
        chunks_per_op = 2 * len([2048, 4096, 8192, 10664, 10664, 8192, 4096, 2048])
        assert chunks_per_op == len(chunker.plan(100_000, 2, 16_384, 2048))
        for phase in ("push", "pull"):
            assert sum(1 for e in spans if e["name"] == f"{phase} ('step', 1)") == chunks_per_op
        assert all(e["pid"] == rank and e["dur"] >= 0 for e in spans)
        assert any(e["tid"].startswith("reducer 1 stream") for e in spans)
    from redsrv.core.timeline import merge

    assert merge([str(tmp_path / f"trace-{r}.json") for r in range(2)], str(tmp_path / "all.json")) > 0
