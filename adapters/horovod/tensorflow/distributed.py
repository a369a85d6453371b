"""Horovod's gradient wrappers for TensorFlow: ``DistributedGradientTape`` (custom loops) and
``DistributedOptimizer`` (Keras 3 optimizers, ``model.fit``). Both reduce every gradient of a
step in one host call (:func:`grouped_allreduce`), default op Average."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from .. import common
from ..common import ProcessSet, global_process_set
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
        if not any(local):
            return tf.nest.pack_sequence_as(grads, self._reduce_gradients(flat))
        reduced = iter(self._reduce_gradients([g for g, own in zip(flat, local) if not own]))
        size = self._reduce_gradients.process_set.size() or 1
        out = []
        for g, own in zip(flat, local):
            if not own:
                out.append(next(reduced))
            elif g is None or not self._scale_local_gradients:
                out.append(g)
            elif isinstance(g, tf.IndexedSlices):
                out.append(tf.IndexedSlices(g.values / size, g.indices, g.dense_shape))
            else:
                out.append(g / size)
        return tf.nest.pack_sequence_as(grads, out)

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


class _DistributedOptimizer:
    """Mixed in before a Keras 3 optimizer's class: ``apply`` reduces the gradients first
    (``apply_gradients``, which ``model.fit`` calls, goes through ``apply``)."""

    _reduce_gradients: _GradientReducer

    def apply(self, grads: Sequence[Any], trainable_variables: Any = None) -> Any:
        return super().apply(self._reduce_gradients(list(grads)), trainable_variables)  # type: ignore[misc]


def DistributedOptimizer(optimizer: Any, name: str | None = None, use_locking: bool = False, device_dense: str = "",  # noqa: N802 - Horovod's name
                         device_sparse: str = "", compression: Any = Compression.none, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op: Any = common.Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = None,
                         process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True) -> Any:
    """A Keras 3 optimizer of ``optimizer``'s class and configuration whose updates use gradients
    reduced over the ranks (default: averaged). Build it before ``model.compile``.

    ``backward_passes_per_step`` > 1 (local gradient accumulation) is not supported here: use
    Keras 3's own ``gradient_accumulation_steps`` optimizer argument (each micro-batch's gradient
    is then reduced; Average and Sum are linear, so the accumulated result is the same)."""
    if backward_passes_per_step != 1:
        raise NotImplementedError("backward_passes_per_step > 1 is not supported for Keras optimizers: create the optimizer "
                                  "with Keras' gradient_accumulation_steps=N instead")
    if not hasattr(optimizer, "apply") or not hasattr(optimizer, "get_config"):
        raise ValueError(f"DistributedOptimizer wraps Keras 3 optimizers, got {type(optimizer).__name__}")
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    wrapped = cls.from_config(config)
    wrapped._reduce_gradients = _GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor, groups,
                                                 process_set, f"DistributedOptimizer.{config.get('name', base.__name__)}")
    return wrapped
