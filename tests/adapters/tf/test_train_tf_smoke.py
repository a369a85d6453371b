"""CI smoke run of ``redsrv bench train --framework tf``: 2 workers and 2 reducers at 1 Gbit/s, a
2M-parameter model, one round of a few steps.

Checks that TensorFlow's own cross-process step (``MultiWorkerMirroredStrategy``, ring) and the
``ReductionServerStrategy`` step train identically on every rank and to the same model, that the
raw block replays exactly what the strategy sent, that the rate limit is in force, and that the
cluster leaves no namespace or process behind. Speed is not judged here (theory is 1.0x at n=2);
the full comparison is a manual benchmark (docs/performance.md, "End-to-end training: JAX and
Keras"). Skipped without TensorFlow or where network namespaces cannot be created, as
tests/bench/test_train_smoke.py.
"""

from __future__ import annotations

import os

import pytest

from redsrv.bench.train import Options, run_train

from tests_support import check_fused_train_run, why_no_namespaces

pytest.importorskip("tensorflow")
pytest.importorskip("keras")
pytestmark = [pytest.mark.netns, pytest.mark.tf, pytest.mark.slow, pytest.mark.timeout(120)]

REASON = why_no_namespaces()


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_tf_two_workers_two_reducers_small_model(tmp_path):
    prefix = f"rstt{os.getpid() % 100000}"
    doc = run_train(Options(framework="tf", workers=2, reducers=2, rate_bps=10**9, params=2_000_000, steps=3, warmup=1,
                            rounds=1, out=str(tmp_path), prefix=prefix, quiet=True))
    check_fused_train_run(doc, "tf", prefix)
