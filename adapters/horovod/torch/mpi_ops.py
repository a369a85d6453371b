"""Horovod's PyTorch collectives (``horovod.torch.mpi_ops``) on the reduction server.

Tensors become flat NumPy views of their memory (CPU tensors are reduced in place when an
in-place op asks for it; accelerator tensors are staged through host memory) and go to
:mod:`redsrv.adapters.horovod.common`, which keys them and calls the core client. The out-of-place
``allreduce``/``allgather``/``broadcast``/``alltoall``/``reducescatter`` are differentiable,
with Horovod's gradients.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import torch

from redsrv.core import wire

from .. import common
from ..common import ProcessSet, global_process_set
from .compression import Compression

__all__ = [
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "sparse_allreduce_async",
    "poll", "synchronize", "join", "barrier",
]

_BF16 = np.dtype(ml_dtypes.bfloat16)
#: Horovod's dtypes that the wire lacks, with the wire dtype they are reduced in: int16 sums,
#: minima, maxima and products in int32 come back to int16 as Horovod's int16 arithmetic gives
#: them (wrapping included; only an Average whose sum overflows int16 differs). Broadcast,
#: allgather and alltoall move them as their own bytes.
_WIDENED = {torch.int16: np.dtype(np.int32)}
#: The core's wire dtypes (``redsrv.core.wire``), which torch names as NumPy does, and the above.
_SUPPORTED = (*(getattr(torch, name) for name in wire.DTYPE_NAMES), *_WIDENED)

poll = common.poll
synchronize = common.synchronize


# --- tensors <-> NumPy --------------------------------------------------------------------


def _check(tensor: Any) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _SUPPORTED:
        names = ", ".join(str(d).removeprefix("torch.") for d in _SUPPORTED)
        raise ValueError(f"Tensor type {str(tensor.dtype).removeprefix('torch.')} is not supported (supported: {names})")
    if tensor.is_sparse:
        raise ValueError("sparse tensors are not supported: densify them (DistributedOptimizer(sparse_as_dense=True))")
    return tensor


def _host_view(tensor: torch.Tensor) -> tuple[np.ndarray, bool]:
    """``tensor``'s data as a NumPy array of its shape, and whether that array is ``tensor``'s
    own memory (a CPU contiguous tensor) rather than a copy."""
    host = tensor.detach()
    shares = host.device.type == "cpu" and host.is_contiguous()
    if not shares:
        host = host.to("cpu").contiguous()
    if host.dtype is torch.bfloat16:
        return host.view(torch.int16).numpy().view(_BF16), shares
    return host.numpy(), shares


def _to_tensor(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A tensor on ``like``'s device holding ``array`` (shared when on the CPU)."""
    array = np.ascontiguousarray(array)
    tensor = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16) if array.dtype == _BF16 else torch.from_numpy(array)
    return tensor if like.device.type == "cpu" else tensor.to(like.device)


def _into(target: torch.Tensor, shares: bool) -> Callable[[np.ndarray], torch.Tensor]:
    """Finish an in-place operation: the result is already in ``target`` when it shares
    memory with the array the client wrote, else it is copied in."""

    def finish(result: np.ndarray) -> torch.Tensor:
        if not shares:
            target.copy_(_to_tensor(result.reshape(target.shape), target))
        return target

    return finish


def _new(like: torch.Tensor) -> Callable[[np.ndarray], torch.Tensor]:
    def finish(result: np.ndarray) -> torch.Tensor:
        return _to_tensor(result, like).reshape(result.shape).to(like.dtype)

    return finish


def _reducible(tensor: torch.Tensor, arr: np.ndarray, shares: bool) -> tuple[np.ndarray, bool]:
    """``arr`` in the dtype the reducers add it in (see ``_WIDENED``), and whether it is still
    ``tensor``'s memory."""
    wide = _WIDENED.get(tensor.dtype)
    return (arr, shares) if wide is None else (arr.astype(wide), False)


def _all(futures: Sequence[concurrent.futures.Future[Any]]) -> concurrent.futures.Future[list[Any]]:
    """One future of every result, in order; the first error wins."""
    combined: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def arrived(done: concurrent.futures.Future[Any]) -> None:
        with lock:
            if combined.done():
                return
            if done.exception() is not None:
                combined.set_exception(done.exception())  # type: ignore[arg-type]
                return
            remaining[0] -= 1
            if remaining[0]:
                return
        combined.set_result([f.result() for f in futures])

    if not futures:
        combined.set_result([])
    for future in futures:
        future.add_done_callback(arrived)
    return combined


