"""Data-parallel training of a small MLP with plain JAX and optax through redsrv.

Every process drives its local devices with ``jax.shard_map``; the one change from single-host
JAX is the first transform of the optax chain, ``redsrv.jax.allreduce_gradients(AXIS)``, where
``lax.pmean`` would be. It averages the gradients over every device of every process: each
process sums its own devices in XLA, the reducers add the processes. The data set is generated
(a fixed seed); global device ``g = rank * local_devices + d`` trains on rows ``g*B .. (g+1)*B``,
so the result equals one process with all the devices and ``lax.pmean``.

Two processes with two CPU devices each, against two reducers::

    redsrv reducer --port 29600 &  redsrv reducer --port 29601 &
    for r in 0 1; do
      XLA_FLAGS=--xla_force_host_platform_device_count=2 REDSRV_REDUCERS=127.0.0.1:29600,127.0.0.1:29601 \\
        REDSRV_JOB=jax-demo python -m redsrv.examples.jax_optax --rank $r --world-size 2 --out rank$r.npz &
    done; wait

The same training in one process on four devices with ``lax.pmean`` (no reducers)::

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m redsrv.examples.jax_optax --reference --out ref.npz

Reducer addresses, job, rank and world size may come from the flags or from ``REDSRV_REDUCERS``,
``REDSRV_JOB``, ``RANK`` and ``WORLD_SIZE``.
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "batch"
FEATURES, HIDDEN, CLASSES, ROWS_PER_DEVICE = 32, 64, 4, 16
LEARNING_RATE = 1e-2


def make_data(global_devices: int) -> tuple[np.ndarray, np.ndarray]:
    """The whole data set, identical in every process; global device g uses block g."""
    rng = np.random.default_rng(1234)
    x = rng.standard_normal((global_devices * ROWS_PER_DEVICE, FEATURES)).astype(np.float32)
    teacher = rng.standard_normal((FEATURES, CLASSES)).astype(np.float32)
    return x, np.argmax(x @ teacher, axis=1).astype(np.int32)


def init_params(seed: int = 0) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w1": jax.random.normal(k1, (FEATURES, HIDDEN)) / np.sqrt(FEATURES),
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, CLASSES)) / np.sqrt(HIDDEN),
        "b2": jnp.zeros(CLASSES),
    }


def loss_fn(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    logits = hidden @ params["w2"] + params["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_train_step(mesh: jax.sharding.Mesh, tx: optax.GradientTransformation, mean: Any) -> Any:
    """One jitted step over the local devices; ``mean`` reduces the loss for logging."""

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS)), out_specs=(P(), P(), P()))
    def train_step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> Any:
        # Varying-typed parameters keep the gradients per device (shard_map's type system would
        # otherwise sum them over this process's devices only); the transform averages them.
        loss, grads = jax.value_and_grad(loss_fn)(lax.pcast(params, AXIS, to="varying"), x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, mean(loss, AXIS)

    return train_step


def lax_pmean_gradients() -> optax.GradientTransformation:
    """What ``redsrv.jax.allreduce_gradients`` replaces: ``lax.pmean`` over this process's devices."""
    return optax.GradientTransformation(lambda params: optax.EmptyState(),
                                        lambda updates, state, params=None: (lax.pmean(updates, AXIS), state))


