"""The JAX adapter in one process (world size 1) on two CPU devices against an in-process reducer.

With one rank the reducers return what they got, so every result must equal JAX's own collective
over the local devices: the differential oracle for the local-devices-first path, the pytree
fusion, gradients, keys and the error path. Cross-process sums are in test_jax_multiprocess.py.
"""

from __future__ import annotations

import re
import time
from functools import partial

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import redsrv  # noqa: E402
import redsrv.jax as rjax  # noqa: E402

from tests_support import poll  # noqa: E402

pytestmark = pytest.mark.jax

AXIS = "i"
# reconnect_window=0: the error tests check that a lost reducer is raised, not ridden through (R22).
FAST = {"op_timeout": 10.0, "heartbeat_interval": 0.2, "close_timeout": 3.0, "connect_timeout": 5.0,
        "reconnect_window": 0.0}


@pytest.fixture(autouse=True)
def two_devices() -> None:
    if jax.local_device_count() < 2:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=2 before JAX starts")


@pytest.fixture
def comm(daemon):  # type: ignore[no-untyped-def]
    c = rjax.init([daemon], rank=0, world_size=1, job="jax-local", **FAST)
    yield c
    c.close()


def tree_inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {"a": rng.standard_normal((2, 5, 3)).astype(np.float32),
            "h": rng.standard_normal((2, 7)).astype(jnp.bfloat16),
            "n": rng.integers(-50, 50, size=(2, 3)).astype(np.int32),
            "s": rng.standard_normal(2).astype(np.float32)}  # a scalar per device


def assert_trees_equal(got, want) -> None:  # type: ignore[no-untyped-def]
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g, np.float64), np.asarray(w, np.float64))


def sharded(mesh, tree):  # type: ignore[no-untyped-def]
    return jax.tree.map(lambda v: jax.device_put(v.reshape(-1, *v.shape[2:]), NamedSharding(mesh, P(AXIS))), tree)


def test_redsrv_jax_is_the_adapter_module() -> None:
    import redsrv.adapters.jax

    assert rjax is redsrv.adapters.jax
    assert set(rjax.__all__) >= {"init", "psum", "pmean", "allreduce_gradients", "broadcast_tree", "check"}


def test_psum_and_pmean_in_pmap_equal_lax(comm) -> None:  # type: ignore[no-untyped-def]
    tree = tree_inputs()
    floats = {"a": tree["a"], "h": tree["h"]}
    ours = jax.pmap(lambda t, f: (rjax.psum(t, AXIS), rjax.pmean(f, AXIS)), axis_name=AXIS)(tree, floats)
    ref = jax.pmap(lambda t, f: (lax.psum(t, AXIS), lax.pmean(f, AXIS)), axis_name=AXIS)(tree, floats)
    # two devices: a + b is exact whatever the order, so equality is bitwise
    assert_trees_equal(ours, ref)
    comm.check()


@pytest.mark.parametrize("check_vma", [True, False])
def test_psum_and_pmean_in_shard_map_under_jit_equal_lax(comm, check_vma: bool) -> None:  # type: ignore[no-untyped-def]
    mesh = jax.make_mesh((2,), (AXIS,))
    tree = sharded(mesh, tree_inputs())

    def body(psum, pmean, t):  # type: ignore[no-untyped-def]
        return psum(t, AXIS), pmean({"a": t["a"], "h": t["h"]}, AXIS)

    def run(psum, pmean):  # type: ignore[no-untyped-def]
        fn = jax.shard_map(partial(body, psum, pmean), mesh=mesh, in_specs=P(AXIS), out_specs=P(), check_vma=check_vma)
        return jax.jit(fn)(tree)

    assert_trees_equal(run(rjax.psum, rjax.pmean), run(lax.psum, lax.pmean))
    comm.check()


