"""Horovod's PyTorch helpers: broadcast a model's parameters or an optimizer's state from one
rank, and Python objects between ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import common
from ..common import ProcessSet, global_process_set
from .mpi_ops import broadcast_async_, synchronize

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite, in place, every rank's parameters with rank ``root_rank``'s: a
    ``model.state_dict()``, ``model.named_parameters()`` or ``model.parameters()``. Exact bit
    for bit; all broadcasts run concurrently."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, (list, tuple)) or hasattr(params, "__next__"):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = []
    for name, p in items:
        tensor = p.data if isinstance(p, torch.nn.Parameter) else p
        handles.append(broadcast_async_(tensor, root_rank, None if name is None else f"param.{name}"))
    for handle in handles:
        synchronize(handle)


@dataclass(frozen=True)
class _TensorSlot:
    """Stands for tensor number ``index`` of a broadcast optimizer state."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None) -> None:
    """Make every rank's optimizer state (moments, step counts, learning rates and the other
    hyperparameters of every parameter group) equal to rank ``root_rank``'s.

    The state's structure and scalars travel as one pickled object; its tensors travel as raw
    bytes (exact), then every other rank loads the result with ``load_state_dict``. Ranks whose
    optimizer has not stepped yet receive the full state; unlike Horovod, no optimizer step is
    taken to create it. As under Horovod, when the optimizer has no state yet, every parameter
    that requires a gradient and has none gets a zero gradient (sparse for ``SparseAdam`` and
    for a ``model``'s sparse embeddings), so code that reads ``p.grad`` afterwards finds what
    Horovod leaves there."""
    if not optimizer.state_dict()["state"]:
        _zero_missing_grads(optimizer, model)
    is_root = common.rank() == root_rank
    tensors: list[torch.Tensor] = []
    structure: Any = None
    if is_root:
        state_dict = optimizer.state_dict()
        structure = {"state": {pid: {name: _slot(value, tensors) for name, value in entry.items()}
                               for pid, entry in state_dict["state"].items()},
                     "param_groups": state_dict["param_groups"]}
    structure = common.broadcast_object(structure, root_rank, name="optimizer.structure")
    if not is_root:
        tensors = [torch.empty(slot.shape, dtype=slot.dtype) for slot in _slots(structure)]
    handles = [broadcast_async_(t, root_rank, f"optimizer.tensor.{i}") for i, t in enumerate(tensors)]
    received = [synchronize(h) for h in handles]
    if not is_root:
        state = {pid: {name: received[v.index] if isinstance(v, _TensorSlot) else v for name, v in entry.items()}
                 for pid, entry in structure["state"].items()}
        optimizer.load_state_dict({"state": state, "param_groups": structure["param_groups"]})


def _zero_missing_grads(optimizer: torch.optim.Optimizer, model: Any) -> None:
    sparse = {id(p) for m in (model.modules() if model is not None else ())
              if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                zero = torch.zeros_like(p)
                takes_sparse = isinstance(optimizer, torch.optim.SparseAdam) or (
                    isinstance(optimizer, torch.optim.SGD) and id(p) in sparse)
                p.grad = zero.to_sparse() if takes_sparse else zero


def _slot(value: Any, tensors: list[torch.Tensor]) -> Any:
    if not torch.is_tensor(value):
        return value
    tensors.append(value.detach().to("cpu").contiguous())
    return _TensorSlot(len(tensors) - 1, tuple(value.shape), value.dtype)


def _slots(structure: Any) -> list[_TensorSlot]:
    found = [v for entry in structure["state"].values() for v in entry.values() if isinstance(v, _TensorSlot)]
    return sorted(found, key=lambda s: s.index)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = global_process_set) -> Any:
    """Rank ``root_rank``'s picklable ``obj`` on every rank (pickled between the job's ranks only)."""
    return common.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order."""
    return common.allgather_object(obj, name, process_set)
