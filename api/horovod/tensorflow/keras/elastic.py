"""``redsrv.horovod.tensorflow.keras.elastic``, as ``horovod.tensorflow.keras.elastic``: the
classes of :mod:`redsrv.horovod.keras.elastic`."""

from redsrv.adapters.horovod.keras.elastic import *  # noqa: F403 - exactly the names in its __all__
from redsrv.adapters.horovod.keras.elastic import __all__ as __all__