@pytest.mark.parametrize("axes", ["d", "m", ("d", "m")])
def test_a_two_axis_mesh_reduces_over_the_named_axes_only(comm, axes) -> None:  # type: ignore[no-untyped-def]
    # Over "d" (size 1) both devices send their own group's data: keys must tell "m" apart too.
    mesh = jax.make_mesh((1, 2), ("d", "m"))
    x = jax.device_put(jnp.arange(12.0).reshape(2, 6), NamedSharding(mesh, P(("d", "m"))))

    def run(reduce):  # type: ignore[no-untyped-def]
        fn = jax.shard_map(lambda v: reduce(v, axes)[None], mesh=mesh, in_specs=P(("d", "m")), out_specs=P(("d", "m")))
        return jax.jit(fn)(x)

    np.testing.assert_array_equal(run(rjax.psum), run(lax.psum))
    comm.check()


def loss(reduce, w, x):  # type: ignore[no-untyped-def]
    total = reduce(jnp.tanh(x * w).sum(axis=0), AXIS)
    return jnp.sum(total**2) / 7 + jnp.sum(reduce(x.mean() * w, AXIS))


def test_gradients_through_psum_equal_lax_in_pmap(comm) -> None:  # type: ignore[no-untyped-def]
    w = jnp.array([0.5, -1.0, 2.0])
    x = jnp.asarray(tree_inputs()["a"])
    grads = {name: jax.pmap(jax.grad(partial(loss, reduce), argnums=(0, 1)), axis_name=AXIS, in_axes=(None, 0))(w, x)
             for name, reduce in (("ours", rjax.psum), ("lax", lax.psum))}
    for got, want in zip(grads["ours"], grads["lax"]):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    comm.check()


