"""Every private or experimental PyTorch API redsrv relies on, and nothing else.

PyTorch has no stable API for out-of-tree c10d backends written in Python. The pieces used:

* ``Backend.register_backend(..., extended_api=True)``, documented as "experimental and
  subject to change", and the ``_DistributedBackendOptions`` it hands the creator (we read
  ``store``, ``group_rank``, ``group_size``, ``timeout`` and ``group_id``).
* A creator that returns a Python subclass of ``torch.distributed.ProcessGroup`` (pybind
  trampoline ``PyProcessGroup``): torch then uses that object as the group itself
  (``_new_process_group_helper``: "defaults to the old behavior for PythonProcessGroups"). The
  C++ ``Backend`` base cannot be constructed from Python, so this is the only route.
* ``torch.distributed.ProcessGroupGloo(store, rank, size, timeout)`` and ``PrefixStore``: the
  peer links are a gloo backend object built from the store c10d hands the creator, used
  directly (not registered as a group), and its ``Work`` objects, whose ``_source_rank()``
  answers ``recv`` from any source. The ranks of a group also tell each other their hosts
  through that store (:func:`group_hosts`).
* A Python subclass of ``torch.distributed.Work`` (trampoline ``PyWork``, which forwards
  ``wait`` and ``get_future`` only). We use it instead of the private
  ``_create_work_from_future`` because that ``Work``'s ``wait()`` never raises: a failed
  collective would return as if it had succeeded.

Keeping them here means a torch upgrade that moves one breaks exactly this module, and
:func:`check` (run by the canary test) names what moved instead of failing deep inside DDP.
The public adapter, :mod:`redsrv.adapters.torch`, touches none of these names itself.
"""

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ProcessGroupBase", "FutureWork", "DelegatedWork", "LinksContext", "GroupSpec", "register", "check", "settle",
           "peer_group", "group_hosts", "WorkList", "translate", "TESTED_TORCH"]

#: The torch release these private names were checked against.
TESTED_TORCH = "2.13"

ProcessGroupBase = dist.ProcessGroup

# The Work subclasses below are made on every collective: slots and a direct call of the base's
# initialiser make one in about 0.36 us against 0.55 (timeit, this module's DelegatedWork).
_WORK_INIT = dist.Work.__init__


@dataclass(frozen=True)
class GroupSpec:
    """What the creator learns about the group being made (from torch's backend options)."""

    store: Any
    rank: int
    size: int
    timeout: timedelta | None
    group_name: str


def settle(future: torch.futures.Future[Any]) -> torch.futures.Future[Any]:
    """A future that is in torch's error state when ``future`` holds an exception.

    ``Future.set_exception`` from Python stores the exception as the future's *value* (only
    Python's ``wait()`` raises it), so C++ consumers such as DDP's reducer would see a success.
    A ``then`` callback that re-raises turns it into a real error; DDP's ``backward()`` then
    raises a ``RuntimeError`` naming the redsrv error type and message.
    """
    return future.then(_value)


def _value(future: torch.futures.Future[Any]) -> Any:
    return future.value()


class FutureWork(dist.Work):
    """The ``Work`` of one collective, done when ``future`` (set from the transport thread) is.

    ``wait()`` raises redsrv's typed error to Python callers (``dist.all_reduce``) and, through
    the trampoline, to C++ callers (DDP's parameter broadcast); ``get_future()`` is the settled
    future DDP chains on.
    """

    __slots__ = ("_raw", "_on_get_future", "_settled", "_describe")

    def __init__(self, future: torch.futures.Future[Any], describe: Callable[[], str],
                 on_get_future: Callable[[], None] | None = None) -> None:
        _WORK_INIT(self)
        self._raw = future
        self._on_get_future = on_get_future
        # Made on first use: most calls (a plain dist.all_reduce) never ask for either, and each
        # costs microseconds on every call (docs/torch_backend.md, "Small operations, second step").
        self._settled: torch.futures.Future[Any] | None = None
        self._describe = describe

    def wait(self, timeout: Any = None) -> bool:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else (timeout or 0)
        if seconds > 0 and not self._raw.done():
            done = threading.Event()
            self._raw.add_done_callback(lambda _f: done.set())  # runs at once if it finished meanwhile
            if not done.wait(seconds) and not self._raw.done():
                from ..core.errors import PeerTimeoutError

                raise PeerTimeoutError(f"{self._describe()} did not complete", phase="Work.wait", timeout=seconds)
        self._raw.wait()  # raises the operation's error, with its type
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        if self._settled is None:
            if self._on_get_future is not None:
                self._on_get_future()
            self._settled = settle(self._raw)
        return self._settled

    def is_completed(self) -> bool:
        # The future itself, not the event: its callbacks run after waiters are released.
        return bool(self._raw.done())


