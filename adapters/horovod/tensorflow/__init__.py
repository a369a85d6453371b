"""``import redsrv.horovod.tensorflow as hvd``: Horovod's TensorFlow API on the reduction server.

Collectives on tensors (eagerly and inside ``tf.function``), ``DistributedGradientTape`` for
custom training loops, ``DistributedOptimizer`` for Keras 3 optimizers, ``broadcast_variables``.
Launch with ``redsrv run -np N python train.py`` (or mpirun/SLURM with ``REDSRV_REDUCERS``).
See docs/horovod.md for what differs from Horovod.
"""

import tensorflow as tf

from ..common import *  # noqa: F403 - init, size, rank, ..., ops, process sets: listed once in common.__all__
from ..common import __all__ as _common_all
from .distributed import DistributedGradientTape, DistributedOptimizer
from .mpi_ops import (
    Compression,
    allgather,
    allgather_object,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    broadcast_global_variables,
    broadcast_object,
    broadcast_variables,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    reducescatter,
    size_op,
)

__all__ = [
    *_common_all,
    "Compression", "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_", "alltoall",
    "reducescatter", "grouped_reducescatter", "barrier",
    "join", "broadcast_variables", "broadcast_object", "allgather_object", "DistributedGradientTape",
    "DistributedOptimizer", "broadcast_global_variables",
    "rank_op", "local_rank_op", "size_op", "local_size_op", "process_set_included_op",
]


def _executing_eagerly() -> bool:
    """Horovod's private helper (``horovod.tensorflow.util._executing_eagerly``, an attribute of
    ``horovod.tensorflow`` too), which Horovod's own tests call as ``hvd._executing_eagerly()``;
    not in ``__all__``, re-exported by name."""
    return tf.executing_eagerly()
