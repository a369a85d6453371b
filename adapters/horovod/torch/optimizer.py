"""Horovod's ``DistributedOptimizer`` for PyTorch: gradients are reduced as backward produces
them, through the reducers, and ``step()`` applies the reduced gradients.

Each parameter gets a post-accumulate-grad hook (a public hook since torch 2.1): once its
gradient was accumulated ``backward_passes_per_step`` times, the hook starts an in-place
allreduce of it named after the parameter, so communication overlaps the rest of backward.
``step()`` (or ``synchronize()``) waits for every reduction and then runs the wrapped
optimizer's own ``step``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .. import common
from ..common import ProcessSet, global_process_set
from .compression import Compression
from .mpi_ops import gradient_allreduce_async_, gradient_grouped_allreduce_async_, sparse_allreduce_async, synchronize

__all__ = ["DistributedOptimizer"]


class _DistributedOptimizer:
    """Mixed in before the wrapped optimizer's class (see :func:`DistributedOptimizer`)."""

    def _hvd_setup(self, named_parameters: Sequence[tuple[str, torch.Tensor]] | None, compression: Any,
                   backward_passes_per_step: int, op: common.ReduceOp, gradient_predivide_factor: float, groups: Any,
                   sparse_as_dense: bool, process_set: ProcessSet) -> None:
        params = [p for group in self.param_groups for p in group["params"]]  # type: ignore[attr-defined]
        if named_parameters is None:
            named = [(f"allreduce.noname.{i}.{j}", p) for i, group in enumerate(self.param_groups)  # type: ignore[attr-defined]
                     for j, p in enumerate(group["params"])]
        else:
            named = list(named_parameters)
        if any(not isinstance(item, tuple) for item in named):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced by "
                             "model.named_parameters().")
        names = [name for name, _ in named]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(duplicates)}")
        named_ids = {id(p) for _, p in named}
        unnamed = [p for p in params if id(p) not in named_ids]
        if unnamed:
            raise ValueError(f"named_parameters was specified, but {len(unnamed)} model parameter(s) were not named")
        self._compression = compression
        self._op = op
        self._predivide = gradient_predivide_factor
        self._sparse_as_dense = sparse_as_dense
        self._process_set = process_set
        self._parameter_names = {p: name for name, p in named}
        self.backward_passes_per_step = backward_passes_per_step
        self._delay = {p: backward_passes_per_step for p in params}
        self._handles: dict[Any, tuple[int | None, Any]] = {}
        self._requires_update = [p for p in params if p.requires_grad]
        self._synchronized = False
        self._should_synchronize = True
        self._groups = _form_groups(groups, self._requires_update, self._parameter_names)
        self._group_of = {p: group for group in self._groups for p in group}
        self._group_ready: dict[tuple[torch.Tensor, ...], int] = {group: 0 for group in self._groups}
        self._hook_handles = []
        if process_set.included():
            for p in self._requires_update:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    # --- Horovod's public methods ---

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._delay:
            self._delay[p] = passes

    def synchronize(self) -> None:
        """Wait for every gradient's reduction (starting those whose hooks did not fire: a
        parameter unused this step still takes part, with a zero gradient) and write them back."""
        if not self._process_set.included():
            self._synchronized = True
            return
        started = {p for key in self._handles for p in (key if isinstance(key, tuple) else (key,))}
        for p in self._requires_update:
            if p not in started:
                self._handles[p] = self._start(p)
        for key, (handle, _ctx) in list(self._handles.items()):
            if handle is None:
                self._handles[key] = self._start(key)
        try:
            for key, (handle, ctx) in self._handles.items():
                if isinstance(key, tuple):
                    for p, output, part_ctx in zip(key, synchronize(handle), ctx):
                        self._write_grad(p, output, part_ctx)
                    self._group_ready[key] = 0
                else:
                    self._write_grad(key, handle() if callable(handle) else synchronize(handle), ctx)
        finally:
            self._handles.clear()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this context does not synchronize (call ``synchronize()`` first,
        e.g. to clip the reduced gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                              "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your "
                              "code.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                                 "or optimizer.synchronize(). This is prohibited as it can cause a race condition.")
        super().zero_grad(set_to_none)  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        self.set_backward_passes_per_step(self.backward_passes_per_step)
        super().load_state_dict(state_dict)  # type: ignore[misc]

    # --- gradient reduction ---

    def _make_hook(self, p: torch.Tensor) -> Any:
        def hook(_param: torch.Tensor) -> None:
            entry = self._handles.get(p) or self._handles.get(self._group_of.get(p))  # type: ignore[arg-type]
            if entry is not None and entry[0] is not None and self._delay[p] <= 0:
                raise AssertionError("Gradients were computed more than backward_passes_per_step times before call to "
                                     "step(). Increase backward_passes_per_step to accumulate gradients locally.")
            self._delay[p] -= 1
            if self._delay[p] > 0:
                self._handles[p] = (None, None)
                return
            group = self._group_of.get(p)
            if group is None:
                self._handles[p] = self._start(p)
                return
            self._group_ready[group] += 1
            if self._group_ready[group] == len(group):
                for member in group:
                    self._handles.pop(member, None)
                self._handles[group] = self._start(group)
            else:
                self._handles[p] = (None, None)

        return hook

    def _scales(self) -> tuple[float, float]:
        if self._op is common.ReduceOp.AVERAGE:
            return 1.0 / self._predivide, self._predivide
        return 1.0, 1.0

    def _grad(self, p: torch.Tensor) -> torch.Tensor:
        if p.grad is None:
            # Not computed here this step, perhaps elsewhere: every rank must still contribute.
            p.grad = torch.zeros_like(p)
        return p.grad.to_dense() if p.grad.is_sparse else p.grad

    def _start(self, key: Any) -> tuple[Any, Any]:
        prescale, postscale = self._scales()
        if isinstance(key, tuple):
            compressed = [self._compression.compress(self._grad(p)) for p in key]
            handle = gradient_grouped_allreduce_async_([c for c, _ in compressed], self._parameter_names[key[0]], self._op,
                                                       prescale, postscale, self._process_set)
            return handle, [ctx for _, ctx in compressed]
        if key.grad is not None and key.grad.is_sparse and not self._sparse_as_dense:
            # Horovod's sparse path: every rank's entries gathered, a function to call for the result.
            return sparse_allreduce_async(key.grad, self._parameter_names[key], self._op, self._process_set), None
        compressed, ctx = self._compression.compress(self._grad(key))
        handle = gradient_allreduce_async_(compressed, self._parameter_names[key], self._op, prescale, postscale,
                                           self._process_set)
        return handle, ctx

    def _write_grad(self, p: torch.Tensor, output: torch.Tensor, ctx: Any) -> None:
        self._delay[p] = self.backward_passes_per_step
        reduced = output if output.is_sparse else self._compression.decompress(output, ctx)
        if p.grad is not None and p.grad.is_sparse:
            p.grad.zero_().add_(reduced if reduced.is_sparse else reduced.to_sparse())
        elif reduced.data_ptr() != p.grad.data_ptr() or reduced.dtype != p.grad.dtype:  # type: ignore[union-attr]
            p.grad.copy_(reduced)  # type: ignore[union-attr]


def _form_groups(groups: Any, params: list[torch.Tensor], names: dict[torch.Tensor, str]) -> list[tuple[torch.Tensor, ...]]:
    """Horovod's ``groups``: ``None`` (each gradient alone), a number of groups (parameters in
    name order, split evenly: the same on every rank), or lists of parameters (the rest alone)."""
    if groups is None:
        return []
    if isinstance(groups, list):
        seen: set[int] = set()
        formed = []
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
            formed.append(tuple(p for p in group if any(p is q for q in params)))
        return [g for g in formed if len(g) > 1]
    if not isinstance(groups, int) or groups <= 0:
        raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    ordered = sorted(params, key=lambda p: names[p])
    base, extra = divmod(len(ordered), groups)
    formed, start = [], 0
    for i in range(groups):
        stop = start + base + (1 if i < extra else 0)
        formed.append(tuple(ordered[start:stop]))
        start = stop
    return [g for g in formed if len(g) > 1]


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Sequence[tuple[str, torch.Tensor]] | None = None,  # noqa: N802 - Horovod's name
                         compression: Any = Compression.none, backward_passes_per_step: int = 1, op: Any = common.Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                         sparse_as_dense: bool = False, process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients reduced over the ranks (default:
    averaged). The result is still an instance of the optimizer's own class, sharing its
    parameter groups and state.

    ``backward_passes_per_step``: local backward passes accumulated before the reduction (the
    reduced gradient is their sum, averaged over ranks only). ``gradient_predivide_factor``
    (Average only): gradients are scaled by ``1/f`` before the sum and ``f/size`` after it.
    ``groups``: reduce gradients together, as a number of groups or lists of parameters.
    ``named_parameters`` names the reductions (``model.named_parameters()``); without it,
    parameters are named by position, which every rank must share."""
    chosen = common.resolve_op(op, None)
    if gradient_predivide_factor != 1.0 and chosen is not common.ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in a future version.",
                      DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
    wrapped = cls.__new__(cls)
    # The pickling protocol's __setstate__ rebuilds an optimizer from its attributes (and re-arms
    # torch's step hooks for the new class), so the wrapper shares the original's groups and state.
    wrapped.__setstate__(dict(optimizer.__dict__))
    wrapped._hvd_setup(named_parameters, compression, backward_passes_per_step, chosen, gradient_predivide_factor, groups,
                       sparse_as_dense, process_set)
    return wrapped
