"""``redsrv soak --framework torch``: DDP training with the redsrv hook rides through reducers
killed, stopped and frozen at random (RELIABILITY R19, R22), and its oracle sees every gradient
bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(300)]

#: Seed 9's schedule (cli/soak_ddp.py: uniform(0.5, 1.5) x interval, kinds in shuffled threes)
#: starts with a reducer killed about 8 s into training, then a freeze.
SEED = 9


def soak_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDSRV_")}
    # Recovery on, with a window short enough that a hang (window + 30 s of silence) is caught
    # well inside the test's own timeout; still six times the 5 s freeze.
    env.update({"PYTHONUNBUFFERED": "1", "REDSRV_RECONNECT_WINDOW": "30"})
    return env


def test_ddp_soak_rides_through_reducer_faults_with_exact_gradients(procs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    report_path = tmp_path / "soak.json"
    soak = procs.popen([sys.executable, "-m", "redsrv", "soak", "--framework", "torch", "--duration", "35",
                        "--workers", "3", "--reducers", "2", "--fault-interval", "8", "--seed", str(SEED),
                        "--json", str(report_path), "--log-dir", str(tmp_path / "logs")],
                       env=soak_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = soak.communicate(timeout=240)
    assert soak.returncode == 0, out[-4000:]
    report = json.loads(report_path.read_text())
    assert report["steps_completed"] > 50, out[-4000:]
    assert report["failed_steps"] == 0, report["failures"]
    assert report["wrong_steps"] == 0, report["wrong_details"]
    assert report["param_checks"] > 0 and report["param_mismatches"] == []
    assert report["hangs"] == [] and report["crashes"] == []
    assert report["generations"] == 1
    first = report["fault_log"][0]
    assert first["kind"] == "kill_reducer", report["fault_log"]
    assert first["recovery_s"] is not None, "every worker should have completed a step started after the kill"
    assert report["recovery_by_kind"]["kill_reducer"]["recovered"] >= 1
    for name, rss in report["rss"].items():
        assert rss["start_mib"] > 0 and rss["last_mib"] > 0, name
