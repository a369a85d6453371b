"""``redsrv.horovod.tensorflow.keras.callbacks``, as ``horovod.tensorflow.keras.callbacks``: the
classes of :mod:`redsrv.horovod.keras.callbacks`."""

from redsrv.adapters.horovod.keras.callbacks import *  # noqa: F403 - exactly the names in its __all__
from redsrv.adapters.horovod.keras.callbacks import __all__ as __all__