@pytest.mark.parametrize("check_vma", [True, False])
def test_gradients_through_psum_equal_lax_in_shard_map(comm, check_vma: bool) -> None:  # type: ignore[no-untyped-def]
    mesh = jax.make_mesh((2,), (AXIS,))
    w = jnp.array([0.5, -1.0, 2.0])
    x = jax.device_put(tree_inputs()["a"].reshape(10, 3), NamedSharding(mesh, P(AXIS)))

    def run(reduce):  # type: ignore[no-untyped-def]
        def body(w, x):  # type: ignore[no-untyped-def]
            w = lax.pcast(w, AXIS, to="varying") if check_vma else w
            gw, gx = jax.grad(partial(loss, reduce), argnums=(0, 1))(w, x)
            return gw[None], gx

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(AXIS), check_vma=check_vma))(w, x)

    for got, want in zip(run(rjax.psum), run(lax.psum)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    comm.check()


def test_a_tree_travels_as_one_exchange_per_dtype_under_deterministic_keys(comm, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    keys = []
    submit = comm.client.allreduce_async

    def record(x, **kwargs):  # type: ignore[no-untyped-def]
        keys.append((kwargs["key"], x.dtype.name, x.size))
        return submit(x, **kwargs)

    monkeypatch.setattr(comm.client, "allreduce_async", record)
    step = jax.pmap(lambda t: rjax.psum(t, AXIS), axis_name=AXIS)
    tree = tree_inputs()
    for _ in range(2):
        step(tree)
    comm.check()
    # per device and run: one float32 vector (a and s fused), one bfloat16, one int32
    assert len(keys) == 2 * 2 * 3
    by_key = {k: (dtype, size) for k, dtype, size in keys}
    assert len(by_key) == len(keys), "a key was used twice"
    prefix, where, phase, vector, dtype, device, call = keys[0][0]
    # the call site by module, function and line (and a digest of the stack outside JAX): never a
    # file path, which differs between hosts
    assert prefix == "redsrv.jax"
    assert re.fullmatch(re.escape(__name__) + r":test_a_tree_travels\S*\.<lambda>:\d+#[0-9a-f]{12}", where), where
    assert {(k[0][2], k[0][4], k[1]) for k in keys} == {("fwd", "float32", "float32"), ("fwd", "bfloat16", "bfloat16"),
                                                        ("int", "int32", "int32")}
    assert {k[0][5] for k in keys} == {0, 1} and {k[0][6] for k in keys} == {0, 1}
    # each device sends half of the padded flat vector: float32 holds 15 + 1 elements -> 8 each
    assert {size for k, dtype, size in keys if dtype == "float32"} == {8}


def test_a_leaf_of_unfused_bytes_or_more_travels_alone_and_sums_stay_exact(comm, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    keys = []
    submit = comm.client.allreduce_async

    def record(x, **kwargs):  # type: ignore[no-untyped-def]
        keys.append((kwargs["key"][3], x.dtype.name, x.size))
        return submit(x, **kwargs)

    monkeypatch.setattr(comm.client, "allreduce_async", record)
    monkeypatch.setattr(rjax, "UNFUSED_BYTES", 15 * 4)  # "a" (15 float32 per device) alone, "s" fused
    tree = tree_inputs()
    ours = jax.pmap(lambda t: rjax.psum(t, AXIS), axis_name=AXIS)(tree)
    comm.check()
    assert_trees_equal(ours, jax.pmap(lambda t: lax.psum(t, AXIS), axis_name=AXIS)(tree))
    # per device: "a" alone (15 -> 16 padded, 8 each), the rest of float32 ("s": 1 -> 2, 1 each),
    # bfloat16 ("h" is 14 bytes: fused, alone in its dtype), int32
    assert sorted((vector, dtype, size) for vector, dtype, size in keys if dtype == "float32") == \
        [(0, "float32", 8), (0, "float32", 8), (1, "float32", 1), (1, "float32", 1)]


def test_wire_dtype_compresses_floats_only(comm) -> None:  # type: ignore[no-untyped-def]
    tree = {"a": tree_inputs()["a"], "n": tree_inputs()["n"]}
    ours = jax.pmap(lambda t: rjax.psum(t, AXIS, wire_dtype="bf16"), axis_name=AXIS)(tree)
    ref = jax.pmap(lambda t: lax.psum(t, AXIS), axis_name=AXIS)(tree)
    np.testing.assert_allclose(ours["a"], ref["a"], rtol=1e-2, atol=1e-2)  # bf16 keeps 8 bits of mantissa
    assert not np.array_equal(ours["a"], ref["a"])  # it was rounded, so it did travel as bf16
    np.testing.assert_array_equal(ours["n"], ref["n"])
    comm.check()


def test_optax_transform_averages_like_lax_pmean(comm) -> None:  # type: ignore[no-untyped-def]
    params = {"w": jnp.array([1.0, -2.0, 3.0]), "b": jnp.array(0.5)}
    x = jnp.asarray(tree_inputs()["a"])

    def make(sync):  # type: ignore[no-untyped-def]
        tx = optax.chain(sync, optax.sgd(0.1))

        def step(params, x):  # type: ignore[no-untyped-def]
            grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(params)
            updates, _ = tx.update(grads, tx.init(params), params)
            return optax.apply_updates(params, updates)

        return jax.pmap(step, axis_name=AXIS, in_axes=(None, 0))(params, x)

    reference = optax.GradientTransformation(lambda p: optax.EmptyState(), lambda u, s, p=None: (lax.pmean(u, AXIS), s))
    got, want = make(rjax.allreduce_gradients(AXIS)), make(reference)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-6)
    comm.check()


def test_broadcast_tree_keeps_structure_dtypes_and_leaf_types(comm) -> None:  # type: ignore[no-untyped-def]
    tree = {"w": jnp.arange(6.0).reshape(2, 3), "key": np.array([1, 2**32 - 1], np.uint32),
            "n": (np.int32(4), jnp.ones(2, jnp.bfloat16)), "mask": np.array([True, False])}
    got = comm.broadcast_tree(tree)
    assert jax.tree.structure(got) == jax.tree.structure(tree)
    assert isinstance(got["w"], jax.Array) and isinstance(got["key"], np.ndarray)
    assert_trees_equal(got, tree)


def test_invariant_input_under_check_vma_is_a_clear_error(comm) -> None:  # type: ignore[no-untyped-def]
    mesh = jax.make_mesh((2,), (AXIS,))
    fn = jax.shard_map(lambda w: rjax.psum(w, AXIS), mesh=mesh, in_specs=P(), out_specs=P())
    with pytest.raises(TypeError, match="invariant over axis 'i'.*pcast"):
        jax.jit(fn)(jnp.ones(3))


def test_unsupported_dtype_and_integer_mean_fail_at_trace_time(comm) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TypeError, match="uint16 is not supported"):
        jax.pmap(lambda x: rjax.psum(x, AXIS), axis_name=AXIS)(jnp.ones((2, 3), jnp.uint16))
    with pytest.raises(TypeError, match="floating-point"):
        jax.pmap(lambda x: rjax.pmean(x, AXIS), axis_name=AXIS)(jnp.ones((2, 3), jnp.int32))


def test_without_init_the_collective_says_so() -> None:
    with pytest.raises(ValueError, match="not initialised"):
        jax.pmap(lambda x: rjax.psum(x, AXIS), axis_name=AXIS)(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="not initialised"):
        rjax.check()


def test_init_reads_the_environment_through_config(daemon, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("REDSRV_REDUCERS", daemon)
    monkeypatch.setenv("REDSRV_JOB", "from-env")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("REDSRV_OP_TIMEOUT", "7")
    with rjax.init() as comm:
        assert (comm.rank, comm.world_size, comm.client.config.job, comm.client.config.op_timeout) == (0, 1, "from-env", 7.0)
        assert rjax.default_communicator() is comm
        with pytest.raises(ValueError, match="already initialised"):
            rjax.init()
    with pytest.raises(ValueError, match="not initialised"):
        rjax.default_communicator()
    monkeypatch.setenv("REDSRV_OP_TIMEOUT", "-1")
    with pytest.raises(redsrv.ConfigError, match="op_timeout"):
        rjax.init()


def test_a_cached_step_follows_a_new_default_communicator(daemon) -> None:  # type: ignore[no-untyped-def]
    step = jax.pmap(lambda x: rjax.psum(x, AXIS), axis_name=AXIS)
    x = jnp.ones((2, 4))
    first = rjax.init([daemon], rank=0, world_size=1, job="jax-first", **FAST)
    step(x).block_until_ready()
    first.close()
    with rjax.init([daemon], rank=0, world_size=1, job="jax-second", **FAST) as second:
        np.testing.assert_array_equal(step(x), 2 * np.ones((2, 4)))
        second.check()
        assert second.client.ops_completed == 2  # both devices ran on the new client


def test_a_dead_reducer_is_stored_and_raised_by_check_never_hung() -> None:
    reducer = redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, close_timeout=2))
    host, port = reducer.start()
    comm = rjax.init([f"{host}:{port}"], rank=0, world_size=1, job="jax-dies", **FAST)
    try:
        step = comm.checked(jax.pmap(lambda x: comm.psum(x, AXIS), axis_name=AXIS))
        x = jnp.ones((2, 1000))
        np.testing.assert_array_equal(step(x), 2 * np.ones((2, 1000)))
        reducer.stop()
        started = time.monotonic()
        with pytest.raises(redsrv.PeerLostError) as info:
            # the break is seen by the next exchange or the client's own check: step until it is
            poll(lambda: step(x) is None, 10, "a step raising PeerLostError")
        assert time.monotonic() - started < 10
        # the raw step still completes (callbacks never raise) and its result is poisoned
        raw = jax.pmap(lambda x: comm.psum(x, AXIS), axis_name=AXIS)(x)
        assert np.isnan(np.asarray(raw)).all()
        with pytest.raises(redsrv.PeerLostError):
            comm.check()  # stays raised
        assert info.value is not None
    finally:
        comm.close()
        reducer.stop()


