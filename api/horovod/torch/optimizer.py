"""``redsrv.horovod.torch.optimizer``, as ``horovod.torch.optimizer``: implemented in
:mod:`redsrv.adapters.horovod.torch.optimizer`."""

from redsrv.adapters.horovod.torch.optimizer import *  # noqa: F403 - exactly the names in its __all__
from redsrv.adapters.horovod.torch.optimizer import __all__ as __all__
