"""``redsrv.horovod.tensorflow.distributed``: implemented in
:mod:`redsrv.adapters.horovod.tensorflow.distributed`."""

from redsrv.adapters.horovod.tensorflow.distributed import *  # noqa: F403 - exactly the names in its __all__
from redsrv.adapters.horovod.tensorflow.distributed import __all__ as __all__
