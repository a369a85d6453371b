"""One rank of the tf-keras (Keras 2) Horovod-API test run: ``python hvd_keras2_worker.py OUT_PREFIX``
with ``TF_USE_LEGACY_KERAS=1`` (rank, size and reducers in the environment). Trains a linear model
with ``hvd.DistributedOptimizer(backward_passes_per_step=2)`` through ``model.fit``, for a
new-style and an ``optimizers.legacy`` SGD, and saves each rank's data and results (``.npz``) and
facts (``.json``); the test recomputes the training by hand with NumPy."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from hvd_results import save  # noqa: E402

import redsrv.horovod.tensorflow.keras as hvd  # noqa: E402

#: Five batches of BATCH rows per rank: two reduce-and-apply cycles, and a fifth step left aggregated.
STEPS, BATCH, LR = 5, 4, 0.1
KERNEL0, BIAS0 = 0.5, 0.1


def data(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    x = rng.standard_normal((STEPS * BATCH, 3)).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3 + rank).astype("float32")


def fit(optimizer: tf.keras.optimizers.Optimizer, x: np.ndarray, y: np.ndarray, average: bool,
        out: dict[str, np.ndarray], facts: dict[str, object], tag: str) -> None:
    opt = hvd.DistributedOptimizer(optimizer, backward_passes_per_step=2, average_aggregated_gradients=average)
    model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(3,),
                                                       kernel_initializer=tf.keras.initializers.Constant(KERNEL0),
                                                       bias_initializer=tf.keras.initializers.Constant(BIAS0))])
    model.compile(optimizer=opt, loss="mse")
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    out[f"{tag}.kernel"], out[f"{tag}.bias"] = (np.asarray(w) for w in model.get_weights())
    facts[f"{tag}.iterations"] = int(opt.iterations.numpy())
    facts[f"{tag}.counter"] = int(opt._agg_helper.counter.numpy())
    facts[f"{tag}.class"] = [type(opt).__name__, isinstance(opt, type(optimizer))]
    facts[f"{tag}.callback_is_tf_keras"] = isinstance(callback, __import__("tf_keras").callbacks.Callback)
    config = opt.get_config()
    facts[f"{tag}.config_round_trip"] = type(opt).from_config(config).get_config() == config


def partial(x: np.ndarray, y: np.ndarray, rank: int, out: dict[str, np.ndarray]) -> None:
    """The first layer local (``PartialDistributedOptimizer``): its gradients stay this rank's."""
    init = tf.keras.initializers.Constant(0.1 * (rank + 1))
    model = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(3,), kernel_initializer=init, bias_initializer=init),
                                 tf.keras.layers.Dense(1, kernel_initializer=init, bias_initializer=init)])
    opt = hvd.PartialDistributedOptimizer(tf.keras.optimizers.SGD(learning_rate=LR), local_layers=model.layers[0])
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    own = tape.gradient(loss, model.trainable_weights)
    got = [g for g, _ in opt._compute_gradients(loss, model.trainable_weights, tape=tape)]
    for i, (o, g) in enumerate(zip(own, got)):
        out[f"partial.own.{i}"], out[f"partial.got.{i}"] = o.numpy(), g.numpy()


def main() -> None:
    prefix = sys.argv[1]
    hvd.init()
    out: dict[str, np.ndarray] = {}
    facts: dict[str, object] = {"keras": tf.keras.__name__}
    x, y = data(hvd.rank())
    out["x"], out["y"] = x, y
    fit(tf.keras.optimizers.SGD(learning_rate=LR), x, y, True, out, facts, "sgd")
    fit(tf.keras.optimizers.legacy.SGD(learning_rate=LR), x, y, False, out, facts, "legacy")
    partial(x, y, hvd.rank(), out)
    save(prefix, out, facts)
    hvd.shutdown()


if __name__ == "__main__":
    main()
