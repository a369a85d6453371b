"""``import redsrv.horovod.tensorflow.keras as hvd``: Horovod's ``horovod.tensorflow.keras`` path
(its ``tf.keras`` API). TensorFlow's Keras is Keras 3 here, so this is :mod:`redsrv.horovod.keras`
under Horovod's other name: the same functions, callbacks and elastic classes."""

from importlib import import_module as _import_module

from redsrv.horovod.keras import *  # noqa: F403 - exactly the names in its __all__
from redsrv.horovod.keras import __all__ as __all__

# This package's own submodules, as ``import horovod.tensorflow.keras`` gives them.
callbacks = _import_module(f"{__name__}.callbacks")
elastic = _import_module(f"{__name__}.elastic")
