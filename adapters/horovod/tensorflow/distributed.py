"""Horovod's gradient wrappers for TensorFlow: ``DistributedGradientTape`` (custom loops) and
``DistributedOptimizer`` (Keras 3 and tf-keras optimizers, ``model.fit``). Both reduce every
gradient of a step in one host call (:func:`grouped_allreduce`), default op Average."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from .. import common
from ..common import ProcessSet, global_process_set
from .gradient_aggregation_eager import LocalGradientAggregationHelperEager, reduce_with_locals
from .mpi_ops import Compression, grouped_allreduce

__all__ = ["DistributedGradientTape", "DistributedOptimizer"]


class _GradientReducer:
    """What both wrappers do with a step's gradients."""

    def __init__(self, compression: Any, sparse_as_dense: bool, op: Any, gradient_predivide_factor: float, groups: Any,
                 process_set: ProcessSet, name: str) -> None:
        self.op = common.resolve_op(op, None)
        if gradient_predivide_factor != 1.0 and self.op is not common.ReduceOp.AVERAGE:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        self.compression = compression
        self.predivide = gradient_predivide_factor
        self.process_set = process_set
        self.name = name
        #: A Keras 3 DistributedOptimizer's local variables, by id (Keras 3 variables have no
        #: ``ref()``), kept here, in a plain object: a Keras 3 optimizer would track a dict of
        #: variables set on it as variables of its own.
        self.local_vars: dict[int, Any] = {}
        self.scale_local_gradients = True

    def __call__(self, grads: Sequence[Any]) -> list[Any]:
        """The reduced gradients; ``None`` (a source this step did not reach) stays ``None`` and
        is not reduced, so every rank must leave the same sources unconnected."""
        if not self.process_set.included():
            return list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        prescale, postscale = (1.0 / self.predivide, self.predivide) if self.op is common.ReduceOp.AVERAGE else (1.0, 1.0)
        # IndexedSlices (embedding gradients) are reduced densely, in the one host call
        reduced = grouped_allreduce([tf.convert_to_tensor(grads[i]) for i in present], op=self.op,
                                    compression=self.compression, name=self.name,
                                    prescale_factor=prescale, postscale_factor=postscale, process_set=self.process_set)
        out = list(grads)
        for i, value in zip(present, reduced):
            out[i] = value
        return out


class _DistributedGradientTape(tf.GradientTape):
    """A ``tf.GradientTape`` whose ``gradient`` returns gradients reduced over the ranks."""

    _reduce_gradients: _GradientReducer
    #: Horovod's local sources (model parallelism): by identity, since a Keras 3 variable has no
    #: ``ref()``; the value keeps the source alive so that its id is not reused.
    _local_sources: dict[int, Any]
    _scale_local_gradients: bool

    def register_local_source(self, source: Any) -> None:
        """Horovod's: ``source``'s gradient stays this rank's own, not reduced (divided by the
        set's size when ``scale_local_gradients``, Horovod's default)."""
        self._local_sources[id(source)] = source

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(grads, expand_composites=False)
        local = [id(s) in self._local_sources for s in tf.nest.flatten(sources, expand_composites=False)]
        reduced = reduce_with_locals(self._reduce_gradients, flat, local, self._reduce_gradients.process_set.size() or 1,
                                     self._scale_local_gradients)
        return tf.nest.pack_sequence_as(grads, reduced)

    def get_local_and_global_gradients(self, target: Any, sources: Any, output_gradients: Any = None,
                                       use_generic_names: bool = False) -> tuple[list[Any], list[Any]]:
        """Horovod's: ``(source, gradient)`` pairs of the local sources, then of the others."""
        pairs = list(zip(sources, self.gradient(target, sources, output_gradients)))
        return ([p for p in pairs if id(p[0]) in self._local_sources],
                [p for p in pairs if id(p[0]) not in self._local_sources])


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",  # noqa: N802 - Horovod's name
                            compression: Any = Compression.none, sparse_as_dense: bool = False, op: Any = common.Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                            process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True) -> tf.GradientTape:
    """Wrap a recorded ``tf.GradientTape``: its ``gradient()`` reduces the gradients over the
    ranks (default: averages them). The wrapper shares the tape's recording. ``groups`` and
    ``num_groups`` are accepted; every gradient of a call already travels in one host call."""
    tape = _DistributedGradientTape.__new__(_DistributedGradientTape)
    tape.__dict__.update(gradtape.__dict__)
    tape._reduce_gradients = _GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor, groups,
                                              process_set, "DistributedGradientTape")
    tape._local_sources = {}
    tape._scale_local_gradients = scale_local_gradients
    return tape


