"""One rank of a TensorFlow/Keras Horovod-API test run: ``python hvd_tf_worker.py OUT_PREFIX``
(rank, size and reducers in the environment). Saves inputs and results (``.npz``) and facts
(``.json``); the test recomputes the results with NumPy/TensorFlow alone."""

from __future__ import annotations

import os
import sys
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from hvd_results import save  # noqa: E402

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
    disagreements(out, facts)


def _error(call: Any) -> dict[str, object] | None:
    """The exception ``call()`` raised: its classes, message and cause (``None`` if it did not)."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        cause = exc.__cause__
        return {"types": [c.__name__ for c in type(exc).__mro__], "message": getattr(exc, "message", str(exc)),
                "cause": None if cause is None else [c.__name__ for c in type(cause).__mro__],
                "cause.message": None if cause is None else str(cause)}
    return None


def disagreements(out: dict[str, np.ndarray], facts: dict[str, object]) -> None:
    """Ranks that disagree (shape, dtype, root rank), eagerly, in a ``tf.function`` and in a
    TensorFlow 1 session; then a collective that agrees, which must still be right."""
    r = hvd.rank()
    shape = lambda: hvd.allreduce(tf.ones(r + 2), name="mismatch")  # noqa: E731
    dtype = lambda: hvd.allreduce(tf.ones(3, tf.float32 if r == 0 else tf.int32), name="dtype")  # noqa: E731
    root = lambda: hvd.broadcast(tf.ones(3), root_rank=r, name="root")  # noqa: E731
    facts["error.eager.shape"], facts["error.eager.dtype"], facts["error.eager.root"] = _error(shape), _error(dtype), _error(root)
    facts["error.function.shape"] = _error(tf.function(shape))
    facts["error.function.root"] = _error(tf.function(root))

    def session() -> None:
        with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
            sess.run(hvd.allreduce(tf.ones(r + 2), name="mismatch.v1"))

    facts["error.session.shape"] = _error(session)
    out["after.disagreements"] = hvd.allreduce(tf.constant([1.0, 2.0]) * (r + 1), op=hvd.Sum).numpy()


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


def keras_partial(out: dict[str, np.ndarray]) -> None:
    """A Keras 3 ``PartialDistributedOptimizer`` whose first layer is local: one SGD step from
    the same weights on each rank's own batch; the gradients are saved for the test's check."""
    r = hvd.rank()
    x, y = data()
    model = make_model(seed=0)
    opt = hvd_keras.PartialDistributedOptimizer(keras.optimizers.SGD(learning_rate=1.0), local_layers=model.layers[0])
    xs, ys = tf.constant(x[8 * r : 8 * r + 8]), tf.constant(y[8 * r : 8 * r + 8])
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(xs) - ys))
    grads = tape.gradient(loss, model.trainable_variables)
    before = [v.numpy() for v in model.trainable_variables]
    opt.apply_gradients(zip(grads, model.trainable_variables))
    for i, (g, b, v) in enumerate(zip(grads, before, model.trainable_variables)):
        out[f"partial.own.{i}"], out[f"partial.step.{i}"] = g.numpy(), b - v.numpy()


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


def query_ops() -> tf.types.experimental.ConcreteFunction:
    """The ``*_op`` queries in a function traced before ``hvd.init()``: run after it, it must
    read the values of the running process (Horovod's ops are evaluated at run time)."""
    def queries() -> tf.Tensor:
        return tf.stack([hvd.rank_op(), hvd.local_rank_op(), hvd.size_op(), hvd.local_size_op(),
                         hvd.process_set_included_op(), hvd.size_op(process_set_id=99),
                         hvd.process_set_included_op(process_set_id=99)])

    return tf.function(queries).get_concrete_function()


def queries(traced: tf.types.experimental.ConcreteFunction, facts: dict[str, object]) -> None:
    facts["queries.traced"] = traced().numpy().tolist()
    facts["queries.eager"] = [int(op().numpy()) for op in (hvd.rank_op, hvd.local_rank_op, hvd.size_op,
                                                              hvd.local_size_op, hvd.process_set_included_op)]
    last = hvd.add_process_set([hvd.size() - 1])
    included = tf.function(lambda: tf.stack([hvd.size_op(process_set_id=last.process_set_id),
                                              hvd.process_set_included_op(process_set_id=last.process_set_id)]))
    facts["queries.set"] = included().numpy().tolist()
    set_id = last.process_set_id
    hvd.remove_process_set(last)
    facts["queries.removed"] = int(hvd.size_op(process_set_id=set_id).numpy())
    try:
        hvd.size_op(process_set_id=last)  # type: ignore[arg-type] - the set itself, not its id
        facts["queries.type_error"] = None
    except TypeError as exc:
        facts["queries.type_error"] = str(exc)


def v1_session(out: dict[str, np.ndarray]) -> None:
    """Collectives in a TensorFlow 1 graph run by a ``tf.compat.v1.Session``: several independent
    ones fetched together, and one fetched alone after another built later."""
    r = hvd.rank()
    x, y = make(r, 11, (5,), "float32"), make(r, 12, (2, 3), "int32")
    out["in.v1.x"], out["in.v1.y"] = x, y
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        summed = hvd.allreduce(tf.constant(x), op=hvd.Sum)
        gathered = hvd.allgather(tf.constant(y))
        root = hvd.broadcast(tf.constant(y), root_rank=1)
        biggest = hvd.allreduce(tf.constant(x), op=hvd.Max)
        out["v1.all"] = np.concatenate([a.ravel() for a in session.run([summed, gathered, root, biggest, hvd.rank_op()])])
        out["v1.root"] = session.run(root)
        out["v1.summed"] = session.run(summed)


def main() -> None:
    prefix = sys.argv[1]
    traced = query_ops()
    hvd.init()
    out: dict[str, np.ndarray] = {}
    facts: dict[str, object] = {}
    queries(traced, facts)
    v1_session(out)
    ops(out, facts)
    tape_training(out)
    keras_partial(out)
    keras_fit(out, facts)
    save(prefix, out, facts)
    hvd.shutdown()


if __name__ == "__main__":
    main()
