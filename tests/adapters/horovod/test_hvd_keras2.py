"""``redsrv.horovod.tensorflow.keras`` under tf-keras (Keras 2, ``TF_USE_LEGACY_KERAS=1``) on two
worker processes: ``DistributedOptimizer(backward_passes_per_step=2)`` in ``model.fit`` against the
same schedule computed by hand with NumPy (gradients summed locally for two steps, averaged over
the ranks, applied every second step only). The tests' names hold ``tf_keras``, which the
``tf-keras2`` tox env selects; they skip where tf-keras is not installed."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("tf_keras")

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "hvd_keras2_worker.py")
sys.path.insert(0, HERE)

from hvd_keras2_worker import BATCH, BIAS0, KERNEL0, LR, STEPS  # noqa: E402
from hvd_support import run_worker_ranks  # noqa: E402

N = 2
#: float32 training against a float64 schedule over five steps
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def run(tmp_path_factory):  # type: ignore[no-untyped-def]
    yield from run_worker_ranks(tmp_path_factory.mktemp("hvd-keras2"), N, "hvd-keras2", WORKER,
                                {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "1"})


def by_hand(results: list[dict[str, np.ndarray]], average_aggregated_gradients: bool) -> tuple[np.ndarray, np.ndarray]:
    """Horovod's local aggregation with backward_passes_per_step=2 and op=Average, for a Dense(1)
    layer under mean squared error and plain SGD."""
    kernel, bias = np.full((3, 1), KERNEL0), np.full((1,), BIAS0)
    acc = [(np.zeros_like(kernel), np.zeros_like(bias)) for _ in results]
    for step in range(STEPS):
        for rank, r in enumerate(results):
            x, y = (r[k][step * BATCH:(step + 1) * BATCH].astype(np.float64) for k in ("x", "y"))
            err = x @ kernel + bias - y
            acc[rank] = (acc[rank][0] + 2 * x.T @ err / BATCH, acc[rank][1] + 2 * err.sum(axis=0) / BATCH)
        if (step + 1) % 2 == 0:
            divisor = N * (2 if average_aggregated_gradients else 1)
            kernel = kernel - LR * sum(a[0] for a in acc) / divisor
            bias = bias - LR * sum(a[1] for a in acc) / divisor
            acc = [(np.zeros_like(kernel), np.zeros_like(bias)) for _ in results]
    return kernel, bias


@pytest.mark.parametrize(("tag", "average"), [("sgd", True), ("legacy", False)])
def test_tf_keras_backward_passes_per_step_equals_the_schedule_by_hand(run, tag: str, average: bool) -> None:  # type: ignore[no-untyped-def]
    results, facts = run
    kernel, bias = by_hand(results, average)
    for r, f in zip(results, facts):
        np.testing.assert_allclose(r[f"{tag}.kernel"], kernel, **TOLERANCE)
        np.testing.assert_allclose(r[f"{tag}.bias"], bias, **TOLERANCE)
        assert f[f"{tag}.iterations"] == STEPS  # every step counts, applied or not
        assert f[f"{tag}.counter"] == STEPS % 2  # the fifth step's gradients wait for a sixth


def test_tf_keras_optimizer_and_callbacks_are_keras_2_ones(run) -> None:  # type: ignore[no-untyped-def]
    _, facts = run
    for f in facts:
        assert f["keras"].startswith("tf_keras")
        for tag in ("sgd", "legacy"):
            assert f[f"{tag}.class"] == ["SGD", True]
            assert f[f"{tag}.callback_is_tf_keras"]
            assert f[f"{tag}.config_round_trip"]


def test_tf_keras_schedule_by_hand_is_not_the_unaggregated_one(run) -> None:  # type: ignore[no-untyped-def]
    # The oracle itself: averaging the aggregated sums or not gives different weights here.
    results, _ = run
    assert not np.allclose(by_hand(results, True)[0], by_hand(results, False)[0])


def test_tf_keras_partial_distributed_optimizer_keeps_local_layers_gradients(run) -> None:  # type: ignore[no-untyped-def]
    results, _ = run
    for r in results:
        for i in range(4):  # the local layer's kernel and bias, then the reduced layer's
            own, got = r[f"partial.own.{i}"], r[f"partial.got.{i}"]
            expected = own / N if i < 2 else sum(q[f"partial.own.{i}"] for q in results) / N
            np.testing.assert_allclose(got, expected, **TOLERANCE)
    assert not np.allclose(results[0]["partial.own.0"], results[1]["partial.own.0"])  # the ranks' own differ