def _is_keras2_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a tf-keras (Keras 2) one, new-style or ``optimizers.legacy``. Only
    a program that imported tf-keras (``tf.keras`` under ``TF_USE_LEGACY_KERAS=1``) can hold one."""
    tf_keras = sys.modules.get("tf_keras")
    return tf_keras is not None and isinstance(optimizer, (tf_keras.optimizers.Optimizer,
                                                           tf_keras.optimizers.legacy.Optimizer))


class _DistributedOptimizer:
    """Mixed in before a Keras 3 optimizer's class: ``apply`` reduces the gradients first
    (``apply_gradients``, which ``model.fit`` calls, goes through ``apply``), except those of the
    variables registered as local."""

    _reduce_gradients: _GradientReducer

    def register_local_var(self, var: Any) -> None:
        """Horovod's: ``var``'s gradient stays this rank's own, not reduced (divided by the set's
        size when ``scale_local_gradients``)."""
        self._reduce_gradients.local_vars[id(var)] = var

    def apply(self, grads: Sequence[Any], trainable_variables: Any = None) -> Any:
        reducer = self._reduce_gradients
        variables = trainable_variables if trainable_variables is not None else self._trainable_variables  # type: ignore[attr-defined]
        local = [id(v) in reducer.local_vars for v in variables]
        reduced = reduce_with_locals(reducer, list(grads), local, reducer.process_set.size() or 1,
                                     reducer.scale_local_gradients)
        return super().apply(reduced, trainable_variables)  # type: ignore[misc]


class _CallableList(list):  # type: ignore[type-arg]
    """Horovod's shim: ``optimizer.variables`` and ``optimizer.variables()`` both give the list."""

    def __call__(self) -> _CallableList:
        return self


class _Keras2DistributedOptimizer:
    """Mixed in before a tf-keras (Keras 2) optimizer's class, as Horovod's
    ``create_distributed_optimizer`` subclasses it: the gradients it computes
    (``compute_gradients``/``_compute_gradients``/``get_gradients``, which ``minimize`` and
    ``model.fit`` call) come back reduced over the ranks; with ``backward_passes_per_step > 1``,
    accumulated locally and reduced and applied every that many steps. The dynamic class carries
    the options (``_hvd_options``), so that ``from_config`` on it builds a distributed optimizer
    too."""

    _HAS_AGGREGATE_GRAD = True
    _hvd_options: dict[str, Any]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        options = self._hvd_options
        self._name = options["name"] or f"Distributed{options['base_name']}"
        self._aggregated_gradients = False
        reducer = _GradientReducer(options["compression"], options["sparse_as_dense"], options["op"],
                                   options["gradient_predivide_factor"], options["groups"], options["process_set"],
                                   f"DistributedOptimizer.{self._name}")
        self._allreduce_grads = lambda grads, variables: reducer(list(grads))
        self._local_vars: set[Any] = set()
        self.process_set = options["process_set"]
        self.scale_local_gradients = options["scale_local_gradients"]
        self._agg_helper = None
        if options["backward_passes_per_step"] > 1:
            self._agg_helper = LocalGradientAggregationHelperEager(
                backward_passes_per_step=options["backward_passes_per_step"], allreduce_func=self._allreduce_grads,
                sparse_as_dense=options["sparse_as_dense"],
                average_aggregated_gradients=options["average_aggregated_gradients"],
                process_set=options["process_set"], scale_local_gradients=options["scale_local_gradients"])

    @property
    def variables(self) -> _CallableList:
        base = super().variables  # a list (new-style optimizers) or a method (optimizers.legacy)
        return _CallableList(base() if callable(base) else base)

    def register_local_var(self, var: Any) -> None:
        """Horovod's: ``var``'s gradient stays this rank's own, not reduced (divided by the set's
        size when ``scale_local_gradients``)."""
        if self._agg_helper:
            self._agg_helper.register_local_var(var)
        else:
            self._local_vars.add(var.ref())

    def compute_gradients(self, loss: Any, var_list: Any, tape: Any = None) -> list[tuple[Any, Any]]:
        return self._compute_gradients(loss, var_list, None, tape)

    def _compute_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None, tape: Any = None) -> list[tuple[Any, Any]]:
        tape = tf.GradientTape() if tape is None else tape
        base = super()
        if hasattr(base, "_compute_gradients"):
            grads_and_vars = base._compute_gradients(loss, var_list, grad_loss, tape=tape)
        else:
            grads_and_vars = base.compute_gradients(loss, var_list, tape=tape)  # type: ignore[misc]
        grads, weights = list(zip(*grads_and_vars))
        return list(zip(self._allreduce(grads, weights), weights))

    def get_gradients(self, loss: Any, params: Any) -> Any:
        return self._allreduce(super().get_gradients(loss, params), params)  # type: ignore[misc]

    def _aggregate_gradients(self, grads_and_vars: Any) -> Any:
        base = super()
        if hasattr(base, "_aggregate_gradients"):
            return base._aggregate_gradients(grads_and_vars)
        return base.aggregate_gradients(grads_and_vars)  # type: ignore[misc]

    def _allreduce(self, grads: Sequence[Any], variables: Sequence[Any]) -> Any:
        self._aggregated_gradients = True
        if self._agg_helper:
            return self._agg_helper.compute_gradients(tuple(grads), tuple(variables))
        local = [v.ref() in self._local_vars for v in variables]
        return reduce_with_locals(lambda gs: self._allreduce_grads(gs, None), grads, local,
                                  self.process_set.size() or 1, self.scale_local_gradients)

    def apply_gradients(self, *args: Any, **kwargs: Any) -> Any:
        if not self._agg_helper:
            return super().apply_gradients(*args, **kwargs)  # type: ignore[misc]
        if isinstance(args[0], zip):  # read by both branches of the helper's condition
            args = (list(args[0]), *args[1:])
        return self._agg_helper.apply_gradients(
            lambda: super(_Keras2DistributedOptimizer, self).apply_gradients(*args, **kwargs),  # type: ignore[misc]
            self, *args, **kwargs)


