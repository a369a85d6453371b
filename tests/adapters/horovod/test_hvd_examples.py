"""The Horovod example scripts under ``redsrv run -np 2`` follow the trajectory of one process
on the global batch (batch and learning rate times two), and print with rank prefixes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import child_env

sys.path.insert(0, os.path.dirname(__file__))
from hvd_support import START_ENV  # noqa: E402

pytest.importorskip("torch")

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples")
CHECKSUM = re.compile(r"parameter checksum (\d+\.\d+)")


def run(args: list[str]) -> str:
    result = subprocess.run(args, env=child_env(START_ENV), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_torch_example_under_redsrv_run_equals_one_process_on_the_global_batch() -> None:
    script = os.path.join(EXAMPLES, "horovod_torch.py")
    distributed = run([sys.executable, "-m", "redsrv", "run", "-np", "2", sys.executable, script, "--epochs", "2"])
    single = run([sys.executable, script, "--epochs", "2", "--batch-size", "32", "--lr", "0.02"])
    assert "[0] epoch 2: loss" in distributed
    got, expected = float(CHECKSUM.search(distributed).group(1)), float(CHECKSUM.search(single).group(1))
    # float32; only the order of additions differs (two half-batch means, then their mean)
    assert got == pytest.approx(expected, rel=1e-6)
