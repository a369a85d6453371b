"""``import redsrv.horovod.torch as hvd``: Horovod's PyTorch API on the reduction server.

A Horovod script runs with only its import changed::

    import redsrv.horovod.torch as hvd
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

and is launched with ``redsrv run -np 4 python train.py`` (or ``mpirun``/SLURM/torchrun with
``REDSRV_REDUCERS`` set). See docs/horovod.md for what differs from Horovod.
"""

from ..common import *  # noqa: F403 - init, size, rank, ..., ops, process sets: listed once in common.__all__
from ..common import __all__ as _common_all
from .compression import Compression
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .mpi_ops import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    *_common_all,
    "Compression", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "sparse_allreduce_async", "allgather",
    "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "join", "barrier", "poll", "synchronize", "broadcast_parameters",
    "broadcast_optimizer_state", "broadcast_object", "allgather_object", "DistributedOptimizer", "SyncBatchNorm",
]
