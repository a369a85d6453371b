"""Smoke runs of ``redsrv bench torch-ops`` (the per-operation comparison with gloo in
docs/torch_backend.md): it runs, every requested cell is measured and checked, and the JSON
holds the samples the table's medians come from; a wrong result makes it exit 1. And of
``redsrv bench fsdp``, FSDP2 steps on one host."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(300)]


def test_bench_torch_ops_smoke(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from conftest import child_env

    out = tmp_path / "ops.json"
    done = subprocess.run([sys.executable, "-m", "redsrv", "bench", "torch-ops", "--sizes", "4", "64",
                           "--ops", "send_recv", "all_gather_into_tensor", "--rounds", "1", "--json", str(out)],
                          env=child_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert [(r["op"], r["kib"]) for r in rows] == [("send_recv", 4), ("send_recv", 64),
                                                   ("all_gather_into_tensor", 4), ("all_gather_into_tensor", 64)]
    for row in rows:
        assert row["gloo_ms"] > 0 and row["redsrv_ms"] > 0 and row["ratio"] > 0 and row["control_ratio"] > 0, row
        assert len(row["samples_ms"]["redsrv"]) == len(row["samples_ms"]["gloo"]) == row["reps"], row
        assert set(row["wrong"]) >= {"gloo", "redsrv", "control"} and not any(row["wrong"].values()), row
    assert rows[2]["relay_ms"] is not None and rows[0]["relay_ms"] is None  # the relayed design, all-gather only
    table = done.stdout.splitlines()
    assert any(line.startswith("all_gather_into_tensor") and "64 KiB" in line for line in table), done.stdout


def test_bench_torch_ops_reports_a_wrong_result_and_exits_1(procs, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # A real wrong sum: a proxy flips one byte in the middle of a reducer's result (fault_proxy).
    # Through the reducers: the two workers share this host, where the group would otherwise
    # reduce in shared memory (docs/torch_backend.md, "One host").
    monkeypatch.setenv("REDSRV_HOST_REDUCE", "flat")
    from redsrv.bench import torch_ops
    from redsrv.cli.fleet import _Fleet

    from fault_proxy import Fault, FaultProxy

    reducer = procs.start_reducer()
    proxy = FaultProxy((reducer.host, reducer.port), Fault("corrupt", "reducer", "pull", reducer.proc.pid, {}))
    proxy.arm()
    try:
        status = torch_ops.run(workers=2, reducers=1, sizes_kib=[64], ops=["all_reduce"], rounds=1, json_path=None,
                               fleet=_Fleet([reducer.proc], [proxy.address]))
    finally:
        proxy.close()
    assert proxy.fault.fired_at is not None, "the proxy never corrupted a result"
    assert status == 1
    assert "WRONG RESULTS: all_reduce at 64 KiB through redsrv: 1 call(s)" in capsys.readouterr().err


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_balanced_orders_make_each_variant_follow_each_other_equally_often(k: int) -> None:
    from collections import Counter

    from redsrv.bench.torch_ops import balanced_orders

    orders = balanced_orders(k)
    assert len(orders) == (k if k % 2 == 0 else 2 * k)
    assert all(sorted(order) == list(range(k)) for order in orders)
    follows = Counter((a, b) for order in orders for a, b in zip(order, order[1:]))
    assert set(follows) == {(a, b) for a in range(k) for b in range(k) if a != b}
    assert len(set(follows.values())) == 1, follows
    positions = Counter((position, v) for order in orders for position, v in enumerate(order))
    assert len(set(positions.values())) == 1, positions


def test_bench_fsdp_smoke(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``redsrv bench fsdp`` trains both FSDP2 models, checks them against each other and reports
    every timed step; its layers are large enough to take the one-host shared-memory gathers."""
    from conftest import child_env

    out = tmp_path / "fsdp.json"
    done = subprocess.run([sys.executable, "-m", "redsrv", "bench", "fsdp", "--width", "1024", "--layers", "2",
                           "--steps", "2", "--rounds", "2", "--json", str(out)],
                          env=child_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["problems"] == []
    assert len(result["step_ms"]["gloo"]) == len(result["step_ms"]["redsrv"]) == 4  # 2 rounds x 2 steps
    assert result["ratio"] > 0 and len(result["ratios"]) == 2
    assert any(line.startswith("redsrv/gloo") for line in done.stdout.splitlines()), done.stdout
