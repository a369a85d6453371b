"""``redsrv.horovod.tensorflow`` and ``redsrv.horovod.keras`` on two worker processes, against
NumPy and single-process TensorFlow/Keras (one run of ``hvd_tf_worker.py`` holds every check)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "hvd_tf_worker.py")
sys.path.insert(0, HERE)

from hvd_support import IMPLEMENTATION, START_ENV, assert_reexported, implementation_modules, run_worker_ranks  # noqa: E402
from hvd_tf_worker import data, make_model  # noqa: E402

N = 2



def test_the_public_tf_and_keras_paths_reexport_the_implementation() -> None:
    # test_public_paths.py checks every module; this env (tox -e tf) runs only this file.
    modules = [m for m in implementation_modules() if m.startswith((IMPLEMENTATION + ".tensorflow", IMPLEMENTATION + ".keras"))]
    assert len(modules) >= 4
    for module in modules:
        assert_reexported(module)

@pytest.fixture(scope="module")
def run(tmp_path_factory):  # type: ignore[no-untyped-def]
    yield from run_worker_ranks(tmp_path_factory.mktemp("hvd-tf"), N, "hvd-tf", WORKER, {"TF_CPP_MIN_LOG_LEVEL": "2"})


def in_order(arrays: list[np.ndarray], op: str) -> np.ndarray:
    total = arrays[0].copy()
    for a in arrays[1:]:
        total = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op](total, a)
    return total


def test_collectives_on_tensors(run) -> None:  # type: ignore[no-untyped-def]
    results, facts = run
    for dtype in ("float32", "float64", "int32"):
        xs = [r[f"in.{dtype}"] for r in results]
        for op in ("sum", "min", "max", "prod"):
            for r in results:
                np.testing.assert_array_equal(r[f"allreduce.{dtype}.{op}"], in_order(xs, op))
        average = in_order(xs, "sum") // N if dtype == "int32" else in_order(xs, "sum") / N
        for r in results:
            np.testing.assert_array_equal(r[f"allreduce.{dtype}.avg"], average)
    x = [r["in.x"] for r in results]
    for rank, r in enumerate(results):
        np.testing.assert_array_equal(r["graph.0"], x[0] + x[1] + x[1])  # sum, plus rank 1's value
        np.testing.assert_array_equal(r["graph.1"], 2 * (x[0] + x[1]) + 2 * x[1])  # keys taken at run time
        np.testing.assert_array_equal(r["allgather"], np.concatenate([s["in.z"] for s in results]))
        start = 0 if rank == 0 else 1
        np.testing.assert_array_equal(r["alltoall"], np.concatenate([s["in.t"][start : start + rank + 1] for s in results]))
        assert r["alltoall.splits"].tolist() == [rank + 1] * N
        total = in_order([s["in.s"] for s in results], "sum")
        np.testing.assert_array_equal(r["reducescatter"], total[:3] if rank == 0 else total[3:])
        for i in range(2):
            np.testing.assert_array_equal(r[f"grouped.{i}"], in_order([s[f"in.g{i}"] for s in results], "sum"))
        np.testing.assert_array_equal(r["keras.allreduce"], x[0] + x[1])
        np.testing.assert_allclose(r["fp16"], in_order([s["in.fp16"] for s in results], "sum"), rtol=2e-3, atol=1e-2)
        np.testing.assert_array_equal(r["broadcast_variables"], results[1]["in.v"])
        np.testing.assert_array_equal(r["grad.allreduce"], N * np.array([1.0, 2.0, 3.0]))
    for rank, f in enumerate(facts):
        assert f["objects"] == [{"from": 1}, [0, 1]]
        assert f["basics"] == [rank, N, rank, N]



def test_ranks_that_disagree_raise_failed_precondition_as_horovods_ops_do(run) -> None:  # type: ignore[no-untyped-def]
    """Horovod's TensorFlow ops report ranks that disagree (shape, dtype, root rank) as
    ``tf.errors.FailedPreconditionError`` (its status PRECONDITION_ERROR), eagerly and in graphs;
    so does redsrv.horovod, with redsrv's own error as the oracle: eagerly it is the cause, and
    in every mode its message is the error's."""
    results, facts = run
    for f in facts:
        for mode in ("eager.shape", "eager.dtype", "eager.root", "function.shape", "function.root", "session.shape"):
            error = f[f"error.{mode}"]
            assert error is not None, mode
            assert error["types"][:3] == ["FailedPreconditionError", "OpError", "Exception"], (mode, error["types"])
            if mode.startswith("eager"):
                assert "HorovodInternalError" in error["cause"] and "ContributionMismatchError" in error["cause"], mode
                assert error["message"] == error["cause.message"], mode
        assert "ranks disagree" in f["error.eager.shape"]["message"]  # float32[2] against float32[3]
        # in a graph the message is the same redsrv error's (job, rank and key named)
        for mode in ("function.shape", "function.root", "session.shape"):
            message = f[f"error.{mode}"]["message"]
            assert "ranks disagree" in message and "job='hvd-tf'" in message and "key=" in message, (mode, message)
    for r in results:  # the ranks still agree on the collectives that follow
        np.testing.assert_array_equal(r["after.disagreements"], [3.0, 6.0])


