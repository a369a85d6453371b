"""What Horovod's framework modules share, framework-neutral (NumPy arrays in, futures out):
initialisation and topology, reduction ops, process sets, operation keys, handles and errors.

Horovod's API is process-global (``hvd.init()`` then ``hvd.allreduce(...)`` anywhere), so the
one connection per process set lives in a single :class:`_Runtime` that ``init()`` creates and
``shutdown()`` closes; nothing else here holds state.

**Keys.** The reducers match contributions by key, so every rank must give an operation the
same key. Horovod names operations (``name=``) and negotiates by name; here an operation's key
is ``("hvd", kind, name, n)`` (the adapters' key scheme, ``redsrv.core.commons``) where ``n``
counts the earlier operations of that kind and name in the same process set. Named operations
may therefore be issued in a different order on different ranks (as under Horovod, as long as
they are asynchronous); unnamed ones share the name ``""`` and must be issued in the same order
on every rank, which is also Horovod's assumption.

**Objects.** ``broadcast_object``/``allgather_object`` pickle Python objects, like Horovod. The
bytes travel as ``uint8`` arrays between the ranks of one job (authenticated by the job's
secret when one is set); reducers only ever see raw bytes and never deserialize anything.
Unpickling trusts the other ranks of your own job, exactly as Horovod does.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import enum
import hashlib
import io
import itertools
import pickle
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from redsrv.core import collectives, commons
from redsrv.core.client import Client
from redsrv.core.config import Config
from redsrv.core.errors import ConfigError, ContributionMismatchError, LocalProtocolError, PeerTimeoutError, RedsrvError
from redsrv.core.host_client import host_identity

__all__ = [
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "HorovodInternalError", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size", "cross_rank",
    "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built",
    "ddl_built", "ccl_built", "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
]


class ReduceOp(enum.IntEnum):
    """Horovod's reduction ops, with Horovod's numbering."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average, Sum, Adasum, Min, Max, Product = (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM, ReduceOp.MIN, ReduceOp.MAX,
                                           ReduceOp.PRODUCT)
_CORE_OPS = {ReduceOp.SUM: "sum", ReduceOp.MIN: "min", ReduceOp.MAX: "max", ReduceOp.PRODUCT: "product"}
ADASUM_UNSUPPORTED = ("Adasum is not supported by redsrv: it combines gradients pairwise along a hypercube of workers, "
                      "which a reduction server (every worker talks only to the reducers) cannot express. Use "
                      "op=hvd.Average (the default) or hvd.Sum.")


# --- errors ---------------------------------------------------------------------------------


class HorovodInternalError(RedsrvError, RuntimeError):
    """A collective failed at run time (a peer lost or too slow, ranks that disagree on shapes or
    dtypes, the connection closed). Horovod raises this type; here it is also the redsrv error
    that caused it, so ``except hvd.HorovodInternalError`` and ``except redsrv.PeerLostError``
    (or ``PeerTimeoutError``, ``ContributionMismatchError``...) both catch it. The message
    names the job, rank, operation key and timeout. Restart the job (or a new ``hvd.init()``
    once the fleet is back)."""


_WRAPPED: dict[type, type] = {}
_WRAP_LOCK = threading.Lock()


def internal_error(exc: BaseException) -> BaseException:
    """``exc`` as a :class:`HorovodInternalError` that is still an instance of its own class.
    Argument misuse (``ValueError``/``TypeError``) and non-redsrv errors pass unchanged."""
    if not isinstance(exc, RedsrvError) or isinstance(exc, (HorovodInternalError, LocalProtocolError, ConfigError)):
        return exc
    cls = type(exc)
    with _WRAP_LOCK:
        wrapped = _WRAPPED.get(cls)
        if wrapped is None:
            wrapped = type("HorovodInternalError", (HorovodInternalError, cls), {"__module__": __name__})
            _WRAPPED[cls] = wrapped
    context = {name: getattr(exc, name) for name in ("peer", "job", "rank", "key", "chunk", "phase", "elapsed", "timeout")}
    error = wrapped(exc.detail, **context)
    error.__cause__ = exc
    return error


