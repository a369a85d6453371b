"""``hvd.elastic`` for Keras on TensorFlow, Keras 3 or tf-keras (Horovod 0.28's ``horovod.keras.elastic``
and ``horovod.tensorflow.keras.elastic``): :class:`KerasState`, ``run``, and the callbacks that keep
the state's ``batch`` and ``epoch`` current and commit it during ``model.fit``::

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=10)]

    @hvd.elastic.run
    def train(state):
        state.model.fit(dataset, steps_per_epoch=steps, epochs=epochs - state.epoch, callbacks=callbacks)
    train(state)

Launch with ``redsrv run -np 4 --min-np 2 python train.py`` (docs/horovod.md, "Elastic training").
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ..elastic import HostsUpdatedInterrupt, State
from ..tensorflow.elastic import TensorFlowKerasState, run

__all__ = ["KerasState", "TensorFlowKerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "HostsUpdatedInterrupt", "run"]


class KerasState(TensorFlowKerasState):
    """The state of a Keras model and its optimizer (``optimizer``, else the compiled one), plus
    plain objects given as keywords, exposed as attributes (``state.batch``, ``state.epoch``)."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, backend=tf.keras.backend, **kwargs)


class CommitStateCallback(tf.keras.callbacks.Callback):
    """Commit ``state`` after every ``batches_per_commit`` batches and at the end of every epoch.
    The count starts again at every ``fit`` (each new world), so every rank commits at the same
    batches: a commit is where workers waiting to join are let in, and all ranks must see it."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be at least 1, got {batches_per_commit}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.batches_remaining = self.batches_per_commit

    def on_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(tf.keras.callbacks.Callback):
    """Keep ``state.batch`` at the last finished batch of the epoch (0 once the epoch ends).

    Horovod also shortens the first epoch after a reset by ``state.batch`` steps through
    ``params['steps']``. Keras 3 reads the number of steps once, before the first epoch, so here
    that value only changes what the progress bar shows: the resumed epoch runs all its steps.
    Commit at epoch ends (``batches_per_commit`` a divisor of the steps per epoch) for resumed
    epochs to line up, or size the resumed ``fit`` from ``state.batch`` yourself."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: int | None = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        steps = (self.params or {}).get("steps")
        if steps:
            if self.steps_per_epoch is None:
                self.steps_per_epoch = steps
            self.params["steps"] = self.steps_per_epoch - self.state.batch  # type: ignore[attr-defined]

    def on_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.batch = batch  # type: ignore[attr-defined]

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.batch = 0  # type: ignore[attr-defined]


class UpdateEpochStateCallback(tf.keras.callbacks.Callback):
    """Keep ``state.epoch`` at the number of epochs finished across every ``fit`` of the run.
    Keras numbers each ``fit``'s epochs from 0, so the count is offset by ``state.epoch`` at the
    start of the ``fit``; it counts the epoch just finished (+1), so that a reset after it does
    not repeat it."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch  # type: ignore[attr-defined]

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.initial_epoch = self.state.epoch  # type: ignore[attr-defined]

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1  # type: ignore[attr-defined]
