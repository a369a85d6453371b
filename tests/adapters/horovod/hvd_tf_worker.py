"""One rank of a TensorFlow/Keras Horovod-API test run: ``python hvd_tf_worker.py OUT_PREFIX``
(rank, size and reducers in the environment). Saves inputs and results (``.npz``) and facts
(``.json``); the test recomputes the results with NumPy/TensorFlow alone."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import redsrv.horovod.keras as hvd_keras  # noqa: E402
import redsrv.horovod.tensorflow as hvd  # noqa: E402


def make(rank: int, tag: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + tag)
    values = rng.integers(-3, 4, size=shape)
    if dtype.startswith("float"):
        values = values + rng.random(shape).round(2)
    return values.astype(dtype)


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 5)).astype("float32")
    return x, np.sin(x.sum(axis=1, keepdims=True))


def make_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])


def ops(out: dict[str, np.ndarray], facts: dict[str, object]) -> None:
    r, n = hvd.rank(), hvd.size()
    for dtype in ("float32", "float64", "int32"):
        x = make(r, 1, (3, 4), dtype)
        out[f"in.{dtype}"] = x
        for name, op in (("sum", hvd.Sum), ("avg", hvd.Average), ("min", hvd.Min), ("max", hvd.Max), ("prod", hvd.Product)):
            out[f"allreduce.{dtype}.{name}"] = hvd.allreduce(tf.constant(x), op=op, name=f"{dtype}.{name}").numpy()

    @tf.function
    def graph_step(t: tf.Tensor) -> tf.Tensor:
        return hvd.allreduce(t, op=hvd.Sum) + hvd.broadcast(t, root_rank=1)

    x = make(r, 2, (4,), "float64")
    out["in.x"] = x
    out["graph.0"], out["graph.1"] = graph_step(tf.constant(x)).numpy(), graph_step(tf.constant(2 * x)).numpy()
    z = make(r, 3, (r + 1, 2), "float32")
    out["in.z"] = z
    out["allgather"] = hvd.allgather(tf.constant(z)).numpy()
    t = make(r, 4, (3, 2), "float32")  # rank 0 sends 1 row to rank 0 and 2 to rank 1; rank 1 the same
    out["in.t"] = t
    received, counts = hvd.alltoall(tf.constant(t), splits=[1, 2])
    out["alltoall"], out["alltoall.splits"] = received.numpy(), counts.numpy()
    s = make(r, 5, (5, 2), "float64")
    out["in.s"] = s
    out["reducescatter"] = hvd.reducescatter(tf.constant(s), op=hvd.Sum).numpy()
    g = [make(r, 6, (2,), "float32"), make(r, 7, (3, 1), "float64")]
    out["in.g0"], out["in.g1"] = g
    out["grouped.0"], out["grouped.1"] = (v.numpy() for v in hvd.grouped_allreduce([tf.constant(a) for a in g], op=hvd.Sum))
    out["keras.allreduce"] = hvd_keras.allreduce(x, average=False)
    out["fp16"] = hvd.allreduce(tf.constant(make(r, 8, (6,), "float32")), op=hvd.Sum, compression=hvd.Compression.fp16).numpy()
    out["in.fp16"] = make(r, 8, (6,), "float32")
    v = tf.Variable(make(r, 9, (3,), "float32"))
    hvd.broadcast_variables([v], root_rank=1)
    out["in.v"], out["broadcast_variables"] = make(r, 9, (3,), "float32"), v.numpy()
    w = tf.Variable(make(r, 10, (3,), "float64"))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(hvd.allreduce(w, op=hvd.Sum) * tf.constant([1.0, 2.0, 3.0], tf.float64))
    out["grad.allreduce"] = tape.gradient(loss, w).numpy()
    facts["objects"] = [hvd.broadcast_object({"from": r}, root_rank=1), hvd.allgather_object(r)]
    facts["basics"] = [r, n, hvd.local_rank(), hvd.local_size()]
    try:
        hvd.allreduce(tf.ones(r + 2), name="mismatch")
        facts["error"] = None
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        facts["error"] = [c.__name__ for c in type(exc).__mro__]


def tape_training(out: dict[str, np.ndarray]) -> None:
    r = hvd.rank()
    x, y = data()
    model = make_model(seed=0)
    opt = keras.optimizers.SGD(learning_rate=0.1)
    xs, ys = tf.constant(x[8 * r : 8 * r + 8]), tf.constant(y[8 * r : 8 * r + 8])

    @tf.function
    def step() -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xs) - ys))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    for _ in range(3):
        step()
    for i, v in enumerate(model.trainable_variables):
        out[f"tape.{i}"] = v.numpy()


def keras_fit(out: dict[str, np.ndarray], facts: dict[str, object]) -> None:
    r = hvd.rank()
    x, y = data()
    model = make_model(seed=0 if r == 0 else 50 + r)  # the callback makes rank 0's weights everyone's
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.05, momentum=0.9))
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    history = model.fit(x[8 * r : 8 * r + 8], y[8 * r : 8 * r + 8], batch_size=4, epochs=3, shuffle=False, verbose=0,
                        callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
                                   hvd_keras.callbacks.MetricAverageCallback()])
    facts["fit.loss"] = history.history["loss"]
    facts["fit.class"] = [type(model.optimizer).__name__, isinstance(model.optimizer, keras.optimizers.SGD)]
    for i, v in enumerate(model.trainable_variables):
        out[f"fit.{i}"] = np.asarray(v.numpy())
    warm = make_model(seed=0)
    warm.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.4)), loss="mse",
                 jit_compile=False)
    history = warm.fit(x[8 * r : 8 * r + 8], y[8 * r : 8 * r + 8], batch_size=4, epochs=3, shuffle=False, verbose=0,
                       callbacks=[hvd_keras.callbacks.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2)])
    facts["warmup.lr"] = history.history["lr"]
    stairs = make_model(seed=0)
    stairs.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.3)), loss="mse",
                   jit_compile=False)
    schedule = hvd_keras.callbacks.LearningRateScheduleCallback(initial_lr=0.4, multiplier=0.5, start_epoch=1)
    history = stairs.fit(x[8 * r : 8 * r + 8], y[8 * r : 8 * r + 8], batch_size=4, epochs=3, shuffle=False, verbose=0,
                         callbacks=[schedule])
    facts["schedule.lr"] = history.history["lr"]


def main() -> None:
    prefix = sys.argv[1]
    hvd.init()
    out: dict[str, np.ndarray] = {}
    facts: dict[str, object] = {}
    ops(out, facts)
    tape_training(out)
    keras_fit(out, facts)
    np.savez(prefix + ".npz", **out)
    with open(prefix + ".json", "w") as f:
        json.dump(facts, f)
    hvd.shutdown()


if __name__ == "__main__":
    main()
