"""The JAX worker of ``redsrv bench train --framework jax`` (the orchestration, timing rule and
report are :mod:`redsrv.bench.train`'s).

Every process is one rank with one CPU device. The model is the torch worker's: a stack of square
dense layers (tanh between them) initialised identically on every rank, each rank its own
generated batch, loss = sum of squared errors / batch, plain SGD. The blocks:

  gloo     JAX's own cross-process all-reduce: ``jax.distributed`` with its gloo CPU collectives,
           the step a ``jit`` of ``shard_map`` over the global mesh (one device per process) with
           ``lax.pmean`` of the gradients
  hook     the same step on this process's device, the gradients reduced by ``redsrv.jax.pmean``
  raw      the client's allreduce_async of exactly the arrays that pmean sends (each leaf of 4 MiB or
           more alone, the rest fused per dtype: :func:`redsrv.core.fusion.unfuse_large`), then waited
  compute  the same step without any all-reduce (the parameters it produces are dropped)

XLA's CPU backend runs single-threaded here (``XLA_FLAGS`` from :func:`worker_env`), as torch does
with one thread: the workers and reducers share the machine's cores.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from redsrv.bench import harness
from redsrv.bench.train import (
    LEARNING_RATE,
    RawReplay,
    ReferenceModel,
    agreement,
    hook_vs_gloo,
    init_params,
    local_block,
    params_digest,
    rank_batch,
    run_blocks,
    trained_block,
)

__all__ = ["worker", "worker_env", "XLA_THREAD_FLAGS", "SETUP"]

#: The result file's description of the step.
SETUP = {"optimizer": "SGD", "learning_rate": LEARNING_RATE, "baseline": "jax.distributed, gloo CPU collectives, lax.pmean in "
         "jit(shard_map) over one CPU device per process",
         "redsrv": "redsrv.jax.pmean (leaves of 4 MiB or more alone, the rest fused per dtype)"}

#: One compute thread for XLA's CPU client (Eigen's pool and the intra-op pool), for both blocks.
XLA_THREAD_FLAGS = ("--xla_cpu_multi_thread_eigen=false", "intra_op_parallelism_threads=1")
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def worker_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a JAX worker: CPU only, one device per process (a test environment may force
    more: that flag is dropped), single-threaded XLA."""
    kept = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_FLAG) and f not in XLA_THREAD_FLAGS]
    return dict(env, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join([*kept, *XLA_THREAD_FLAGS]))


def _use_gloo_interface(interface: str) -> None:
    """JAX's gloo collectives bind to the address of the host name, which in a network namespace
    of the emulated cluster is loopback: make them bind to the namespace's interface instead, as
    ``GLOO_SOCKET_IFNAME`` does for torch. ``jax/_src/xla_bridge.py`` creates them with
    ``_jax.make_gloo_tcp_collectives(distributed_client=...)`` and no interface argument, so the
    factory it looks up is wrapped (before the CPU backend exists)."""
    from jax._src import xla_bridge

    make = xla_bridge._jax.make_gloo_tcp_collectives
    if getattr(make, "redsrv_interface", None) == interface:
        return
    wrapped = functools.partial(make, interface=interface)
    wrapped.redsrv_interface = interface  # type: ignore[attr-defined]
    xla_bridge._jax.make_gloo_tcp_collectives = wrapped


def worker(spec: dict[str, Any]) -> int:
    w = _JaxWorker(spec)
    try:
        w.run()
    finally:
        w.close()
    return 0


