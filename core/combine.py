"""Combining contributions in rank order: the one arithmetic rule that the reducers
(core/reducer.py, across workers) and host-level reduction (core/host.py, across the workers of
one host) share, so that both give the same bytes for the same inputs (RELIABILITY R14).
"""

from __future__ import annotations

import numpy as np

from .wire import DType, ReduceOp, numpy_dtype

__all__ = ["ACCUMULATION_DTYPES", "UFUNCS", "Combiner"]

#: Accumulation dtype per wire dtype: 16-bit floats are combined in float32 (RELIABILITY R14).
ACCUMULATION_DTYPES = {DType.FLOAT16: np.dtype("<f4"), DType.BFLOAT16: np.dtype("<f4")}

#: The element-wise NumPy function of each combining op. Every op is applied in ascending rank
#: order, so even the non-associative ones (float sums and products) give the same bytes on
#: every rank and in every run.
UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}


class Combiner:
    """Combines equal-length byte ranges into the first, in the order given, keeping one float32
    scratch for 16-bit floats (grown as needed, reused: one combiner per thread).

    >>> a, b, c = (np.array([1.5, 2.0], dtype=np.float32) for _ in range(3))
    >>> Combiner().combine_into_first([a.view(np.uint8), b.view(np.uint8), c.view(np.uint8)], DType.FLOAT32, ReduceOp.SUM)
    >>> a
    array([4.5, 6. ], dtype=float32)
    """

    def __init__(self) -> None:
        self._widened = np.empty(0, dtype=np.uint8)

    def combine_into_first(self, pieces: list[np.ndarray], dtype: DType, op: ReduceOp) -> None:
        """``pieces[0] = op(pieces[0], pieces[1], ...)`` applied left to right (16-bit floats
        through a float32 scratch, rounded once): the same operations, in the same order, as
        combining whole payloads. ``pieces`` are byte views of equal length."""
        wire = numpy_dtype(dtype)
        ufunc = UFUNCS[op]
        out = pieces[0].view(wire)
        acc_dtype = ACCUMULATION_DTYPES.get(dtype, wire)
        if acc_dtype == wire:
            for piece in pieces[1:]:
                ufunc(out, piece.view(wire), out=out)
            return
        nbytes = out.size * acc_dtype.itemsize
        if self._widened.nbytes < nbytes:
            self._widened = np.empty(nbytes, dtype=np.uint8)
        acc = self._widened[:nbytes].view(acc_dtype)
        np.copyto(acc, out, casting="unsafe")
        for piece in pieces[1:]:
            ufunc(acc, piece.view(wire), out=acc, casting="unsafe")
        np.copyto(out, acc, casting="unsafe")