@contextlib.contextmanager
def _submitting() -> Iterator[None]:
    """Errors raised while starting an operation (a client already broken or closed) come out as
    :class:`HorovodInternalError` too, as Horovod raises them."""
    try:
        yield
    except RedsrvError as exc:
        wrapped = internal_error(exc)
        if wrapped is exc:
            raise
        raise wrapped from exc


def resolve_op(op: Any, average: bool | None) -> ReduceOp:
    """Horovod's rules for the deprecated ``average`` flag next to ``op``; default Average."""
    if op is not None and average is not None:
        raise ValueError("op and average cannot both be given (average is deprecated: use op=)")
    if average is not None:
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    chosen = ReduceOp.AVERAGE if op is None else ReduceOp(op)
    if chosen is ReduceOp.ADASUM:
        raise NotImplementedError(ADASUM_UNSUPPORTED)
    return chosen


# --- process sets ---------------------------------------------------------------------------


class ProcessSet:
    """A subset of the ranks that runs collectives of its own: ``ProcessSet([0, 2])``, then pass
    it to ``hvd.init(process_sets=[...])`` or ``hvd.add_process_set``. Each set is its own redsrv
    job on the same reducers, so sets run concurrently and a failure in one does not touch the
    others. Operations take global ranks (``root_rank``), as in Horovod."""

    process_set_id: int | None = None
    ranks: list[int] | None = None

    def __init__(self, ranks_or_comm: Iterable[int]) -> None:
        if isinstance(ranks_or_comm, (str, bytes)) or not isinstance(ranks_or_comm, Iterable):
            raise ValueError("ProcessSet takes a list of ranks (MPI communicators are not supported: redsrv does not "
                             "use MPI for communication)")
        ranks = sorted(ranks_or_comm)
        if any(not isinstance(r, (int, np.integer)) or isinstance(r, bool) for r in ranks):
            raise ValueError(f"ProcessSet takes a list of integer ranks, got {ranks!r}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks must be distinct, got {ranks}")
        self.ranks = [int(r) for r in ranks]
        self._client: Client | None = None
        self._keys = commons.KeySpace("hvd")

    def size(self) -> int | None:
        """The number of ranks in the set, or ``None`` before it is registered."""
        if self.process_set_id is None or self.ranks is None:
            return None
        return len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set (-1 when not included), ``None`` before it is
        registered."""
        if self.process_set_id is None or self.ranks is None:
            return None
        own = rank()
        return self.ranks.index(own) if own in self.ranks else -1

    def included(self) -> bool | None:
        """Whether this process belongs to the set, ``None`` before ``hvd.init()``."""
        if self.ranks is None or _runtime is None:
            return None
        return rank() in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __str__ = __repr__

    # --- used by the framework modules ---

    def next_key(self, kind: str, name: str | None) -> tuple[Any, ...]:
        """The key of the next ``kind`` operation called ``name`` in this set (see the module
        docstring): identical on every rank that issues the same named operations."""
        return self._keys.next_key(kind, "" if name is None else str(name))

    def root_index(self, root_rank: int) -> int:
        """A global ``root_rank`` as a position within the set."""
        ranks = self._members()
        if root_rank not in ranks:
            raise ValueError(f"root_rank {root_rank} is not in {self!r}")
        return ranks.index(root_rank)

    def client(self) -> Client | None:
        """This set's connection; ``None`` in a one-rank job without reducers (every collective
        is then the identity, computed locally)."""
        runtime = _require()
        if self.process_set_id is None:
            raise ValueError(f"{self!r} is not registered: pass it to hvd.init(process_sets=...) or hvd.add_process_set()")
        if runtime.rank not in self._members():
            raise ValueError(f"rank {runtime.rank} is not in {self!r}: only its members may run its collectives")
        return self._client

    def _members(self) -> list[int]:
        return list(range(size())) if self.process_set_id == 0 else list(self.ranks or [])

    def _set_size(self) -> int:
        return len(self._members())


#: The set of every rank (Horovod's ``hvd.global_process_set``).
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


# --- initialisation -------------------------------------------------------------------------


@dataclass(frozen=True)
class Topology:
    """Where this process sits, from the host every rank reports at ``init()``: local ranks share
    a host; ``cross_rank`` numbers the processes with the same local rank."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    homogeneous: bool

    @classmethod
    def from_hosts(cls, hosts: Sequence[int], rank: int, given: Sequence[tuple[int, int]] | None = None) -> Topology:
        """``hosts[r]`` identifies rank ``r``'s host; ``given[r]``, where every rank has one, is
        the (local rank, local size) its launcher set, which wins over the count per host.

        >>> t = Topology.from_hosts([7, 7, 9, 9], rank=2)
        >>> (t.local_rank, t.local_size, t.cross_rank, t.cross_size, t.homogeneous)
        (0, 2, 1, 2, True)
        >>> Topology.from_hosts([7, 7], rank=1, given=[(0, 1), (0, 1)]).cross_rank
        1
        """
        per_host: dict[int, int] = {}
        local_ranks = []
        for host in hosts:  # one pass: a rank's local rank counts the earlier ranks on its host
            local_ranks.append(per_host.get(host, 0))
            per_host[host] = local_ranks[-1] + 1
        local_sizes = [per_host[host] for host in hosts]
        if given is not None:
            local_ranks, local_sizes = [lr for lr, _ in given], [ls for _, ls in given]
        local_rank = local_ranks[rank]
        cross_rank = sum(1 for r in range(rank) if local_ranks[r] == local_rank)
        cross_size = sum(1 for lr in local_ranks if lr == local_rank)
        return cls(rank, len(hosts), local_rank, local_sizes[rank], cross_rank, cross_size, len(set(local_sizes)) == 1)


