"""Fusing many arrays into one flat vector per dtype, and splitting the result back.

A model's gradients are many small arrays of a few dtypes. One all-reduce per array pays a round
trip each; one per dtype pays one round trip for all of them and lets the chunker pipeline the
bytes. Every adapter that reduces a list of arrays (a pytree, a list of gradients) needs the same
three steps, so they live here, pure: group the arrays by dtype (:func:`group_by_dtype`), fuse
each group (:func:`fuse`), reduce the flat vector, and :func:`split` it back into views of the
original shapes.

The grouping only reads ``.dtype`` and ``.shape``, and :func:`split` only slices and reshapes, so
both work on any array type that has them (a JAX tracer included); :func:`fuse` builds a NumPy
vector. Groups come in order of each dtype's first appearance and keep their members' order, which
every rank computes identically from the same list: the layouts agree without any exchange.

>>> import numpy as np
>>> arrays = [np.ones((2, 2), np.float32), np.arange(3), np.full(1, 7, np.float32)]
>>> groups = group_by_dtype(arrays)
>>> [(g.dtype.name, g.members, g.total) for g in groups]
[('float32', (0, 2), 5), ('int64', (1,), 3)]
>>> flat = fuse(arrays, groups[0])
>>> flat
array([1., 1., 1., 1., 7.], dtype=float32)
>>> [a.shape for a in split(flat * 2, groups[0])]
[(2, 2), (1,)]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

__all__ = ["FusedGroup", "fuse", "group_by_dtype", "members_by_dtype", "split", "unfuse_large"]


class _Shaped(Protocol):
    @property
    def dtype(self) -> Any: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


_Sliceable = TypeVar("_Sliceable")


@dataclass(frozen=True)
class FusedGroup:
    """The arrays of one dtype, in the order given: ``members`` are their positions in the list,
    ``shapes`` their shapes; in the fused vector member ``k`` is ``[offsets[k], offsets[k] + sizes[k])``."""

    dtype: np.dtype[Any]
    members: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(shape) for shape in self.shapes)

    @property
    def offsets(self) -> tuple[int, ...]:
        starts, at = [], 0
        for size in self.sizes:
            starts.append(at)
            at += size
        return tuple(starts)

    @property
    def total(self) -> int:
        """Elements in the fused vector."""
        return sum(self.sizes)


def members_by_dtype(dtypes: Sequence[Any]) -> list[tuple[np.dtype[Any], tuple[int, ...]]]:
    """The grouping rule alone: positions in ``dtypes`` (anything ``np.dtype`` accepts) grouped by
    dtype, in order of each dtype's first appearance. For arrays whose shapes are not all known
    until they run (a traced TensorFlow tensor), which fuse and split with the framework's ops.

    >>> import numpy as np
    >>> members_by_dtype(["float32", "int64", np.float32])
    [(dtype('float32'), (0, 2)), (dtype('int64'), (1,))]
    """
    members: dict[np.dtype[Any], list[int]] = {}
    for index, dtype in enumerate(dtypes):
        members.setdefault(np.dtype(dtype), []).append(index)
    return [(dtype, tuple(indices)) for dtype, indices in members.items()]


def group_by_dtype(arrays: Sequence[_Shaped]) -> list[FusedGroup]:
    """Group ``arrays`` by dtype, in order of each dtype's first appearance (:func:`members_by_dtype`).

    >>> import numpy as np
    >>> [g.members for g in group_by_dtype([np.zeros(2, np.int32), np.zeros(1), np.zeros(3, np.int32)])]
    [(0, 2), (1,)]
    >>> group_by_dtype([])
    []
    """
    return [FusedGroup(dtype, indices, tuple(tuple(int(n) for n in arrays[i].shape) for i in indices))
            for dtype, indices in members_by_dtype([array.dtype for array in arrays])]


def unfuse_large(groups: Sequence[FusedGroup], min_bytes: int) -> list[FusedGroup]:
    """``groups`` with every member of at least ``min_bytes`` taken out into a group of its own,
    placed before what stays fused of its dtype. Fusing such an array saves no round trip worth
    its copy: its bytes fill the pipeline by themselves, and a framework that fuses inside a
    compiled step (JAX) pays the concatenation and the split in fresh buffers every step. Every
    rank computes the same groups from the same shapes.

    >>> import numpy as np
    >>> groups = group_by_dtype([np.zeros(4, np.float32), np.zeros(1000, np.float32), np.zeros(2, np.float32)])
    >>> [g.members for g in unfuse_large(groups, min_bytes=4000)]
    [(1,), (0, 2)]
    """
    if min_bytes < 1:
        raise ValueError(f"min_bytes must be positive, got {min_bytes}")
    out: list[FusedGroup] = []
    for group in groups:
        large = {k for k, size in enumerate(group.sizes) if size * group.dtype.itemsize >= min_bytes}
        out += [FusedGroup(group.dtype, (group.members[k],), (group.shapes[k],)) for k in sorted(large)]
        rest = [k for k in range(len(group.members)) if k not in large]
        if rest:
            out.append(FusedGroup(group.dtype, tuple(group.members[k] for k in rest), tuple(group.shapes[k] for k in rest)))
    return out


def fuse(arrays: Sequence[np.ndarray[Any, Any]], group: FusedGroup) -> np.ndarray[Any, Any]:
    """One new contiguous vector holding ``group``'s members of ``arrays``, flattened in order.

    >>> import numpy as np
    >>> fuse([np.array([[1, 2], [3, 4]]), np.array([5])], FusedGroup(np.dtype(int), (0, 1), ((2, 2), (1,))))
    array([1, 2, 3, 4, 5])
    """
    for index, shape in zip(group.members, group.shapes):
        array = arrays[index]
        if np.dtype(array.dtype) != group.dtype or tuple(array.shape) != shape:
            raise ValueError(f"array {index} is {array.dtype}{list(array.shape)}, "
                             f"the group was made for {group.dtype}{list(shape)}")
    if not group.members:
        return np.empty(0, group.dtype)
    return np.concatenate([np.asarray(arrays[i]).reshape(-1) for i in group.members])


def split(flat: _Sliceable, group: FusedGroup) -> list[_Sliceable]:
    """``flat`` (a fused vector of ``group.total`` or more elements; padding past the end is
    ignored) cut back into the members' shapes, in member order. NumPy slices are views."""
    length = len(flat)  # type: ignore[arg-type]
    if length < group.total:
        raise ValueError(f"a fused vector of {length} elements cannot hold the group's {group.total}")
    return [flat[start : start + size].reshape(shape)  # type: ignore[index]
            for start, size, shape in zip(group.offsets, group.sizes, group.shapes)]
