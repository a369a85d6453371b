"""Horovod's framework-neutral names (``init``, ``rank``, ops, process sets, ``HorovodInternalError``),
which every framework module re-exports too; implemented in :mod:`redsrv.adapters.horovod.common`."""

from redsrv.adapters.horovod.common import *  # noqa: F403 - exactly the names in its __all__
from redsrv.adapters.horovod.common import __all__ as __all__
