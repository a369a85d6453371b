"""DDP rides through a reducer killed and restarted on its address, or frozen and resumed
(RELIABILITY R22), with no change to the training script: every step completes and the final
parameters are bitwise those of the same training with no fault. And the public way to replace a
hook's client when reconnects are off."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(240)]

WORKER = os.path.join(os.path.dirname(__file__), "ddp_recovery_worker.py")
WORLD = 3
STEPS = 40
CONFIG = {"reconnect_window": 30.0, "heartbeat_interval": 0.2, "heartbeat_misses": 5, "op_timeout": 60.0}


def progress(prefix: str) -> tuple[str, int] | None:
    try:
        with open(prefix + ".progress") as f:
            run, step = f.read().split()
    except (OSError, ValueError):
        return None
    return run, int(step)


def train_through(procs, tmp_path, fault) -> list[dict]:  # type: ignore[no-untyped-def,type-arg]
    from conftest import child_env

    reducers = [procs.start_reducer() for _ in range(2)]
    workers, prefixes = [], []
    for rank in range(WORLD):
        prefix = str(tmp_path / f"rank{rank}")
        spec = {"rank": rank, "world_size": WORLD, "reducers": [r.address for r in reducers],
                "store": str(tmp_path / "store"), "steps": STEPS, "config": CONFIG}
        log = open(prefix + ".log", "w")
        procs.files.append(log)
        workers.append(procs.popen([sys.executable, WORKER, json.dumps(spec), prefix], env=child_env(), stdout=log,
                                   stderr=subprocess.STDOUT))
        prefixes.append(prefix)
    from tests_support import poll

    deadline = time.monotonic() + 150

    def faulted_run_under_way() -> bool:
        assert all(w.poll() is None for w in workers), [open(p + ".log").read()[-2000:] for p in prefixes]
        run, step = progress(prefixes[0]) or ("", -1)
        return run == "faulted" and step >= 5

    poll(faulted_run_under_way, 150, "rank 0 at step 5 of the faulted run")
    fault(procs, reducers)
    for worker in workers:
        worker.wait(timeout=max(1.0, deadline - time.monotonic()))
    reports = []
    for prefix in prefixes:
        with open(prefix + ".json") as f:
            reports.append(json.load(f))
        with open(prefix + ".log") as f:
            assert "reconnected to reducer" in f.read(), "the fault never reached this rank's training"
    return reports


def test_ddp_rides_through_a_reducer_killed_and_restarted(procs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    def kill_and_restart(procs, reducers) -> None:  # type: ignore[no-untyped-def]
        reducers[0].signal(signal.SIGKILL)
        reducers[0].proc.wait(10)
        procs.restart_reducer(reducers[0])

    for report in train_through(procs, tmp_path, kill_and_restart):
        assert report["error"] is None, report["error"]
        assert report["equal"], f"rank {report['rank']}: the faulted training differs from the clean one"


def test_ddp_rides_through_a_reducer_frozen_and_resumed(procs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    def freeze(procs, reducers) -> None:  # type: ignore[no-untyped-def]
        reducers[0].signal(signal.SIGSTOP)
        time.sleep(1.5)  # noqa: TID251 - the length of the freeze (past the 1 s heartbeat bound), not a synchronisation
        reducers[0].signal(signal.SIGCONT)

    for report in train_through(procs, tmp_path, freeze):
        assert report["error"] is None, report["error"]
        assert report["equal"], f"rank {report['rank']}: the faulted training differs from the clean one"


def test_a_broken_hook_client_is_replaced_publicly_and_training_goes_on(procs) -> None:  # type: ignore[no-untyped-def]
    import numpy as np

    import redsrv
    import redsrv.torch

    reducer = procs.start_reducer()
    state = redsrv.torch.HookState([reducer.address], rank=0, world_size=1, job="replace", reconnect_window=0.0,
                                   op_timeout=10.0)
    try:
        assert state.client.allreduce(np.ones(4, np.float32)).tolist() == [1.0] * 4
        reducer.signal(signal.SIGKILL)
        reducer.proc.wait(10)
        with pytest.raises(redsrv.PeerLostError):
            state.client.allreduce(np.ones(4, np.float32))
        restarted = procs.restart_reducer(reducer)
        old = state.client
        state.replace_client()
        assert state.client is not old and old._closed and state.client.config == old.config
        assert state.client.allreduce(np.ones(4, np.float32)).tolist() == [1.0] * 4
        assert restarted.address == reducer.address
    finally:
        state.close()
