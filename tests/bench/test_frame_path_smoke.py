"""Smoke run of ``redsrv bench frame-path`` as a user starts it: both paths at two sizes, every
result checked by the command itself. The JSON must hold each (size, path) with frames and CPU
counted; speed is not judged. Skipped where the native plane is not built."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from redsrv.core import plane

from conftest import child_env

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(plane.native_unavailable() is not None, reason="the native plane is not built")]


def test_both_paths_at_two_sizes(procs, tmp_path):  # type: ignore[no-untyped-def]
    out = tmp_path / "frame-path.json"
    run = procs.popen([sys.executable, "-m", "redsrv", "bench", "frame-path", "--sizes", "64KiB", "1MiB", "--reps", "5",
                       "--rounds", "2", "--op", "mean", "--json", str(out)],
                      cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    printed, _ = run.communicate(timeout=100)
    assert run.returncode == 0, printed
    doc = json.loads(out.read_text())
    assert doc["op"] == "mean" and doc["command"].startswith("redsrv bench frame-path")
    rows = {(r["bytes"], r["path"]): r for r in doc["rows"]}
    assert set(rows) == {(size, path) for size in (64 << 10, 1 << 20) for path in ("receiver", "decoder")}
    for row in rows.values():
        assert len(row["rounds"]) == 2 and row["frames_per_op"] >= 1
        assert row["io_us_per_op"] > 0 and row["process_us_per_op"] > 0 and row["median_ms"] > 0
    assert "receiver" in printed and "decoder" in printed
