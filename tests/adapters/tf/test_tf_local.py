"""The TensorFlow adapter in one process: differential tests against stock ``MirroredStrategy`` on
two logical CPU devices, and two workers as two threads (eager) for the cross-worker paths.

Tolerances: one worker adds exactly what stock TensorFlow adds (two local values, one order), so
results are compared bit for bit; across workers the reducers add in rank order, float32 to 1e-6.
"""

from __future__ import annotations

import concurrent.futures
import json

import pytest

tf = pytest.importorskip("tensorflow")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import redsrv  # noqa: E402
import redsrv.tf  # noqa: E402

pytestmark = pytest.mark.tf

DEVICES = ["/cpu:0", "/cpu:1"]
SHAPES = [(3, 4), (5,), ()]


@pytest.fixture
def ops(daemon):  # type: ignore[no-untyped-def]
    """Cross-device ops for a one-worker job."""
    ops = redsrv.tf.ReductionServerCrossDeviceOps(reducers=[daemon], rank=0, world_size=1, job="tf-local")
    yield ops
    ops.close()


def replica_values(strategy, dtype, seed: int = 0):  # type: ignore[no-untyped-def]
    """One PerReplica per shape: replica r holds values drawn from (seed, r)."""
    def value(shape, ctx):  # type: ignore[no-untyped-def]
        rng = np.random.default_rng([seed, ctx.replica_id_in_sync_group, len(shape)])
        data = rng.integers(-50, 50, size=shape) if dtype.is_integer else rng.standard_normal(shape)
        return tf.constant(np.asarray(data).astype(dtype.as_numpy_dtype))
    return [strategy.experimental_distribute_values_from_function(lambda ctx, s=s: value(s, ctx)) for s in SHAPES]


