"""Horovod's local gradient aggregation (``backward_passes_per_step > 1``) for Keras 2 (tf-keras)
optimizers, as ``horovod.tensorflow.gradient_aggregation_eager``: each step's gradients are added
to local accumulators; every ``backward_passes_per_step``-th step the sums are reduced over the
ranks (divided by ``backward_passes_per_step`` with ``average_aggregated_gradients``) and
applied, and the accumulators are reset; the other steps only count the optimizer's iteration.

The reset assigns zeros rather than subtracting the sums, so an inf or NaN gradient spoils one
aggregation cycle only (Horovod's ``test_grad_aggregation_with_inf_grad``). The reduction is
the optimizer's own (one host call of :func:`grouped_allreduce`); nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from ..common import ProcessSet, global_process_set

__all__ = ["LocalGradientAggregationHelperEager", "reduce_with_locals"]


def reduce_with_locals(allreduce: Callable[[list[Any]], list[Any]], grads: Sequence[Any], local: Sequence[bool],
                       size: int, scale_local_gradients: bool) -> list[Any]:
    """``grads`` with the others' (``local`` false) reduced by ``allreduce`` in one call, and the
    local ones kept, divided by ``size`` when ``scale_local_gradients`` (Horovod's
    ``__filtered_reduce_grads``: a local gradient stays this rank's own)."""
    if not any(local):
        return list(allreduce(list(grads)))
    reduced = iter(allreduce([g for g, own in zip(grads, local) if not own]))
    out = []
    for g, own in zip(grads, local):
        if not own:
            out.append(next(reduced))
        elif g is None or not scale_local_gradients:
            out.append(g)
        elif isinstance(g, tf.IndexedSlices):
            out.append(tf.IndexedSlices(g.values / size, g.indices, g.dense_shape))
        else:
            out.append(g / size)
    return out


class LocalGradientAggregationHelperEager:
    """Horovod's helper of the same name, for a tf-keras optimizer built eagerly (TensorFlow 2).

    ``allreduce_func(grads, vars)`` reduces a list of gradients over the ranks. ``counter`` (a
    variable) counts the steps of the current cycle: it is 0 right after the reduction."""

    def __init__(self, backward_passes_per_step: int, allreduce_func: Callable[[Sequence[Any], Sequence[Any]], list[Any]],
                 sparse_as_dense: bool, average_aggregated_gradients: bool,
                 process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True) -> None:
        self.allreduce_grads = allreduce_func
        self.sparse_as_dense = sparse_as_dense
        self.backward_passes_per_step = backward_passes_per_step
        if self.backward_passes_per_step <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self.average_aggregated_gradients = average_aggregated_gradients
        self.locally_aggregated_grads: dict[int, tf.Variable] = {}
        self.counter = tf.Variable(initial_value=0)
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._local_vars: set[Any] = set()

    def register_local_var(self, var: Any) -> None:
        """Horovod's: ``var``'s gradient is aggregated but never reduced over the ranks."""
        self._local_vars.add(var.ref())

    def compute_gradients(self, grads: Sequence[Any], vars: Sequence[Any]) -> Any:  # noqa: A002 - Horovod's name
        """The accumulated gradients; on every ``backward_passes_per_step``-th call, reduced."""
        resulting_grads = []
        for idx, grad in enumerate(grads):
            if self.sparse_as_dense and isinstance(grad, tf.IndexedSlices):
                grad = tf.convert_to_tensor(grad)
            elif isinstance(grad, tf.IndexedSlices):
                raise ValueError("IndexedSlices are not supported when `backward_passes_per_step` > 1 and "
                                 "`sparse_as_dense` is False.")
            if idx not in self.locally_aggregated_grads and grad is not None:
                # Lifted out of a tf.function being traced, so that the accumulator is created once.
                with tf.init_scope():
                    self.locally_aggregated_grads[idx] = tf.Variable(tf.zeros(grad.shape, grad.dtype), trainable=False)
            if grad is None:
                resulting_grads.append(None)
            else:
                self.locally_aggregated_grads[idx].assign_add(grad)
                resulting_grads.append(self.locally_aggregated_grads[idx].read_value())
        assert len(self.locally_aggregated_grads) == len(grads)
        self.counter.assign_add(1)

        def reduce_and_clear() -> list[Any]:
            reduced = self._allreduce_helper(resulting_grads, vars)
            self._clear_vars()
            return reduced

        return tf.cond(pred=tf.equal(self.counter, self.backward_passes_per_step), true_fn=reduce_and_clear,
                       false_fn=lambda: resulting_grads)

    def _allreduce_helper(self, grads: Sequence[Any], vars: Sequence[Any]) -> list[Any]:  # noqa: A002 - Horovod's name
        local = [v.ref() in self._local_vars for v in vars]
        reduced = reduce_with_locals(lambda gs: self.allreduce_grads(gs, [v for v, own in zip(vars, local) if not own]),
                                     grads, local, self.process_set.size() or 1, self.scale_local_gradients)
        if not self.average_aggregated_gradients:
            return reduced
        return [g if g is None else g / self.backward_passes_per_step for g in reduced]

    def _clear_vars(self) -> None:
        self.counter.assign(0)
        for variable in self.locally_aggregated_grads.values():
            variable.assign(tf.zeros_like(variable))

    def apply_gradients(self, apply_grads_closure: Callable[[], Any], optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Apply (``apply_grads_closure``) on the step that reduced; on the others only count the
        optimizer's iteration (and run its gradient aggregation, as its ``apply_gradients``
        would)."""
        legacy = hasattr(optimizer, "_create_all_weights")  # an OptimizerV2 (tf-keras' optimizers.legacy)

        def increment_optimizer_iteration() -> Any:
            if getattr(optimizer, "iterations", None) is not None:
                increment = optimizer.iterations.assign_add(1)
                return increment.op if legacy else increment
            return tf.no_op()

        def non_aggregation_step() -> Any:
            transform = getattr(optimizer, "_transform_unaggregated_gradients", None)
            optimizer._aggregate_gradients(transform(args[0]) if transform is not None else args[0])
            return increment_optimizer_iteration()

        return tf.cond(pred=tf.equal(self.counter, 0), true_fn=apply_grads_closure, false_fn=non_aggregation_step)
