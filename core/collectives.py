"""Collectives built from the reducers' two primitives, all-reduce and broadcast: an exact
broadcast of any dtype, all-gather (first dimensions may differ per rank), all-to-all and
reduce-scatter. NumPy only, so every
adapter (the c10d backend, the Horovod API, TensorFlow's cross-worker gather) shares one
implementation, its deadlines and its typed errors.

All-gather is one broadcast per rank, each rank the root of its own: a worker pushes its own
bytes once and pulls everyone's, the least an all-gather can move. Data travels as raw bytes
(``uint8``), so every dtype arrives bit for bit. When the shapes are not known in advance a
small first round gathers them, and ranks that disagree on the dtype or the trailing
dimensions get a :class:`ContributionMismatchError` on every rank (every rank sees the same
table of shapes, so every rank reaches the same verdict).

Each function returns a :class:`concurrent.futures.Future`; the second round of a two-round
collective is started from the first round's completion callback.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from . import wire
from .client import Client
from .errors import ContributionMismatchError, PeerTimeoutError

__all__ = ["broadcast_exact_async", "broadcast_exact", "broadcast_exact_in_place_async",
           "allgather_async", "allgather", "allgather_into_async", "alltoall_async", "alltoall", "reducescatter_async",
           "split_sizes", "MAX_DIMS"]

_T = TypeVar("_T")

#: The most dimensions an array may have in a collective whose shapes are gathered first (the
#: shape table has a fixed width so that it can travel as one all-reduce).
MAX_DIMS = 16
_SHAPE_WIDTH = 2 + MAX_DIMS  # dtype code, ndim, dims


def broadcast_exact_async(client: Client, x: np.ndarray, *, root: int = 0, key: Any, timeout: float | None = None,
                          out: np.ndarray | None = None) -> concurrent.futures.Future[np.ndarray]:
    """Rank ``root``'s ``x`` on every rank, bit for bit, for any fixed-size dtype; the result has
    ``x``'s dtype and shape (``out`` when given: an array like ``x``, C-contiguous and writeable,
    which may be ``x`` itself).

    The wire's dtypes travel as themselves, so ranks that disagree on the dtype get a
    :class:`ContributionMismatchError`; any other dtype (complex, uint16, float8, ...) travels as
    its bytes. A broadcast never adds, so -0.0, NaN payloads and every integer arrive unchanged.
    """
    arr = _contiguous(x)
    if arr.dtype.hasobject or arr.dtype.itemsize == 0:
        raise TypeError(f"broadcast_exact needs a fixed-size dtype, got {arr.dtype}")
    if out is not None:
        if not isinstance(out, np.ndarray) or out.dtype != arr.dtype or out.size != arr.size:
            raise ValueError(f"out must be an array of {arr.size} {arr.dtype} elements, got "
                             f"{getattr(out, 'size', '?')} of {getattr(out, 'dtype', type(out).__name__)}")
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError("out must be a C-contiguous, writeable array")
    result_array = np.empty_like(arr) if out is None else out
    result: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()
    moved = client.broadcast_async(_exact(arr), root=root, key=key, timeout=timeout, out=_exact(result_array))
    _chain(result, moved, lambda _landed: result_array.reshape(arr.shape))
    return result


def broadcast_exact_in_place_async(client: Client, x: np.ndarray, *, root: int = 0, key: Any,
                                   timeout: float | None = None) -> concurrent.futures.Future[np.ndarray]:
    """:func:`broadcast_exact_async` with ``x`` (C-contiguous, writeable) as both the root's input
    and every rank's result, returning the client's own future, settled with a flat view of ``x``.
    No second future stands between the client and the caller, so a caller that only waits can
    be woken by the thread that settles it (the c10d backend's broadcast: adapters/torch.py)."""
    flags = x.flags if isinstance(x, np.ndarray) else None
    if flags is None or not (flags.c_contiguous and flags.writeable):
        raise ValueError("an in-place broadcast needs a C-contiguous, writeable array")
    if x.dtype.hasobject or x.dtype.itemsize == 0:
        raise TypeError(f"broadcast_exact needs a fixed-size dtype, got {x.dtype}")
    flat = _exact(x)
    return client.broadcast_async(flat, root=root, key=key, timeout=timeout, out=flat)


def _exact(arr: np.ndarray) -> np.ndarray:
    """What a broadcast moves for ``arr``: the wire's dtypes as themselves (checked across
    ranks), any other as its bytes."""
    flat = arr.reshape(-1)
    return flat if _on_wire(arr.dtype) else flat.view(np.uint8)


def broadcast_exact(client: Client, x: np.ndarray, *, root: int = 0, key: Any, timeout: float | None = None,
                    out: np.ndarray | None = None) -> np.ndarray:
    """Blocking :func:`broadcast_exact_async`."""
    return _wait(client, broadcast_exact_async(client, x, root=root, key=key, timeout=timeout, out=out), timeout)


def allgather_async(client: Client, x: np.ndarray, *, key: Any,
                    timeout: float | None = None) -> concurrent.futures.Future[list[np.ndarray]]:
    """Every rank's ``x``, in rank order, on every rank. First dimensions may differ per rank;
    the dtype and the other dimensions must agree (else :class:`ContributionMismatchError` on
    every rank). Any fixed-size dtype works, the wire's or not (int16, complex, ...): the data
    travels as its bytes. ``key`` must be the same on every rank and unique among operations in
    flight."""
    arr = _contiguous(x)
    if arr.ndim > MAX_DIMS:
        raise ValueError(f"allgather supports at most {MAX_DIMS} dimensions, got {arr.ndim}")
    if arr.dtype.hasobject or arr.dtype.itemsize == 0:
        raise TypeError(f"allgather needs a fixed-size dtype, got {arr.dtype}")
    result: concurrent.futures.Future[list[np.ndarray]] = concurrent.futures.Future()
    table = np.zeros((client.world_size, _SHAPE_WIDTH), dtype=np.int64)
    table[client.rank, :2] = (_dtype_tag(arr.dtype), arr.ndim)
    table[client.rank, 2 : 2 + arr.ndim] = arr.shape

    def shapes_known(done: concurrent.futures.Future[np.ndarray]) -> None:
        try:
            shapes = _shapes(done.result(), client, key, arr.dtype)
            parts = _gather_bytes(client, arr, shapes, key, timeout)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            _settle(result, exc=exc)
            return
        _chain(result, parts, lambda parts: [p.view(arr.dtype).reshape(s) for p, s in zip(parts, shapes, strict=True)])

    client.allreduce_async(table, key=(key, "shapes"), timeout=timeout).add_done_callback(shapes_known)
    return result


def allgather(client: Client, x: np.ndarray, *, key: Any, timeout: float | None = None) -> list[np.ndarray]:
    """Blocking :func:`allgather_async`."""
    return _wait(client, allgather_async(client, x, key=key, timeout=timeout), timeout)


def allgather_into_async(client: Client, x: np.ndarray, out: np.ndarray, *, key: Any,
                         timeout: float | None = None) -> concurrent.futures.Future[np.ndarray]:
    """Every rank's ``x`` into ``out`` (``world_size * x.size`` elements of ``x``'s dtype, rank
    ``r``'s at ``[r * x.size, (r + 1) * x.size)``), when every rank's ``x`` has the same size:
    one round, each rank's bytes received straight into its slot. A rank whose size differs
    makes the operation fail with :class:`ContributionMismatchError` on every rank."""
    arr = np.ascontiguousarray(x).reshape(-1)
    flat = out.reshape(-1)
    if out.dtype != arr.dtype or flat.size != arr.size * client.world_size:
        raise ValueError(f"out must hold {client.world_size} x {arr.size} elements of {arr.dtype}, "
                         f"got {flat.size} of {out.dtype}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out must be a C-contiguous, writeable array")
    result: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()
    slots = flat.view(np.uint8).reshape(client.world_size, -1)
    parts = _broadcasts(client, arr, [slots[r] for r in range(client.world_size)], key, timeout)
    _chain(result, parts, lambda _parts: out)
    return result


def alltoall_async(client: Client, x: np.ndarray, splits: Sequence[int] | None = None, *, key: Any,
                   timeout: float | None = None) -> concurrent.futures.Future[tuple[np.ndarray, list[int]]]:
    """Horovod's / MPI's all-to-all: rank ``r`` sends the ``splits[j]`` rows (along the first
    dimension) after the first ``sum(splits[:j])`` to rank ``j``; returns the rows received,
    concatenated in rank order, and how many came from each rank. ``splits=None`` divides the
    first dimension evenly (it must be divisible by the world size).

    Through the reducers every rank's whole ``x`` reaches every rank (a broadcast is the only
    point-to-multipoint path they offer): each worker pulls ``world_size`` times what a direct
    exchange would. Correct and deadline-bound, not bandwidth-optimal."""
    arr = _contiguous(x)
    n = client.world_size
    rows = arr.shape[0] if arr.ndim else 1
    if splits is None:
        if rows % n:
            raise ValueError(f"alltoall without splits needs a first dimension divisible by {n}, got {rows}")
        split_list = [rows // n] * n
    else:
        split_list = [int(s) for s in splits]
        if len(split_list) != n or any(s < 0 for s in split_list) or sum(split_list) != rows:
            raise ValueError(f"splits must be {n} non-negative counts adding up to the first dimension {rows}, got {split_list}")
    result: concurrent.futures.Future[tuple[np.ndarray, list[int]]] = concurrent.futures.Future()
    table = np.zeros((n, n), dtype=np.int64)
    table[client.rank] = split_list
    gathered = allgather_async(client, arr, key=(key, "rows"), timeout=timeout)
    split_table = client.allreduce_async(table, key=(key, "splits"), timeout=timeout)

    def pick(parts: list[np.ndarray]) -> tuple[np.ndarray, list[int]]:
        table = split_table.result()
        received = []
        counts = []
        for r, part in enumerate(parts):
            start = int(table[r, : client.rank].sum())
            count = int(table[r, client.rank])
            received.append(part[start : start + count])
            counts.append(count)
        return np.concatenate(received) if received else arr[:0], counts

    def both(_done: concurrent.futures.Future[Any]) -> None:
        if gathered.done() and split_table.done():
            _chain(result, gathered, pick, errors_from=split_table)

    gathered.add_done_callback(both)
    split_table.add_done_callback(both)
    return result


def alltoall(client: Client, x: np.ndarray, splits: Sequence[int] | None = None, *, key: Any,
             timeout: float | None = None) -> tuple[np.ndarray, list[int]]:
    """Blocking :func:`alltoall_async`."""
    return _wait(client, alltoall_async(client, x, splits, key=key, timeout=timeout), timeout)


def split_sizes(total: int, parts: int) -> list[int]:
    """``total`` rows divided into ``parts`` as evenly as possible, the first ones one larger
    (Horovod's reduce-scatter and MPI's convention).

    >>> split_sizes(10, 4)
    [3, 3, 2, 2]
    """
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def reducescatter_async(client: Client, x: np.ndarray, *, op: str = "sum", key: Any, sizes: Sequence[int] | None = None,
                        timeout: float | None = None) -> concurrent.futures.Future[np.ndarray]:
    """The reduction of ``x`` over the ranks, of which each rank keeps its own rows along the
    first dimension: ``sizes[r]`` of them (default :func:`split_sizes`). Every rank passes the
    same shape. Through the reducers this is an all-reduce and a slice: the worker moves its
    whole array each way, what a ring reduce-scatter plus all-gather would."""
    arr = _contiguous(x)
    rows = arr.shape[0] if arr.ndim else 1
    counts = split_sizes(rows, client.world_size) if sizes is None else [int(s) for s in sizes]
    if len(counts) != client.world_size or sum(counts) != rows or any(c < 0 for c in counts):
        raise ValueError(f"sizes must be {client.world_size} non-negative counts adding up to {rows}, got {counts}")
    start = sum(counts[: client.rank])
    result: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()
    reduced = client.allreduce_async(arr, op=op, key=key, timeout=timeout)
    _chain(result, reduced, lambda total: np.array(total.reshape(arr.shape)[start : start + counts[client.rank]]))
    return result


# --- helpers --------------------------------------------------------------------------------


def _contiguous(x: Any) -> np.ndarray:
    """``x`` as a C-contiguous array of its own shape (``np.ascontiguousarray`` would make a
    scalar one-dimensional)."""
    arr = np.asarray(x)
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def _on_wire(dtype: np.dtype) -> bool:
    """Whether the wire carries ``dtype`` as itself (a byte-swapped float32 is not float32's bytes)."""
    known = _ON_WIRE.get(dtype)
    if known is None:
        code = wire.DTYPE_NAMES.get(dtype.name)
        known = _ON_WIRE[dtype] = code is not None and dtype == wire.numpy_dtype(code)
    return known


#: :func:`_on_wire`'s answers: it runs on every broadcast, and there are few dtypes.
_ON_WIRE: dict[np.dtype, bool] = {}


def _dtype_tag(dtype: np.dtype) -> int:
    """What a rank writes in the shape table for its dtype: the wire code of a wire dtype, else
    a negative number derived from the dtype's description (``'<i2'``), the same on every rank."""
    if _on_wire(dtype):
        return int(wire.dtype_code(dtype))
    return -1 - int.from_bytes(hashlib.blake2b(dtype.str.encode(), digest_size=6).digest(), "little")


def _dtype_label(tag: int, own: np.dtype) -> str:
    """The dtype a shape table's tag stands for, as far as this rank can tell."""
    if tag == _dtype_tag(own):
        return str(own)
    return str(wire.numpy_dtype(wire.DType(tag))) if tag >= 0 else "a dtype the wire does not carry"


def _shapes(table: np.ndarray, client: Client, key: Any, own: np.dtype) -> list[tuple[int, ...]]:
    """Each rank's shape from the gathered table, after checking that the ranks agree on the
    dtype and on every dimension but the first."""
    shapes = []
    for r in range(client.world_size):
        ndim = int(table[r, 1])
        shapes.append(tuple(int(d) for d in table[r, 2 : 2 + ndim]))
    for r in range(1, client.world_size):
        if table[r, 0] != table[0, 0] or shapes[r][1:] != shapes[0][1:] or (len(shapes[r]) == 0) != (len(shapes[0]) == 0):
            theirs = f"{_dtype_label(int(table[r, 0]), own)}{list(shapes[r])}"
            first = f"{_dtype_label(int(table[0, 0]), own)}{list(shapes[0])}"
            raise ContributionMismatchError(
                f"allgather: rank 0 has {first}, rank {r} has {theirs}; ranks may differ in the first dimension only",
                job=client.config.job, rank=client.rank, key=key)
    return shapes


def _gather_bytes(client: Client, arr: np.ndarray, shapes: list[tuple[int, ...]], key: Any,
                  timeout: float | None) -> concurrent.futures.Future[list[np.ndarray]]:
    itemsize = arr.dtype.itemsize
    targets = [np.empty(int(np.prod(s, dtype=np.int64)) * itemsize, dtype=np.uint8) for s in shapes]
    return _broadcasts(client, arr.reshape(-1), targets, key, timeout)


def _broadcasts(client: Client, arr: np.ndarray, targets: list[np.ndarray], key: Any,
                timeout: float | None) -> concurrent.futures.Future[list[np.ndarray]]:
    """Rank ``r``'s bytes into ``targets[r]`` on every rank: one broadcast per rank with bytes,
    rooted there, each received straight into its slot (the own rank's too: a slot that is the
    input itself, as FSDP's all-gather passes it, then costs no copy)."""
    own = arr.view(np.uint8).reshape(-1)
    if own.size != targets[client.rank].size:
        raise ContributionMismatchError(f"allgather: rank {client.rank} passed {own.size} bytes, the slot holds "
                                        f"{targets[client.rank].size}", job=client.config.job, rank=client.rank, key=key)
    futures = []
    for root, target in enumerate(targets):
        if not target.size:
            continue
        sent = own if root == client.rank else target  # only the root's contents travel
        futures.append(client.broadcast_async(sent, root=root, key=(key, "bytes", root), timeout=timeout, out=target))
    combined: concurrent.futures.Future[list[np.ndarray]] = concurrent.futures.Future()
    remaining = [len(futures)]
    count_lock = threading.Lock()  # callbacks run on the completion thread, or here if a part is already done

    def arrived(done: concurrent.futures.Future[np.ndarray]) -> None:
        if done.exception() is not None:
            _settle(combined, exc=done.exception())
            return
        with count_lock:
            remaining[0] -= 1
            last = not remaining[0]
        if last:
            _settle(combined, targets)

    if not futures:
        _settle(combined, targets)
    for future in futures:
        future.add_done_callback(arrived)
    return combined


def _chain(result: concurrent.futures.Future[Any], source: concurrent.futures.Future[Any], transform: Callable[[Any], Any],
           errors_from: concurrent.futures.Future[Any] | None = None) -> None:
    """Complete ``result`` with ``transform(source's result)``, or with the first error."""

    def done(finished: concurrent.futures.Future[Any]) -> None:
        try:
            if errors_from is not None:
                errors_from.result()
            value = transform(finished.result())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            _settle(result, exc=exc)
            return
        _settle(result, value)

    source.add_done_callback(done)


_SETTLE_LOCK = threading.Lock()


def _settle(result: concurrent.futures.Future[Any], value: Any = None, *, exc: BaseException | None = None) -> None:
    """Complete ``result`` unless another part already did (the first error wins)."""
    with _SETTLE_LOCK:
        if result.running() or result.done() or not result.set_running_or_notify_cancel():
            return
    if exc is not None:
        result.set_exception(exc)
    else:
        result.set_result(value)


def _wait(client: Client, future: concurrent.futures.Future[_T], timeout: float | None) -> _T:
    """The result, bounded like :meth:`Client.wait` (each part keeps its own deadline; this bound
    holds even if that machinery were stuck). Two rounds: twice the operation timeout."""
    bound = 2 * (client.config.op_timeout if timeout is None else timeout) + client.config.heartbeat_timeout + 1.0
    try:
        return future.result(timeout=bound)
    except concurrent.futures.TimeoutError:
        if future.done():
            raise  # the operation's own PeerTimeoutError
        raise PeerTimeoutError("collective did not complete", job=client.config.job, rank=client.rank,
                               phase="wait for result", timeout=bound) from None
