"""``hvd.elastic`` for PyTorch (Horovod 0.28's ``horovod.torch.elastic``): the ``run`` decorator
and :class:`TorchState`, over the framework-neutral loop in :mod:`redsrv.adapters.horovod.elastic`.

::

    sampler = hvd.elastic.ElasticSampler(dataset)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)
    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for batch_idx, batch in enumerate(loader):
                ...
                state.sampler.record_batch(batch_idx, 32)
                if batch_idx % 10 == 9:
                    state.commit()
            state.sampler.set_epoch(state.epoch + 1)
            state.commit()
    train(state)

Launch with ``redsrv run -np 4 --min-np 2 python train.py`` (docs/horovod.md, "Elastic training").
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from .. import common
from ..elastic import HostsUpdatedInterrupt, ObjectState, run_fn
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .sampler import ElasticSampler

__all__ = ["run", "TorchState", "ElasticSampler", "HostsUpdatedInterrupt"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``func(state, ...)`` elastically: when a worker is lost or added, every worker
    returns to the last commit (or keeps its state, when added), joins the new world and calls
    ``func`` again after syncing the state from rank 0. ``func`` must not start with a
    collective of its own: a newcomer syncs first (Horovod's rule)."""
    return run_fn(func, _reset)


def _reset() -> None:
    common.shutdown()
    common.init()


class _Handler:
    """Keeps a copy of one model's or optimizer's ``state_dict`` at each commit."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.saved = copy.deepcopy(value.state_dict())

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Adjust to a new world before the sync; nothing for models and optimizers."""


class _ModelHandler(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def sync(self) -> None:
        # Samples marked one by one (record_indices) are known to their own rank only: gather
        # them all before rank 0's progress is sent to everyone.
        state = self.value.state_dict()
        state["processed_indices"] = sorted(set().union(*allgather_object(state["processed_indices"])))
        self.value.load_state_dict(broadcast_object(state))

    def reset(self) -> None:
        self.value.reset()  # re-split for the new world even when no sync follows (workers only removed)


def _handler(value: Any) -> _Handler | None:
    if isinstance(value, ElasticSampler):
        return _SamplerHandler(value)
    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return _OptimizerHandler(value)
    return None


class TorchState(ObjectState):
    """The state of a PyTorch training process: models, optimizers and samplers
    (:class:`ElasticSampler`; by keyword, or the ``model`` and ``optimizer`` arguments) are saved as ``state_dict`` copies
    and synced with ``broadcast_parameters`` / ``broadcast_optimizer_state`` (a sampler: rank 0's
    progress, with every rank's ``record_indices``); every other keyword is a plain
    object (:class:`ObjectState`). Each is an attribute (``state.model``, ``state.batch``);
    assigning a new model or optimizer to one saves it."""

    _handlers: dict[str, _Handler]

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers = {name: h for name, h in ((name, _handler(v)) for name, v in kwargs.items()) if h is not None}
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        plain = {name: value for name, value in kwargs.items() if name not in handlers}
        super().__init__(bcast_object=broadcast_object, get_rank=common.rank, **plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def reset(self) -> None:
        for handler in self._handlers.values():
            handler.reset()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        super().__setattr__(name, value)