def bits(array: np.ndarray) -> np.ndarray:
    """The bytes of ``array`` (scalars included), to compare bit for bit."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def local(strategy, values):  # type: ignore[no-untyped-def]
    return [[t.numpy() for t in strategy.experimental_local_results(v)] for v in values]


# int32 is missing on purpose: MirroredStrategy never gives int32 to its cross-device ops (it
# reduces them locally); ReductionServerStrategy does, tested with two workers below.
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int64], ids=lambda d: d.name)
@pytest.mark.parametrize("reduce_op", ["SUM", "MEAN"])
def test_batch_reduce_equals_stock_mirrored_strategy(ops, dtype, reduce_op) -> None:  # type: ignore[no-untyped-def]
    if reduce_op == "MEAN" and dtype.is_integer:
        pytest.skip("stock MEAN of integers changes their dtype")
    ours = tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=ops)
    stock = tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=tf.distribute.ReductionToOneDevice())
    results = []
    for strategy in (ours, stock):
        values = replica_values(strategy, dtype)
        reduced = strategy.extended.batch_reduce_to(reduce_op, [(v, v) for v in values])
        results.append(local(strategy, reduced))
    for got, want in zip(*results):
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(bits(g), bits(w))


def test_keras_fit_equals_stock_mirrored_strategy(ops) -> None:  # type: ignore[no-untyped-def]
    import keras

    def train(strategy):  # type: ignore[no-untyped-def]
        keras.utils.set_random_seed(3)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((40, 5)).astype("float32")
        y = rng.standard_normal((40, 1)).astype("float32")
        with strategy.scope():
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)  # 40 = 16 + 16 + 8
        return history.history, [w.numpy() for w in model.weights]

    got_history, got = train(tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=ops))
    want_history, want = train(tf.distribute.MirroredStrategy(DEVICES))
    assert got_history == want_history
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_xla_is_refused_with_a_clear_error(ops) -> None:  # type: ignore[no-untyped-def]
    strategy = tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=ops)

    @tf.function(jit_compile=True, autograph=False)  # autograph would wrap our error in a StagingError
    def step():  # type: ignore[no-untyped-def]
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce("SUM", tf.constant(1.0)))

    with pytest.raises(redsrv.ConfigError, match="jit_compile=False"):
        step()


def test_keras_jit_compile_is_refused(daemon) -> None:  # type: ignore[no-untyped-def]
    import keras

    strategy = redsrv.tf.ReductionServerStrategy([daemon], 1, 0, DEVICES, job="tf-jit", environ={})
    try:
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse", jit_compile=True)
        with pytest.raises(redsrv.ConfigError, match="XLA"):
            model.fit(np.ones((8, 3), "float32"), np.ones((8, 1), "float32"), batch_size=4, verbose=0)
    finally:
        strategy.close()


def test_unsupported_dtype_is_a_type_error_at_trace_time(ops) -> None:  # type: ignore[no-untyped-def]
    strategy = tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=ops)
    values = strategy.experimental_distribute_values_from_function(lambda ctx: tf.constant([1, 2], tf.uint16))
    with pytest.raises(TypeError, match="uint16"):
        strategy.extended.batch_reduce_to("SUM", [(values, values)])


def two_workers(daemon, job, fn):  # type: ignore[no-untyped-def]
    """Run ``fn(ops, rank)`` for ranks 0 and 1 of a two-worker job, each on its own thread."""
    ops = [redsrv.tf.ReductionServerCrossDeviceOps(reducers=[daemon], rank=r, world_size=2, job=job) for r in (0, 1)]
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            return [f.result(timeout=60) for f in [pool.submit(fn, o, r) for r, o in enumerate(ops)]]
    finally:
        for o in ops:
            o.close()


def test_one_replica_per_worker_is_still_summed_across_workers(daemon) -> None:  # type: ignore[no-untyped-def]
    # Stock CrossDeviceOps returns a one-replica value unchanged; ours must not.
    inputs = [np.arange(6, dtype=np.float32) * (r + 1) for r in (0, 1)]

    def reduce(ops, rank):  # type: ignore[no-untyped-def]
        total = ops.batch_reduce("SUM", [(tf.constant(inputs[rank]), "/cpu:0")])[0]
        mean = ops.reduce("MEAN", tf.constant(inputs[rank]), "/cpu:0")
        return [t.numpy() for t in (tf.convert_to_tensor(total), tf.convert_to_tensor(mean))]

    for total, mean in two_workers(daemon, "tf-one-replica", reduce):
        np.testing.assert_array_equal(total, inputs[0] + inputs[1])
        np.testing.assert_allclose(mean, (inputs[0] + inputs[1]) / 2, rtol=1e-6)


@pytest.mark.parametrize("dtype", [tf.float32, tf.int32], ids=lambda d: d.name)
def test_two_workers_two_devices_sum_and_mean_over_all_four_replicas(daemon, dtype) -> None:  # type: ignore[no-untyped-def]
    strategy = tf.distribute.MirroredStrategy(DEVICES)

    def values(rank):  # type: ignore[no-untyped-def]
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.fill([2, 3], tf.constant(10 * rank + ctx.replica_id_in_sync_group + 1, dtype)))

    def reduce(ops, rank):  # type: ignore[no-untyped-def]
        pr = values(rank)
        return [local(strategy, ops.batch_reduce(op, [(pr, pr), (pr, pr)])) for op in ("SUM", "MEAN")]

    everything = 1 + 2 + 11 + 12
    mean = everything // 4 if dtype.is_integer else everything / 4  # integer MEAN truncates, as TensorFlow's
    for sums, means in two_workers(daemon, f"tf-two-by-two-{dtype.name}", reduce):
        for got, want in [(t, everything) for v in sums for t in v] + [(m, mean) for v in means for m in v]:
            assert got.dtype == dtype.as_numpy_dtype
            np.testing.assert_allclose(got, np.full((2, 3), want), rtol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int64", "bool", "uint8", "int8", "uint32",
                                   "complex64"])
def test_initial_values_arrive_bit_for_bit_from_worker_0(daemon, dtype) -> None:  # type: ignore[no-untyped-def]
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)

    def make(rank, shape):  # type: ignore[no-untyped-def]
        raw = np.random.default_rng([rank, len(shape)]).integers(0, 256, size=int(np.prod(shape)) * np_dtype.itemsize)
        if np_dtype == np.bool_:
            raw %= 2  # TensorFlow keeps only 0 and 1 in a bool
        return raw.astype(np.uint8).view(np_dtype).reshape(shape)  # any bit pattern: NaN payloads, -0.0

    shapes = [(3, 5), (), (7,)]

    def broadcast(ops, rank):  # type: ignore[no-untyped-def]
        return [ops.broadcast_initial_value(tf.constant(make(rank, s))).numpy() for s in shapes]

    for got in two_workers(daemon, f"tf-broadcast-{dtype}", broadcast):
        for g, s in zip(got, shapes):
            want = make(0, s)
            assert g.dtype == want.dtype and g.shape == want.shape
            np.testing.assert_array_equal(bits(g), bits(want))


def test_strategy_reads_tf_config_and_refuses_conflicting_sources(daemon) -> None:  # type: ignore[no-untyped-def]
    tf_config = json.dumps({"cluster": {"worker": ["localhost:1"], "reducer": [daemon]},
                            "task": {"type": "worker", "index": 0}})
    strategy = redsrv.tf.ReductionServerStrategy(devices=DEVICES, job="tf-config", environ={"TF_CONFIG": tf_config})
    try:
        assert (strategy.num_workers, strategy.worker_index, strategy.num_replicas_in_sync) == (1, 0, 2)
        assert strategy.is_chief and strategy.extended.should_checkpoint and strategy.extended.should_save_summary
        assert strategy.chief_only("a", ["b", "c"]) == ["a", "b", "c"]
        assert "worker 0/1" in repr(strategy)
    finally:
        strategy.close()
        strategy.close()  # idempotent
    with pytest.raises(redsrv.ConfigError, match="conflicting reducers"):
        redsrv.tf.ReductionServerStrategy(devices=DEVICES, environ={"TF_CONFIG": tf_config, "REDSRV_REDUCERS": "elsewhere:1"})


def test_workers_with_different_device_counts_are_refused_at_start_up(daemon) -> None:  # type: ignore[no-untyped-def]
    def start(rank: int) -> BaseException | None:
        try:
            redsrv.tf.ReductionServerStrategy([daemon], 2, rank, DEVICES[: 2 - rank], job="tf-devices", environ={}).close()
        except redsrv.ConfigError as exc:
            return exc
        return None

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        errors = list(pool.map(start, (0, 1)))
    for error in errors:
        assert error is not None and "worker 0: 2, worker 1: 1" in str(error)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "bool", "uint16", "complex64"])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_returns_every_replica_in_replica_order_bit_for_bit(daemon, dtype, axis) -> None:  # type: ignore[no-untyped-def]
    # Two workers of two devices; replica g (global id) holds g + 1 slices along the axis (ragged).
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    strategy = tf.distribute.MirroredStrategy(DEVICES)
    gathered_axis = axis % 3

    def block(replica: int) -> np.ndarray:
        shape = [2, 3, 2]
        shape[gathered_axis] = replica + 1
        raw = np.random.default_rng(replica).integers(0, 256, size=int(np.prod(shape)) * np_dtype.itemsize)
        if np_dtype == np.bool_:
            raw %= 2
        return raw.astype(np.uint8).view(np_dtype).reshape(shape)

    def gather(ops, rank):  # type: ignore[no-untyped-def]
        pr = strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(block(2 * rank + ctx.replica_id_in_sync_group)))
        return local(strategy, [ops._gather(pr, pr, axis)])[0]

    want = np.concatenate([block(g) for g in range(4)], axis=gathered_axis)
    for per_device in two_workers(daemon, f"tf-gather-{dtype}-{axis}", gather):
        for got in per_device:
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(bits(got), bits(want))


def test_gather_of_mismatched_trailing_dimensions_fails_on_every_worker(daemon) -> None:  # type: ignore[no-untyped-def]
    def gather(ops, rank):  # type: ignore[no-untyped-def]
        try:
            ops._gather(tf.zeros([1, 2 + rank]), "/cpu:0", 0)
        except redsrv.ContributionMismatchError as exc:
            return exc
        return None

    for error in two_workers(daemon, "tf-gather-mismatch", gather):
        assert isinstance(error, redsrv.ContributionMismatchError) and "rank 1 has float32[1, 3]" in str(error), error


def test_communication_options_timeout_bounds_the_exchange(daemon) -> None:  # type: ignore[no-untyped-def]
    # Worker 1 never joins: the call's timeout_seconds (0.5 s), not the 20 s operation timeout, ends the wait.
    import time

    def reduce(ops, rank):  # type: ignore[no-untyped-def]
        if rank == 1:
            return None
        options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=0.5)
        started = time.monotonic()
        with pytest.raises(redsrv.PeerTimeoutError):
            ops.batch_reduce("SUM", [(tf.constant([1.0]), "/cpu:0")], options=options)
        return time.monotonic() - started

    elapsed, _ = two_workers(daemon, "tf-options-timeout", reduce)
    assert elapsed < 5, elapsed
