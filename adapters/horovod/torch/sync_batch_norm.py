"""Horovod's ``SyncBatchNorm``: batch normalization whose training statistics cover the whole
global batch, every rank's samples."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .. import common
from .mpi_ops import allreduce

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(torch.nn.SyncBatchNorm):
    """Drop-in for ``torch.nn.BatchNormNd`` (and ``torch.nn.SyncBatchNorm``, whose parameters and
    buffers it shares): in training, the mean and variance are those of the global batch.

    Each rank sums its samples and their squares per channel and one differentiable allreduce
    adds them up (with the sample count), so backward needs no code of its own: the allreduce's
    gradient carries every rank's share of the statistics' gradient. Evaluation uses the running
    statistics, which are the same on every rank."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, **kwargs: Any) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, **kwargs)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's name
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        channels = input.size(1)
        dims = [0, *range(2, input.dim())]
        count = torch.tensor([input.numel() // channels], dtype=input.dtype, device=input.device)
        totals = allreduce(torch.cat([input.sum(dims), (input * input).sum(dims), count]), op=common.Sum,
                           name=None)
        samples = totals[-1]
        mean = totals[:channels] / samples
        var = totals[channels : 2 * channels] / samples - mean * mean  # biased, as batch norm normalizes
        if self.training and self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), float(samples))
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (input - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out

    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, samples: float) -> None:
        with torch.no_grad():
            self.num_batches_tracked.add_(1)  # type: ignore[union-attr]
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            unbiased = var * (samples / max(samples - 1.0, 1.0))
            self.running_mean.mul_(1 - factor).add_(mean * factor)  # type: ignore[union-attr]
            self.running_var.mul_(1 - factor).add_(unbiased * factor)  # type: ignore[union-attr]
