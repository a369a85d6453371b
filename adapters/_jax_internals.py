"""Every JAX attribute the JAX adapter reads that JAX does not document as stable API, and nothing else.

The adapter needs two facts JAX's public functions do not return:

- which manual mesh axes a traced value *varies* over under ``jax.shard_map(check_vma=True)``
  (the "varying manual axes" type): a value invariant over the reduced axis has already been summed
  over this process's devices, and must be refused rather than summed again;
- which axes of the current abstract mesh are manual (inside ``shard_map`` or ``pmap``), to number
  the local devices of the mapped computation.

It also calls one experimental function, ``jax.experimental.buffer_callback`` (JAX says it may be
replaced by a callback API built on mutable arrays): the exchange runs on XLA's own buffers through
it, re-exported here as :data:`buffer_callback`.

Both attributes are attributes of JAX's abstract values and meshes that have moved between releases
(``aval.vma`` until about 0.9, ``aval.manual_axis_type.varying`` in 0.10). They are read here and
only here; the canary test ``tests/adapters/jax/test_jax_internals.py`` checks each one against the
installed JAX and says what moved. It is the first test to read when a JAX release breaks the
adapter. Written and tested against :data:`TESTED_JAX`.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental.buffer_callback import buffer_callback

__all__ = ["PRIVATE_API", "TESTED_JAX", "buffer_callback", "manual_axis_names", "varying_axes"]

#: The JAX minor release these reads were written and tested against.
TESTED_JAX = "0.10"

#: (where, attribute, why we need it): the canary test checks each one exists on the installed JAX.
PRIVATE_API: tuple[tuple[str, str, str], ...] = (
    ("jax.typeof(x) inside shard_map", "manual_axis_type.varying",
     "the manual axes a value varies over (JAX <= 0.9: aval.vma), to refuse already-combined values"),
    ("jax.sharding.get_abstract_mesh()", "manual_axes", "the mapped axes, to number the local devices"),
    ("jax.experimental.buffer_callback", "buffer_callback(callback(ctx, out, *args), result_shape_dtypes, "
     "has_side_effect=True)", "the exchange reads and writes XLA's own buffers instead of copies"),
)


def varying_axes(x: Any) -> frozenset[Any]:
    """The manual mesh axes ``x`` varies over; empty outside ``shard_map(check_vma=True)``."""
    aval = jax.typeof(x)
    manual_axis_type = getattr(aval, "manual_axis_type", None)
    if manual_axis_type is not None:
        return frozenset(manual_axis_type.varying)
    return frozenset(getattr(aval, "vma", frozenset()))  # JAX releases before 0.10


def manual_axis_names() -> list[Any]:
    """The manual axes of the abstract mesh in force (those of ``shard_map``/``pmap``), in mesh order."""
    mesh = jax.sharding.get_abstract_mesh()
    return [name for name in mesh.axis_names if name in mesh.manual_axes]