def translate(exc: BaseException, what: str, timeout: float) -> BaseException:
    """gloo's error as redsrv's typed one: expired deadlines and lost peers keep their meaning
    (``PeerTimeoutError``, ``PeerLostError``) and the message names the operation; anything
    else is returned as it is."""
    from ..core.errors import PeerLostError, PeerTimeoutError

    text = str(exc)
    lowered = text.lower()
    translated: BaseException = exc
    if "timed out" in lowered or "timeout" in lowered:
        translated = PeerTimeoutError(f"{what}: {text}", phase="peer links", timeout=timeout)
    elif any(word in lowered for word in ("connection closed", "connection reset", "broken pipe", "connection refused",
                                          "socket closed", "closed by peer")):
        translated = PeerLostError(f"{what}: {text}", phase="peer links", timeout=timeout)
    return translated


def peer_group(spec: GroupSpec, timeout: float, what: str, restart_count: int = 0) -> Any:
    """A gloo backend connecting every rank of the group to every other, rendezvousing through
    the group's own store (under a prefix of ours, so its keys never meet c10d's). torchrun keeps
    its store across the restarts of a group: ``restart_count`` keeps a restarted group's
    rendezvous apart from the addresses of the processes it replaced."""
    store = dist.PrefixStore(f"redsrv-peers/{restart_count}/", spec.store)  # type: ignore[attr-defined]
    try:
        return dist.ProcessGroupGloo(store, spec.rank, spec.size, timedelta(seconds=timeout))
    except RuntimeError as exc:
        translated = translate(exc, what, timeout)
        if translated is exc:
            raise
        raise translated from exc


def group_hosts(spec: GroupSpec, identity: str, timeout: float, what: str, restart_count: int = 0) -> list[int]:
    """The host of every rank of the group, numbered by first appearance in rank order (ranks
    whose ``identity`` is equal share a host), through the group's own store: each rank writes
    its identity, rank 0 reads them all and writes the table, the others read the table (one
    write and one read per rank, whatever the group's size). Keyed by ``restart_count`` as
    :func:`peer_group` is. A rank missing past ``timeout`` is a ``PeerTimeoutError``."""
    store = dist.PrefixStore(f"redsrv-hosts/{restart_count}/", spec.store)  # type: ignore[attr-defined]
    bound = timedelta(seconds=timeout)
    try:
        store.set(f"id/{spec.rank}", identity)
        if spec.rank == 0:
            keys = [f"id/{r}" for r in range(spec.size)]
            store.wait(keys, bound)
            numbers: dict[bytes, int] = {}
            table = [numbers.setdefault(store.get(key), len(numbers)) for key in keys]
            store.set("table", ",".join(map(str, table)))
        else:
            store.wait(["table"], bound)
            table = [int(h) for h in store.get("table").decode().split(",")]
    except RuntimeError as exc:
        translated = translate(exc, what, timeout)
        if translated is exc:
            raise
        raise translated from exc
    if len(table) != spec.size:
        raise RuntimeError(f"{what}: the store's table of hosts has {len(table)} ranks, the group {spec.size}")
    return table


@dataclass(frozen=True)
class LinksContext:
    """What a group's peer-link errors say besides the operation: made once per group, so that
    a call builds no message unless it fails."""

    job: str
    rank: int
    timeout: float

    def describe(self, op: str) -> str:
        return f"redsrv {op} over peer links (job {self.job!r}, rank {self.rank})"


