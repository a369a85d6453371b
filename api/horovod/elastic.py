"""Horovod's elastic training, framework-neutral (``State``, ``ObjectState``,
``HostsUpdatedInterrupt``); implemented in :mod:`redsrv.adapters.horovod.elastic`. Scripts use
their framework's ``hvd.elastic`` (``redsrv.horovod.torch.elastic``)."""

from redsrv.adapters.horovod.elastic import *  # noqa: F403 - exactly the names in its __all__
from redsrv.adapters.horovod.elastic import __all__ as __all__