def train(*, steps: int, reference: bool = False, rank: int | None = None, world_size: int | None = None,
          reducers: list[str] | None = None, job: str | None = None, wire_dtype: str | None = None,
          log_every: int = 10) -> dict[str, Any]:
    """Train; with ``reference`` in this process alone on all its devices with ``lax.pmean``."""
    local = jax.local_device_count()
    mesh = jax.make_mesh((local,), (AXIS,))
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    comm = None
    if reference:
        rank, world_size = 0, 1
        tx, mean = optax.chain(lax_pmean_gradients(), optax.adam(LEARNING_RATE)), lax.pmean
    else:
        import redsrv.jax

        comm = redsrv.jax.init(reducers, rank=rank, world_size=world_size, job=job, wire_dtype=wire_dtype)
        rank, world_size = comm.rank, comm.world_size
        tx = optax.chain(redsrv.jax.allreduce_gradients(AXIS), optax.adam(LEARNING_RATE))
        mean = redsrv.jax.pmean
    try:
        x, y = make_data(world_size * local)
        rows = slice(rank * local * ROWS_PER_DEVICE, (rank + 1) * local * ROWS_PER_DEVICE)
        x_local, y_local = jax.device_put(x[rows], sharded), jax.device_put(y[rows], sharded)
        params = init_params()
        if comm is not None:
            params = comm.broadcast_tree(params)  # identical start, whatever each process drew
        params = jax.device_put(params, replicated)
        opt_state = jax.device_put(tx.init(params), replicated)
        train_step = make_train_step(mesh, tx, mean)
        losses = []
        start = time.perf_counter()
        for step in range(steps):
            if step == 1:
                start = time.perf_counter()  # step 0 compiled the step function; time the rest
            params, opt_state, loss = train_step(params, opt_state, x_local, y_local)
            if comm is not None:
                comm.check(loss)  # a failed exchange raises here, after the step, as its redsrv error
            losses.append(float(loss))
            if rank == 0 and log_every and (step % log_every == 0 or step == steps - 1):
                print(f"step {step:4d}  loss {losses[-1]:.5f}", flush=True)
        seconds = time.perf_counter() - start
        timed_steps = max(steps - 1, 1)
        weights = np.concatenate([np.asarray(leaf).ravel() for leaf in jax.tree.leaves(params)])
        out: dict[str, Any] = {"weights": weights, "losses": np.asarray(losses), "seconds": seconds,
                               "first_loss": losses[0] if losses else float("nan"),
                               "last_loss": losses[-1] if losses else float("nan"), "devices": world_size * local,
                               "ms_per_step": seconds / timed_steps * 1000}
        if comm is not None:
            out["bytes_pushed"], out["bytes_pulled"] = comm.client.bytes_pushed, comm.client.bytes_pulled
        return out
    finally:
        if comm is not None:
            comm.close()


def train_worker(*, rank: int, world_size: int, reducers: list[str], job: str, steps: int,
                 wire_dtype: str | None = None) -> dict[str, Any]:
    """One worker of ``redsrv demo`` (the local launcher's interface)."""
    return train(steps=steps, rank=rank, world_size=world_size, reducers=reducers, job=job, wire_dtype=wire_dtype,
                 log_every=0)


def train_reference(*, world_size: int, steps: int) -> np.ndarray:
    """The weights ``world_size`` workers with this process's device count reach, computed here
    alone: the global devices are ``jax.vmap``-ed over (``lax.pmean`` works on a vmap axis too),
    so the launcher needs no extra devices for its check."""
    devices = world_size * jax.local_device_count()
    tx = optax.chain(lax_pmean_gradients(), optax.adam(LEARNING_RATE))

    def body(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> Any:
        grads = jax.grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(jax.vmap(body, axis_name=AXIS, in_axes=(None, None, 0, 0), out_axes=(None, None)))
    x, y = make_data(devices)
    x, y = x.reshape(devices, ROWS_PER_DEVICE, FEATURES), y.reshape(devices, ROWS_PER_DEVICE)
    params = init_params()
    opt_state = tx.init(params)
    for _ in range(steps):
        params, opt_state = step(params, opt_state, x, y)
    return np.concatenate([np.asarray(leaf).ravel() for leaf in jax.tree.leaves(params)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m redsrv.examples.jax_optax", description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--world-size", type=int, default=None)
    parser.add_argument("--reducers", default=None, help="host:port,host:port (default: REDSRV_REDUCERS)")
    parser.add_argument("--job", default=None)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--wire-dtype", choices=["bf16", "fp16"], default=None)
    parser.add_argument("--reference", action="store_true", help="one process, its local devices, lax.pmean")
    parser.add_argument("--out", default=None, help="write weights and losses to this .npz")
    args = parser.parse_args(argv)
    out = train(steps=args.steps, reference=args.reference, rank=args.rank, world_size=args.world_size,
                reducers=args.reducers.split(",") if args.reducers else None, job=args.job, wire_dtype=args.wire_dtype)
    print(f"trained {args.steps} steps on {out['devices']} devices ({out['ms_per_step']:.1f} ms/step after the first): "
          f"loss {out['first_loss']:.4f} -> {out['last_loss']:.4f}", flush=True)
    if args.out:
        np.savez(args.out, **{k: np.asarray(v) for k, v in out.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
