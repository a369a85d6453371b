"""Framework-neutral core of redsrv: wire protocol, chunker, reducer, transport, client.

Imports NumPy (and ml_dtypes for bfloat16) and the standard library only.
"""

from . import errors
from .client import Client, Contributors, ReduceFuture
from .config import Config
from .daemon import DaemonSettings, ReducerDaemon
from .errors import *  # noqa: F403 - the exception hierarchy is public; errors.__all__ lists it once

__all__ = ["Client", "Config", "Contributors", "ReduceFuture", "ReducerDaemon", "DaemonSettings", *errors.__all__]
