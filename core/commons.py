"""What every framework adapter shares besides the client: one key scheme and one rule for
failures of a client the adapter owns (docs/architecture.md, "Adapters").

**Keys.** The reducers match contributions by key, so a key must be the same on every rank and
unique among the job's operations in flight, without any agreement at run time. Every adapter
builds them the same way, through a :class:`KeySpace`: ``(namespace, *where, n)``, where the
namespace keeps each adapter's keys apart from the others' and from a user's own, ``where`` is
structural (a DDP bucket index, a c10d sequence number, a trace-time :func:`call_site`, a local
device) and ``n`` counts the executions of that ``where`` (:meth:`KeySpace.next_call`). Ranks that
run the same program in the same order therefore produce the same keys, and a rank that strays
sends a different length or dtype under a key, which the reducers reject on every rank
(:class:`ContributionMismatchError`) instead of summing it.

**Owned clients.** An adapter closes a client it created once it will send nothing more on it:
in its own ``close()``, and right after a failure that ends its use of the client (TensorFlow's
and JAX's failed exchanges: the adapter abandons the rest of the step), so that the reducers fail
the step for the other ranks at once (RELIABILITY R2, R3) instead of at their timeout. Where the
user decides whether to go on after a failure (the DDP hook, which can replace its client; a c10d
group; the Horovod API), the client stays open until the user closes the adapter. A client the
user passed in is never closed by an adapter. Either way the failure itself is raised or reported
as the core raised it, in the framework's idiom (R18). See :func:`abandon`.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from typing import Any

from .client import Client

__all__ = ["KeySpace", "abandon", "call_site"]

# Frames from these modules never make a call site: the standard library differs between Python
# patch releases, and redsrv's own frames say nothing about where the user called it.
_ALWAYS_SKIPPED = ("redsrv.core", "redsrv.adapters")


class KeySpace:
    """One adapter's operation keys: ``(namespace, *parts)``, and per-``where`` execution counters.
    Thread-safe: every local device's callback thread, or DDP's autograd thread beside the main
    thread, may draw keys at once.

    >>> keys = KeySpace("redsrv.tf")
    >>> [keys.next_key("site") for _ in range(2)]
    [('redsrv.tf', 'site', 0), ('redsrv.tf', 'site', 1)]
    >>> keys.next_call("other"), keys.key("broadcast", 7)
    (0, ('redsrv.tf', 'broadcast', 7))
    """

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._lock = threading.Lock()
        self._counters: dict[Any, int] = {}

    def key(self, *parts: Any) -> tuple[Any, ...]:
        """``(namespace, *parts)``."""
        return (self.namespace, *parts)

    def next_call(self, *where: Any) -> int:
        """How many times ``where`` was asked for before (0, 1, 2, ...)."""
        with self._lock:
            call = self._counters.get(where, 0)
            self._counters[where] = call + 1
        return call

    def next_key(self, *where: Any) -> tuple[Any, ...]:
        """``(namespace, *where, n)`` for the ``n``-th execution of ``where``."""
        return self.key(*where, self.next_call(*where))

    def reset(self) -> None:
        """Count every ``where`` from zero again (a new session, started on every rank)."""
        with self._lock:
            self._counters.clear()


def call_site(skip: tuple[str, ...] = (), *, context: str | None = None) -> str:
    """Where the caller was called from, as ``innermost frame#digest of every frame``: the Python
    stack outside the modules named in ``skip`` (prefixes: a framework, generated code), the
    standard library and redsrv itself, each frame as ``module:function:line``; ``context`` (e.g.
    "eager") is mixed into the digest.

    Module names and line numbers, never file paths: the same script may live in different
    directories on different hosts, and the site must be the same on every rank running the same
    program. Call it at trace time, so that a compiled step keeps its site however often it runs.
    """
    skipped = _ALWAYS_SKIPPED + tuple(skip)
    frames = []
    frame: Any = sys._getframe(1)
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if not (module.startswith(skipped) or module.partition(".")[0] in sys.stdlib_module_names):
            code = frame.f_code
            frames.append(f"{module}:{getattr(code, 'co_qualname', code.co_name)}:{frame.f_lineno}")
        frame = frame.f_back
    if context is not None:
        frames.append(context)
    digest = hashlib.blake2b("|".join(frames).encode(), digest_size=6).hexdigest()
    return f"{frames[0] if frames else context or '<unknown>'}#{digest}"


def abandon(client: Client, *, owned: bool) -> bool:
    """The adapter sends nothing more on ``client`` after a failure (see the module docstring):
    close it if the adapter ``owned`` it. Returns whether it did; the caller then raises or
    reports the failure in its framework's idiom."""
    if owned:
        client.close()
    return owned
