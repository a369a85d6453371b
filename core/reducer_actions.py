"""What the reducer's state machine asks the daemon to do: the :data:`Action` types its events
return, and the two sentinels :meth:`ReducerCore.extend` returns instead of a new limit.

Kept apart from the state so that the daemon, the only I/O around the core, can see everything it
must execute in one place; ``docs/architecture.md`` lists these, and
``tests/unit/test_architecture_docs.py`` fails when the list and this module disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .wire import Error

__all__ = ["Action", "SendError", "SendResult", "CloseConnection", "SendSafe", "Log", "DISCARD", "WAIT_FOR_MEMORY"]

#: What :meth:`ReducerCore.extend` returns when the rest of a payload is to be read and dropped
#: (its chunk failed meanwhile: nothing will use those bytes).
DISCARD = -1
#: ... or when the push must wait for memory (the daemon stops reading it and asks again later).
WAIT_FOR_MEMORY = -2


@dataclass
class SendError:
    """Send ``frame`` on ``conn``; close the connection after it when ``close_after``."""

    conn: int
    frame: Error
    close_after: bool = False


@dataclass
class SendResult:
    """Send ``header`` then ``data`` to every connection in ``conns``; each connection's writer
    calls ``release()`` once when it is done with ``data`` (sent or dropped)."""

    conns: list[int]
    header: bytes
    data: memoryview
    release: Callable[[], None]


@dataclass
class CloseConnection:
    """Close ``conn`` without a word (a sibling stream of a client that broke)."""

    conn: int


@dataclass
class SendSafe:
    """Tell the worker on ``conn`` that every rank has the results of its first ``frames``
    RESULT frames (wire.Safe)."""

    conn: int
    frames: int


@dataclass
class Log:
    """Log ``message`` at ``level``."""

    level: str  # "info", "warning", "error"
    message: str


Action = SendError | SendResult | CloseConnection | SendSafe | Log
