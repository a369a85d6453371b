"""A Horovod Keras training script (Keras 3 on TensorFlow); the import is the only redsrv line.

    redsrv run -np 2 python examples/horovod_keras.py
    python examples/horovod_keras.py                      # one process, no reducers

Horovod's recipe: learning rate scaled by the number of workers, a shard of the data per worker,
``DistributedOptimizer``, initial variables broadcast from rank 0, metrics averaged over
workers, and a gradual learning-rate warmup. With ``--warmup-epochs 0``, W workers with batch
size B follow the same trajectory as one process with batch size W x B and the same scaled
rate given with ``--lr`` times W (the printed checksum shows it).
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import redsrv.horovod.keras as hvd  # noqa: E402  (was: import horovod.keras as hvd)


def synthetic_dataset(samples: int = 512) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1234)
    x = rng.standard_normal((samples, 20)).astype("float32")
    labels = (x[:, :4].argmax(axis=1) + (x[:, 4] > 1)) % 4
    return x, labels.astype("int64")


def main() -> None:
    parser = argparse.ArgumentParser(description="Horovod Keras example on synthetic data")
    parser.add_argument("--batch-size", type=int, default=16, help="batch size per worker")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate for one worker (scaled by the worker count)")
    parser.add_argument("--warmup-epochs", type=int, default=1)
    args = parser.parse_args()

    hvd.init()
    keras.utils.set_random_seed(42)

    x, y = synthetic_dataset()
    x, y = x[hvd.rank() :: hvd.size()], y[hvd.rank() :: hvd.size()]  # this worker's shard

    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(4)])
    scaled_lr = args.lr * hvd.size()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=scaled_lr, momentum=0.5))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),  # every worker starts from rank 0's weights
        hvd.callbacks.MetricAverageCallback(),  # epoch logs averaged over the workers
    ]
    if args.warmup_epochs:
        callbacks.append(hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=args.warmup_epochs,
                                                                  verbose=1))
    history = model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, shuffle=False, callbacks=callbacks,
                        verbose=0)
    checksum = sum(float(np.abs(np.asarray(v)).astype("float64").sum()) for v in model.trainable_variables)
    if hvd.rank() == 0:
        for epoch, (loss, accuracy) in enumerate(zip(history.history["loss"], history.history["accuracy"]), 1):
            print(f"epoch {epoch}: loss {loss:.4f} accuracy {accuracy:.3f}", flush=True)
        print(f"parameter checksum {checksum:.10f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