def test_a_failed_exchange_is_raised_with_its_type_and_where_it_happened(comm, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def refuse(x, **kwargs):  # type: ignore[no-untyped-def]
        raise redsrv.ContributionMismatchError("rank 0 sent 8 float32, rank 1 sent 9")

    monkeypatch.setattr(comm.client, "allreduce_async", refuse)
    out = jax.pmap(lambda x: rjax.psum(x, AXIS), axis_name=AXIS)(jnp.ones((2, 3)))
    assert np.isnan(np.asarray(out)).all()
    with pytest.raises(redsrv.ContributionMismatchError, match="rank 1 sent 9") as info:
        comm.check()
    assert any("redsrv.jax.psum at" in note and "local device" in note for note in getattr(info.value, "__notes__", [""]))



def test_every_vector_starts_before_its_call_waits_and_in_flight_calls_keep_their_own_buffers(comm, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    events = []
    submit, wait = comm.client.allreduce_async, comm.client.wait

    def record_submit(x, **kwargs):  # type: ignore[no-untyped-def]
        future = submit(x, **kwargs)
        future.redsrv_test_key = kwargs["key"]
        events.append(("start", kwargs["key"][2], kwargs["key"][5], kwargs["key"][6], kwargs["key"][3]))
        return future

    def record_wait(future, **kwargs):  # type: ignore[no-untyped-def]
        key = future.redsrv_test_key
        events.append(("wait", key[2], key[5], key[6], key[3]))
        return wait(future, **kwargs)

    monkeypatch.setattr(comm.client, "allreduce_async", record_submit)
    monkeypatch.setattr(comm.client, "wait", record_wait)
    step = jax.pmap(lambda t: rjax.psum(t, AXIS), axis_name=AXIS)
    trees = [jax.tree.map(lambda v, i=i: v + np.asarray(i, v.dtype), tree_inputs()) for i in range(6)]
    outs = [step(t) for t in trees]  # dispatched back to back: executions may overlap
    comm.check(outs)
    for tree, out in zip(trees, outs):
        assert_trees_equal(out, jax.pmap(lambda t: lax.psum(t, AXIS), axis_name=AXIS)(tree))
    # per device and call: the float32 and bfloat16 vectors of the floats' exchange, the int32 one of the integers'
    for phase, vectors in (("fwd", 2), ("int", 1)):
        for device in (0, 1):
            for call in range(6):
                mine = [(kind, vector) for kind, p, d, c, vector in events if (p, d, c) == (phase, device, call)]
                assert sorted(mine) == [("start", v) for v in range(vectors)] + [("wait", v) for v in range(vectors)]
                assert all(kind == "start" for kind, _ in mine[:vectors]), f"{phase} call {call} waited before starting: {mine}"


def test_a_vector_that_fails_to_start_poisons_the_call_and_drops_the_staging_buffers(comm, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    step = jax.pmap(lambda t: rjax.psum(t, AXIS), axis_name=AXIS)
    comm.check(step(tree_inputs()))
    assert comm._spare, "a finished call gives its staging buffers back for the next one"
    submit = comm.client.allreduce_async

    def second_refused(x, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs["key"][3] == 1:
            raise redsrv.PeerLostError("reducer 127.0.0.1:1 went away")
        return submit(x, **kwargs)

    monkeypatch.setattr(comm.client, "allreduce_async", second_refused)
    out = step(tree_inputs())
    for leaf in jax.tree.leaves({k: v for k, v in out.items() if k != "n"}):
        assert np.isnan(np.asarray(leaf, np.float32)).all()
    assert (np.asarray(out["n"]) == 0).all()
    with pytest.raises(redsrv.PeerLostError, match="went away"):
        comm.check()
    assert not comm._in_flight and not comm._spare  # an I/O thread may still touch them: never reused
