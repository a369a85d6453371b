"""Smoke run of ``redsrv bench allreduce`` as a user starts it: torchrun, two ranks on
127.0.0.1, two reducers. Checks that the JSON holds both implementations for every size with
positive figures and the nccl-tests arithmetic; speed is not judged (loopback). Skipped without torch.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import child_env

pytest.importorskip("torch")
pytestmark = [pytest.mark.torch, pytest.mark.timeout(120)]


def test_torchrun_two_ranks_two_reducers(procs, tmp_path):  # type: ignore[no-untyped-def]
    reducers = [procs.start_reducer() for _ in range(2)]
    out = tmp_path / "allreduce.json"
    run = procs.popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       "-m", "redsrv", "bench", "allreduce", "--reducers", ",".join(r.address for r in reducers),
                       "--sizes", "4KiB", "64KiB", "--reps", "2", "--warmup", "1", "--line-gbit", "10", "--timeout", "60",
                       "--json", str(out)],
                      cwd=tmp_path, env=child_env({"OMP_NUM_THREADS": "1"}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                      text=True)
    printed, _ = run.communicate(timeout=100)
    assert run.returncode == 0, printed
    doc = json.loads(out.read_text())
    assert doc["world_size"] == 2 and doc["reducers"] == [r.address for r in reducers]
    rows = {(r["size_bytes"], r["impl"]): r for r in doc["rows"]}
    assert set(rows) == {(kib * 1024, impl) for kib in (4, 64) for impl in ("gloo", "redsrv")}
    for (size, _impl), r in rows.items():
        assert r["reps"] == 2 and len(r["times_s"]) == 2 and min(r["times_s"]) > 0
        assert r["median_s"] > 0 and r["algbw_gbps"] == pytest.approx(size / r["median_s"] / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"])  # 2(n-1)/n = 1 at n=2
        assert 0 < r["nic_use"] == pytest.approx(r["algbw_gbps"] / 1.25)
    assert "redsrv" in printed and "speedup" in printed  # rank 0's table


def test_one_process_is_told_to_use_a_launcher(monkeypatch, capsys):  # type: ignore[no-untyped-def]
    from redsrv.cli import main

    for var in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID",
                "SLURM_NTASKS", "TF_CONFIG", "CLUSTER_SPEC"):
        monkeypatch.delenv(var, raising=False)
    assert main(["bench", "allreduce", "--reducers", "127.0.0.1:9", "--sizes-kib", "4"]) == 2
    assert "at least 2 ranks" in capsys.readouterr().err
