"""CI smoke run of ``redsrv bench train --framework jax``: 2 workers and 2 reducers at 1 Gbit/s, a
2M-parameter model, one round of a few steps.

Checks that JAX's own cross-process step (gloo through ``jax.distributed``) and the redsrv step
train identically on every rank and to the same model, that the raw block replays exactly the
vectors ``redsrv.jax.pmean`` sends, that the rate limit is in force, and that the cluster leaves
no namespace or process behind. Speed is not judged here (theory is 1.0x at n=2); the full
comparison is a manual benchmark (docs/performance.md, "End-to-end training: JAX and Keras").
Skipped without JAX or where network namespaces cannot be created, as tests/bench/test_train_smoke.py.
"""

from __future__ import annotations

import os

import psutil
import pytest

from redsrv.bench.netns import our_namespaces
from redsrv.bench.train import MODES, Options, run_train

from tests_support import why_no_namespaces

pytest.importorskip("jax")
pytestmark = [pytest.mark.netns, pytest.mark.jax, pytest.mark.slow, pytest.mark.timeout(120)]

REASON = why_no_namespaces()


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_jax_two_workers_two_reducers_small_model(tmp_path):
    prefix = f"rstj{os.getpid() % 100000}"
    doc = run_train(Options(framework="jax", workers=2, reducers=2, rate_bps=10**9, params=2_000_000, steps=3, warmup=1,
                            rounds=1, out=str(tmp_path), prefix=prefix, quiet=True))
    assert our_namespaces(prefix) == [], "namespaces left behind"
    children = [c for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]
    assert not children, f"processes left behind: {[c.cmdline() for c in children]}"
    blocks = doc["blocks"]
    assert [(b["round"], b["mode"]) for b in blocks] == [(0, m) for m in MODES]
    for b in blocks:
        assert b["correct"], f"{b['mode']}: {b['checks']}"
        assert len(b["times"]) == 3 and all(t > 0 for t in b["times"])
    gloo_checks = [c for b in blocks if b["mode"] == "gloo" for c in b["checks"]]
    assert all(c["ranks_identical"] for c in gloo_checks), gloo_checks
    hook_checks = [c for b in blocks if b["mode"] == "hook" for c in b["checks"]]
    assert all(c["ranks_identical"] and c["match"] and c["moved"] > 0 for c in hook_checks), hook_checks
    model = doc["model"]
    assert model["buckets"] == [[model["params"], "float32"]]  # one fused float32 vector
    assert model["grad_bytes"] == 4 * model["params"]
    assert doc["ok"] and doc["summary"]["correct"] and doc["summary"]["framework"] == "jax"
    assert doc["machine"]["jax"]
    rows = {r["mode"]: r for r in doc["summary"]["rows"]}
    assert rows.keys() == set(MODES)
    for mode in ("gloo", "hook", "raw"):
        assert rows[mode]["grad_gbps"] <= doc["goodput_gbps"] * 1.05, rows[mode]
    assert doc["summary"]["speedup"] > 0
