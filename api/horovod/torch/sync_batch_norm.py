"""``redsrv.horovod.torch.sync_batch_norm``, as ``horovod.torch.sync_batch_norm``: implemented in
:mod:`redsrv.adapters.horovod.torch.sync_batch_norm`."""

from redsrv.adapters.horovod.torch.sync_batch_norm import *  # noqa: F403 - exactly the names in its __all__
from redsrv.adapters.horovod.torch.sync_batch_norm import __all__ as __all__
