"""``hvd.elastic`` for TensorFlow 2 (Horovod 0.28's ``horovod.tensorflow.elastic``): the ``run``
decorator, :class:`TensorFlowKerasState` (a Keras model and its optimizer) and
:class:`TensorFlowState` (a list of variables), over the framework-neutral loop in
:mod:`redsrv.adapters.horovod.elastic`. The Keras callbacks are in
:mod:`redsrv.adapters.horovod.keras.elastic`.

A collective that fails inside a ``tf.function`` (``model.fit``'s training step) reaches Python as
TensorFlow's ``UnknownError`` wrapping our :class:`HorovodInternalError`; ``run`` turns it back
into that error so the loop restores the last commit, as Horovod's ``run`` does with its ops'
errors. Only TensorFlow 2 in eager mode is supported (no ``tf.compat.v1`` sessions).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from .. import common
from ..elastic import HostsUpdatedInterrupt, ObjectState, reset_world, run_fn
from .mpi_ops import broadcast_object, broadcast_variables

__all__ = ["run", "TensorFlowKerasState", "TensorFlowState", "HostsUpdatedInterrupt"]


def _is_collective_failure(error: tf.errors.OpError) -> bool:
    # TensorFlow keeps only the text of an exception raised in a host call (tf.numpy_function),
    # starting with its class name; HorovodInternalError is the only one our collectives raise
    # for a lost peer or a passed deadline (common.wait_future).
    return common.HorovodInternalError.__name__ in (error.message or "")


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``func(state, ...)`` elastically (see :func:`redsrv.adapters.horovod.elastic.run_fn`):
    on a lost worker every worker restores the last commit, on workers waiting to join every
    worker keeps its state; then all join the new world, run the reset callbacks, sync the state
    from rank 0 and call ``func`` again. ``func`` must not start with a collective of its own."""

    @functools.wraps(func)
    def translated(state: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as error:
            if _is_collective_failure(error):
                raise common.HorovodInternalError(f"a collective inside a TensorFlow function failed: {error.message}") \
                    from error
            raise

    return run_fn(translated, reset_world)


def _snapshot(variables: Sequence[Any]) -> list[np.ndarray]:
    # Host copies: a commit must survive whatever the next steps assign to the variables.
    return [np.array(tf.convert_to_tensor(v)) for v in variables]


def _assign(variables: Sequence[Any], values: Sequence[np.ndarray]) -> None:
    for variable, value in zip(variables, values):
        variable.assign(value)


class TensorFlowKerasState(ObjectState):
    """The state of a Keras model and its optimizer (``optimizer`` or the model's compiled one),
    plus plain objects given as keywords (``state.epoch``, ``state.batch``). ``commit`` copies
    every model and optimizer variable to host memory; ``restore`` assigns the copies back;
    ``sync`` broadcasts rank 0's variables and objects.

    The model must be built. An optimizer whose variables do not exist yet is built here for the
    model's trainable variables (Horovod asks for one ``fit`` step first; Keras 3 can build them
    directly), so the slots and the iteration count are part of the state from the start.
    ``backend`` is accepted for Horovod's signature (TensorFlow 1 sessions are not supported)."""

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any) -> None:
        if not getattr(model, "built", True):
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if optimizer is None:
            raise ValueError("TensorFlowKerasState needs an optimizer: pass optimizer=, or compile the model first")
        if not getattr(optimizer, "built", True):
            optimizer.build(model.trainable_variables)
        self.model = model
        self.optimizer = optimizer
        self.backend = backend
        self._save_model()
        super().__init__(bcast_object=broadcast_object, get_rank=common.rank, **kwargs)

    def _variables(self) -> list[Any]:
        return [*self.model.variables, *self.optimizer.variables]

    def save(self) -> None:
        self._save_model()
        super().save()

    def restore(self) -> None:
        _assign(self._variables(), self._saved_variables)
        super().restore()

    def sync(self) -> None:
        broadcast_variables(self._variables(), root_rank=0)
        self._save_model()
        super().sync()

    def _save_model(self) -> None:
        self._saved_variables = _snapshot(self._variables())


class TensorFlowState(ObjectState):
    """The state of a list of ``tf.Variable`` objects (TensorFlow 2, eager), plus plain objects
    given as keywords. ``session`` is accepted for Horovod's signature and must be None."""

    def __init__(self, variables: Sequence[Any] | None = None, session: Any = None, **kwargs: Any) -> None:
        if session is not None:
            raise ValueError("TensorFlowState(session=...) is TensorFlow 1's graph mode, which is not supported")
        if not variables:
            raise ValueError("TensorFlowState needs the variables to track (TensorFlow 2 has no global variables "
                             "collection)")
        self.variables = list(variables)
        self._saved_values = _snapshot(self.variables)
        super().__init__(bcast_object=broadcast_object, get_rank=common.rank, **kwargs)

    def save(self) -> None:
        self._saved_values = _snapshot(self.variables)
        super().save()

    def restore(self) -> None:
        _assign(self.variables, self._saved_values)
        super().restore()

    def sync(self) -> None:
        broadcast_variables(self.variables, root_rank=0)
        self._saved_values = _snapshot(self.variables)
        super().sync()
