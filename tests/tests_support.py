"""Helpers shared by test modules (importable because tests/ is on sys.path via conftest)."""

from __future__ import annotations

import numpy as np

from worker_main import make_input

__all__ = ["make_input", "rank_order_sum"]


def rank_order_sum(arrays: list[np.ndarray]) -> np.ndarray:
    """((x0 + x1) + x2) + ... in the arrays' own dtype: what the reducer computes."""
    total = arrays[0].copy()
    for x in arrays[1:]:
        total += x
    return total
