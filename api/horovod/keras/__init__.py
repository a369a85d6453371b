"""``import redsrv.horovod.keras as hvd``: Horovod's Keras API (Keras 3 on TensorFlow) on the reduction
server, implemented in :mod:`redsrv.adapters.horovod.keras`. See docs/horovod.md for what differs from Horovod."""

from importlib import import_module as _import_module

from redsrv.adapters.horovod.keras import *  # noqa: F403 - exactly the names in its __all__
from redsrv.adapters.horovod.keras import __all__ as __all__

# ``hvd.callbacks`` and ``hvd.elastic`` are this package's own submodules (the same classes), as it would be after an
# import of ``redsrv.horovod.keras.callbacks`` by name, not the implementation's module the star
# import bound (``from . import callbacks`` would keep that one: the name is already bound).
callbacks = _import_module(f"{__name__}.callbacks")
elastic = _import_module(f"{__name__}.elastic")
