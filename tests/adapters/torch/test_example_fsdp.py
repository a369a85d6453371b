"""``examples/torch_fsdp.py`` as its docstring runs it: under torchrun on the redsrv backend, 5
steps twice through a distributed checkpoint end with the weights of 10 steps in one go (the
checkpoint carries the sharded weights and the optimizer's momentum). The reference runs on the
redsrv backend too: a gloo-backed run of the example aborted once at exit under load, in gloo's
own teardown ("terminate called without an active exception"), which is not what this tests;
test_dtensor.py compares FSDP2 and checkpoints with gloo bitwise."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("torch")

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(300)]


def torchrun(procs, args: list[str], env: dict[str, str], log: str) -> str:  # type: ignore[no-untyped-def]
    from conftest import child_env

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    with open(log, "w") as out:
        proc = procs.popen([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "redsrv.examples.torch_fsdp", *args],
                           env=child_env({**env, "OMP_NUM_THREADS": "1"}), stdout=out, stderr=subprocess.STDOUT)
        proc.wait(timeout=120)
    with open(log) as f:
        output = f.read()
    assert proc.returncode == 0, output[-4000:]
    return output


def test_fsdp_example_resumes_from_its_checkpoint_like_an_uninterrupted_run(procs, fleet, tmp_path) -> None:  # type: ignore[no-untyped-def]
    slack = {"REDSRV_HEARTBEAT_INTERVAL": "0.5", "REDSRV_HEARTBEAT_MISSES": "20"}
    reducers = [r.address for r in fleet(2, env=slack)]
    env = {**slack, "REDSRV_REDUCERS": ",".join(reducers), "REDSRV_JOB": "fsdp-example"}
    checkpoint = str(tmp_path / "checkpoint")
    torchrun(procs, ["--steps", "5", "--checkpoint", checkpoint], env, str(tmp_path / "first.log"))
    assert os.path.exists(os.path.join(checkpoint, ".metadata"))
    resumed = torchrun(procs, ["--steps", "5", "--checkpoint", checkpoint], env, str(tmp_path / "second.log"))
    whole = torchrun(procs, ["--steps", "10"], {**env, "REDSRV_JOB": "fsdp-example-whole"}, str(tmp_path / "whole.log"))
    ours = re.search(r"redsrv: weights sum (\S+)", resumed)
    theirs = re.search(r"redsrv: weights sum (\S+)", whole)
    assert ours and theirs, (resumed[-2000:], whole[-2000:])
    assert ours.group(1) == theirs.group(1)
