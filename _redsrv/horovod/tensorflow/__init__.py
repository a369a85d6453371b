"""``import redsrv.horovod.tensorflow as hvd``: Horovod's TensorFlow API on the reduction server.

Collectives on tensors (eagerly and inside ``tf.function``), ``DistributedGradientTape`` for
custom training loops, ``DistributedOptimizer`` for Keras 3 optimizers, ``broadcast_variables``.
Launch with ``redsrv run -np N python train.py`` (or mpirun/SLURM with ``REDSRV_REDUCERS``).
See docs/horovod.md for what differs from Horovod.
"""

from ..common import (
    Adasum,
    Average,
    HorovodInternalError,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from .distributed import DistributedGradientTape, DistributedOptimizer
from .mpi_ops import (
    Compression,
    allgather,
    allgather_object,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_object,
    broadcast_variables,
    grouped_allreduce,
    join,
    reducescatter,
)

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size", "cross_rank",
    "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built",
    "ddl_built", "ccl_built", "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "Compression",
    "allreduce", "grouped_allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier", "join",
    "broadcast_variables", "broadcast_object", "allgather_object", "DistributedGradientTape", "DistributedOptimizer",
]
