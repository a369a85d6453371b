"""Framework-neutral core of redsrv: wire protocol, chunker, reducer, transport, client.

Imports NumPy (and ml_dtypes for bfloat16) and the standard library only.
"""

from .client import Client, Contributors, ReduceFuture
from .config import Config
from .daemon import DaemonSettings, ReducerDaemon
from .errors import (
    AuthenticationError,
    ClientClosedError,
    ConfigError,
    ContributionMismatchError,
    JobMismatchError,
    LocalProtocolError,
    PeerError,
    PeerLostError,
    PeerTimeoutError,
    ProtocolError,
    RedsrvError,
    ReducerShutdownError,
    RemoteProtocolError,
    StaleContributionError,
)

__all__ = [
    "Client",
    "Config",
    "Contributors",
    "ReduceFuture",
    "ReducerDaemon",
    "DaemonSettings",
    "RedsrvError",
    "ConfigError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "PeerError",
    "PeerTimeoutError",
    "PeerLostError",
    "ReducerShutdownError",
    "JobMismatchError",
    "ContributionMismatchError",
    "StaleContributionError",
    "AuthenticationError",
    "ClientClosedError",
]
