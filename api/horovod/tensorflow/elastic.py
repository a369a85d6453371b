"""``hvd.elastic`` for TensorFlow (``run``, ``TensorFlowKerasState``, ``TensorFlowState``), as
Horovod's ``horovod.tensorflow.elastic``; implemented in
:mod:`redsrv.adapters.horovod.tensorflow.elastic`."""

from redsrv.adapters.horovod.tensorflow.elastic import *  # noqa: F403 - exactly the names in its __all__
from redsrv.adapters.horovod.tensorflow.elastic import __all__ as __all__
