"""A JAX worker process for the adapter tests.

    python jax_worker.py SPEC_JSON OUT_PREFIX

SPEC: {"mode": "redsrv" | "lax", "scenario": "collectives" | "loop", "reducers": [...], "rank": r,
       "world_size": n, "job": "...", "config": {...}, "loop_seconds": float}

``collectives`` runs psum/pmean (pytrees of several dtypes) and gradients through them inside
``jax.pmap`` and ``jax.shard_map`` (check_vma on and off); in mode ``lax`` the same code uses
``lax.psum``/``lax.pmean`` on this process's devices only (the reference: one process with all
the devices). Every input depends only on the global device index ``rank * local + d``, so the
outputs of all processes, concatenated in rank order, compare one to one with the reference.
Writes OUT_PREFIX.npz (each result as [local devices, ...]) and OUT_PREFIX.json.

``loop`` runs pmap psum steps and ``check()`` after each, touching OUT_PREFIX.progress with the
step count, until an error or ``loop_seconds``; the error's type and time go to the json. With
``fail_at_step`` this process's exchanges fail from that step on (a failure only it sees).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import redsrv
import redsrv.jax as rjax

AXIS = "i"


def device_inputs(g: int) -> dict[str, np.ndarray]:
    """The inputs of global device ``g`` (a pytree with several dtypes and an odd total size)."""
    rng = np.random.default_rng([7, g])
    return {
        "a": rng.standard_normal((5, 3)).astype(np.float32),
        "b": rng.standard_normal(7).astype(np.float32),
        "h": rng.standard_normal(4).astype(jnp.bfloat16),
        "n": rng.integers(-100, 100, size=3).astype(np.int32),
    }


def loss(w: jax.Array, x: jax.Array, reduce: Any) -> jax.Array:
    """A loss that differentiates through the collective (w: [3], x: [5, 3])."""
    total = reduce(jnp.tanh(x * w).sum(axis=0), AXIS)  # [3], summed over all devices
    return jnp.sum(total**2) / 7 + jnp.sum(reduce(x.mean() * w, AXIS))


def collectives(spec: dict[str, Any], comm: rjax.Communicator | None) -> dict[str, np.ndarray]:
    lax_mode = spec["mode"] == "lax"
    psum = lax.psum if lax_mode else rjax.psum
    pmean = lax.pmean if lax_mode else rjax.pmean
    local = jax.local_device_count()
    first = 0 if lax_mode else spec["rank"] * local
    per_device = [device_inputs(first + d) for d in range(local)]
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *per_device)  # leaves [local, ...]
    w = np.array([0.5, -1.0, 2.0], np.float32)
    out: dict[str, np.ndarray] = {}

    def put(prefix: str, tree: Any) -> None:
        for name, value in tree.items():
            out[f"{prefix}.{name}"] = np.asarray(jax.device_get(value)).astype(np.float32)

    # pmap: per-device values
    pm = jax.pmap(lambda t: (psum(t, AXIS), pmean({"a": t["a"], "h": t["h"]}, AXIS)), axis_name=AXIS)
    summed, meaned = pm(stacked)
    put("pmap.psum", summed)
    put("pmap.pmean", meaned)
    grad_fn = jax.grad(loss, argnums=(0, 1))
    gw, gx = jax.pmap(lambda w, x: grad_fn(w, x, psum), axis_name=AXIS, in_axes=(None, 0))(w, stacked["a"])
    out["pmap.grad_w"], out["pmap.grad_x"] = np.asarray(gw), np.asarray(gx)

    # shard_map: leaves [local * k, ...] sharded over the devices
    mesh = jax.make_mesh((local,), (AXIS,))
    sharded = jax.tree.map(lambda v: jax.device_put(v.reshape(-1, *v.shape[2:]), NamedSharding(mesh, P(AXIS))), stacked)
    for check_vma in (True, False):
        tag = f"smap{int(check_vma)}"

        def body(t: Any) -> Any:
            s, m = psum(t, AXIS), pmean({"a": t["a"], "h": t["h"]}, AXIS)
            # out_specs P(AXIS) on replicated values: one copy per device, as pmap returns them
            return jax.tree.map(lambda v: v[None], s), jax.tree.map(lambda v: v[None], m)

        vary = (lambda v: lax.pcast(v, AXIS, to="varying")) if check_vma else (lambda v: v)
        smap = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=check_vma))
        summed, meaned = smap(sharded)
        put(f"{tag}.psum", summed)
        put(f"{tag}.pmean", meaned)

        def grad_body(w: jax.Array, x: jax.Array) -> Any:
            gw, gx = grad_fn(vary(w), x, psum)  # noqa: B023 - used at once
            return gw[None], gx

        gw, gx = jax.jit(jax.shard_map(grad_body, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(AXIS),
                                       check_vma=check_vma))(w, sharded["a"])
        out[f"{tag}.grad_w"], out[f"{tag}.grad_x"] = np.asarray(gw), np.asarray(gx).reshape(local, 5, 3)

    if comm is not None:
        comm.check()
        mine = {"w": np.full((2, 3), spec["rank"] + 1, np.float32), "k": np.full(2, spec["rank"], np.uint32),
                "j": jnp.full(4, spec["rank"], jnp.int32)}
        got = comm.broadcast_tree(mine, root=spec["world_size"] - 1)
        out["broadcast.w"], out["broadcast.k"], out["broadcast.j"] = got["w"], got["k"].astype(np.int64), np.asarray(got["j"])
        out["broadcast.j_is_jax"] = np.array(isinstance(got["j"], jax.Array))
    return out


def loop(spec: dict[str, Any], comm: rjax.Communicator, prefix: str, report: dict[str, Any]) -> None:
    step_fn = jax.pmap(lambda x: rjax.psum(x, AXIS), axis_name=AXIS)
    x = jnp.ones((jax.local_device_count(), 1000), jnp.float32)
    deadline = time.monotonic() + spec.get("loop_seconds", 60)
    step = 0
    while time.monotonic() < deadline:
        if step == spec.get("fail_at_step", -1):
            # a failure only this process sees, as if its own side of the exchange broke
            def refuse(x: Any, at: int = step, **kwargs: Any) -> Any:
                raise redsrv.RemoteProtocolError(f"injected failure at step {at} on rank {spec['rank']}")

            comm.client.allreduce_async = refuse  # type: ignore[method-assign]
        y = step_fn(x)
        comm.check(y)
        step += 1
        report["steps"] = step
        with open(prefix + ".progress", "w") as f:
            f.write(str(step))
        time.sleep(0.02)  # noqa: TID251 - a training step's compute time: pacing, not a synchronisation


def main() -> int:
    spec = json.loads(sys.argv[1])
    prefix = sys.argv[2]
    report: dict[str, Any] = {"rank": spec.get("rank", 0), "error": None, "devices": jax.local_device_count()}
    results: dict[str, np.ndarray] = {}
    comm = None
    try:
        if spec["mode"] == "redsrv":
            comm = rjax.init(spec["reducers"], rank=spec["rank"], world_size=spec["world_size"], job=spec["job"],
                             **spec.get("config", {}))
            report["client"] = type(comm.client).__name__  # HostClient where several processes share a host
        if spec["scenario"] == "collectives":
            results = collectives(spec, comm)
        else:
            assert comm is not None
            loop(spec, comm, prefix, report)
    except redsrv.RedsrvError as exc:
        report["error"] = {"type": type(exc).__name__, "message": str(exc), "at": time.time(),
                           "mro": [c.__name__ for c in type(exc).__mro__],
                           "notes": list(getattr(exc, "__notes__", []))}
    except Exception as exc:  # an untyped error is a test failure: report it as such
        report["error"] = {"type": type(exc).__name__, "message": str(exc), "at": time.time(), "mro": [],
                           "traceback": traceback.format_exc()}
    finally:
        if comm is not None:
            comm.close()
    np.savez(prefix + ".npz", **results)
    with open(prefix + ".json", "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
