"""Horovod's Keras callbacks for ``model.fit``: callbacks of the Keras that ``tf.keras`` is, Keras 3,
or tf-keras (Keras 2) under ``TF_USE_LEGACY_KERAS=1``, as Horovod's ``horovod.tensorflow.keras``
subclasses ``tf.keras.callbacks.Callback``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import tensorflow as tf

from .. import common
from ..tensorflow.mpi_ops import broadcast_variables

#: The Keras of ``tf.keras``, read once: Keras 3, or tf-keras with ``TF_USE_LEGACY_KERAS=1``.
_Callback = tf.keras.callbacks.Callback


def _is_keras2(model: Any) -> bool:
    """Whether ``model`` is a tf-keras (Keras 2) one: its optimizer builds its variables at the
    first step, not before training."""
    return any(k.__module__.startswith("tf_keras") for k in type(model).__mro__)


def _optimizer_variables(optimizer: Any) -> list[Any]:
    variables = optimizer.variables  # a list, or a method (tf-keras' optimizers.legacy)
    return list(variables() if callable(variables) else variables)

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback"]


class BroadcastGlobalVariablesCallback(_Callback):
    """Make every rank start from rank ``root_rank``'s model and optimizer variables.

    Horovod broadcasts after the first batch (when a Keras 2 optimizer's variables first exist),
    and so does this callback for a tf-keras model; Keras 3 builds them before training begins,
    so for a Keras 3 model the broadcast happens at ``on_train_begin`` and the first step already
    starts from identical weights. ``local_variables`` are left alone."""

    def __init__(self, root_rank: int, device: str = "", local_variables: Iterable[Any] | None = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        self._local = {id(v) for v in (local_variables or ())}

    def register_local_var(self, var: Any) -> None:
        self._local.add(id(var))

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if not _is_keras2(self.model):
            self._broadcast()

    def on_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._broadcast()

    def _broadcast(self) -> None:
        if self.broadcast_done:
            return
        variables = [v for v in self.model.variables if id(v) not in self._local]
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            variables += [v for v in _optimizer_variables(optimizer) if id(v) not in self._local]
        broadcast_variables(variables, root_rank=self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(_Callback):
    """Replace each epoch's logged metrics with their average over the ranks, so that callbacks
    after it (``ReduceLROnPlateau``, checkpoints) see the same values everywhere."""

    def __init__(self, device: str = "") -> None:
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if not logs:
            return
        for metric in sorted(logs):  # the same order on every rank
            value = np.asarray(logs[metric], dtype=np.float64).reshape(-1)
            future = common.allreduce_async(common.global_process_set, value, common.Average, name=f"metric.{metric}")
            logs[metric] = float(common.wait_future(future, common.global_process_set.client())[0])


class LearningRateScheduleCallback(_Callback):
    """Between epochs ``start_epoch`` and ``end_epoch``, set the learning rate to
    ``initial_lr * multiplier(epoch)`` (``multiplier`` a function of the epoch, or a constant
    ``m`` meaning ``m ** (epoch - start_epoch)``); once per epoch with ``staircase``, else every
    batch with a fractional epoch.

    ``momentum_correction`` (Goyal et al.: momentum scaled by new/old rate for the batch the rate
    changes in) acts on tf-keras' ``optimizers.legacy`` optimizers, whose momentum is a variable,
    as in Horovod. A Keras 3 or new-style tf-keras optimizer's momentum is a Python number
    compiled into the training step, so there it has no effect."""

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float], start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        self.restore_momentum: float | None = None
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier ** (epoch - start_epoch))

    def _learning_rate(self) -> float:
        return float(np.asarray(self.model.optimizer.learning_rate))

    def _adjust_learning_rate(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old_lr = self._learning_rate()
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        # Only an optimizers.legacy optimizer (tf-keras) keeps its momentum as a hyperparameter variable.
        if self.momentum_correction and "momentum" in getattr(optimizer, "_hyper", {}):
            self.restore_momentum = float(np.asarray(optimizer.momentum))
            optimizer.momentum = self.restore_momentum * new_lr / old_lr

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            steps = (self.params or {}).get("steps")
            if not steps:
                raise ValueError(f"Could not autodetect the number of steps per epoch: pass steps_per_epoch to "
                                 f"{type(self).__name__}()")
            self.steps_per_epoch = steps

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.current_epoch = epoch

    def on_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.current_epoch < self.start_epoch or (self.end_epoch is not None and self.current_epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._adjust_learning_rate(self.current_epoch)
        else:
            self._adjust_learning_rate(self.current_epoch + batch / self.steps_per_epoch)  # type: ignore[operator]

    def on_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.restore_momentum:
            self.model.optimizer.momentum = self.restore_momentum
            self.restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["lr"] = self._learning_rate()


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Goyal et al.'s gradual warmup: over ``warmup_epochs`` the learning rate grows from
    ``initial_lr / size`` to ``initial_lr`` (``initial_lr`` is the rate scaled for all ranks)."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            # shifted by one batch so that each epoch ends on a round value
            epoch += 1.0 / self.steps_per_epoch  # type: ignore[operator]
            n = common.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and common.rank() == 0:  # type: ignore[operator]
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {self._learning_rate():g}.")
