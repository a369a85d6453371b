"""``import redsrv.horovod.keras as hvd``: Horovod's Keras API (Keras 3 on TensorFlow) on the
reduction server: ``DistributedOptimizer`` for ``model.fit``, the callbacks in
:mod:`redsrv.horovod.keras.callbacks`, elastic training in :mod:`redsrv.horovod.keras.elastic`,
and collectives on values (returned as NumPy arrays, as Horovod's Keras functions return
evaluated values).

A Keras 3 model must be compiled with ``jit_compile=False`` where XLA would otherwise be chosen
(a GPU): the reductions are host calls. See docs/horovod.md.
"""

from typing import Any

import numpy as np
import tensorflow as tf

from ..common import *  # noqa: F403 - init, size, rank, ..., ops, process sets: listed once in common.__all__
from ..common import Average, ProcessSet, Sum, global_process_set
from ..common import __all__ as _common_all
from ..tensorflow import distributed as _distributed
from ..tensorflow import mpi_ops as _ops
from ..tensorflow.mpi_ops import Compression
from . import callbacks, elastic

__all__ = [
    *_common_all,
    "Compression", "callbacks", "elastic", "DistributedOptimizer", "PartialDistributedOptimizer",
    "broadcast_global_variables", "allreduce", "allgather",
    "broadcast", "reducescatter",
]


def DistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "", device_sparse: str = "",  # noqa: N802 - Horovod's name
                         compression: Any = Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: Any = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = None,
                         process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True) -> Any:
    """An optimizer like ``optimizer`` (Keras 3, or tf-keras: Keras 2) whose updates use gradients
    averaged (``op``) over the ranks. Pass it to ``model.compile``. Horovod's signature;
    ``backward_passes_per_step > 1`` is for tf-keras optimizers only (docs/horovod.md)."""
    return _distributed.DistributedOptimizer(optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
                                             gradient_predivide_factor=gradient_predivide_factor, op=op,
                                             backward_passes_per_step=backward_passes_per_step,
                                             average_aggregated_gradients=average_aggregated_gradients,
                                             num_groups=num_groups, groups=groups, process_set=process_set,
                                             scale_local_gradients=scale_local_gradients)


def PartialDistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "",  # noqa: N802 - Horovod's name
                                device_sparse: str = "", compression: Any = Compression.none,
                                sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0, op: Any = Average,
                                groups: Any = None, process_set: ProcessSet = global_process_set,
                                local_layers: Any = None, scale_local_gradients: bool = True) -> Any:
    """:func:`DistributedOptimizer` whose ``local_layers``' trainable weights keep this rank's own
    gradients (not reduced; divided by the set's size when ``scale_local_gradients``), as
    Horovod's ``horovod.keras.PartialDistributedOptimizer``."""
    if op != Average and op != Sum:
        raise ValueError("op currently only supports Average and Sum")
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise ValueError("groups should be a non-negative integer or a list of list of tf.Variable.")
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, tf.keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, tf.keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    wrapped = DistributedOptimizer(optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
                                   gradient_predivide_factor=gradient_predivide_factor, op=op, groups=groups,
                                   process_set=process_set, scale_local_gradients=scale_local_gradients)
    for var in [var for layer in local_layers for var in layer.trainable_weights]:
        wrapped.register_local_var(var)
    return wrapped


def broadcast_global_variables(root_rank: int) -> None:
    raise NotImplementedError("Keras 3 has no global variables collection: use "
                              "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) in fit, or "
                              "redsrv.horovod.tensorflow.broadcast_variables(model.variables, root_rank)")


def allreduce(value: Any, name: str | None = None, average: bool = True, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op: Any = None, compression: Any = Compression.none) -> np.ndarray:
    """The value reduced over the ranks (Average unless ``average=False`` or ``op``)."""
    chosen = op if op is not None else (Average if average else Sum)
    return _ops.allreduce(tf.convert_to_tensor(value), op=chosen, name=name, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, compression=compression).numpy()


def allgather(value: Any, name: str | None = None) -> np.ndarray:
    return _ops.allgather(tf.convert_to_tensor(value), name=name).numpy()


def broadcast(value: Any, root_rank: int, name: str | None = None) -> np.ndarray:
    return _ops.broadcast(tf.convert_to_tensor(value), root_rank, name=name).numpy()


def reducescatter(value: Any, name: str | None = None, op: Any = Average) -> np.ndarray:
    return _ops.reducescatter(tf.convert_to_tensor(value), op=op, name=name).numpy()