# --- allreduce ------------------------------------------------------------------------------


def _allreduce_start(tensor: torch.Tensor, in_place: bool, name: str | None, op: common.ReduceOp, prescale_factor: float,
                     postscale_factor: float, process_set: ProcessSet,
                     kind: str = "allreduce", check_shape: bool = True,
                     ) -> tuple[concurrent.futures.Future[np.ndarray], Callable[[np.ndarray], torch.Tensor], Any]:
    _check(tensor)
    arr, shares = _reducible(tensor, *_host_view(tensor))
    out = arr if in_place and shares and prescale_factor == 1.0 else None
    future = common.allreduce_async(process_set, arr, op, name=name, kind=kind, prescale_factor=prescale_factor,
                                    postscale_factor=postscale_factor, out=out, check_shape=check_shape)
    if in_place:
        return future, _into(tensor, shares and out is not None), (tensor, arr)
    return future, _new(tensor), (tensor, arr)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start reducing ``tensor`` over the ranks (default op Average); ``tensor`` is not modified.
    Returns a handle for :func:`poll` / :func:`synchronize`."""
    chosen = common.resolve_op(op, average)
    return common.start_named(process_set, "allreduce", name, lambda: _allreduce_start(
        tensor, False, name, chosen, prescale_factor, postscale_factor, process_set))


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """In-place :func:`allreduce_async`: ``synchronize`` writes the result into ``tensor``."""
    chosen = common.resolve_op(op, average)
    return common.start_named(process_set, "allreduce", name, lambda: _allreduce_start(
        tensor, True, name, chosen, prescale_factor, postscale_factor, process_set))


def gradient_allreduce_async_(tensor: torch.Tensor, name: str, op: common.ReduceOp, prescale_factor: float,
                              postscale_factor: float, process_set: ProcessSet) -> int:
    """:func:`allreduce_async_` of a parameter's gradient (``DistributedOptimizer``), without the
    shape check: its name is its parameter's, whose shape the ranks' models share, and the
    reducers still compare lengths and dtypes. One message per gradient, not two."""
    return common.start_named(process_set, "allreduce", name, lambda: _allreduce_start(
        tensor, True, name, op, prescale_factor, postscale_factor, process_set, check_shape=False))


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place :func:`allreduce`; returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


class _Allreduce(torch.autograd.Function):
    """Differentiable allreduce: the gradient is the same allreduce of the output's gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: common.ReduceOp, prescale_factor: float,
                postscale_factor: float, process_set: ProcessSet) -> torch.Tensor:
        ctx.op, ctx.scales, ctx.process_set = op, (prescale_factor, postscale_factor), process_set
        return synchronize(allreduce_async(tensor, None, name, op, prescale_factor, postscale_factor, process_set))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad = allreduce(grad_output, op=ctx.op, prescale_factor=ctx.scales[0], postscale_factor=ctx.scales[1],
                         process_set=ctx.process_set)
        return grad, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, compression: Any = Compression.none,
              op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """``op`` (default Average) of ``tensor`` over the ranks, as a new tensor of the same shape
    and dtype. Combined in rank order: bitwise identical on every rank."""
    chosen = common.resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, name, chosen, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


# --- grouped allreduce ----------------------------------------------------------------------


