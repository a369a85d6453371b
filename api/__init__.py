"""redsrv: a reduction server for data-parallel training.

Workers push gradient chunks to stateless CPU reducers and pull back the sums: every worker
sends and receives its gradient once, about 2(n-1)/n times less traffic than ring all-reduce.

>>> import redsrv
>>> client = redsrv.Client(["10.0.0.5:29600"], rank=0, world_size=4, job="run-17")  # doctest: +SKIP

Framework adapters: ``redsrv.torch``, ``redsrv.tf``, ``redsrv.jax`` (each imports its framework).
"""

from importlib.metadata import PackageNotFoundError, version

from redsrv.core import *  # noqa: F403 - the public API is the core's, listed once in its __all__
from redsrv.core import __all__ as _core_all

try:
    __version__ = version("redsrv")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [*_core_all, "__version__"]
