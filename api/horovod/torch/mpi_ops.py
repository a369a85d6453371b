"""``redsrv.horovod.torch.mpi_ops``, as ``horovod.torch.mpi_ops``: implemented in
:mod:`redsrv.adapters.horovod.torch.mpi_ops`."""

from redsrv.adapters.horovod.torch.mpi_ops import *  # noqa: F403 - exactly the names in its __all__
from redsrv.adapters.horovod.torch.mpi_ops import __all__ as __all__