def _grouped_start(tensors: Sequence[torch.Tensor], in_place: bool, name: str | None, op: common.ReduceOp,
                   prescale_factor: float, postscale_factor: float, process_set: ProcessSet, check_shape: bool = True) -> int:
    if not tensors:
        raise ValueError("grouped allreduce needs at least one tensor")

    def start() -> tuple[concurrent.futures.Future[list[np.ndarray]], Callable[[list[np.ndarray]], list[torch.Tensor]], Any]:
        started = [_allreduce_start(t, in_place, None if name is None else f"{name}.{i}", op, prescale_factor,
                                    postscale_factor, process_set, kind="grouped_allreduce", check_shape=check_shape)
                   for i, t in enumerate(tensors)]
        finishes = [finish for _, finish, _ in started]

        def finish_all(results: list[np.ndarray]) -> list[torch.Tensor]:
            return [f(r) for f, r in zip(finishes, results)]

        return _all([f for f, _, _ in started]), finish_all, [k for _, _, k in started]

    return common.start_named(process_set, "grouped_allreduce", name, start)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start reducing every tensor of the list (one handle; ``synchronize`` gives a list)."""
    return _grouped_start(tensors, False, name, common.resolve_op(op, average), prescale_factor, postscale_factor, process_set)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """In-place :func:`grouped_allreduce_async`."""
    return _grouped_start(tensors, True, name, common.resolve_op(op, average), prescale_factor, postscale_factor, process_set)


def gradient_grouped_allreduce_async_(tensors: Sequence[torch.Tensor], name: str, op: common.ReduceOp,
                                      prescale_factor: float, postscale_factor: float, process_set: ProcessSet) -> int:
    """:func:`grouped_allreduce_async_` of gradients, without the shape check (see
    :func:`gradient_allreduce_async_`)."""
    return _grouped_start(tensors, True, name, op, prescale_factor, postscale_factor, process_set, check_shape=False)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set))


class _GroupedAllreduce(torch.autograd.Function):
    """Differentiable grouped allreduce: the gradients are the same grouped allreduce of the
    outputs' gradients (as for :class:`_Allreduce`)."""

    @staticmethod
    def forward(ctx: Any, name: str | None, op: common.ReduceOp, prescale_factor: float, postscale_factor: float,
                process_set: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.scales, ctx.process_set = op, (prescale_factor, postscale_factor), process_set
        return tuple(synchronize(grouped_allreduce_async(list(tensors), None, name, op, prescale_factor, postscale_factor,
                                                         process_set)))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        grads = grouped_allreduce([g.contiguous() for g in grad_outputs], op=ctx.op, prescale_factor=ctx.scales[0],
                                  postscale_factor=ctx.scales[1], process_set=ctx.process_set)
        return (None, None, None, None, None, *grads)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """:func:`allreduce` of every tensor of the list, as new tensors (differentiable)."""
    chosen = common.resolve_op(op, average)
    compressed = [compression.compress(t) for t in tensors]
    reduced = _GroupedAllreduce.apply(name, chosen, prescale_factor, postscale_factor, process_set, *[c for c, _ in compressed])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)]


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None, op: Any,
                           process_set: ProcessSet = global_process_set) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse COO ``tensor`` the way Horovod does: every rank's indices and
    values are gathered (two named allgathers) and stand side by side in the result, an
    uncoalesced sparse tensor whose duplicate entries add up to the sum (``op=Average``: the
    values divided by the set's size). Returns a function that waits and gives the result,
    as Horovod's does."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise TypeError(f"sparse_allreduce_async needs a sparse COO tensor, got {type(tensor).__name__}"
                        f"{' (dense)' if isinstance(tensor, torch.Tensor) else ''}")
    chosen = common.resolve_op(op, None)
    if chosen not in (common.Sum, common.Average):
        raise ValueError(f"sparse allreduce supports Sum and Average, got {chosen.name}")
    # Indices are (ndim, nnz): transposed so that the ranks' entries concatenate along the first dimension.
    indices = allgather_async(tensor._indices().t().contiguous(), name=f"{name}.indices", process_set=process_set)
    values = allgather_async(tensor._values().contiguous(), name=f"{name}.values", process_set=process_set)

    def result() -> torch.Tensor:
        gathered_values, gathered_indices = synchronize(values), synchronize(indices)
        if chosen is common.Average:
            gathered_values = gathered_values / process_set._set_size()
        return torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, tensor.size())

    return result


# --- allgather ------------------------------------------------------------------------------


def _gather_start(tensor: torch.Tensor, name: str | None, process_set: ProcessSet,
                  kind: str = "allgather",
                  ) -> tuple[concurrent.futures.Future[list[np.ndarray]], Callable[[list[np.ndarray]], torch.Tensor], Any]:
    _check(tensor)
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor with at least one dimension (it concatenates along the first)")
    arr, _ = _host_view(tensor)

    def finish(parts: list[np.ndarray]) -> torch.Tensor:
        return _to_tensor(np.concatenate(parts), tensor)

    return common.allgather_async(process_set, arr, name=name, kind=kind), finish, tensor


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    """Start concatenating every rank's ``tensor`` along the first dimension (which may differ)."""
    return common.start_named(process_set, "allgather", name, lambda: _gather_start(tensor, name, process_set))


