"""``import redsrv.horovod.torch as hvd``: Horovod's PyTorch API on the reduction server, implemented
in :mod:`redsrv.adapters.horovod.torch`. See docs/horovod.md for what differs from Horovod."""

from redsrv.adapters.horovod.torch import *  # noqa: F403 - exactly the names in its __all__
from redsrv.adapters.horovod.torch import __all__ as __all__

# Horovod's submodules, as attributes too (``hvd.mpi_ops``), as ``import horovod.torch`` gives them.
from . import compression, elastic, functions, mpi_ops, optimizer, sampler, sync_batch_norm  # noqa: F401
