"""Canary for the JAX attributes the adapter reads that JAX does not promise to keep
(``redsrv.adapters._jax_internals``).

When a JAX release moves one of them, these tests fail first and say which one moved and what the
adapter needed it for; fix ``_jax_internals.py`` (only).
"""

from __future__ import annotations

from functools import partial

import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from redsrv.adapters import _jax_internals  # noqa: E402

pytestmark = pytest.mark.jax

AXIS = "i"


def _moved(what: str) -> str:
    return (f"JAX {jax.__version__}: {what}. redsrv.adapters._jax_internals was written for JAX "
            f"{_jax_internals.TESTED_JAX}; its PRIVATE_API says what each read is for: {_jax_internals.PRIVATE_API}")


def _inside_shard_map(body, check_vma: bool) -> None:  # type: ignore[no-untyped-def]
    mesh = jax.make_mesh((2,), (AXIS,))
    x = jax.device_put(jnp.ones(4), NamedSharding(mesh, P(AXIS)))
    jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=check_vma)(x)


def test_the_abstract_value_still_carries_its_varying_axes_where_we_read_them() -> None:
    seen = {}

    def body(x):  # type: ignore[no-untyped-def]
        aval = jax.typeof(x)
        seen["manual_axis_type"] = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
        seen["vma"] = getattr(aval, "vma", None)
        return x

    _inside_shard_map(body, check_vma=True)
    assert frozenset({AXIS}) in (seen["manual_axis_type"], seen["vma"]), _moved(
        f"a shard_map input's abstract value has neither manual_axis_type.varying nor vma naming its axis ({seen})")


def test_varying_axes_tells_a_per_device_value_from_a_combined_one() -> None:
    seen = {}

    def body(check_vma, x):  # type: ignore[no-untyped-def]
        seen[check_vma] = (_jax_internals.varying_axes(lax.axis_index(AXIS)), _jax_internals.varying_axes(x),
                           _jax_internals.varying_axes(lax.psum(x, AXIS)))
        return x

    for check_vma in (True, False):
        _inside_shard_map(partial(body, check_vma), check_vma)
    assert seen[True] == (frozenset({AXIS}), frozenset({AXIS}), frozenset()), _moved(
        f"under check_vma=True (axis_index, input, psum of it) vary over {seen[True]}")
    assert seen[False] == (frozenset(), frozenset(), frozenset()), _moved(
        f"under check_vma=False (axis_index, input, psum of it) vary over {seen[False]}")


def test_manual_axis_names_are_the_mapped_axes_and_none_outside() -> None:
    seen = {}

    def shard_body(x):  # type: ignore[no-untyped-def]
        seen["shard_map"] = _jax_internals.manual_axis_names()
        return x

    def pmap_body(x):  # type: ignore[no-untyped-def]
        seen["pmap"] = _jax_internals.manual_axis_names()
        return x

    def partial_body(x):  # type: ignore[no-untyped-def]
        seen["shard_map over one of two axes"] = _jax_internals.manual_axis_names()
        return x

    _inside_shard_map(shard_body, check_vma=True)
    jax.pmap(pmap_body, axis_name=AXIS)(jnp.ones((2, 3)))
    # Only the axes shard_map maps are manual: "other" stays automatic and must not be counted.
    mesh = jax.make_mesh((2, 1), (AXIS, "other"))
    x = jax.device_put(jnp.ones(4), NamedSharding(mesh, P(AXIS)))
    jax.jit(jax.shard_map(partial_body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), axis_names={AXIS}))(x)
    assert seen == {"shard_map": [AXIS], "pmap": [AXIS], "shard_map over one of two axes": [AXIS]}, _moved(
        f"the abstract mesh's manual axes read {seen}")
    assert _jax_internals.manual_axis_names() == [], _moved("outside any map the abstract mesh reports manual axes")


def test_buffer_callback_hands_the_callback_writable_buffers_per_device() -> None:
    seen = []

    def add_one(ctx, out, x):  # type: ignore[no-untyped-def]
        result, status = out
        np.asarray(result)[...] = np.asarray(x) + 1
        np.asarray(status)[...] = 7
        seen.append(np.asarray(x).shape)

    def body(x):  # type: ignore[no-untyped-def]
        shapes = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((), np.int32))
        result, status = _jax_internals.buffer_callback(add_one, shapes, has_side_effect=True)(x)
        return result + status.astype(x.dtype)

    mesh = jax.make_mesh((2,), (AXIS,))
    x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P(AXIS)))
    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False))(x)
    assert np.asarray(got).tolist() == [8.0, 9.0, 10.0, 11.0] and seen == [(2,), (2,)], _moved(
        f"buffer_callback under shard_map gave {np.asarray(got).tolist()}, its callback saw inputs {seen}")
