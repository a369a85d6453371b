"""Horovod elastic training for Keras (``redsrv.horovod.tensorflow.keras.elastic``) under
``redsrv run -np 3 --min-np 2 --max-np 3``, as test_hvd_elastic.py does for PyTorch: one of three
workers is killed (SIGKILL) inside ``model.fit`` two steps past a commit; the other two get the
failed collective out of ``fit`` (TensorFlow's error, turned back into HorovodInternalError by
``run``), restore that commit, re-form as a world of 2 and carry on; a replacement joins at a
commit of that world; training ends in a world of 3. The final weights equal a single-process
reference that applies the same schedule of sizes (each step's gradient the average over that
step's ranks' batches)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import child_env
from tests_support import elastic_outcome

tf = pytest.importorskip("tensorflow")

sys.path.insert(0, os.path.dirname(__file__))
import hvd_keras_elastic_worker as script  # noqa: E402 - the worker's own batches and model, for the reference

pytestmark = [pytest.mark.tf, pytest.mark.slow, pytest.mark.timeout(420)]


def reference(schedule: dict[int, int]) -> list[float]:
    """One process applying step s with the average of ranks 0..schedule[s]-1's gradients,
    computed as Keras's training step computes them (a traced tape over the compiled loss)."""
    import keras

    model = script.make_model()
    optimizer = keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    optimizer.build(model.trainable_variables)

    @tf.function
    def gradients(x, y):  # type: ignore[no-untyped-def]
        with tf.GradientTape() as tape:
            prediction = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=prediction)
        return tape.gradient(loss, model.trainable_variables)

    for step in range(len(schedule)):
        per_rank = [[g.numpy() for g in gradients(*script.batch(step, rank))] for rank in range(schedule[step])]
        averaged = []
        for index in range(len(per_rank[0])):
            total = per_rank[0][index]
            for other in per_rank[1:]:
                total = total + other[index]  # rank order, as the reducers add
            averaged.append(total / np.float32(len(per_rank)))
        optimizer.apply(averaged, model.trainable_variables)
    return [float(v) for w in model.get_weights() for v in w.reshape(-1)]


def test_a_worker_killed_inside_fit_is_survived_replaced_and_the_weights_match_the_schedule(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {**child_env(), "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run([sys.executable, "-m", "redsrv", "run", "-np", "3", "--min-np", "2", "--max-np", "3",
                             sys.executable, script.__file__, str(tmp_path)], env=env, capture_output=True,
                            text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "worker w2" in result.stderr and "exited with status -9" in result.stderr  # the one killed
    schedule, finals = elastic_outcome(result.stdout)
    sizes = [schedule[s] for s in range(len(schedule))]
    assert sizes[-2 * script.STEPS_PER_EPOCH:] == [3] * (2 * script.STEPS_PER_EPOCH)
    weights = finals["[w0]"][2:]
    got = [float.fromhex(w) for w in weights]
    # Bit for bit: the reducers add the float32 gradients in rank order and divide by the size, as
    # the reference does, and both compute a rank's gradient with the same traced ops.
    assert got == reference(schedule)
    assert got != reference({step: 3 for step in schedule})  # the reference does see the world of 2


def test_run_turns_a_collective_failure_inside_a_tf_function_back_into_horovod_internal_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside ``fit`` a failed collective reaches Python as TensorFlow's UnknownError; ``run``
    must give the loop HorovodInternalError (which, outside an elastic run, propagates), and
    leave every other TensorFlow error as it was."""
    from redsrv.adapters.horovod import common
    from redsrv.horovod.tensorflow import elastic

    def failing_step(error: BaseException):  # type: ignore[no-untyped-def]
        def host(x):  # type: ignore[no-untyped-def]
            raise error

        @tf.function
        def step():  # type: ignore[no-untyped-def]
            return tf.numpy_function(host, [tf.constant(1.0)], tf.float32, stateful=True)

        return lambda state: step()

    for name in list(os.environ):  # one rank without reducers: run syncs the state first
        if name.startswith("REDSRV_") or name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            monkeypatch.delenv(name)
    common.init()
    try:
        state = elastic.TensorFlowState([tf.Variable([1.0, 2.0])])
        with pytest.raises(common.HorovodInternalError, match="peer w1 lost"):
            elastic.run(failing_step(common.HorovodInternalError("peer w1 lost")))(state)
        with pytest.raises(tf.errors.OpError) as caught:
            elastic.run(failing_step(KeyError("not a collective")))(state)
        assert not isinstance(caught.value, common.HorovodInternalError)
    finally:
        common.shutdown()


def test_the_callbacks_track_batch_and_epoch_and_commit_where_horovod_does() -> None:
    """One process, no elastic driver: a commit only saves. Five steps per epoch, a commit every
    two batches (counted across epochs) and at each epoch end; the state's batch and epoch as Horovod's callbacks set them,
    and a restore returns the model to the last commit."""
    import keras

    from redsrv.horovod.keras import elastic

    model = script.make_model()
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05), loss="mse", jit_compile=False)
    state = elastic.KerasState(model, batch=0, epoch=1)
    commits = []

    class Recorded(elastic.CommitStateCallback):
        def on_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
            if self.batches_remaining == 1:
                commits.append(("batch", state.batch, int(state.optimizer.iterations)))
            super().on_batch_end(batch, logs)

        def on_epoch_end(self, epoch, logs=None):  # type: ignore[no-untyped-def]
            commits.append(("epoch", state.epoch, int(state.optimizer.iterations)))
            super().on_epoch_end(epoch, logs)

    x, y = script.batch(0, 0)
    callbacks = [elastic.UpdateEpochStateCallback(state), elastic.UpdateBatchStateCallback(state), Recorded(state, 2)]
    model.fit(np.tile(x, (5, 1)), np.tile(y, (5, 1)), batch_size=script.BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=callbacks)
    # The batch count runs on across epochs (reset only when fit starts), as in Horovod.
    assert commits == [("batch", 1, 2), ("batch", 3, 4), ("epoch", 2, 5), ("batch", 0, 6), ("batch", 2, 8),
                       ("batch", 4, 10), ("epoch", 3, 10)]
    assert (state.epoch, state.batch) == (3, 0)
    committed = [w.copy() for w in model.get_weights()]
    model.fit(x, y, batch_size=script.BATCH, epochs=1, shuffle=False, verbose=0)
    assert int(state.optimizer.iterations) == 11
    state.restore()
    assert int(state.optimizer.iterations) == 10
    for now, then in zip(model.get_weights(), committed):
        np.testing.assert_array_equal(now, then)