class _Runtime:
    """The state between ``init()`` and ``shutdown()``: the configuration, one client per
    registered process set this rank belongs to, the topology and the open handles."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.rank = config.rank
        self.size = config.world_size
        self.sets: dict[int, ProcessSet] = {}
        self.set_ids = itertools.count(1)
        self.handles: dict[int, _Handle] = {}
        self.handle_ids = itertools.count(1)
        self.names_in_flight: set[tuple[Any, ...]] = set()  # see start_named
        self.lock = threading.Lock()
        self.topology = Topology(self.rank, self.size, 0, 1, 0, 1, True)

    def connect(self, process_set: ProcessSet, ranks: list[int], job: str) -> None:
        process_set._client = None
        if self.rank in ranks and self.config.reducers:
            # A subset of the ranks: the launcher's local ranks describe the whole job, not this set.
            whole = len(ranks) == self.size
            process_set._client = Client(config=self.config.replace(
                job=job, rank=ranks.index(self.rank), world_size=len(ranks),
                host_reduce=self.config.host_reduce if whole else "flat"))

    def close(self) -> None:
        for process_set in list(self.sets.values()):
            _close_set(process_set)
        self.sets.clear()


_runtime: _Runtime | None = None
_init_lock = threading.Lock()
#: How many times init() succeeded in this process outside elastic mode (under _init_lock).
_inits = 0


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | None = None) -> None:
    """Connect to the reducers named by ``REDSRV_REDUCERS`` (rank and size from ``redsrv run``,
    ``mpirun``, SLURM, torchrun or ``REDSRV_RANK``/``REDSRV_WORLD_SIZE``) and register
    ``process_sets``. A one-rank job needs no reducers. Calling it again is a no-op."""
    global _runtime, _inits
    if comm is not None:
        raise NotImplementedError("hvd.init(comm=...) is not supported: redsrv does not use MPI communicators. Use "
                                  "process sets (hvd.ProcessSet([ranks])) for subsets of the ranks.")
    with _init_lock:
        if _runtime is not None:
            return
        config = Config.from_env()
        if config.rendezvous is not None:  # elastic (redsrv run --min-np): the driver places us
            from .elastic import assigned_config

            config = assigned_config(config)
        elif _inits:
            # init() again after shutdown(), on every rank as in Horovod (Horovod's own test files
            # do it between tests): a job of its own on the reducers, so that this session's keys,
            # numbered from zero again, never meet chunks the last one left there
            config = config.replace(job=f"{config.job[:100]}.init{_inits}")
        if not config.reducers and config.world_size > 1:
            raise ConfigError(f"{config.world_size} ranks but no reducers: set REDSRV_REDUCERS (redsrv run does), "
                              "or start the script with `redsrv run -np N`")
        runtime = _Runtime(config)
        global_process_set._keys.reset()  # a new session numbers its operations from zero on every rank
        try:
            runtime.connect(global_process_set, list(range(runtime.size)), config.job)
            runtime.sets[0] = global_process_set
            global_process_set.ranks = list(range(runtime.size))
            runtime.topology = _discover_topology(runtime, global_process_set)
            _runtime = runtime
            if config.rendezvous is None:
                _inits += 1
            atexit.register(shutdown)  # close connections cleanly when the script ends (as Horovod)
            for process_set in process_sets or ():
                add_process_set(process_set)
        except BaseException:
            _runtime = None
            runtime.close()
            raise


def shutdown() -> None:
    """Close every connection. Pending operations fail; ``init()`` may be called again."""
    global _runtime
    with _init_lock:
        runtime, _runtime = _runtime, None
    atexit.unregister(shutdown)
    if runtime is not None:
        runtime.close()


def is_initialized() -> bool:
    return _runtime is not None


def _require() -> _Runtime:
    if _runtime is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _runtime


def size() -> int:
    return _require().size


def rank() -> int:
    return _require().rank


def local_size() -> int:
    return _require().topology.local_size


def local_rank() -> int:
    return _require().topology.local_rank


def cross_size() -> int:
    return _require().topology.cross_size


def cross_rank() -> int:
    return _require().topology.cross_rank


def is_homogeneous() -> bool:
    return _require().topology.homogeneous


def _false() -> bool:
    return False


# Build-feature queries some scripts make: redsrv talks TCP to the reducers, with neither MPI,
# Gloo, NCCL, DDL, oneCCL nor GPU kernels of its own.
mpi_threads_supported = mpi_enabled = mpi_built = gloo_enabled = gloo_built = _false
nccl_built = ddl_built = ccl_built = cuda_built = rocm_built = _false


#: What Horovod's process-set queries (TensorFlow's ``size_op``, ``process_set_included_op``)
#: return for an id that names no registered set: Horovod's own code, kept so scripts that test
#: for it keep working.
PROCESS_SET_ERROR_UNKNOWN_SET = -3


def process_set_size(process_set_id: int) -> int:
    """The size of the registered process set ``process_set_id``, or
    :data:`PROCESS_SET_ERROR_UNKNOWN_SET`."""
    found = _registered(process_set_id)
    return PROCESS_SET_ERROR_UNKNOWN_SET if found is None else found._set_size()


def process_set_included(process_set_id: int) -> int:
    """1 when this rank belongs to the registered process set ``process_set_id``, else 0, or
    :data:`PROCESS_SET_ERROR_UNKNOWN_SET`."""
    found = _registered(process_set_id)
    return PROCESS_SET_ERROR_UNKNOWN_SET if found is None else int(rank() in found._members())


def set_id(process_set_id: Any) -> int:
    """``process_set_id`` as an int; ``TypeError`` for anything else (a ``ProcessSet`` included:
    these queries take its ``process_set_id``, as Horovod's do)."""
    if isinstance(process_set_id, bool) or not isinstance(process_set_id, (int, np.integer)):
        raise TypeError(f"process_set_id must be an int (a ProcessSet's .process_set_id), got "
                        f"{type(process_set_id).__name__}")
    return int(process_set_id)


def _registered(process_set_id: int) -> ProcessSet | None:
    runtime = _require()
    with runtime.lock:
        return runtime.sets.get(set_id(process_set_id))


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    raise NotImplementedError("hvd.start_timeline is not supported; set REDSRV_TIMELINE=trace-{rank}.json before start "
                              "for redsrv's Chrome-trace timeline")


def stop_timeline() -> None:
    raise NotImplementedError("hvd.stop_timeline is not supported; see REDSRV_TIMELINE")


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set (every rank calls this, in the same order, as in Horovod) and
    return it. Its members connect to the reducers as a job of their own."""
    runtime = _require()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    ranks = list(process_set.ranks or [])
    if not ranks or any(not 0 <= r < runtime.size for r in ranks):
        raise ValueError(f"process set ranks must be a non-empty subset of 0..{runtime.size - 1}, got {ranks}")
    with runtime.lock:
        if any(existing.ranks == ranks for existing in runtime.sets.values()):
            raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
        set_id = next(runtime.set_ids)
    digest = hashlib.blake2b(",".join(map(str, ranks)).encode(), digest_size=8).hexdigest()
    runtime.connect(process_set, ranks, f"{runtime.config.job[:100]}.set-{digest}")
    process_set.process_set_id = set_id
    with runtime.lock:
        runtime.sets[set_id] = process_set
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Close a registered process set's job; ``False`` for the global set or one not registered."""
    runtime = _runtime
    if runtime is None or process_set.process_set_id in (None, 0):
        return False
    with runtime.lock:
        removed = runtime.sets.pop(process_set.process_set_id, None)
    _close_set(process_set)
    return removed is not None


def _close_set(process_set: ProcessSet) -> None:
    client, process_set._client = process_set._client, None
    if process_set.process_set_id != 0:
        process_set.process_set_id = None
    if client is not None:
        client.close()


def _discover_topology(runtime: _Runtime, process_set: ProcessSet) -> Topology:
    """Every rank reports its host (the identity host-level reduction uses: ``REDSRV_HOST_ID``, or
    the host name, boot id and network namespace, so containers and emulated hosts on one machine
    are hosts of their own) and the local rank and size its launcher set, if any. The same
    all-gather on every rank gives the same table, so local and cross ranks agree everywhere."""
    config = runtime.config
    host = int.from_bytes(hashlib.blake2b(host_identity(config).encode(), digest_size=7).digest(), "little")
    mine = [host, -1, -1] if config.local_rank is None or config.local_size is None else [
        host, config.local_rank, config.local_size]
    client = process_set._client
    if client is None:
        table = np.array([mine], dtype=np.int64)
    else:
        out = np.empty(runtime.size * 3, dtype=np.int64)
        table = wait_future(collectives.allgather_into_async(client, np.array(mine, dtype=np.int64), out,
                                                             key=process_set._keys.key("init", "hosts")),
                            client).reshape(runtime.size, 3)
    # A launcher's local ranks count only when every rank has one: a mixed job has no common rule.
    given = [(int(lr), int(ls)) for _, lr, ls in table] if bool((table[:, 1] >= 0).all()) else None
    return Topology.from_hosts([int(h) for h in table[:, 0]], runtime.rank if client is not None else 0, given)


# --- collectives on NumPy arrays ------------------------------------------------------------


def _done(value: Any) -> concurrent.futures.Future[Any]:
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_result(value)
    return future


def _then(future: concurrent.futures.Future[Any], transform: Callable[[Any], Any]) -> concurrent.futures.Future[Any]:
    result: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def finish(done: concurrent.futures.Future[Any]) -> None:
        try:
            value = transform(done.result())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            result.set_exception(exc)
            return
        result.set_result(value)

    future.add_done_callback(finish)
    return result


def allreduce_async(process_set: ProcessSet, arr: np.ndarray, op: ReduceOp, *, name: str | None = None, kind: str = "allreduce",
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0, out: np.ndarray | None = None,
                    check_shape: bool = False) -> concurrent.futures.Future[np.ndarray]:
    """``op`` of ``arr`` over the set's ranks, scaled before and after as Horovod does. Average
    divides the rank-order sum by the set's size (integers: floor division, as Horovod).

    The reducers compare lengths and dtypes; ``check_shape`` also compares ``arr.shape`` (one
    more small message, sent concurrently), so that ranks whose shapes differ with the same
    number of elements fail as under Horovod instead of adding unrelated elements."""
    key = process_set.next_key(kind, name)
    client = process_set.client()
    shapes = _shape_bounds_async(client, arr.shape, key) if check_shape and client is not None else None
    if prescale_factor != 1.0:
        arr = _scaled(arr, prescale_factor)
    is_float = arr.dtype.kind == "f" or arr.dtype.name == "bfloat16"
    core_op = "mean" if op is ReduceOp.AVERAGE and is_float else _CORE_OPS.get(op, "sum")
    if client is None:
        result = _done(np.array(arr, copy=True) if out is None else _copy_into(out, arr))
    else:
        with _submitting():
            result = client.allreduce_async(arr, op=core_op, key=key, out=out)
    set_size = process_set._set_size()
    integer_average = op is ReduceOp.AVERAGE and not is_float and arr.dtype.kind in "iu"

    def finish(total: np.ndarray) -> np.ndarray:
        if integer_average:
            np.floor_divide(total, set_size, out=total)
        if postscale_factor != 1.0:
            total[...] = _scaled(total, postscale_factor)
        return total

    if integer_average or postscale_factor != 1.0:
        result = _then(result, finish)
    if shapes is None or client is None:
        return result
    return _agreeing(result, shapes, arr.shape, client, key)


def _shape_bounds_async(client: Client, shape: tuple[int, ...], key: Any) -> concurrent.futures.Future[np.ndarray]:
    """The element-wise minimum over the ranks of ``[ndim, *dims, -ndim, *-dims]`` (dims padded
    to :data:`collectives.MAX_DIMS`): every rank had this shape exactly when the first half
    equals minus the second, and on a mismatch the two halves bound the shapes that were sent."""
    if len(shape) > collectives.MAX_DIMS:
        raise ValueError(f"at most {collectives.MAX_DIMS} dimensions are supported, got {len(shape)}")
    described = np.zeros(1 + collectives.MAX_DIMS, dtype=np.int64)
    described[0], described[1 : 1 + len(shape)] = len(shape), shape
    with _submitting():
        bounds: concurrent.futures.Future[np.ndarray] = client.allreduce_async(
            np.concatenate([described, -described]), op="min", key=(key, "shape"))
    return bounds


def _agreeing(result: concurrent.futures.Future[np.ndarray], shapes: concurrent.futures.Future[np.ndarray],
              shape: tuple[int, ...], client: Client, key: Any) -> concurrent.futures.Future[np.ndarray]:
    """``result`` once the ranks' shapes are known to agree; a :class:`ContributionMismatchError`
    (on every rank: they all see the same bounds) when they do not. An error of the data itself
    (a length or dtype the reducers refused) comes first."""
    checked: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()
    remaining = [2]
    lock = threading.Lock()

    def arrived(_done: concurrent.futures.Future[Any]) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        try:
            value = result.result()
            bounds = shapes.result()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            checked.set_exception(exc)
            return
        width = bounds.size // 2
        low, high = bounds[:width], -bounds[width:]
        if not np.array_equal(low, high):
            def described(row: np.ndarray) -> list[int]:
                return [int(d) for d in row[1 : 1 + int(row[0])]]

            checked.set_exception(ContributionMismatchError(
                f"Mismatched shapes: rank {client.rank} sent {list(shape)}, but the ranks' shapes range over "
                f"{described(low)} .. {described(high)} (element-wise); every rank must pass the same shape",
                job=client.config.job, rank=client.rank, key=key))
            return
        checked.set_result(value)

    result.add_done_callback(arrived)
    shapes.add_done_callback(arrived)
    return checked


def _scaled(arr: np.ndarray, factor: float) -> np.ndarray:
    """``arr * factor`` in ``arr``'s dtype, computed as Horovod does on the CPU: 16-bit floats
    in float32 (rounded once, at the end), other floats in their own precision, integers in
    float64 (then truncated)."""
    compute: np.dtype[Any]
    if arr.dtype.itemsize == 2 and (arr.dtype.kind == "f" or arr.dtype.name == "bfloat16"):
        compute = np.dtype(np.float32)
    else:
        compute = arr.dtype if arr.dtype.kind == "f" else np.dtype(np.float64)
    return np.asarray(arr.astype(compute) * np.asarray(factor, dtype=compute)).astype(arr.dtype)


def _copy_into(out: np.ndarray, arr: np.ndarray) -> np.ndarray:
    out.reshape(-1)[...] = arr.reshape(-1)
    return out


def broadcast_async(process_set: ProcessSet, arr: np.ndarray, root_rank: int, *, name: str | None = None,
                    out: np.ndarray | None = None, kind: str = "broadcast") -> concurrent.futures.Future[np.ndarray]:
    """Global rank ``root_rank``'s ``arr`` on every member of the set, bit for bit, whatever its
    dtype (the core's exact broadcast)."""
    key = process_set.next_key(kind, name)
    client = process_set.client()
    root = process_set.root_index(root_rank)
    if client is None:
        return _done(np.array(arr, copy=True) if out is None else _copy_into(out, arr))
    with _submitting():
        return collectives.broadcast_exact_async(client, arr, root=root, key=key, out=out)


def allgather_async(process_set: ProcessSet, arr: np.ndarray, *, name: str | None = None,
                    kind: str = "allgather") -> concurrent.futures.Future[list[np.ndarray]]:
    """Every member's ``arr`` in rank order (first dimensions may differ)."""
    key = process_set.next_key(kind, name)
    client = process_set.client()
    if client is None:
        return _done([np.array(arr, copy=True)])
    with _submitting():
        return collectives.allgather_async(client, arr, key=key)


def alltoall_async(process_set: ProcessSet, arr: np.ndarray, splits: Sequence[int] | None, *,
                   name: str | None = None) -> concurrent.futures.Future[tuple[np.ndarray, list[int]]]:
    key = process_set.next_key("alltoall", name)
    client = process_set.client()
    if client is None:
        rows = arr.shape[0] if arr.ndim else 1
        if splits is not None and [int(s) for s in splits] != [rows]:
            raise ValueError(f"splits must be one count adding up to the first dimension {rows}, got {list(splits)}")
        return _done((np.array(arr, copy=True), [rows]))
    with _submitting():
        return collectives.alltoall_async(client, arr, splits, key=key)


def reducescatter_async(process_set: ProcessSet, arr: np.ndarray, op: ReduceOp, *, name: str | None = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        check_shape: bool = False) -> concurrent.futures.Future[np.ndarray]:
    """The reduction of ``arr``, of which each member keeps its rows: the first ``rows % size``
    members one more than the others (Horovod's split)."""
    process_set.client()  # a clear error for a set this rank is not in
    if arr.ndim == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    set_size = process_set._set_size()
    index = process_set._members().index(rank())
    counts = collectives.split_sizes(arr.shape[0], set_size)
    start = sum(counts[:index])
    reduced = allreduce_async(process_set, arr, op, name=name, kind="reducescatter", prescale_factor=prescale_factor,
                              postscale_factor=postscale_factor, check_shape=check_shape)
    return _then(reduced, lambda total: np.array(total.reshape(arr.shape)[start : start + counts[index]]))


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every member of the set reached the barrier."""
    wait_future(allreduce_async(process_set, np.ones(1, dtype=np.int32), ReduceOp.SUM, kind="barrier"), process_set.client())


def join_ranks(process_set: ProcessSet = global_process_set) -> int:
    """Horovod's ``join()``: block until every rank joined; the rank that joined last. Ranks
    report when they joined (wall clock), so "last" is as precise as the hosts' clocks."""
    import time

    stamp = np.array([time.time()], dtype=np.float64)
    times = wait_future(allgather_async(process_set, stamp, kind="join"), process_set.client())
    members = process_set._members()
    return members[int(np.argmax([float(t[0]) for t in times]))]


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Rank ``root_rank``'s ``obj`` on every member, pickled between the job's ranks (see the
    module docstring for the trust model)."""
    label = name or type(obj).__name__
    client = process_set.client()
    payload = _pickled(obj) if rank() == root_rank else np.empty(0, dtype=np.uint8)
    length = wait_future(broadcast_async(process_set, np.array([payload.size], dtype=np.int64), root_rank,
                                         name=label, kind="object.size"), client)
    data = payload if rank() == root_rank else np.empty(int(length[0]), dtype=np.uint8)
    received = wait_future(broadcast_async(process_set, data, root_rank, name=label, kind="object.bytes"), client)
    return obj if rank() == root_rank else _unpickled(received)


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every member's ``obj``, in rank order."""
    parts = wait_future(allgather_async(process_set, _pickled(obj), name=name or type(obj).__name__, kind="object.gather"),
                        process_set.client())
    return [_unpickled(p) for p in parts]


def _pickled(obj: Any) -> np.ndarray:
    buffer = io.BytesIO()
    pickle.dump(obj, buffer)
    return np.frombuffer(buffer.getbuffer(), dtype=np.uint8).copy()


def _unpickled(data: np.ndarray) -> Any:
    # Bytes from another rank of this same job (see the module docstring); never from a reducer.
    return pickle.loads(np.ascontiguousarray(data).tobytes())  # noqa: S301


# --- handles --------------------------------------------------------------------------------


@dataclass
class _Handle:
    future: concurrent.futures.Future[Any]
    finish: Callable[[Any], Any]
    client: Client | None
    keep: Any  # inputs that must outlive the operation (their memory is being sent)
    name: tuple[Any, ...] | None = None  # (process set id, kind, name) while the name is in use


def start_named(process_set: ProcessSet, kind: str, name: str | None,
                start: Callable[[], tuple[concurrent.futures.Future[Any], Callable[[Any], Any], Any]]) -> int:
    """Start an asynchronous operation (``start()`` gives its future, how to finish its result
    and what to keep alive) once its ``name`` is known to be free, and return Horovod's integer
    handle for ``poll``/``synchronize``.

    As in Horovod, a name belongs to one operation of a kind at a time: asking for a second
    ``kind`` operation called ``name`` in the same process set while the first is in flight is a
    ``ValueError``, raised before anything is sent (so the ranks' keys stay aligned). The name is
    free again once this rank has seen the first one finish (``synchronize``, or ``poll``
    returning ``True``): a rule every rank applies the same way, unlike "the reply has arrived"."""
    runtime = _require()
    claim = None if name is None else (process_set.process_set_id, kind, str(name))
    with runtime.lock:
        if claim is not None and claim in runtime.names_in_flight:
            raise ValueError(f"Requested to {kind} a tensor named {name!r} while another {kind} of that name is still in "
                             "flight: use a different name, or synchronize the first operation before reusing its name.")
        if claim is not None:
            runtime.names_in_flight.add(claim)
    try:
        future, finish, keep = start()
    except BaseException:
        _release_name(runtime, claim)
        raise
    with runtime.lock:
        handle = next(runtime.handle_ids)
        runtime.handles[handle] = _Handle(future, finish, process_set._client, keep, claim)
    return handle


def _release_name(runtime: _Runtime, claim: tuple[Any, ...] | None) -> None:
    if claim is not None:
        with runtime.lock:
            runtime.names_in_flight.discard(claim)


def poll(handle: int) -> bool:
    """Whether the operation finished (``synchronize`` will then not block)."""
    runtime = _require()
    entry = runtime.handles.get(handle)
    if entry is None:
        raise ValueError(f"unknown handle {handle!r} (already synchronized?)")
    done = entry.future.done()
    if done:
        _release_name(runtime, entry.name)
    return done


def synchronize(handle: int) -> Any:
    """Wait for the operation and return its output; errors are :class:`HorovodInternalError`."""
    runtime = _require()
    with runtime.lock:
        entry = runtime.handles.pop(handle, None)
    if entry is None:
        return None  # Horovod returns nothing for an unknown (already synchronized) handle
    try:
        return entry.finish(wait_future(entry.future, entry.client))
    finally:
        _release_name(runtime, entry.name)


def wait_future(future: concurrent.futures.Future[Any], client: Client | None) -> Any:
    """The future's result within a bound (two rounds of the operation timeout plus the
    heartbeat window: a collective that gathers shapes first makes two rounds); redsrv errors
    come out as :class:`HorovodInternalError`."""
    config = client.config if client is not None else (_runtime.config if _runtime is not None else Config())
    bound = 2 * config.op_timeout + config.heartbeat_timeout + 1.0
    try:
        return future.result(timeout=bound)
    except (concurrent.futures.TimeoutError, RedsrvError) as exc:
        error: BaseException = exc
        if not future.done():
            error = PeerTimeoutError("Horovod operation did not complete", job=config.job, rank=config.rank,
                                     phase="synchronize", timeout=bound)
        wrapped = internal_error(error)
        if wrapped is exc:
            raise
        raise wrapped from exc
