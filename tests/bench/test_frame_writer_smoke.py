"""Smoke run of ``redsrv bench frame-writer`` as a user starts it: every batch's bytes are checked
by the command itself; speed is not judged. The JSON holds one row per size, with the batch that
fitted the socket buffer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from redsrv.core import plane

from conftest import child_env

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(plane.native_unavailable() is not None, reason="the native plane is not built")]


def test_both_writers_per_size(procs, tmp_path):  # type: ignore[no-untyped-def]
    out = tmp_path / "frame-writer.json"
    run = procs.popen([sys.executable, "-m", "redsrv", "bench", "frame-writer", "--sizes", "0", "1MiB", "--reps", "3",
                       "--json", str(out)],
                      cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    printed, _ = run.communicate(timeout=100)
    assert run.returncode == 0, printed
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("redsrv bench frame-writer")
    assert [row["payload_bytes"] for row in doc["rows"]] == [0, 1 << 20]
    assert doc["rows"][0]["batch"] == 200 and doc["rows"][1]["batch"] == 2  # 3 MiB holds two frames of 1 MiB
    for row in doc["rows"]:
        assert row["python_us_per_frame"] > 0 and row["native_us_per_frame"] > 0
