"""DDP on CUDA tensors with the redsrv hook, against DDP over gloo on the same device (both
ranks share one GPU, as a one-GPU machine allows). Skipped without CUDA: CI has no GPU, so this
runs where one is lent (docs/torch_backend.md, "CUDA tensors", has the figures and command).

The hook stages each bucket through a pinned host buffer on a side stream (``_CudaStaging`` in
adapters/torch.py). At world size 2 a sum has one order and halving is exact, so the final
parameters must equal gloo's bitwise. NCCL is tried too, for the step-time comparison; it
refuses two ranks on one GPU, which the test reports rather than fails on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(400),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

WORKER = os.path.join(os.path.dirname(__file__), "cuda_worker.py")
WORLD_SIZE = 2
RUN_TIMEOUT = 240.0
SHAPE = {"width": 1024, "layers": 6, "steps": 12}  # ~24 MiB of float32 gradients: one or two DDP buckets


def launch(procs, path: str, tmp: str, reducers: list[str]) -> list[dict]:  # type: ignore[no-untyped-def,type-arg]
    from conftest import child_env
    from tests_support import wait_all, worker_results

    os.makedirs(tmp)
    prefixes, workers = [], []
    for rank in range(WORLD_SIZE):
        spec = {"rank": rank, "world_size": WORLD_SIZE, "path": path, "device": 0, "store": os.path.join(tmp, "store"),
                "reducers": reducers, "job": f"cuda-{path}", **SHAPE}
        prefix = os.path.join(tmp, f"rank{rank}")
        log = open(prefix + ".log", "w")
        procs.files.append(log)
        workers.append(procs.popen([sys.executable, WORKER, json.dumps(spec), prefix], env=child_env(
            {"REDSRV_HEARTBEAT_INTERVAL": "0.5", "REDSRV_HEARTBEAT_MISSES": "20"}), stdout=log, stderr=subprocess.STDOUT))
        prefixes.append(prefix)
    wait_all(workers, RUN_TIMEOUT)
    reports = []
    for prefix in prefixes:
        _, report = worker_results(prefix, arrays=False)
        if report["error"] is None:
            with np.load(prefix + ".npz") as data:
                report["params"] = data["params"]
        reports.append(report)
    return reports


def test_ddp_on_cuda_with_the_redsrv_hook_equals_gloo(procs, fleet, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    reducers = [r.address for r in fleet(2, env={"REDSRV_HEARTBEAT_INTERVAL": "0.5", "REDSRV_HEARTBEAT_MISSES": "20"})]
    ours = launch(procs, "redsrv", str(tmp_path / "redsrv"), reducers)
    unstaged = launch(procs, "redsrv-unstaged", str(tmp_path / "unstaged"), reducers)
    gloo = launch(procs, "gloo", str(tmp_path / "gloo"), reducers)
    nccl = launch(procs, "nccl", str(tmp_path / "nccl"), reducers)
    for rank in range(WORLD_SIZE):
        for run in (ours, unstaged, gloo):
            assert run[rank]["error"] is None, run[rank]["error"]
        assert ours[rank]["pinned_buffers"] and all(ours[rank]["pinned_buffers"]), ours[rank]
        assert ours[rank]["params"].tobytes() == gloo[rank]["params"].tobytes(), f"rank {rank} differs from gloo"
        assert unstaged[rank]["params"].tobytes() == gloo[rank]["params"].tobytes(), f"rank {rank} (unstaged) differs"
    line = (f"\nDDP on CUDA, 2 ranks on one GPU, {ours[0]['gradient_mib']:.0f} MiB of gradients, median step: "
            f"redsrv hook {ours[0]['step_ms_median']:.1f} ms (staged through a blocking copy: "
            f"{unstaged[0]['step_ms_median']:.1f} ms), gloo {gloo[0]['step_ms_median']:.1f} ms")
    if nccl[0]["error"] is None:
        line += f", nccl {nccl[0]['step_ms_median']:.1f} ms"
    else:
        line += f"; nccl: {nccl[0]['error'].strip().splitlines()[-1][:200]}"
    with capsys.disabled():
        print(line)
