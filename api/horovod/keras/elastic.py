"""``hvd.elastic`` for Keras (``run``, ``KerasState``, the commit and batch/epoch callbacks), as
Horovod's ``horovod.keras.elastic``; implemented in :mod:`redsrv.adapters.horovod.keras.elastic`."""

from redsrv.adapters.horovod.keras.elastic import *  # noqa: F403 - exactly the names in its __all__
from redsrv.adapters.horovod.keras.elastic import __all__ as __all__
