"""torchrun's elastic restarts on the redsrv backend (docs/torch_backend.md, "torchrun restarts").

``torchrun --nnodes 1 --nproc-per-node 3 --max-restarts 2`` runs ``elastic_worker.py``; rank 1
of the first attempt SIGKILLs itself mid-training. The other ranks' reductions then fail (the
reducers see the rank go), torchrun ends the group and starts three new processes, which rejoin
the same reducers under the same job and resume from the script's checkpoint. The run must end
well, after exactly one restart, with the weights of the same training run that nobody
interrupted (bitwise: the same reductions in the same rank order).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("torch")

import torch  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(300)]

WORKER = os.path.join(os.path.dirname(__file__), "elastic_worker.py")
STEPS = 12
KILL_AT = 5
RUN_TIMEOUT = 120.0


def torchrun(procs, reducers: list[str], folder: str, kill_at: int) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def,type-arg]
    from conftest import child_env

    os.makedirs(folder)
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    env = child_env({"REDSRV_REDUCERS": ",".join(reducers), "REDSRV_JOB": f"elastic-{os.path.basename(folder)}",
                     "REDSRV_HEARTBEAT_INTERVAL": "0.5", "REDSRV_HEARTBEAT_MISSES": "20", "OMP_NUM_THREADS": "1"})
    log = open(os.path.join(folder, "torchrun.log"), "w")
    procs.files.append(log)
    proc = procs.popen([torchrun, "--standalone", "--nnodes", "1", "--nproc-per-node", "3", "--max-restarts", "2",
                        "--monitor-interval", "0.2", WORKER, folder, str(STEPS), str(kill_at)],
                       env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        proc.wait(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        pass  # the return code below says so; the fixture ends it
    with open(os.path.join(folder, "torchrun.log")) as f:
        output = f.read()
    return subprocess.CompletedProcess(proc.args, proc.returncode, output, "")


def lines(folder: str, rank: int) -> list[dict]:  # type: ignore[type-arg]
    with open(os.path.join(folder, f"rank{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_a_killed_worker_is_restarted_and_training_resumes_from_the_checkpoint(procs, fleet, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    reducers = [r.address for r in fleet(2, env={"REDSRV_HEARTBEAT_INTERVAL": "0.5", "REDSRV_HEARTBEAT_MISSES": "20"})]
    reference = torchrun(procs, reducers, str(tmp_path / "reference"), -1)
    assert reference.returncode == 0, reference.stdout[-4000:]
    run = torchrun(procs, reducers, str(tmp_path / "killed"), KILL_AT)
    assert run.returncode == 0, run.stdout[-4000:]

    folder = str(tmp_path / "killed")
    rank1 = lines(folder, 1)
    killed = next(line for line in rank1 if "killed" in line)
    assert killed["step"] == KILL_AT
    for rank in range(3):
        steps = [(line["restart"], line["step"]) for line in lines(folder, rank) if "step" in line and "restart" in line]
        restarts = sorted({r for r, _ in steps})
        assert restarts == [0, 1], f"rank {rank} ran in attempts {restarts}"
        resumed = [s for r, s in steps if r == 1]
        # The new attempt starts after the last checkpointed step and ends the training.
        assert resumed[0] <= KILL_AT and resumed[-1] == STEPS - 1, f"rank {rank}: {steps}"
    first_good = min(line["time"] for line in lines(folder, 0) if line.get("restart") == 1)
    with capsys.disabled():
        print(f"\ntorchrun restart on the redsrv backend: {first_good - killed['killed']:.1f}s from the kill to the "
              "first good step")

    weights = torch.load(os.path.join(folder, "final.pt"))
    expected = torch.load(str(tmp_path / "reference" / "final.pt"))
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), f"{name} differs from the uninterrupted run"
