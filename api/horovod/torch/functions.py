"""``redsrv.horovod.torch.functions``, as ``horovod.torch.functions``: implemented in
:mod:`redsrv.adapters.horovod.torch.functions`."""

from redsrv.adapters.horovod.torch.functions import *  # noqa: F403 - exactly the names in its __all__
from redsrv.adapters.horovod.torch.functions import __all__ as __all__
