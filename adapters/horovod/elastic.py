"""Horovod's elastic training, framework-neutral: the ``run`` loop, :class:`State` and
:class:`ObjectState`, :class:`HostsUpdatedInterrupt` (Horovod 0.28's API and semantics).

Under ``redsrv run --min-np`` each worker takes its rank, size and job from the driver's
rendezvous at ``hvd.init()`` (:func:`assigned_config`), one **epoch** at a time: each epoch is a
redsrv job of its own on the same reducers (``<job>.e<epoch>``), so a contribution of one world
is never summed with another's. The loop in :func:`run_fn` does what Horovod's does: sync the
state from rank 0, run the training function; on :class:`HorovodInternalError` (a worker lost,
a collective failed) restore the last commit, on :class:`HostsUpdatedInterrupt` (workers wait
to join, seen at a commit) keep the state; then leave the world, join the next one, run the
reset callbacks, and sync again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from redsrv.core.config import Config
from redsrv.core.rendezvous import RendezvousClient

from . import common

__all__ = ["HostsUpdatedInterrupt", "State", "ObjectState", "run_fn", "reset_world", "is_elastic", "current_epoch"]


class HostsUpdatedInterrupt(RuntimeError):
    """Workers wait to join (or leave) the world: raised by ``state.commit()`` on every member at
    the same commit, so all of them re-form together. The state is kept, not restored.
    ``skip_sync`` is True when the world only shrinks (no one needs the state sent)."""

    def __init__(self, skip_sync: bool) -> None:
        super().__init__("the world's membership changed: re-forming it" + (" (workers removed only)" if skip_sync else ""))
        self.skip_sync = skip_sync


class _Session:
    """This process's place in an elastic job: the rendezvous and the last epoch it joined.
    Outlives ``hvd.shutdown()``: the next ``hvd.init()`` asks for the epoch after it."""

    def __init__(self, config: Config) -> None:
        assert config.rendezvous is not None and config.worker_id is not None and config.secret is not None
        self.client = RendezvousClient(config.rendezvous, config.worker_id, config.secret,
                                       connect_timeout=config.connect_timeout)
        self.epoch = -1


_session: _Session | None = None


def assigned_config(config: Config) -> Config:
    """``config`` with this worker's rank, size and job in the next world (called by
    ``hvd.init()`` when ``REDSRV_RENDEZVOUS`` is set); waits for that world to form, up to the
    elastic timeout."""
    global _session
    if _session is None:
        _session = _Session(config)
    assignment = _session.client.join(_session.epoch, timeout=config.elastic_timeout)
    _session.epoch = assignment.epoch
    # The launcher's per-host counts describe no particular world: the topology comes from
    # the host names every rank reports at init.
    return config.replace(rank=assignment.rank, world_size=assignment.size, job=assignment.job, local_rank=None,
                          local_size=None)


def is_elastic() -> bool:
    """Whether this process runs under an elastic driver (so a lost world can be re-formed)."""
    return _session is not None


def current_epoch() -> int:
    """The epoch of the world this process last joined (-1 outside elastic runs)."""
    return -1 if _session is None else _session.epoch


class State:
    """What elastic training keeps across worlds. Subclasses say how to ``save`` (to host
    memory), ``restore`` (the last save) and ``sync`` (from rank 0 to everyone);
    ``commit()`` saves and then checks for workers waiting to join."""

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Callbacks run after every re-formed world, before the state is synced (e.g. to scale
        the learning rate by the new ``hvd.size()``)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state, then raise :class:`HostsUpdatedInterrupt` on every rank if workers
        wait to join. Costs a copy of the state and one small broadcast: commit every few steps,
        trading steps lost at a failure against time spent saving."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Rank 0 asks the rendezvous whether workers wait; its answer is broadcast, so every
        rank raises :class:`HostsUpdatedInterrupt` at the same commit or none does."""
        if _session is None or not common.is_initialized():
            return
        waiting = _session.client.hosts_updated(_session.epoch) if common.rank() == 0 else False
        process_set = common.global_process_set
        flag = common.wait_future(common.broadcast_async(process_set, np.array([int(waiting)], dtype=np.int64), 0,
                                                         kind="elastic.hosts"), process_set.client())
        if int(flag[0]):
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Adjust to a new world before the sync; nothing by default."""


class ObjectState(State):
    """State made of plain Python objects, given as keyword arguments and kept as attributes
    (``state.epoch``, ``state.batch``). ``sync`` sends rank 0's saved values to everyone."""

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int], **kwargs: Any) -> None:
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)


def reset_world() -> None:
    """Leave the current world and join the next one (``shutdown(); init()``): the ``reset`` every
    framework's ``run`` passes to :func:`run_fn`."""
    common.shutdown()
    common.init()


def run_fn(func: Callable[..., Any], reset: Callable[[], None]) -> Callable[..., Any]:
    """Horovod's elastic loop around ``func(state, *args, **kwargs)``; ``reset`` leaves the
    current world and joins the next (``shutdown(); init()``). Outside an elastic run a failed
    collective cannot be answered by a new world, so :class:`HorovodInternalError` propagates."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except common.HorovodInternalError:
                if not is_elastic():
                    raise
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as interrupt:
                skip_sync = interrupt.skip_sync
            reset()
            state.on_reset()

    return wrapper
