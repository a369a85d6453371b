"""Every private TensorFlow API the TensorFlow adapter touches, and nothing else.

TensorFlow's public ``tf.distribute`` API lets a :class:`tf.distribute.CrossDeviceOps` subclass
replace how one process's devices are reduced, but not what a *multi-worker* strategy must change:
the global replica count Keras scales the loss by, global replica ids, input sharding, initial-value
broadcast, which reductions leave the process at all. ``MultiWorkerMirroredStrategy`` does those
things by overriding private methods of ``MirroredExtended``; so do we, here and only here, keeping
the redsrv logic in :mod:`redsrv.adapters.tf` and calling back into it.

:data:`PRIVATE_API` lists each private name with what it is used for. The canary test
(``tests/adapters/tf/test_tf_internals.py``) checks every entry against the installed TensorFlow
and names what moved; it is the first test to read when a new TensorFlow release breaks the
adapter. Tested against :data:`TESTED_TF`.

One Keras 3 function is wrapped here too (:func:`install_keras_multi_worker_paths`), and one of
Keras 2's (tf-keras): both take their multi-worker paths (``predict`` concatenating every worker's
outputs, per-step logs reduced over every worker) only for ``isinstance(strategy,
MultiWorkerMirroredStrategy)``; :data:`KERAS_PRIVATE_API` and :data:`TF_KERAS_PRIVATE_API` list
what the wrappers rely on, checked by the same canary test.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as _cross_device_ops
from tensorflow.python.distribute import distribute_lib as _distribute_lib
from tensorflow.python.distribute import distribute_utils as _distribute_utils
from tensorflow.python.distribute import input_util as _input_util
from tensorflow.python.distribute import mirrored_strategy as _mirrored_strategy
from tensorflow.python.distribute import values as _values
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops import control_flow_util as _control_flow_util

#: The TensorFlow minor release these overrides were written and tested against.
TESTED_TF = "2.21"

#: (object, attribute, why we need it). The canary test checks each one exists with the expected
#: kind (method, property, function) and, for methods we override, the same parameters.
PRIVATE_API: tuple[tuple[Any, str, str], ...] = (
    (_mirrored_strategy, "MirroredExtended", "base class of the multi-worker extended object"),
    (_mirrored_strategy.MirroredExtended, "_num_replicas_in_sync", "made global: Keras scales the loss by it"),
    (_mirrored_strategy.MirroredExtended, "_in_multi_worker_mode", "turns on global partial-batch handling"),
    (_mirrored_strategy.MirroredExtended, "_get_replica_id_in_sync_group", "global replica ids"),
    (_mirrored_strategy.MirroredExtended, "_get_local_replica_id", "global replica ids"),
    (_mirrored_strategy.MirroredExtended, "_experimental_distribute_dataset", "per-worker InputContext"),
    (_mirrored_strategy.MirroredExtended, "_distribute_datasets_from_function", "per-worker InputContext"),
    (_mirrored_strategy.MirroredExtended, "_experimental_distribute_values_from_function", "global replica ids"),
    (_mirrored_strategy.MirroredExtended, "_input_workers_with_options", "the local input pipeline"),
    (_mirrored_strategy.MirroredExtended, "_get_variable_creator_initial_value", "broadcast initial values"),
    (_mirrored_strategy.MirroredExtended, "_get_cross_device_ops", "stock code keeps int32 local"),
    (_mirrored_strategy.MirroredExtended, "_reduce_to", "stock code keeps CPU-destined reductions local"),
    (_mirrored_strategy.MirroredExtended, "_use_merge_call", "always merge_call into batch_reduce"),
    (_mirrored_strategy.MirroredExtended, "_gather_to_implementation", "plain tensors are gathered over the workers too"),
    (_cross_device_ops.CrossDeviceOps, "_gather", "strategy.gather / all_gather enter the cross-device ops here"),
    (_cross_device_ops.CrossDeviceOps, "_gather_implementation", "our cross-worker all-gather"),
    (_cross_device_ops.CrossDeviceOps, "_num_between_graph_workers", "stock code skips one-replica reductions"),
    (_input_util, "get_distributed_dataset", "distribute a dataset with our InputContext"),
    (_input_util, "get_distributed_datasets_from_function", "distribute a dataset function with our InputContexts"),
    (_distribute_utils, "regroup", "per-replica values with global replica ids"),
    (_cross_device_ops, "reduce_non_distributed_value", "single-worker reduction of a plain tensor"),
    (_values, "DistributedValues", "the per-replica values a reduction receives"),
    (_values, "Mirrored", "an already reduced value (MEAN of it is itself)"),
    (_control_flow_util, "GraphOrParentsInXlaContext", "reject jit_compile=True"),
    (_distribute_lib.Strategy, "__init__", "build a MirroredStrategy subclass around our extended object"),
)

#: Private attributes of CollectiveAllReduceExtended that Keras 2 (the tf_keras package) reads from
#: a multi-worker strategy's extended object; ReductionServerExtended provides them.
KERAS2_READS = ("_task_id",)

# Parameters of the private methods we override, as TensorFlow TESTED_TF declares them: if one
# changes, our override would be called wrongly, so the canary test compares them.
OVERRIDDEN_SIGNATURES: dict[str, tuple[str, ...]] = {
    "__init__": ("self", "container_strategy", "devices", "cross_device_ops"),
    "_get_replica_id_in_sync_group": ("self", "replica_id"),
    "_get_local_replica_id": ("self", "replica_id_in_sync_group"),
    "_experimental_distribute_dataset": ("self", "dataset", "options"),
    "_distribute_datasets_from_function": ("self", "dataset_fn", "options"),
    "_experimental_distribute_values_from_function": ("self", "value_fn"),
    "_input_workers_with_options": ("self", "options"),
    "_get_variable_creator_initial_value": ("self", "replica_id", "device", "primary_var", "kwargs"),
    "_get_cross_device_ops": ("self", "value"),
    "_reduce_to": ("self", "reduce_op", "value", "destinations", "options"),
    "_use_merge_call": ("self",),
    "_gather_to_implementation": ("self", "value", "destinations", "axis", "options"),
    "_in_multi_worker_mode": ("self",),
}


def in_xla_context() -> bool:
    """Whether the code being traced will be compiled by XLA (``jit_compile=True``)."""
    return bool(_control_flow_util.GraphOrParentsInXlaContext(_ops.get_default_graph()))


def local_values(value: Any) -> tuple[Any, ...]:
    """The per-device tensors of a ``DistributedValues`` (or ``(value,)`` for a plain tensor)."""
    if isinstance(value, _values.DistributedValues):
        return tuple(value.values)
    return (value,)


def signature_of(name: str) -> tuple[str, ...]:
    """Parameter names of ``MirroredExtended.<name>`` in the installed TensorFlow."""
    member: Any = inspect.getattr_static(_mirrored_strategy.MirroredExtended, name)
    function: Any = member.fget if isinstance(member, property) else member
    return tuple(inspect.signature(function).parameters)


class CrossDeviceOpsBase(tf.distribute.CrossDeviceOps):  # type: ignore[misc]
    """:class:`tf.distribute.CrossDeviceOps` that never takes TensorFlow's one-replica shortcut.

    ``CrossDeviceOps.reduce``/``batch_reduce`` return a value unchanged, without calling the
    implementation, when a process has one replica and ``_num_between_graph_workers`` is 1 (the
    default): right for one process, a silent local-only "sum" for one device per worker.
    """

    _redsrv_num_workers = 1

    @property
    def _num_between_graph_workers(self) -> int:
        return self._redsrv_num_workers


class Hooks:
    """What :class:`ReductionServerExtended` needs from the adapter (implemented in ``tf.py``)."""

    num_workers: int
    worker_index: int
    cross_device_ops: Any

    def broadcast_initial_value(self, value: Any) -> Any:
        raise NotImplementedError


class ReductionServerExtended(_mirrored_strategy.MirroredExtended):  # type: ignore[misc]
    """``MirroredExtended`` for one worker of many: local devices in-graph, other workers through
    the cross-device ops (the reducers). The same overrides ``CollectiveAllReduceExtended`` makes,
    without its gRPC server and collective ops."""

    def __init__(self, container_strategy: Any, hooks: Hooks, devices: Sequence[str] | None) -> None:
        self._redsrv = hooks
        super().__init__(container_strategy, devices=devices, cross_device_ops=hooks.cross_device_ops)
        # Attributes of CollectiveAllReduceExtended that Keras 2 (tf_keras) reads: its
        # ModelCheckpoint sends a non-chief's file to "workertemp_<_task_id>" (KERAS2_READS).
        self._task_type = "worker"
        self._task_id = hooks.worker_index

    # --- one worker of many ---

    @property
    def _num_replicas_in_sync(self) -> int:
        return len(self.worker_devices) * self._redsrv.num_workers

    def _in_multi_worker_mode(self) -> bool:
        return self._redsrv.num_workers > 1

    def _get_replica_id_in_sync_group(self, replica_id: int) -> int:
        return self._redsrv.worker_index * len(self.worker_devices) + replica_id

    def _get_local_replica_id(self, replica_id_in_sync_group: int) -> int:
        return replica_id_in_sync_group - self._redsrv.worker_index * len(self.worker_devices)

    @property
    def experimental_between_graph(self) -> bool:
        return True

    @property
    def should_checkpoint(self) -> bool:
        return self._redsrv.worker_index == 0

    @property
    def should_save_summary(self) -> bool:
        return self._redsrv.worker_index == 0

    # --- input: each worker reads its own shard of every global batch ---

    def _input_context(self, pipelines: int = 1, index: int = 0) -> tf.distribute.InputContext:
        return tf.distribute.InputContext(
            num_input_pipelines=self._redsrv.num_workers * pipelines,
            input_pipeline_id=self._redsrv.worker_index * pipelines + index,
            num_replicas_in_sync=self._num_replicas_in_sync)

    def _experimental_distribute_dataset(self, dataset: Any, options: Any) -> Any:
        if options and options.experimental_replication_mode == tf.distribute.InputReplicationMode.PER_REPLICA:
            raise NotImplementedError("InputReplicationMode.PER_REPLICA is only supported by "
                                      "distribute_datasets_from_function")
        return _input_util.get_distributed_dataset(
            dataset, self._input_workers_with_options(options), self._container_strategy(),
            num_replicas_in_sync=self._num_replicas_in_sync, input_context=self._input_context(), options=options)

    def _distribute_datasets_from_function(self, dataset_fn: Callable[..., Any], options: Any) -> Any:
        input_workers = self._input_workers_with_options(options)
        # One pipeline per worker, or per local device in PER_REPLICA mode: pipeline ids are global.
        pipelines = input_workers.num_workers
        contexts = [self._input_context(pipelines, i) for i in range(pipelines)]
        return _input_util.get_distributed_datasets_from_function(
            dataset_fn, input_workers, contexts, self._container_strategy(), options)

    def _experimental_distribute_values_from_function(self, value_fn: Callable[..., Any]) -> Any:
        values = [value_fn(tf.distribute.experimental.ValueContext(self._get_replica_id_in_sync_group(i),
                                                                    self._num_replicas_in_sync))
                  for i in range(len(self.worker_devices))]
        return _distribute_utils.regroup(values, always_wrap=True)

    # --- variables start equal on every worker ---

    def _get_variable_creator_initial_value(self, replica_id: int, device: Any, primary_var: Any, **kwargs: Any) -> Any:
        if replica_id != 0:
            # Other local replicas copy the first one, as in MirroredStrategy.
            return super()._get_variable_creator_initial_value(replica_id=replica_id, device=device,
                                                              primary_var=primary_var, **kwargs)
        initial_value = kwargs["initial_value"]
        dtype = kwargs.get("dtype")
        hooks = self._redsrv

        def initial_value_fn() -> Any:
            with tf.device(device):
                value = initial_value() if callable(initial_value) else initial_value
                value = getattr(value, "wrapped_value", value)  # a CheckpointInitialValue
                value = tf.convert_to_tensor(value, dtype=dtype)
                return hooks.broadcast_initial_value(value)

        return initial_value_fn

    # --- every reduction goes through the reducers ---

    def _use_merge_call(self) -> bool:
        # Our reductions run in cross-replica context (merge_call -> batch_reduce); XLA is refused
        # by the cross-device ops with a clear error instead of falling back to collectives.
        return True

    def _get_cross_device_ops(self, value: Any) -> Any:
        # Stock MirroredStrategy sends int32 to a local-only ReductionToOneDevice.
        return self._redsrv.cross_device_ops

    def _gather_to_implementation(self, value: Any, destinations: Any, axis: Any, options: Any) -> Any:
        # Stock MirroredStrategy returns a plain tensor unchanged; MultiWorkerMirroredStrategy (and
        # so we) gathers it over the workers: Keras gathers each worker's batch sizes that way.
        return self._redsrv.cross_device_ops._gather(value, destinations=destinations, axis=axis, options=options)

    def _reduce_to(self, reduce_op: Any, value: Any, destinations: Any, options: Any) -> Any:
        # As CollectiveAllReduceExtended._reduce_to: stock MirroredStrategy reduces anything bound
        # for a CPU locally, which would keep metrics and partial-batch counts per worker.
        def reduce_one(v: Any) -> Any:
            if isinstance(v, _values.Mirrored) and reduce_op == tf.distribute.ReduceOp.MEAN:
                return v
            if not isinstance(v, _values.DistributedValues) and self._redsrv.num_workers == 1:
                return _cross_device_ops.reduce_non_distributed_value(
                    reduce_op, v, destinations, len(self.worker_devices))
            return self._redsrv.cross_device_ops.reduce(reduce_op, v, destinations=destinations, options=options)

        return tf.nest.map_structure(reduce_one, value)


# --- Keras 3 ----------------------------------------------------------------------------------

#: Keras 3's TensorFlow trainer: its multi-worker paths are keyed on MultiWorkerMirroredStrategy.
KERAS_TRAINER = "keras.src.backend.tensorflow.trainer"

#: (name in KERAS_TRAINER, why we need it), checked by the canary test like PRIVATE_API.
KERAS_PRIVATE_API: tuple[tuple[str, str], ...] = (
    ("reduce_per_replica", "wrapped: its multi-worker branch is taken for MultiWorkerMirroredStrategy only"),
    ("_multi_worker_concat", "predict's concatenation of every worker's outputs, in Keras's own replica order"),
    ("_collective_all_reduce_multi_worker", "the isinstance test we stand in for (the canary reads its source)"),
)


#: Keras 2's (tf-keras) training module, and what its multi-worker paths are keyed on.
TF_KERAS_TRAINING = "tf_keras.src.engine.training"
TF_KERAS_PRIVATE_API: tuple[tuple[str, str], ...] = (
    ("_collective_all_reduce_multi_worker", "wrapped: reduce_per_replica's multi-worker branch (predict's "
                                            "concatenation, summed logs) is taken for MultiWorkerMirroredStrategy only"),
    ("_multi_worker_concat", "what that branch runs for predict: strategy.gather of every worker's outputs"),
)


def install_keras_multi_worker_paths() -> None:
    """Make Keras 3's ``reduce_per_replica`` treat a multi-worker redsrv strategy as it treats
    ``MultiWorkerMirroredStrategy``, and Keras 2's (tf-keras, where installed) likewise. Idempotent;
    without Keras 3 (or with another backend) only Keras 2's.

    Keras decides with ``isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and
    strategy.extended._in_multi_worker_mode()`` (``_collective_all_reduce_multi_worker``), a class
    we must not derive from (it starts gRPC collectives). A strategy opts in by having a
    ``_redsrv_keras_reduce(reduce_op, values)`` method and a multi-worker extended object:

    * ``"concat"`` (``predict``): Keras's own ``_multi_worker_concat`` (every worker's outputs,
      gathered through ``strategy.gather``), so each worker returns every row, as under MWMS;
    * ``"auto"``/``"mean"``/``"sum"`` (the per-step logs of ``fit`` and ``evaluate``): reduced over
      every replica of every worker by the strategy, as MWMS means to (Keras's MWMS branch calls
      ``strategy.reduce(..., axis=0)``, which TensorFlow refuses for scalar logs);
    * ``"first"`` and any other strategy: Keras's code unchanged.
    """
    _install_tf_keras_multi_worker_paths()
    try:
        trainer = importlib.import_module(KERAS_TRAINER)
        import keras
    except ImportError:
        return
    original = trainer.reduce_per_replica
    if getattr(original, "_redsrv_original", None) is not None:
        return

    def reduce_per_replica(values: Any, strategy: Any, reduction: str) -> Any:
        reduce_logs = getattr(strategy, "_redsrv_keras_reduce", None)
        if reduce_logs is None or not strategy.extended._in_multi_worker_mode():
            return original(values, strategy, reduction)
        if reduction == "concat":
            return keras.tree.map_structure(lambda v: trainer._multi_worker_concat(v, strategy), values)
        if reduction in ("auto", "mean", "sum"):
            return reduce_logs("SUM" if reduction == "sum" else "MEAN", values)
        return original(values, strategy, reduction)

    reduce_per_replica._redsrv_original = original  # type: ignore[attr-defined]
    trainer.reduce_per_replica = reduce_per_replica  # type: ignore[attr-defined]


def _install_tf_keras_multi_worker_paths() -> None:
    """Keras 2 asks ``_collective_all_reduce_multi_worker(strategy)`` before concatenating
    ``predict``'s outputs over every worker and summing logs with ``strategy.reduce``: answer yes
    for a multi-worker redsrv strategy (one with ``_redsrv_keras_reduce``), as for MWMS."""
    try:
        training = importlib.import_module(TF_KERAS_TRAINING)
    except ImportError:
        return
    original = training._collective_all_reduce_multi_worker
    if getattr(original, "_redsrv_original", None) is not None:
        return

    def collective_all_reduce_multi_worker(strategy: Any) -> bool:
        if getattr(strategy, "_redsrv_keras_reduce", None) is not None:
            return bool(strategy.extended._in_multi_worker_mode())
        return bool(original(strategy))

    collective_all_reduce_multi_worker._redsrv_original = original  # type: ignore[attr-defined]
    training._collective_all_reduce_multi_worker = collective_all_reduce_multi_worker


def init_strategy(strategy: tf.distribute.Strategy, extended: Any) -> None:
    """``tf.distribute.Strategy.__init__`` (skipping ``MirroredStrategy.__init__``, which would
    build a stock ``MirroredExtended``)."""
    _distribute_lib.Strategy.__init__(strategy, extended)
