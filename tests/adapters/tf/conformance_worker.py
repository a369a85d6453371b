"""One worker of a tf.distribute conformance run: the same checks under ReductionServerStrategy or
MultiWorkerMirroredStrategy (MWMS), results written as JSON for the test to compare.

    python conformance_worker.py SPEC_JSON OUT_PREFIX

SPEC: {"strategy": "redsrv" | "mwms", "devices": n (redsrv; MWMS has one CPU device per worker),
       "job": "...", "checks": ["name", ...] (default: every check)}

The cluster comes from TF_CONFIG (MWMS: the workers' own addresses; redsrv: the reducers' too).
Every check runs even if one fails; OUT_PREFIX.json maps each check's name to {"value": ...} or
{"error": "Type: message"}. Checks from TensorFlow's own ``strategy_test_lib`` (minimising a loss
eagerly and in a TF1 graph session) run as that library wrote them.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

CHECKS: dict[str, Callable[[Any, int], Any]] = {}


def check(fn: Callable[[Any, int], Any]) -> Callable[[Any, int], Any]:
    CHECKS[fn.__name__] = fn
    return fn


def local(strategy: Any, value: Any) -> list[Any]:
    return [np.asarray(t).tolist() for t in strategy.experimental_local_results(value)]


def ctx() -> Any:
    return tf.distribute.get_replica_context()


# --- the table ----------------------------------------------------------------------------


@check
def gather_of_run(strategy: Any, worker: int) -> Any:
    """strategy.gather(strategy.run(lambda: [[w]]), axis=0), eagerly."""
    return strategy.gather(strategy.run(lambda: tf.constant([[float(worker)]])), axis=0).numpy().tolist()


@check
def all_gather_in_run(strategy: Any, worker: int) -> Any:
    """get_replica_context().all_gather([w], axis=0) inside strategy.run."""
    return local(strategy, strategy.run(lambda: ctx().all_gather(tf.constant([float(worker)]), axis=0)))


@check
def predict_rows(strategy: Any, worker: int) -> Any:
    """model.predict of 32 rows (weights from one seed) on every worker."""
    import keras

    keras.utils.set_random_seed(7)
    x = np.arange(64, dtype="float32").reshape(32, 2) / 64
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    return model.predict(x, batch_size=8, verbose=0).tolist()


# --- gather beyond the table ----------------------------------------------------------------------


@check
def gather_ragged_in_function(strategy: Any, worker: int) -> Any:
    """Replica g holds g + 1 rows of [g, g]; gathered in a tf.function."""
    @tf.function
    def run() -> Any:
        def rows() -> Any:
            g = tf.cast(ctx().replica_id_in_sync_group, tf.float32)
            return tf.fill(tf.stack([ctx().replica_id_in_sync_group + 1, 2]), g)
        return strategy.gather(strategy.run(rows), axis=0)

    return run().numpy().tolist()


@check
def gather_axis_1_int32(strategy: Any, worker: int) -> Any:
    value = strategy.experimental_distribute_values_from_function(
        lambda c: tf.constant([[c.replica_id_in_sync_group], [10 + c.replica_id_in_sync_group]], tf.int32))
    return strategy.gather(value, axis=1).numpy().tolist()


@check
def all_gather_gradient(strategy: Any, worker: int) -> Any:
    """d/dx of sum(all_gather(x) * weights): each replica's slice of the all-reduced upstream gradient."""
    @tf.function
    def run() -> Any:
        def step() -> Any:
            x = tf.fill([2], tf.cast(ctx().replica_id_in_sync_group, tf.float32))
            with tf.GradientTape() as tape:
                tape.watch(x)
                gathered = ctx().all_gather(x, axis=0)
                y = tf.reduce_sum(gathered * tf.range(tf.size(gathered), dtype=tf.float32))
            return tape.gradient(y, x)
        return strategy.run(step)

    return local(strategy, run())


# --- strategy_test_lib ----------------------------------------------------------------------------


def _library_case(name: str) -> Any:
    from tensorflow.python.distribute import strategy_test_lib

    return strategy_test_lib.DistributionTestBase(name)


@check
def minimize_loss_eager(strategy: Any, worker: int) -> Any:
    _library_case("_test_minimize_loss_eager")._test_minimize_loss_eager(strategy)
    return "passed"


@check
def minimize_loss_graph(strategy: Any, worker: int) -> Any:
    if len(strategy.extended.worker_devices) > 1:
        # The library's TF1 session has its own ConfigProto: it sees one CPU, not the logical ones.
        return "skipped: several logical CPU devices"
    _library_case("_test_minimize_loss_graph")._test_minimize_loss_graph(strategy)
    return "passed"


# --- replica ids, all-reduce, values from a function, reduce --------------------------------------


