"""Failures reach the training loop: ``backward()`` raises redsrv's error within the timeout
plus 2 s instead of hanging (DDP never times out a hook's future), and nothing is left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(180)]

WORKER = os.path.join(os.path.dirname(__file__), "fault_worker.py")
OP_TIMEOUT = 2.0
#: RELIABILITY R2: a killed reducer makes every connected worker raise within ~2 s.
LOST_BOUND = 2.0


def test_backward_raises_on_timeout_and_on_a_reducer_killed_mid_step(procs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from conftest import child_env
    from tests_support import poll, wait_for_open_operations

    # A short stall warning is how the test learns that the step's buckets reached the reducer.
    timeout_reducer, killed_reducer = procs.start_reducer(), procs.start_reducer(env={"REDSRV_STALL_WARNING": "0.05"})
    prefix = str(tmp_path / "fault")
    spec = {"timeout_reducer": timeout_reducer.address, "killed_reducer": killed_reducer.address, "op_timeout": OP_TIMEOUT}
    log = open(prefix + ".log", "w")
    procs.files.append(log)
    worker = procs.popen([sys.executable, WORKER, json.dumps(spec), prefix], env=child_env(), stdout=log,
                         stderr=subprocess.STDOUT)

    def waiting() -> bool:
        assert worker.poll() is None, f"worker exited early: {open(prefix + '.log').read()[-3000:]}"
        return os.path.exists(prefix + ".waiting")

    poll(waiting, 120, "the worker reaching the second scenario")
    wait_for_open_operations(killed_reducer.log, 1)  # the step's buckets wait there for rank 1
    killed_at = time.time()
    killed_reducer.signal(signal.SIGKILL)

    try:
        worker.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError("worker still running 60 s after the reducer was killed: backward() hung") from None
    assert worker.returncode == 0, open(prefix + ".log").read()[-3000:]
    with open(prefix + ".json") as f:
        report = json.load(f)

    timed_out = report["timeout"]
    assert timed_out["error"] is not None, "backward() returned although rank 1 never contributed"
    assert "PeerTimeoutError" in timed_out["error"] and "fault-timeout" in timed_out["error"], timed_out["error"]
    took = timed_out["raised"] - timed_out["started"]
    assert OP_TIMEOUT - 0.5 <= took <= OP_TIMEOUT + 2.0, f"timeout raised after {took:.2f}s (op_timeout {OP_TIMEOUT}s)"

    killed = report["killed"]
    assert killed["error"] is not None, "backward() returned although the reducer was killed"
    assert killed["started"] < killed_at, "the step began after the kill: not a mid-step failure"
    assert "PeerLostError" in killed["error"] and killed_reducer.address in killed["error"], killed["error"]
    took = killed["raised"] - killed_at
    assert took <= LOST_BOUND, f"backward() raised {took:.2f}s after the reducer was killed (bound {LOST_BOUND}s)"

    after = report["after"]
    assert after["error"] is not None and after["raised"] - after["started"] < 1.0, (
        f"the step after the failure must fail at once, got {after}")
    assert "PeerLostError" in after["error"], after["error"]
