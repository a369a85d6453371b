"""The exceptions redsrv raises. Each docstring says what happened and how to recover.

Every error that involves a peer carries the context needed to find the culprit: the peer's
address, rank, job, operation key, chunk, the phase, time elapsed and the timeout in force.
"""

from __future__ import annotations

from typing import Any

__all__ = [
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


def _describe(context: dict[str, Any]) -> str:
    parts = []
    for name in ("peer", "job", "rank", "key", "chunk", "phase"):
        value = context.get(name)
        if value is not None:
            parts.append(f"{name}={value!r}" if isinstance(value, str) else f"{name}={value}")
    if context.get("elapsed") is not None:
        parts.append(f"elapsed={context['elapsed']:.3f}s")
    if context.get("timeout") is not None:
        parts.append(f"timeout={context['timeout']:.3f}s")
    return ", ".join(parts)


class RedsrvError(Exception):
    """Base class of every redsrv error.

    Errors that involve a peer carry keyword context appended to the message and kept as
    attributes: the peer address, job, rank, operation key, chunk, phase, elapsed seconds and
    the timeout in force (``None`` when it does not apply).
    """

    def __init__(
        self,
        message: str = "",
        *,
        peer: str | None = None,
        job: str | None = None,
        rank: int | None = None,
        key: Any = None,
        chunk: int | None = None,
        phase: str | None = None,
        elapsed: float | None = None,
        timeout: float | None = None,
    ) -> None:
        self.peer = peer
        self.job = job
        self.rank = rank
        self.key = key
        self.chunk = chunk
        self.phase = phase
        self.elapsed = elapsed
        self.timeout = timeout
        self.detail = message
        context = _describe(dict(peer=peer, job=job, rank=rank, key=key, chunk=chunk, phase=phase,
                                 elapsed=elapsed, timeout=timeout))
        super().__init__(f"{message} ({context})" if context else message)


class ConfigError(RedsrvError, ValueError):
    """The configuration is invalid (bad value, unknown ``REDSRV_*`` variable).

    Raised at start-up, never mid-training. Fix the named argument or variable.
    """


class ProtocolError(RedsrvError):
    """A frame violated the wire protocol. The connection it arrived on is dead."""


class LocalProtocolError(ProtocolError, ValueError):
    """Our caller misused the API (an out-of-range field, an unsupported dtype or op).

    A bug in the calling code; nothing was sent. A ``ValueError``, like every argument misuse.
    """


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that are not a valid frame.

    The connection is closed; other connections are unaffected. Usually a version mismatch
    between worker and reducer builds, or something that is not redsrv on that port.
    """


class PeerError(RedsrvError):
    """An operation involving a remote peer failed. The client that raised it is broken when
    the failure was on a connection: create a new client to continue."""


class PeerTimeoutError(PeerError, TimeoutError):
    """A deadline expired: a reducer stopped answering (frozen, partitioned, overloaded) or the
    other ranks of the job did not contribute in time. Check the named peer or ranks; raise the
    timeout only if the operation is legitimately slow."""


class PeerLostError(PeerError, ConnectionError):
    """A connection broke (reducer killed or restarted, worker of the job gone).

    Open operations fail on every worker of the job. Create a new client once the fleet is back;
    a restarted reducer has a new incarnation and accepts the next step.
    """


class ReducerShutdownError(PeerLostError):
    """The reducer is shutting down (SIGTERM) and failed the open operations."""


class JobMismatchError(RedsrvError):
    """Two members of a job disagree on its parameters (world size, straggler mode, ...), or a
    rank joined twice. The message names both values. Start every worker with the same settings."""


class ContributionMismatchError(RedsrvError):
    """Ranks of a job submitted incompatible data under one key (dtype, length, operation).

    Raised on every rank of the job. Usually the ranks issued collectives in different orders
    or with differently shaped tensors; the message names both ranks and their values.
    """


class StaleContributionError(RedsrvError):
    """A contribution arrived for a chunk that had already closed (a straggler past its
    deadline, a reused key, or a frame from a previous incarnation). It was not summed."""


class AuthenticationError(RedsrvError):
    """The mutual challenge-response failed. Worker and reducer need the same secret.

    Deliberately does not say which side's proof was wrong.
    """


class ClientClosedError(RedsrvError):
    """The client was closed; create a new one."""