class DelegatedWork(dist.Work):
    """A gloo ``Work`` whose failures surface as redsrv's typed errors. ``op`` names the
    operation in them (:meth:`LinksContext.describe`)."""

    __slots__ = ("_inner", "_op", "_context")

    def __init__(self, inner: Any, op: str, context: LinksContext) -> None:
        _WORK_INIT(self)
        self._inner = inner
        self._op = op
        self._context = context

    @property
    def _what(self) -> str:
        return self._context.describe(self._op)

    @property
    def _timeout(self) -> float:
        return self._context.timeout

    def _raise(self, exc: RuntimeError) -> None:
        translated = translate(exc, self._what, self._timeout)
        if translated is exc:
            raise
        raise translated from exc

    def wait(self, timeout: Any = None) -> bool:
        try:
            if timeout is None:
                self._inner.wait()
            else:
                self._inner.wait(timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout))
        except RuntimeError as exc:
            self._raise(exc)
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        inner = self._inner.get_future()
        outer: torch.futures.Future[Any] = torch.futures.Future()

        def relay(done: torch.futures.Future[Any]) -> None:
            try:
                outer.set_result(done.value())
            except RuntimeError as exc:
                outer.set_exception(translate(exc, self._what, self._timeout))

        inner.add_done_callback(relay)
        return settle(outer)

    def is_completed(self) -> bool:
        return bool(self._inner.is_completed())

    def _source_rank(self) -> int:
        """The sender of a ``recv`` from any source (c10d's ``dist.recv(src=None)`` asks)."""
        return int(self._inner._source_rank())


class WorkList(dist.Work):
    """Several operations' works as one, for the coalesced forms c10d asks a group for."""

    def __init__(self, works: list[Any]) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: Any = None) -> bool:
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout)
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        every = torch.futures.collect_all([work.get_future() for work in self._works])
        return settle(every.then(lambda done: [future.value() for future in done.value()]))

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def register(name: str, create: Callable[[GroupSpec], ProcessGroupBase]) -> None:
    """Register ``create`` as the c10d backend ``name`` for CPU tensors."""

    def creator(backend_options: Any, _pg_options: Any) -> ProcessGroupBase:
        spec = GroupSpec(
            store=backend_options.store,
            rank=int(backend_options.group_rank),
            size=int(backend_options.group_size),
            timeout=backend_options.timeout,
            group_name=str(backend_options.group_id),
        )
        return create(spec)

    # Registering again replaces the creator, which is what a second register_backend() call
    # with other settings should do.
    dist.Backend.register_backend(name, creator, extended_api=True, devices=["cpu"])


def check() -> None:
    """Raise ``ImportError`` naming every private torch API above that is missing or moved."""
    problems = []
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError as exc:  # pragma: no cover - torch built without distributed
        raise ImportError(f"torch {torch.__version__} has no torch._C._distributed_c10d: {exc}") from None
    for name in ("_DistributedBackendOptions",):
        if not hasattr(c10d, name):
            problems.append(f"torch._C._distributed_c10d.{name}")
    options = getattr(c10d, "_DistributedBackendOptions", None)
    if options is not None:
        for attr in ("store", "group_rank", "group_size", "timeout", "group_id"):
            if not hasattr(options, attr):
                problems.append(f"_DistributedBackendOptions.{attr}")
    for attr in ("register_backend",):
        if not hasattr(dist.Backend, attr):
            problems.append(f"torch.distributed.Backend.{attr}")
    for cls in ("ProcessGroup", "Work", "ProcessGroupGloo", "PrefixStore"):
        if not isinstance(getattr(dist, cls, None), type):
            problems.append(f"torch.distributed.{cls} (a class to subclass)")
    if problems:
        raise ImportError(
            f"redsrv's c10d backend needs private torch APIs that torch {torch.__version__} no longer has "
            f"(checked against torch {TESTED_TORCH}): {', '.join(problems)}. The DDP communication hook "
            "(redsrv.torch.redsrv_hook) does not use them and still works."
        )
