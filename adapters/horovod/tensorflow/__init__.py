"""``import redsrv.horovod.tensorflow as hvd``: Horovod's TensorFlow API on the reduction server.

Collectives on tensors (eagerly and inside ``tf.function``), ``DistributedGradientTape`` for
custom training loops, ``DistributedOptimizer`` for Keras 3 optimizers, ``broadcast_variables``.
Launch with ``redsrv run -np N python train.py`` (or mpirun/SLURM with ``REDSRV_REDUCERS``).
See docs/horovod.md for what differs from Horovod.
"""

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
    broadcast_global_variables,
    broadcast_object,
    broadcast_variables,
    grouped_allreduce,
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
    "Compression", "allreduce", "grouped_allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier",
    "join", "broadcast_variables", "broadcast_object", "allgather_object", "DistributedGradientTape",
    "DistributedOptimizer", "broadcast_global_variables",
    "rank_op", "local_rank_op", "size_op", "local_size_op", "process_set_included_op",
]