def DistributedOptimizer(optimizer: Any, name: str | None = None, use_locking: bool = False, device_dense: str = "",  # noqa: N802 - Horovod's name
                         device_sparse: str = "", compression: Any = Compression.none, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op: Any = common.Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = None,
                         process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True) -> Any:
    """An optimizer of ``optimizer``'s class and configuration whose updates use gradients
    reduced over the ranks (default: averaged). Build it before ``model.compile``.

    A tf-keras (Keras 2) optimizer, new-style or ``optimizers.legacy``, is wrapped as Horovod
    wraps it, ``backward_passes_per_step > 1`` included (local aggregation, see
    :mod:`.gradient_aggregation_eager`). For a Keras 3 optimizer, ``backward_passes_per_step > 1``
    is not supported: use Keras 3's own ``gradient_accumulation_steps`` optimizer argument (each
    micro-batch's gradient is then reduced; Average and Sum are linear, so the accumulated result
    is the same)."""
    if _is_keras2_optimizer(optimizer):
        options = {"name": name, "base_name": type(optimizer).__name__, "compression": compression,
                   "sparse_as_dense": sparse_as_dense, "op": op, "gradient_predivide_factor": gradient_predivide_factor,
                   "groups": groups, "process_set": process_set, "scale_local_gradients": scale_local_gradients,
                   "backward_passes_per_step": backward_passes_per_step,
                   "average_aggregated_gradients": average_aggregated_gradients}
        base = type(optimizer)
        # The class keeps the optimizer's name, so that a saved model loads without Horovod.
        cls = type(base.__name__, (_Keras2DistributedOptimizer, base),
                   {"__module__": base.__module__, "_hvd_options": options})
        return cls.from_config(optimizer.get_config())
    if backward_passes_per_step != 1:
        raise NotImplementedError("backward_passes_per_step > 1 is not supported for Keras 3 optimizers: create the "
                                  "optimizer with Keras' gradient_accumulation_steps=N instead")
    if not hasattr(optimizer, "apply") or not hasattr(optimizer, "get_config"):
        raise ValueError(f"DistributedOptimizer wraps Keras optimizers (Keras 3, or tf-keras), got {type(optimizer).__name__}")
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    wrapped = cls.from_config(config)
    wrapped._reduce_gradients = _GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor, groups,
                                                 process_set, f"DistributedOptimizer.{config.get('name', base.__name__)}")
    wrapped._reduce_gradients.scale_local_gradients = scale_local_gradients
    return wrapped