def _own_rows(reduced: torch.Tensor, rows: int, process_set: ProcessSet) -> torch.Tensor:
    """This rank's ``rows`` of a gathered tensor (the ranks' row counts are gathered first)."""
    counts = allgather(torch.tensor([rows], dtype=torch.int64), process_set=process_set)
    return reduced.narrow(0, int(counts[: process_set.rank()].sum()), rows)


class _Allgather(torch.autograd.Function):
    """Differentiable allgather. Horovod's gradient: the output gradients averaged over the
    ranks, of which each rank takes its own rows."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet) -> torch.Tensor:
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        averaged = allreduce(grad_output.contiguous(), op=common.Average, process_set=ctx.process_set)
        return _own_rows(averaged, ctx.rows, ctx.process_set), None, None


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension, in rank order."""
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    def start() -> tuple[concurrent.futures.Future[list[Any]], Callable[[list[Any]], list[torch.Tensor]], Any]:
        started = [_gather_start(t, None if name is None else f"{name}.{i}", process_set, kind="grouped_allgather")
                   for i, t in enumerate(tensors)]

        def finish_all(results: list[list[np.ndarray]]) -> list[torch.Tensor]:
            return [finish(r) for (_, finish, _), r in zip(started, results)]

        return _all([f for f, _, _ in started]), finish_all, list(tensors)

    return common.start_named(process_set, "grouped_allgather", name, start)


class _GroupedAllgather(torch.autograd.Function):
    """Differentiable grouped allgather, each tensor's gradient as :class:`_Allgather`'s."""

    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.rows, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        averaged = grouped_allreduce([g.contiguous() for g in grad_outputs], op=common.Average, process_set=ctx.process_set)
        return (None, None, *[_own_rows(a, rows, ctx.process_set) for a, rows in zip(averaged, ctx.rows)])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """:func:`allgather` of every tensor of the list (differentiable)."""
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


# --- broadcast ------------------------------------------------------------------------------


