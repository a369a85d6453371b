"""Combining contributions in rank order: the one arithmetic rule that the reducers
(core/reducer.py, across workers) and host-level reduction (core/host.py, across the workers of
one host) share, so that both give the same bytes for the same inputs (RELIABILITY R14).
"""

from __future__ import annotations

import numpy as np

from .plane import ACCUMULATION_DTYPES, UFUNCS, Kernels, kernels_for
from .wire import DType, ReduceOp, numpy_dtype

__all__ = ["ACCUMULATION_DTYPES", "UFUNCS", "Combiner"]


class Combiner:
    """Combines equal-length byte ranges into the first, in the order given, keeping one float32
    scratch for 16-bit floats (grown as needed, reused: one combiner per thread).

    >>> a, b, c = (np.array([1.5, 2.0], dtype=np.float32) for _ in range(3))
    >>> Combiner().combine_into_first([a.view(np.uint8), b.view(np.uint8), c.view(np.uint8)], DType.FLOAT32, ReduceOp.SUM)
    >>> a
    array([4.5, 6. ], dtype=float32)
    """

    def __init__(self, kernels: Kernels | None = None) -> None:
        self.kernels = kernels or kernels_for("auto")  # which data plane does the arithmetic (core/plane.py)
        self._widened = np.empty(0, dtype=np.uint8)

    def combine_into_first(self, pieces: list[np.ndarray], dtype: DType, op: ReduceOp) -> None:
        """``pieces[0] = op(pieces[0], pieces[1], ...)`` applied left to right (16-bit floats
        through a float32 scratch, rounded once): the same operations, in the same order, as
        combining whole payloads. ``pieces`` are byte views of equal length."""
        wire = numpy_dtype(dtype)
        kernels = self.kernels
        out = pieces[0].view(wire)
        acc_dtype = ACCUMULATION_DTYPES.get(dtype, wire)
        if acc_dtype == wire:
            for piece in pieces[1:]:
                kernels.combine(op, out, piece.view(wire))
            return
        nbytes = out.size * acc_dtype.itemsize
        if self._widened.nbytes < nbytes:
            self._widened = np.empty(nbytes, dtype=np.uint8)
        acc = self._widened[:nbytes].view(acc_dtype)
        kernels.cast(acc, out)
        for piece in pieces[1:]:
            kernels.combine(op, acc, piece.view(wire))
        kernels.cast(out, acc)