class _JaxWorker:
    def __init__(self, spec: dict[str, Any]) -> None:
        import jax

        import redsrv.jax

        self.jax = jax
        self.spec = spec
        self.rank, self.n = spec["rank"], spec["world"]
        self.timeout = spec["op_timeout"]
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        _use_gloo_interface(spec["interface"])
        jax.distributed.initialize(coordinator_address=spec["master"], num_processes=self.n, process_id=self.rank,
                                   initialization_timeout=int(self.timeout))
        if jax.local_device_count() != 1 or jax.device_count() != self.n:
            raise RuntimeError(f"expected one CPU device per process, got {jax.local_device_count()} local and "
                               f"{jax.device_count()} global")
        self.comm = redsrv.jax.init(spec["reducers"], rank=self.rank, world_size=self.n, job=spec["job"],
                                    op_timeout=self.timeout, set_default=False)
        self.layout: list[tuple[int, str]] = []
        self.raw = RawReplay(rank=self.rank, n=self.n)
        self._barriers = 0

    def close(self) -> None:
        self.comm.close()
        self.jax.distributed.shutdown()

    # --- the model and the three steps ---

    def _build(self) -> None:
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax import lax
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        import redsrv.jax
        from redsrv.core import fusion

        spec = self.spec
        self.np = np
        self.initial = init_params(np, spec["layers"], spec["width"])
        self.params = sum(p.size for p in self.initial)
        # Every rank its own data, as in data parallelism; each can make every rank's (the reference's).
        batches = [rank_batch(np, r, spec["batch"], spec["width"]) for r in range(self.n)]
        x, y = self.own = batches[self.rank]
        self.reference = None
        if self.rank == 0:
            self.reference = ReferenceModel(self.initial)
            self.all_x, self.all_y = np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])

        def loss(params: list[Any], x: Any, y: Any) -> Any:
            h = x
            for i in range(0, len(params), 2):
                h = h @ params[i].T + params[i + 1]
                if i + 2 < len(params):
                    h = jnp.tanh(h)
            return jnp.sum((h - y) ** 2) / x.shape[0]

        def sgd(params: list[Any], grads: list[Any]) -> list[Any]:
            return [p - LEARNING_RATE * g for p, g in zip(params, grads, strict=True)]

        def reduced_step(pmean: Callable[[Any, str], Any]) -> Callable[..., Any]:
            def body(params: list[Any], x: Any, y: Any) -> list[Any]:
                grads = jax.grad(loss)(lax.pcast(params, "i", to="varying"), x, y)
                return sgd(params, pmean(grads, "i"))

            return body

        # Baseline: one device per process in a global mesh; lax.pmean runs over gloo.
        world = Mesh(np.array(jax.devices()), ("i",))
        self.steps: dict[str, Callable[..., Any]] = {}
        self.models: dict[str, list[Any]] = {}
        self.data: dict[str, tuple[Any, Any]] = {}
        if "gloo" in spec["modes"]:
            replicated, split = NamedSharding(world, P()), NamedSharding(world, P("i"))
            self.steps["gloo"] = jax.jit(jax.shard_map(reduced_step(lax.pmean), mesh=world, in_specs=(P(), P("i"), P("i")),
                                                       out_specs=P()), donate_argnums=0)
            self.models["gloo"] = [jax.make_array_from_process_local_data(replicated, p) for p in self.initial]
            self.data["gloo"] = (jax.make_array_from_process_local_data(split, x),
                                 jax.make_array_from_process_local_data(split, y))
        # redsrv: the same step on this process's device; the reducers add the processes.
        local = Mesh(np.array(jax.local_devices()), ("i",))
        comm = self.comm
        self.steps["hook"] = jax.jit(jax.shard_map(reduced_step(lambda g, axis: comm.pmean(g, axis)), mesh=local,
                                                   in_specs=(P(), P("i"), P("i")), out_specs=P()), donate_argnums=0)
        self.models["hook"] = [jnp.asarray(p) for p in self.initial]
        self.data["hook"] = (jnp.asarray(x), jnp.asarray(y))
        self.steps["compute"] = jax.jit(lambda params, x, y: sgd(params, jax.grad(loss)(params, x, y)))
        # What redsrv.jax.pmean sends for these gradients: each large leaf alone, the rest fused
        # per dtype (adapters/jax.py, _exchange_leaves).
        groups = fusion.unfuse_large(fusion.group_by_dtype(self.initial), redsrv.jax.UNFUSED_BYTES)
        self.layout = [(g.total, g.dtype.name) for g in groups]

    def run(self) -> None:
        self._build()
        harness.emit(event="ready")
        harness.emit(event="model", params=self.params, grad_bytes=sum(p.nbytes for p in self.initial))
        blocks = {"gloo": self._train_block, "hook": self._train_block, "raw": self._raw_block, "compute": self._compute_block}
        run_blocks(self.spec, blocks)

    def _barrier(self) -> None:
        """Every process here before any goes on: the coordination service's barrier (no
        collective on the data path, so it costs neither implementation anything)."""
        from jax._src import distributed

        self._barriers += 1
        client = distributed.global_state.client
        assert client is not None
        client.wait_at_barrier(f"redsrv-bench-{self._barriers}", int(self.timeout * 1000))

    def _timed(self, step: Callable[[int], None]) -> tuple[list[float], harness.CpuMeter]:
        return harness.timed_steps(step, warmup=self.spec["warmup"], steps=self.spec["steps"], barrier=self._barrier,
                                   reducer_pids=self.spec["reducer_pids"])

    def _local(self, params: Sequence[Any]) -> list[Any]:
        """This process's copy of each parameter, as numpy."""
        return [self.np.asarray(p.addressable_data(0)) for p in params]

    def _train_block(self, mode: str, rnd: int) -> dict[str, Any]:
        step, (x, y) = self.steps[mode], self.data[mode]

        def one(_i: int) -> None:
            self.models[mode] = step(self.models[mode], x, y)
            self.jax.block_until_ready(self.models[mode])
            if mode == "hook":
                self.comm.check()  # a failed exchange poisons the step: raise it here

        times, meter = self._timed(one)
        mine = self._local(self.models[mode])
        same = self._ranks_identical(mine)
        return trained_block(times, meter, same, [self._vs_reference(mine, rnd),
                                                  self._hook_vs_gloo(mine) if mode == "hook" and "gloo" in self.models else None])

    def _vs_reference(self, mine: Sequence[Any], rnd: int) -> dict[str, Any] | None:
        """As the torch worker's: rank 0 against the reference replay of as many steps."""
        if self.reference is None:
            return None
        self.reference.advance_to((rnd + 1) * (self.spec["warmup"] + self.spec["steps"]), self.all_x, self.all_y)
        return agreement("vs_reference", mine, self.reference.params, self.initial, self.spec["tolerance"])

    def _raw_block(self, mode: str, rnd: int) -> dict[str, Any]:
        return self.raw.block(self.comm.client, self.layout, params=self.params, wire_dtype=self.spec["wire_dtype"],
                              timeout=self.timeout, rnd=rnd, timed=self._timed)

    def _compute_block(self, mode: str, rnd: int) -> dict[str, Any]:
        step, (x, y) = self.steps["compute"], self.data["hook"]
        params = self.models["hook"]
        stepped: list[Any] = []

        def one(_i: int) -> None:
            # Not donated and not kept: the hook model goes on from where it was.
            stepped[:] = self.jax.block_until_ready(step(params, x, y))

        times, meter = self._timed(one)
        # Each step starts from the hook model: the last one's output is one local step from it.
        return local_block(times, meter, self._local(stepped), self._local(params), *self.own, 1, self.spec["tolerance"])

    def _ranks_identical(self, params: Sequence[Any]) -> bool:
        """Bit-identical models on every rank: each rank's digest through the coordination
        service's key-value store (every rank reads every other's)."""
        from jax._src import distributed

        client = distributed.global_state.client
        assert client is not None
        self._barriers += 1
        tag = f"redsrv-bench-digest-{self._barriers}"
        mine = params_digest(params)
        client.key_value_set(f"{tag}/{self.rank}", mine)
        ms = int(self.timeout * 1000)
        return all(client.blocking_key_value_get(f"{tag}/{r}", ms) == mine for r in range(self.n))

    def _hook_vs_gloo(self, hook: Sequence[Any]) -> dict[str, Any]:
        """As the torch worker's (:func:`redsrv.bench.train.hook_vs_gloo`)."""
        return hook_vs_gloo(hook, self._local(self.models["gloo"]), self.initial, self.spec["tolerance"])

