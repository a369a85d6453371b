"""Horovod's gradient compression for PyTorch: cast floating tensors to 16 bits for the trip to
the reducers and back. The reducers accumulate 16-bit floats in float32 (rank order), so only
each contribution and the result are rounded."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor"]


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)``."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _CastCompressor(Compressor):
    wire: torch.dtype

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point:
            return tensor.type(cls.wire), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None or not ctx.is_floating_point else tensor.type(ctx)


class FP16Compressor(_CastCompressor):
    """Floating tensors travel as float16 (Horovod's ``Compression.fp16``)."""

    wire = torch.float16


class BF16Compressor(_CastCompressor):
    """Floating tensors travel as bfloat16: float32's range, so no overflow where float16 would
    (Horovod has no bf16 compressor)."""

    wire = torch.bfloat16


class Compression:
    """``Compression.none``, ``Compression.fp16`` (Horovod's) and ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
