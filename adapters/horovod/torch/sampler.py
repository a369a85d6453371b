"""``hvd.elastic.ElasticSampler`` (Horovod 0.28's ``horovod.torch.elastic.ElasticSampler``): a
``DistributedSampler`` whose progress through an epoch is part of the elastic state, so a world
re-formed at another size splits only the samples not yet processed.

The epoch's order is one shuffle of the whole dataset, the same on every rank (``seed + epoch``).
Each rank takes every ``size``-th of the samples left, so the world's first ``k`` batches cover
exactly the first ``k * batch_size * size`` samples of that order: Horovod's ``record_batch``
only counts them (``processed_num``), and a reset starts the remaining samples after that count.
``record_indices`` (from Horovod before 0.23) marks single samples instead; they are gathered from
every rank at the next sync.

Exactly once per epoch holds while the samples left divide by the world size. Otherwise, as
``DistributedSampler`` does, the first few are repeated at the end so every rank runs as many
batches (a rank with fewer would wait forever in the step's collective).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch.utils.data

from .. import common

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Partitions ``dataset`` (of constant length) across the ranks and re-partitions the samples
    not yet processed after each reset. Put it in the :class:`TorchState`, call
    :meth:`record_batch` after each batch and :meth:`set_epoch` at the end of each epoch (not at
    the start: a restarted epoch must keep what it processed).

    ``shuffle``: a new order each epoch; ``seed``: the same on every rank."""

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.processed_indices: set[int] = set()
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: a new order, nothing processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Every rank has processed its batch ``batch_idx`` of ``batch_size`` samples (called by
        every rank, after each batch, in order)."""
        if self.processed_indices:  # the remaining samples are no longer a suffix of the order
            start = batch_idx * batch_size * self.num_replicas
            self.processed_indices.update(self._padded()[start:start + batch_size * self.num_replicas])
        else:
            self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: Iterable[int]) -> None:
        """This rank processed the samples ``indices`` (for loops that do not go batch by batch);
        the other ranks learn of them at the next sync."""
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's samples in its batch ``batch_idx`` of the current pass."""
        start = batch_idx * batch_size
        return self.indices[start:min(start + batch_size, len(self.indices))]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_num": self.processed_num,
                "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.processed_indices = set(state_dict.get("processed_indices", ()))  # Horovod 0.28's dict has none
        self.reset()

    def reset(self) -> None:
        """Split the samples not yet processed across the current world (``hvd.size()``)."""
        self.num_replicas = common.size()
        self.rank = common.rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = [i for i in order[self.processed_num:] if i not in self.processed_indices]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self.indices = self._padded()[self.rank::self.num_replicas]

    def _padded(self) -> list[int]:
        """The remaining samples, the first ones repeated until they divide by the world size."""
        padded = list(self.remaining_indices)
        while len(padded) < self.total_size:
            padded += self.remaining_indices[:self.total_size - len(padded)]
        return padded

    def __iter__(self) -> Iterator[int]:
        self.indices = self._padded()[self.rank::self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
