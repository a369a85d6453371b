"""An elastic Horovod Keras training script (import changed, as a user's would be) for
test_hvd_keras_elastic.py, run under ``redsrv run -np 3 --min-np 2``: Horovod's pattern of
``KerasState``, the three state callbacks and ``fit(epochs=EPOCHS - state.epoch)`` in
``hvd.elastic.run``. A linear model trained with SGD and momentum; each step's batch is drawn from
(global step, rank), the global step being the optimizer's iteration count (part of the state).
Commits at every epoch end (STEPS_PER_EPOCH batches). The worker that is rank 2 of the first world
kills itself (SIGKILL) before step DOOMED_STEP, two steps past a commit. Rank 0 prints every step
it applied and the world size; every worker prints its final weights (float.hex, exact). A world
of 3 trains to at least TOTAL_EPOCHS epochs and at least 2 epochs after it formed."""

from __future__ import annotations

import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import redsrv.horovod.tensorflow.keras as hvd  # noqa: E402

STEPS_PER_EPOCH, TOTAL_EPOCHS, DOOMED_STEP, FINAL_SIZE, BATCH = 5, 6, 12, 3, 8
LIMIT_EPOCHS = 20_000  # a world of 2 that never grows fails the test instead of running forever


def batch(step: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step * 1000 + rank)
    x = rng.standard_normal((BATCH, 4)).astype(np.float32)
    # Noise the model cannot fit: the weights depend on exactly which batches were averaged when.
    y = (x.sum(axis=1, keepdims=True) + 0.5 + 0.5 * rng.standard_normal((BATCH, 1))).astype(np.float32)
    return x, y


def make_model() -> keras.Model:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    rng = np.random.default_rng(0)
    model.set_weights([rng.standard_normal((4, 1)).astype(np.float32), np.zeros(1, np.float32)])
    return model


def dataset(first_step: int, rank: int) -> tf.data.Dataset:
    def batches():  # type: ignore[no-untyped-def]
        step = first_step
        while True:
            yield batch(step, rank)
            step += 1

    spec = (tf.TensorSpec((BATCH, 4), tf.float32), tf.TensorSpec((BATCH, 1), tf.float32))
    return tf.data.Dataset.from_generator(batches, output_signature=spec)


class Doom(keras.callbacks.Callback):
    """Kill rank 2 of the first world of 3 before it runs DOOMED_STEP; rank 0 reports applied steps."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:  # type: ignore[type-arg]
        step = int(self.model.optimizer.iterations)
        if hvd.rank() == 2 and hvd.size() == 3 and step == DOOMED_STEP and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:  # type: ignore[type-arg]
        if hvd.rank() == 0:
            print("applied", int(self.model.optimizer.iterations) - 1, hvd.size(), flush=True)


def main() -> int:
    hvd.init()
    model = make_model()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.05, momentum=0.9))
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    # Doom first: it reports a step before the commit callback, which raises HostsUpdatedInterrupt
    # at a commit where a replacement waits, and would skip the report of a step that was applied.
    callbacks = [Doom(os.path.join(sys.argv[1], "killed")), hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=STEPS_PER_EPOCH)]

    @hvd.elastic.run
    def train(state: hvd.elastic.KerasState) -> None:
        # Every rank enters with the same (synced) epoch and size, so the same number of epochs.
        epochs = max(TOTAL_EPOCHS, state.epoch + 2) if hvd.size() == FINAL_SIZE else LIMIT_EPOCHS
        data = dataset(int(state.optimizer.iterations), hvd.rank())
        state.model.fit(data, steps_per_epoch=STEPS_PER_EPOCH, epochs=epochs - state.epoch, callbacks=callbacks,
                        shuffle=False, verbose=0)

    train(state)
    weights = [float(v).hex() for w in model.get_weights() for v in w.reshape(-1)]
    print("final", hvd.size(), int(optimizer.iterations), " ".join(weights), flush=True)
    return 0 if state.epoch < LIMIT_EPOCHS else 3


if __name__ == "__main__":
    sys.exit(main())