@check
def replica_ids(strategy: Any, worker: int) -> Any:
    ids = strategy.run(lambda: ctx().replica_id_in_sync_group)
    return {"num_replicas_in_sync": strategy.num_replicas_in_sync, "local": local(strategy, ids)}


@check
def cluster_resolver(strategy: Any, worker: int) -> Any:
    """What MWMS programs pick their chief with."""
    resolver = strategy.cluster_resolver
    return [resolver.task_type, resolver.task_id, len(resolver.cluster_spec().as_dict()["worker"])]


@check
def values_from_function(strategy: Any, worker: int) -> Any:
    value = strategy.experimental_distribute_values_from_function(
        lambda c: tf.constant([c.replica_id_in_sync_group, c.num_replicas_in_sync]))
    return local(strategy, value)


@check
def all_reduce_in_function(strategy: Any, worker: int) -> Any:
    """SUM and MEAN of (g + 1) * [1, 2] over the replicas, and of an int32 (g + 1)."""
    @tf.function
    def run() -> Any:
        def step() -> Any:
            g = tf.cast(ctx().replica_id_in_sync_group + 1, tf.float32)
            value = g * tf.constant([1.0, 2.0])
            return (ctx().all_reduce("SUM", value), ctx().all_reduce("MEAN", value),
                    ctx().all_reduce("SUM", ctx().replica_id_in_sync_group + 1))
        return strategy.run(step)

    return [local(strategy, v) for v in run()]


@check
def all_reduce_gradient_tape(strategy: Any, worker: int) -> Any:
    """strategy_test_lib's _test_collective_comms_gradient_tape with c = g + 1: the gradient of
    all_reduce(x) * c is the SUM (or MEAN) of every replica's c."""
    @tf.function
    def run(op: str) -> Any:
        def step() -> Any:
            c = tf.cast(ctx().replica_id_in_sync_group + 1, tf.float32)
            x = tf.identity(42.0)
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = ctx().all_reduce(op, x) * c
            return tape.gradient(y, x)
        return strategy.run(step)

    return {op: local(strategy, run(op)) for op in ("SUM", "MEAN")}


@check
def all_reduce_indexed_slices(strategy: Any, worker: int) -> Any:
    """Replica g's IndexedSlices: row g of a 6 x 2 gradient holds g + 1; reduced with SUM."""
    def slices(c: Any) -> Any:
        g = c.replica_id_in_sync_group
        return tf.IndexedSlices(tf.constant([[g + 1.0, g + 1.0]]), tf.constant([g]), tf.constant([6, 2]))

    value = strategy.experimental_distribute_values_from_function(slices)
    reduced = strategy.extended.reduce_to("SUM", value, destinations="/cpu:0")
    return [tf.convert_to_tensor(t).numpy().tolist() for t in strategy.experimental_local_results(reduced)]


@check
def reduce_over_axes(strategy: Any, worker: int) -> Any:
    """Replica g holds g + 1 rows of [g, 2g]: reduce SUM/MEAN with axis None, 0 and 1."""
    value = strategy.experimental_distribute_values_from_function(
        lambda c: tf.tile(tf.constant([[1.0, 2.0]]) * c.replica_id_in_sync_group, [c.replica_id_in_sync_group + 1, 1]))
    rows = strategy.experimental_distribute_values_from_function(
        lambda c: tf.ones([2, 3]) * float(c.replica_id_in_sync_group))
    return {"sum_0": strategy.reduce("SUM", value, axis=0).numpy().tolist(),
            "mean_0": strategy.reduce("MEAN", value, axis=0).numpy().tolist(),
            "sum_none": strategy.reduce("SUM", rows, axis=None).numpy().tolist(),
            "mean_none": strategy.reduce("MEAN", rows, axis=None).numpy().tolist(),
            "mean_1": strategy.reduce("MEAN", rows, axis=1).numpy().tolist()}


def main() -> int:
    spec = json.loads(sys.argv[1])
    prefix = sys.argv[2]
    if spec["strategy"] == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        worker = strategy.cluster_resolver.task_id
    else:
        cpus = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * spec["devices"])
        import redsrv.tf

        strategy = redsrv.tf.ReductionServerStrategy(devices=[f"/cpu:{i}" for i in range(spec["devices"])],
                                                      job=spec["job"])
        worker = strategy.worker_index
    results: dict[str, Any] = {}
    try:
        for name in spec.get("checks") or list(CHECKS):
            try:
                results[name] = {"value": CHECKS[name](strategy, worker)}
            except Exception as exc:  # recorded: the test names every failing check at once
                results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    finally:
        if spec["strategy"] == "redsrv":
            strategy.close()
    with open(prefix + ".json", "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
