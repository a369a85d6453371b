"""Keras 3 callbacks for :class:`redsrv.tf.ReductionServerStrategy` (imported on first use, so
``redsrv.tf`` does not load Keras by itself).

Keras 3's ``BackupAndRestore`` is not multi-worker aware: under any multi-worker strategy every
worker writes the same files (on one shared file system they collide) and restores whatever it
finds. tf.keras 2's was (the chief wrote, the others used temporary directories).
:class:`BackupAndRestore` restores that contract with Keras 3's arguments.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from redsrv.core import collectives

from . import tf as _tf

__all__ = ["BackupAndRestore"]


class BackupAndRestore(keras.callbacks.BackupAndRestore):  # type: ignore[misc]
    """``keras.callbacks.BackupAndRestore`` for :class:`redsrv.tf.ReductionServerStrategy`.

    Same arguments and files as Keras's (``backup_dir``, ``save_freq="epoch"`` or a batch count,
    ``double_checkpoint``, ``delete_checkpoint``). Under a strategy of several workers:

    * only the chief (worker 0) writes the backup, and only it deletes it at the end of training;
    * at the start of ``fit`` the chief loads its backup (falling back to the previous one when
      ``double_checkpoint`` kept it) and sends the weights, the optimizer's state and the epoch to
      resume from to every other worker through the reducers. The other workers never read
      ``backup_dir``: they need no shared file system, and they all resume where the chief does.

    Restarting a job after a failure: start every worker again (a new job name, or the same one once
    the reducers have dropped the failed job) with the same callback; training resumes at the epoch
    after the last backup. As with Keras's callback, a backup taken mid-epoch (``save_freq`` an
    integer) resumes at the start of that epoch with the weights of that moment.

    Under any other strategy, or one worker, it is Keras's callback unchanged.
    """

    def _workers(self) -> Any:
        strategy = self.model.distribute_strategy
        if isinstance(strategy, _tf.ReductionServerStrategy) and strategy.num_workers > 1:
            return strategy
        return None

    def on_train_begin(self, logs: Any = None) -> None:
        strategy = self._workers()
        if strategy is None:
            super().on_train_begin(logs)
            return
        # Every worker creates the optimizer's variables now, in the same order: their initial values
        # are broadcast from worker 0, and the chief alone would otherwise create them while loading.
        if self.model.optimizer is not None and not self.model.optimizer.built:
            self.model.optimizer.build(self.model.trainable_variables)
        variables = self._restored_variables()
        header = np.zeros(2, dtype=np.int64)  # (a backup was loaded, the epoch to resume from)
        if strategy.is_chief:
            super().on_train_begin(logs)  # Keras's restore, from backup_dir
            header[:] = (int(tf.io.gfile.exists(self._weights_path)), self.model._initial_epoch or 0)
        ops = strategy.cross_device_ops
        header = ops.client.broadcast(header, root=0, key=ops._keys.next_key("backup"), timeout=ops.timeout)
        if header[0]:
            chief = collectives.broadcast_exact(ops.client, _pack(variables), root=0, key=ops._keys.next_key("backup"),
                                                timeout=ops.timeout)
            if not strategy.is_chief:
                for variable, value in zip(variables, _unpack(chief, variables)):
                    variable.assign(value)
        if header[1] and not strategy.is_chief:
            self.model._initial_epoch = int(header[1])

    def _restored_variables(self) -> list[Any]:
        """What Keras's backup holds: the model's weights and the optimizer's variables."""
        optimizer = self.model.optimizer
        return list(self.model.weights) + (list(optimizer.variables) if optimizer is not None else [])

    def _save_model(self) -> None:
        strategy = self._workers()
        if strategy is None or strategy.is_chief:
            super()._save_model()

    def on_train_end(self, logs: Any = None) -> None:
        strategy = self._workers()
        if strategy is None or strategy.is_chief:
            super().on_train_end(logs)


def _pack(variables: list[Any]) -> np.ndarray:
    """Every variable's bytes, one after the other (the same layout on every worker: one model)."""
    arrays = [np.ascontiguousarray(keras.ops.convert_to_numpy(v)) for v in variables]
    if not arrays:
        return np.zeros(0, dtype=np.uint8)
    return np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])


def _unpack(raw: np.ndarray, variables: list[Any]) -> list[np.ndarray]:
    values = []
    offset = 0
    for variable in variables:
        like = keras.ops.convert_to_numpy(variable)
        values.append(raw[offset : offset + like.nbytes].view(like.dtype).reshape(like.shape))
        offset += like.nbytes
    return values
