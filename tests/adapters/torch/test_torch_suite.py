"""A representative subset of PyTorch's own backend suite (``DistributedTest._DistTestBase``)
against the redsrv backend, through ``dist_suite.py`` (the launcher the full run uses too:
``tox -e torch-suite``, docs/torch_backend.md). One test per operation family the backend
routes differently: reductions with every op (reducers), point-to-point with tags and any
source, gather, scatter and all-gather (peer links), subgroup destruction and DDP."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("expecttest")  # torch's test utilities import it

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(420)]

LAUNCHER = os.path.join(os.path.dirname(__file__), "dist_suite.py")
SUBSET = ["test_all_reduce_max", "test_all_reduce_product", "test_all_reduce_sum_complex", "test_reduce_full_group_min",
          "test_reduce_sum_twice", "test_send_recv_with_tag", "test_send_recv_any_source", "test_isend", "test_irecv",
          "test_scatter_checks", "test_gather_checks", "test_all_gather_coalesced_simple", "test_destroy_group",
          "test_broadcast_full_group", "test_barrier_full_group", "test_DistributedDataParallelCPU"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_suite_subset_passes(world_size: int, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from conftest import child_env

    report_file = tmp_path / "suite.json"
    args = [sys.executable, LAUNCHER, "--backend", "redsrv", "--world-size", str(world_size), "--report", str(report_file)]
    for name in SUBSET:
        args += ["-k", name]
    env = child_env({"REDSRV_HEARTBEAT_INTERVAL": "0.5", "REDSRV_HEARTBEAT_MISSES": "20"})
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=400)
    summary = re.search(r"SUITE .* passed=(\d+) failed=(\d+) skipped=(\d+)", done.stdout)
    assert summary, f"no summary line:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, f"{summary.group(0)}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    report = json.loads(report_file.read_text())
    missing = [name for name in SUBSET if name not in report["passed"]]
    assert not missing, f"named tests that did not pass: {missing} ({summary.group(0)})"
    assert not report["failed"], report["failed"]
    # The reductions reached the reducers, and the point-to-point tests the peer links.
    assert report["routes"]["test_all_reduce_max"] == "reducers", report["routes"]
    assert report["routes"]["test_send_recv_with_tag"] == "peer_links", report["routes"]
