"""``hvd.elastic`` for PyTorch (``run``, ``TorchState``, ``ElasticSampler``, ``HostsUpdatedInterrupt``), as Horovod's
``horovod.torch.elastic``; implemented in :mod:`redsrv.adapters.horovod.torch.elastic`."""

from redsrv.adapters.horovod.torch.elastic import *  # noqa: F403 - exactly the names in its __all__
from redsrv.adapters.horovod.torch.elastic import __all__ as __all__
