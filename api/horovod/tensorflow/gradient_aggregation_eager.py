"""``redsrv.horovod.tensorflow.gradient_aggregation_eager``, as Horovod's module of that name:
implemented in :mod:`redsrv.adapters.horovod.tensorflow.gradient_aggregation_eager`."""

from redsrv.adapters.horovod.tensorflow.gradient_aggregation_eager import *  # noqa: F403 - exactly the names in its __all__
from redsrv.adapters.horovod.tensorflow.gradient_aggregation_eager import __all__ as __all__
