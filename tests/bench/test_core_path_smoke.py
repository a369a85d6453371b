"""Smoke run of ``redsrv bench core-path`` as a user starts it, on both planes: every result
piece is checked by the command itself. The JSON must hold the figures per chunk; speed is not
judged, but the frame counts follow from the protocol and are: one RESULT frame per piece per
rank, and one SAFE per rank for each chunk once every rank acknowledged it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from redsrv.core import plane

from conftest import child_env

pytestmark = pytest.mark.timeout(120)

PLANES = ["python"] + ([] if plane.native_unavailable() is not None else ["native"])


@pytest.mark.parametrize("data_plane", PLANES)
def test_three_ranks_two_pieces_a_chunk(procs, tmp_path, data_plane):  # type: ignore[no-untyped-def]
    out = tmp_path / "core-path.json"
    run = procs.popen([sys.executable, "-m", "redsrv", "bench", "core-path", "--world", "3", "--chunk-kib", "16KiB",
                       "--piece-kib", "8", "--chunks", "50", "--rounds", "2", "--data-plane", data_plane, "--json", str(out)],
                      cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    printed, _ = run.communicate(timeout=100)
    assert run.returncode == 0, printed
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("redsrv bench core-path") and doc["plane"] == data_plane
    assert doc["world"] == 3 and doc["chunk_bytes"] == 16 << 10 and doc["piece_bytes"] == 8 << 10
    assert len(doc["rounds"]) == 2 and doc["us_per_chunk"] > 0 and doc["calls_per_chunk"] > 10
    for row in doc["rounds"]:
        assert row["results_per_chunk"] == 2 * 3 and row["safes_per_chunk"] == 3
    assert "every sum checked" in printed


def test_a_piece_larger_than_the_chunk_is_refused(procs, tmp_path):  # type: ignore[no-untyped-def]
    run = procs.popen([sys.executable, "-m", "redsrv", "bench", "core-path", "--chunk-kib", "8", "--piece-kib", "16"],
                      cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    printed, _ = run.communicate(timeout=100)
    assert run.returncode == 2 and "--piece-kib" in printed
