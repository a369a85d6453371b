"""``import redsrv.horovod.tensorflow as hvd``: Horovod's TensorFlow API on the reduction server,
implemented in :mod:`redsrv.adapters.horovod.tensorflow`. See docs/horovod.md for what differs from Horovod."""

from redsrv.adapters.horovod.tensorflow import *  # noqa: F403 - exactly the names in its __all__
from redsrv.adapters.horovod.tensorflow import __all__ as __all__
from redsrv.adapters.horovod.tensorflow import _executing_eagerly  # noqa: F401 - Horovod's tests call hvd._executing_eagerly()

# Its submodules, as attributes too (``hvd.mpi_ops``), as ``import horovod.tensorflow`` gives them.
from . import distributed, elastic, gradient_aggregation_eager, mpi_ops  # noqa: F401