def test_query_ops_read_the_running_process(run) -> None:  # type: ignore[no-untyped-def]
    _, facts = run
    for rank, f in enumerate(facts):
        rank_, size_, local_rank, local_size = f["basics"]  # hvd.rank(), hvd.size(), ... : the oracle
        expected = [rank_, local_rank, size_, local_size, 1]
        assert f["queries.eager"] == expected
        # traced before hvd.init(), run after it; 99 is no process set: Horovod's code -3
        assert f["queries.traced"] == [*expected, -3, -3]
        assert f["queries.set"] == [1, int(rank == N - 1)]  # the set [N - 1]: its size, this rank in it
        assert f["queries.removed"] == -3
        assert "process_set_id must be an int" in f["queries.type_error"]


def test_collectives_in_a_tf1_session(run) -> None:  # type: ignore[no-untyped-def]
    results, _ = run
    xs, ys = [r["in.v1.x"] for r in results], [r["in.v1.y"] for r in results]
    for rank, r in enumerate(results):
        expected = [in_order(xs, "sum"), np.concatenate(ys), ys[1], in_order(xs, "max"), [rank]]
        np.testing.assert_array_equal(r["v1.all"], np.concatenate([np.ravel(e) for e in expected]).astype(np.float32))
        np.testing.assert_array_equal(r["v1.root"], ys[1])
        np.testing.assert_array_equal(r["v1.summed"], in_order(xs, "sum"))


def test_distributed_gradient_tape_equals_global_batch(run) -> None:  # type: ignore[no-untyped-def]
    results, _ = run
    x, y = data()
    model = make_model(seed=0)
    opt = keras.optimizers.SGD(learning_rate=0.1)
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    for r in results:
        for i, v in enumerate(model.trainable_variables):
            np.testing.assert_allclose(r[f"tape.{i}"], v.numpy(), rtol=1e-5, atol=1e-6)  # float32, other summation order


def test_keras_partial_distributed_optimizer_keeps_local_layers_gradients(run) -> None:  # type: ignore[no-untyped-def]
    # SGD with learning rate 1: the step is the gradient used. The first layer is local: its own
    # gradient divided by the ranks (Horovod's scale_local_gradients); the others' average.
    results, _ = run
    for r in results:
        for i in range(4):
            own = r[f"partial.own.{i}"]
            expected = own / N if i < 2 else sum(q[f"partial.own.{i}"] for q in results) / N
            np.testing.assert_allclose(r[f"partial.step.{i}"], expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(results[0]["partial.own.0"], results[1]["partial.own.0"])


def test_keras_fit_equals_global_batch_and_callbacks(run) -> None:  # type: ignore[no-untyped-def]
    results, facts = run
    x, y = data()
    # one process on the global batch: step k sees rank 0's and rank 1's k-th batches of 4
    order = np.concatenate([np.r_[4 * k : 4 * k + 4, 8 + 4 * k : 8 + 4 * k + 4] for k in range(2)])
    model = make_model(seed=0)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9), loss="mse", jit_compile=False)
    model.fit(x[order], y[order], batch_size=8, epochs=3, shuffle=False, verbose=0)
    for r in results:
        for i, v in enumerate(model.trainable_variables):
            np.testing.assert_allclose(r[f"fit.{i}"], v.numpy(), rtol=1e-5, atol=1e-6)
    assert facts[0]["fit.loss"] == facts[1]["fit.loss"]  # MetricAverageCallback: the same logs everywhere
    assert all(f["fit.class"] == ["SGD", True] for f in facts)
    # warmup over 2 epochs from 0.4 / N to 0.4, then left alone
    expected = [0.4 / N * ((e + 1) * (N - 1) / 2 + 1) for e in range(2)] + [0.4]
    for f in facts:
        np.testing.assert_allclose(f["warmup.lr"], expected, rtol=1e-6)
        # staircase from epoch 1: 0.4 * 0.5 ** (epoch - 1); epoch 0 keeps the compiled 0.3
        np.testing.assert_allclose(f["schedule.lr"], [0.3, 0.4, 0.2], rtol=1e-6)


def test_keras_example_under_redsrv_run_equals_one_process_on_the_global_batch() -> None:
    import re

    from conftest import child_env

    script = os.path.join(HERE, "..", "..", "..", "examples", "horovod_keras.py")

    def checksum(args: list[str]) -> float:
        result = subprocess.run(args, env=child_env({"TF_CPP_MIN_LOG_LEVEL": "2", **START_ENV}), capture_output=True, text=True,
                                timeout=240)
        assert result.returncode == 0, result.stdout + result.stderr
        return float(re.search(r"parameter checksum (\d+\.\d+)", result.stdout).group(1))

    distributed = checksum([sys.executable, "-m", "redsrv", "run", "-np", "2", sys.executable, script, "--epochs", "2",
                            "--warmup-epochs", "0"])
    single = checksum([sys.executable, script, "--epochs", "2", "--warmup-epochs", "0", "--batch-size", "32", "--lr", "0.02"])
    assert distributed == pytest.approx(single, rel=1e-6)  # float32, other summation order
