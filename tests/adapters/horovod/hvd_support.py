"""Starting and waiting for the worker processes of a Horovod-API test run."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

from conftest import ProcessTracker, child_env

#: Workers import torch or TensorFlow before their first collective (hvd.init()); on a loaded
#: machine one rank may start many seconds after another, longer than the tests' shrunk 20 s
#: operation timeout. Failures these tests look for arrive as errors at once, not as timeouts.
START_ENV = {"REDSRV_OP_TIMEOUT": "120"}


def start_ranks(tracker: ProcessTracker, n: int, reducers: list[str], job: str, prefix_of: Callable[[int], str],
                args_of: Callable[[str], list[str]], extra_env: dict[str, str] | None = None,
                ) -> tuple[list[subprocess.Popen], list[str]]:  # type: ignore[type-arg]
    """``n`` workers running ``python *args_of(prefix)``, each with its rank, the world size, the
    reducers and the job in its environment; output goes to ``prefix + ".err"``."""
    workers, prefixes = [], []
    for rank in range(n):
        prefix = prefix_of(rank)
        env = child_env({"REDSRV_REDUCERS": ",".join(reducers), "REDSRV_JOB": job, "RANK": str(rank), "WORLD_SIZE": str(n),
                         **START_ENV, **(extra_env or {})})
        err = open(prefix + ".err", "w")  # a file, not a pipe: a chatty child can never block
        tracker.files.append(err)
        workers.append(tracker.popen([sys.executable, *args_of(prefix)], env=env, stdout=err, stderr=subprocess.STDOUT))
        prefixes.append(prefix)
    return workers, prefixes


def wait_ranks(workers: list[subprocess.Popen], prefixes: list[str], timeout: float) -> None:  # type: ignore[type-arg]
    """Every worker exited 0 within ``timeout`` seconds, else an error showing its output."""
    deadline = time.monotonic() + timeout
    for proc, prefix in zip(workers, prefixes):
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker {prefix} still running after {timeout} s") from None
        if proc.returncode != 0:
            with open(prefix + ".err") as f:
                raise AssertionError(f"worker {prefix} exited with {proc.returncode}:\n{f.read()}")