def _broadcast_start(tensor: torch.Tensor, root_rank: int, in_place: bool, name: str | None, process_set: ProcessSet) -> int:
    def start() -> tuple[concurrent.futures.Future[np.ndarray], Callable[[np.ndarray], torch.Tensor], Any]:
        _check(tensor)
        arr, shares = _host_view(tensor)
        out = arr if in_place and shares else None
        future = common.broadcast_async(process_set, arr, root_rank, name=name, out=out)
        return future, (_into(tensor, shares) if in_place else _new(tensor)), (tensor, arr)

    return common.start_named(process_set, "broadcast", name, start)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start copying global rank ``root_rank``'s ``tensor`` to every rank (into a new tensor)."""
    return _broadcast_start(tensor, root_rank, False, name, process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """In-place :func:`broadcast_async`."""
    return _broadcast_start(tensor, root_rank, True, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    """Differentiable broadcast. Horovod's gradient: the root receives the output gradients
    averaged over the ranks, the other ranks zeros."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        averaged = allreduce(grad_output.contiguous(), op=common.Average, process_set=ctx.process_set)
        if common.rank() != ctx.root_rank:
            averaged = torch.zeros_like(averaged)
        return averaged, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Global rank ``root_rank``'s ``tensor`` on every rank, bit for bit."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# --- alltoall, reducescatter ----------------------------------------------------------------


def _splits_list(splits: Any) -> list[int] | None:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        return [int(s) for s in splits.reshape(-1).tolist()]
    return [int(s) for s in splits]


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start sending ``splits[j]`` rows (first dimension) to rank ``j`` of the set; ``synchronize``
    gives ``(received rows, received splits)``."""

    def start() -> tuple[concurrent.futures.Future[Any], Callable[[Any], tuple[torch.Tensor, torch.Tensor]], Any]:
        _check(tensor)
        arr, _ = _host_view(tensor)
        future = common.alltoall_async(process_set, arr, _splits_list(splits), name=name)

        def finish(result: tuple[np.ndarray, list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
            rows, counts = result
            return _to_tensor(rows, tensor), torch.tensor(counts, dtype=torch.int32)

        return future, finish, tensor

    return common.start_named(process_set, "alltoall", name, start)


class _Alltoall(torch.autograd.Function):
    """Differentiable alltoall: gradients go back the way the rows came."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, process_set: ProcessSet) -> Any:
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
        grad, _ = synchronize(alltoall_async(grad_output.contiguous(), ctx.received, None, ctx.process_set))
        return grad, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Horovod's alltoall: the rows received from every rank, in rank order; with ``splits``
    given, also a tensor of how many rows came from each rank (as Horovod returns)."""
    output, received = _Alltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


def _reducescatter_start(tensor: torch.Tensor, name: str | None, op: common.ReduceOp, process_set: ProcessSet,
                         prescale_factor: float, postscale_factor: float,
                         ) -> tuple[concurrent.futures.Future[np.ndarray], Callable[[np.ndarray], torch.Tensor], Any]:
    _check(tensor)
    arr, _ = _reducible(tensor, *_host_view(tensor))
    future = common.reducescatter_async(process_set, arr, op, name=name, prescale_factor=prescale_factor,
                                        postscale_factor=postscale_factor, check_shape=True)
    return future, _new(tensor), (tensor, arr)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = common.Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    chosen = common.resolve_op(op, None)
    return common.start_named(process_set, "reducescatter", name, lambda: _reducescatter_start(
        tensor, name, chosen, process_set, prescale_factor, postscale_factor))


def _reducescatter_grad(grad: torch.Tensor, op: common.ReduceOp, scale: float, process_set: ProcessSet) -> torch.Tensor:
    """Horovod's reducescatter gradient before its allgather: Sum multiplies the output gradient
    by the set's size, Average leaves it, and both apply the pre- and post-scale factors."""
    if op is common.Sum:
        grad = grad * process_set._set_size()
    return (grad * scale if scale != 1.0 else grad).contiguous()


class _Reducescatter(torch.autograd.Function):
    """Differentiable reducescatter, with Horovod's gradient: every rank's (scaled) output
    gradient gathered (see :func:`_reducescatter_grad`)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: Any, process_set: ProcessSet,
                prescale_factor: float, postscale_factor: float) -> torch.Tensor:
        ctx.op, ctx.process_set, ctx.scale = common.resolve_op(op, None), process_set, prescale_factor * postscale_factor
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad = _reducescatter_grad(grad_output, ctx.op, ctx.scale, ctx.process_set)
        return allgather(grad, process_set=ctx.process_set), None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = Compression.none, op: Any = common.Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """The reduction (default Average) of ``tensor`` over the ranks, of which this rank keeps its
    rows of the first dimension (the first ``rows % size`` ranks one more)."""
    compressed, ctx = compression.compress(tensor)
    reduced = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None, op: Any = common.Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    chosen = common.resolve_op(op, None)

    def start() -> tuple[concurrent.futures.Future[list[np.ndarray]], Callable[[list[np.ndarray]], list[torch.Tensor]], Any]:
        started = [_reducescatter_start(t, None if name is None else f"{name}.{i}", chosen, process_set, prescale_factor,
                                        postscale_factor) for i, t in enumerate(tensors)]

        def finish_all(results: list[np.ndarray]) -> list[torch.Tensor]:
            return [finish(r) for (_, finish, _), r in zip(started, results)]

        return _all([f for f, _, _ in started]), finish_all, [keep for _, _, keep in started]

    return common.start_named(process_set, "grouped_reducescatter", name, start)


class _GroupedReducescatter(torch.autograd.Function):
    """Differentiable grouped reducescatter, each tensor's gradient as :class:`_Reducescatter`'s."""

    @staticmethod
    def forward(ctx: Any, name: str | None, op: Any, process_set: ProcessSet, prescale_factor: float,
                postscale_factor: float, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.process_set, ctx.scale = common.resolve_op(op, None), process_set, prescale_factor * postscale_factor
        return tuple(synchronize(grouped_reducescatter_async(list(tensors), name, op, process_set, prescale_factor,
                                                             postscale_factor)))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        grads = [_reducescatter_grad(g, ctx.op, ctx.scale, ctx.process_set) for g in grad_outputs]
        return (None, None, None, None, None, *grouped_allgather(grads, process_set=ctx.process_set))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None, compression: Any = Compression.none,
                          op: Any = common.Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """:func:`reducescatter` of every tensor of the list (differentiable)."""
    compressed = [compression.compress(t) for t in tensors]
    reduced = _GroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                                          *[c for c, _ in compressed])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)]


# --- synchronisation ------------------------------------------------------------------------


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of the set reached the barrier."""
    common.barrier(process_set)


def join(device: int = -1) -> int:
    """Block until every rank called ``join()``; returns the rank that joined last.

    Unlike Horovod, ranks that joined do not stand in for the others' collectives with zeros:
    every rank must run the same collectives before joining (see docs/horovod.md)."""
    return common.join_ranks(global_process_set)
