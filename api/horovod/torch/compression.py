"""``redsrv.horovod.torch.compression``, as ``horovod.torch.compression``: implemented in
:mod:`redsrv.adapters.horovod.torch.compression`."""

from redsrv.adapters.horovod.torch.compression import *  # noqa: F403 - exactly the names in its __all__
from redsrv.adapters.horovod.torch.compression import __all__ as __all__
