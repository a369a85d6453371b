"""CI smoke run of ``redsrv bench train``: 2 workers and 2 reducers at 1 Gbit/s, a 2M-parameter
model, two rounds of a few steps.

Checks that both models train identically on every rank and that the hook-trained model equals
the gloo-trained one, that the raw block replays exactly the buckets DDP handed the hook, that
the rate limit is in force, and that the cluster leaves no namespace or process behind. Speed is
not judged here (theory is 1.0x at n=2); the full comparison is a manual benchmark
(docs/performance.md, "End-to-end: DDP training steps"). Skipped without torch or where network namespaces cannot be created.
"""

from __future__ import annotations

import os

import pytest

from redsrv.bench.netns import our_namespaces
from redsrv.bench.train import MODES, Options, run_train

from tests_support import check_train_blocks, why_no_namespaces

pytest.importorskip("torch")
pytestmark = [pytest.mark.netns, pytest.mark.torch, pytest.mark.timeout(120)]

REASON = why_no_namespaces()


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_two_workers_two_reducers_small_model(tmp_path):
    prefix = f"rstr{os.getpid() % 100000}"
    doc = run_train(Options(workers=2, reducers=2, rate_bps=10**9, params=2_000_000, steps=3, warmup=1, rounds=2,
                            out=str(tmp_path), prefix=prefix, quiet=True))
    assert os.path.exists(doc["json"])
    check_train_blocks(doc, prefix, rounds=2)
    model = doc["model"]
    assert sum(numel for numel, _ in model["buckets"]) == model["params"]
    assert model["grad_bytes"] == 4 * model["params"]
    assert doc["ok"] and doc["summary"]["correct"]
    rows = {r["mode"]: r for r in doc["summary"]["rows"]}
    assert rows.keys() == set(MODES)
    # Gradients cannot cross a 1 Gbit/s link faster than the link allows: the emulation is on.
    for mode in ("hook", "raw"):
        assert rows[mode]["grad_gbps"] <= doc["goodput_gbps"] * 1.05, rows[mode]
    assert doc["summary"]["speedup"] > 0 and doc["summary"]["overhead"] is not None


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_without_the_baseline_every_block_is_still_checked_against_a_computed_reference(tmp_path):
    prefix = f"rstn{os.getpid() % 100000}"
    doc = run_train(Options(workers=2, reducers=2, rate_bps=10**9, params=2_000_000, steps=2, warmup=1, rounds=1,
                            baseline=False, out=str(tmp_path), prefix=prefix, quiet=True))
    assert our_namespaces(prefix) == [], "namespaces left behind"
    blocks = {b["mode"]: b for b in doc["blocks"]}
    assert set(blocks) == set(MODES) - {"gloo"}
    hook = blocks["hook"]["checks"][0]  # rank 0's: the reference replay runs there
    assert "hook_vs_gloo" not in hook and hook["vs_reference"]["match"] and hook["vs_reference"]["moved"] > 0, hook
    assert all(c["match"] for c in blocks["compute"]["checks"]), blocks["compute"]["checks"]
    assert doc["ok"]
