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
#: The core's wire dtypes (``redsrv.core.wire``), which torch names as NumPy does.
_SUPPORTED = tuple(getattr(torch, name) for name in wire.DTYPE_NAMES)

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
        return _to_tensor(result, like).reshape(result.shape)

    return finish


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
                     kind: str = "allreduce",
                     ) -> tuple[concurrent.futures.Future[np.ndarray], Callable[[np.ndarray], torch.Tensor], Any]:
    _check(tensor)
    arr, shares = _host_view(tensor)
    out = arr if in_place and shares and prescale_factor == 1.0 else None
    future = common.allreduce_async(process_set, arr, op, name=name, kind=kind, prescale_factor=prescale_factor,
                                    postscale_factor=postscale_factor, out=out)
    if in_place:
        return future, _into(tensor, shares and out is not None), (tensor, arr)
    return future, _new(tensor), (tensor, arr)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start reducing ``tensor`` over the ranks (default op Average); ``tensor`` is not modified.
    Returns a handle for :func:`poll` / :func:`synchronize`."""
    chosen = common.resolve_op(op, average)
    future, finish, keep = _allreduce_start(tensor, False, name, chosen, prescale_factor, postscale_factor, process_set)
    return common.add_handle(future, finish, process_set, keep)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """In-place :func:`allreduce_async`: ``synchronize`` writes the result into ``tensor``."""
    chosen = common.resolve_op(op, average)
    future, finish, keep = _allreduce_start(tensor, True, name, chosen, prescale_factor, postscale_factor, process_set)
    return common.add_handle(future, finish, process_set, keep)


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
                   prescale_factor: float, postscale_factor: float, process_set: ProcessSet) -> int:
    if not tensors:
        raise ValueError("grouped allreduce needs at least one tensor")
    started = [_allreduce_start(t, in_place, None if name is None else f"{name}.{i}", op, prescale_factor, postscale_factor,
                                process_set, kind="grouped_allreduce") for i, t in enumerate(tensors)]
    finishes = [finish for _, finish, _ in started]

    def finish_all(results: list[np.ndarray]) -> list[torch.Tensor]:
        return [f(r) for f, r in zip(finishes, results)]

    return common.add_handle(_all([f for f, _, _ in started]), finish_all, process_set, [k for _, _, k in started])


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


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """:func:`allreduce` of every tensor of the list, as new tensors."""
    compressed = [compression.compress(t) for t in tensors]
    reduced = synchronize(grouped_allreduce_async([c for c, _ in compressed], average, name, op, prescale_factor,
                                                  postscale_factor, process_set))
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)]


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None, op: Any, process_set: ProcessSet = global_process_set) -> Any:
    raise NotImplementedError("sparse allreduce is not supported: use DistributedOptimizer(sparse_as_dense=True) or "
                              "densify the tensor")


# --- allgather ------------------------------------------------------------------------------


def _gather_start(tensor: torch.Tensor, name: str | None, process_set: ProcessSet,
                  kind: str = "allgather",
                  ) -> tuple[concurrent.futures.Future[list[np.ndarray]], Callable[[list[np.ndarray]], torch.Tensor]]:
    _check(tensor)
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor with at least one dimension (it concatenates along the first)")
    arr, _ = _host_view(tensor)

    def finish(parts: list[np.ndarray]) -> torch.Tensor:
        return _to_tensor(np.concatenate(parts), tensor)

    return common.allgather_async(process_set, arr, name=name, kind=kind), finish


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    """Start concatenating every rank's ``tensor`` along the first dimension (which may differ)."""
    future, finish = _gather_start(tensor, name, process_set)
    return common.add_handle(future, finish, process_set, tensor)


class _Allgather(torch.autograd.Function):
    """Differentiable allgather: each rank's gradient is its rows of the summed gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet) -> torch.Tensor:
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        summed = allreduce(grad_output, op=common.Sum, process_set=ctx.process_set)
        rows = allgather(torch.tensor([ctx.rows], dtype=torch.int64), process_set=ctx.process_set)
        start = int(rows[: ctx.process_set.rank()].sum())
        return summed.narrow(0, start, ctx.rows), None, None


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension, in rank order."""
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    started = [_gather_start(t, None if name is None else f"{name}.{i}", process_set, kind="grouped_allgather")
               for i, t in enumerate(tensors)]

    def finish_all(results: list[list[np.ndarray]]) -> list[torch.Tensor]:
        return [finish(r) for (_, finish), r in zip(started, results)]

    return common.add_handle(_all([f for f, _ in started]), finish_all, process_set, list(tensors))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    return synchronize(grouped_allgather_async(tensors, name, process_set))


# --- broadcast ------------------------------------------------------------------------------


def _broadcast_start(tensor: torch.Tensor, root_rank: int, in_place: bool, name: str | None, process_set: ProcessSet) -> int:
    _check(tensor)
    arr, shares = _host_view(tensor)
    out = arr if in_place and shares else None
    future = common.broadcast_async(process_set, arr, root_rank, name=name, out=out)
    finish = _into(tensor, shares) if in_place else _new(tensor)
    return common.add_handle(future, finish, process_set, (tensor, arr))


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
    """Differentiable broadcast: the root receives the sum of every rank's gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        summed = allreduce(grad_output, op=common.Sum, process_set=ctx.process_set)
        if common.rank() != ctx.root_rank:
            summed = summed * 0
        return summed, None, None, None


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
    _check(tensor)
    arr, _ = _host_view(tensor)
    future = common.alltoall_async(process_set, arr, _splits_list(splits), name=name)

    def finish(result: tuple[np.ndarray, list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        rows, counts = result
        return _to_tensor(rows, tensor), torch.tensor(counts, dtype=torch.int32)

    return common.add_handle(future, finish, process_set, tensor)


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


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = common.Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    _check(tensor)
    arr, _ = _host_view(tensor)
    future = common.reducescatter_async(process_set, arr, common.resolve_op(op, None), name=name,
                                        prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    return common.add_handle(future, _new(tensor), process_set, (tensor, arr))


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: Any, process_set: ProcessSet,
                prescale_factor: float, postscale_factor: float) -> torch.Tensor:
        ctx.op, ctx.process_set, ctx.scale = op, process_set, prescale_factor * postscale_factor
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad = grad_output * ctx.scale
        if ctx.op == common.Average:
            grad = grad / ctx.process_set.size()
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
    futures = []
    for i, tensor in enumerate(tensors):
        arr, _ = _host_view(_check(tensor))
        futures.append(common.reducescatter_async(process_set, arr, chosen, name=None if name is None else f"{name}.{i}",
                                                  prescale_factor=prescale_factor, postscale_factor=postscale_factor))

    def finish_all(results: list[np.ndarray]) -> list[torch.Tensor]:
        return [_to_tensor(r, t) for r, t in zip(results, tensors)]

    return common.add_handle(_all(futures), finish_all, process_set, list(tensors))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None, compression: Any = Compression.none,
                          op: Any = common.Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[torch.Tensor]:
    compressed = [compression.compress(t) for t in tensors]
    reduced = synchronize(grouped_reducescatter_async([c for c, _ in compressed], name, op, process_set, prescale_factor,
                                                      postscale_factor))
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
