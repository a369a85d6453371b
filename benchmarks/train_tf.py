"""The TensorFlow worker of ``redsrv bench train --framework tf`` (the orchestration, timing rule
and report are :mod:`redsrv.bench.train`'s).

Every process is one worker with one CPU device. The model is the other workers': a Keras stack
of square ``Dense`` layers (tanh between them) with the same initial values on every rank
(:func:`redsrv.bench.train.init_params`), each rank its own generated batch, loss = sum of squared
errors / batch / replicas (Keras's optimizer sums the gradients over the replicas, so this is the
mean gradient, as DDP's), ``keras.optimizers.SGD``. A custom training loop, so that every step is
timed on every rank after a barrier, as the torch worker does. The blocks:

  gloo     TensorFlow's own cross-process all-reduce: ``MultiWorkerMirroredStrategy`` with
           ``CommunicationImplementation.RING`` (its cluster: one ``worker`` task per rank, as
           ``TF_CONFIG`` would give it)
  hook     the same step under redsrv's ``ReductionServerStrategy``
  raw      the client's allreduce_async of exactly the arrays the strategy's host call sent in
           the last hook step (recorded as they pass, as the torch worker records DDP's buckets)
  compute  the same step on a copy of the model outside any strategy: forward, backward, SGD, no
           communication

The barrier and the digest exchange of the identical-parameters check go through the redsrv
client directly (not through either strategy), untimed.
"""

from __future__ import annotations

import os
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

__all__ = ["worker", "worker_env", "SETUP"]

#: The result file's description of the step.
SETUP = {"optimizer": "keras.optimizers.SGD", "learning_rate": LEARNING_RATE, "loop": "custom (strategy.run in a tf.function)",
         "baseline": "tf.distribute.MultiWorkerMirroredStrategy, CommunicationImplementation.RING, one CPU device per worker",
         "redsrv": "redsrv.tf.ReductionServerStrategy (one fused vector per dtype)"}


def worker_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a TensorFlow worker: no TF_CONFIG from outside (each worker is given its cluster
    explicitly), C++ INFO and WARNING lines kept out of the log."""
    out = {k: v for k, v in env.items() if k != "TF_CONFIG"}
    out.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return out


def worker(spec: dict[str, Any]) -> int:
    w = _TfWorker(spec)
    try:
        w.run()
    finally:
        w.close()
    return 0


class _Recorder:
    """Notes the sizes and dtypes of the arrays the strategy's host call sends; ``layout`` is the
    last call's. Left on in every hook step (a list per call, microseconds)."""

    def __init__(self) -> None:
        self.layout: list[tuple[int, str]] = []

    def wrap(self, host_allreduce: Callable[..., Any]) -> Callable[..., Any]:
        def recording(site: str, timeout: float | None, *arrays: Any) -> Any:
            self.layout = [(int(a.size), a.dtype.name) for a in arrays]
            return host_allreduce(site, timeout, *arrays)

        return recording


class _TfWorker:
    def __init__(self, spec: dict[str, Any]) -> None:
        import tensorflow as tf

        import redsrv.tf

        self.tf = tf
        self.spec = spec
        self.rank, self.n = spec["rank"], spec["world"]
        self.timeout = spec["op_timeout"]
        # One compute thread per op, as torch's set_num_threads(1); the inter-op pool stays, since
        # the ring's collectives run concurrently with each other.
        tf.config.threading.set_intra_op_parallelism_threads(1)
        self.strategies: dict[str, Any] = {}
        if "gloo" in spec["modes"]:
            # Created first: MultiWorkerMirroredStrategy must configure the runtime before any op runs.
            resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
                tf.train.ClusterSpec({"worker": spec["tf_workers"]}), task_type="worker", task_id=self.rank,
                rpc_layer="grpc")
            options = tf.distribute.experimental.CommunicationOptions(
                implementation=tf.distribute.experimental.CommunicationImplementation.RING, timeout_seconds=self.timeout)
            self.strategies["gloo"] = tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver,
                                                                               communication_options=options)
        environ = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        # Once MultiWorkerMirroredStrategy has made this process a task of its cluster, a
        # MirroredStrategy on the default "/device:CPU:0" crashes TensorFlow (SIGSEGV while it
        # builds its own fallback collectives): name this task's device in full.
        devices = list(self.strategies["gloo"].extended.worker_devices) if self.strategies else None
        self.redsrv = redsrv.tf.ReductionServerStrategy(spec["reducers"], num_workers=self.n, worker_index=self.rank,
                                                        devices=devices, job=spec["job"], op_timeout=self.timeout,
                                                        environ=environ)
        self.strategies["hook"] = self.redsrv
        self.client = self.redsrv.cross_device_ops.client
        self.recorder = _Recorder()
        ops = self.redsrv.cross_device_ops
        ops._host_allreduce = self.recorder.wrap(ops._host_allreduce)  # looked up when the step is traced
        self.raw = RawReplay(rank=self.rank, n=self.n)
        self._barriers = 0

    def close(self) -> None:
        self.redsrv.close()

    def _model(self) -> Any:
        import keras

        layers, width = self.spec["layers"], self.spec["width"]
        stack: list[Any] = [keras.Input((width,))]
        for i in range(layers):
            stack.append(keras.layers.Dense(width, activation="tanh" if i < layers - 1 else None))
        model = keras.Sequential(stack)
        # Keras keeps kernels as in x out: the transpose of torch's (and init_params') out x in.
        model.set_weights([w.T if w.ndim == 2 else w for w in self.initial])
        return model

    def _build(self) -> None:
        import keras
        import numpy as np

        tf, spec = self.tf, self.spec
        self.np = np
        self.initial = init_params(np, spec["layers"], spec["width"])
        self.params = sum(p.size for p in self.initial)
        # Every rank its own data, as in data parallelism; each can make every rank's (the reference's).
        batches = [rank_batch(np, r, spec["batch"], spec["width"]) for r in range(self.n)]
        self.own = batches[self.rank]
        self.x, self.y = (tf.constant(a) for a in self.own)
        self.reference = None
        if self.rank == 0:
            self.reference = ReferenceModel(self.initial)
            self.all_x, self.all_y = np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])
        self.models: dict[str, Any] = {}
        self.steps: dict[str, Callable[[], Any]] = {}
        for mode, strategy in self.strategies.items():
            with strategy.scope():
                model = self._model()
                optimizer = keras.optimizers.SGD(LEARNING_RATE)
            self.models[mode] = model
            self.steps[mode] = self._step(strategy, model, optimizer, strategy.num_replicas_in_sync)
        model = self._model()  # no strategy: the compute-only step
        self.models["compute"] = model
        self.steps["compute"] = self._step(None, model, keras.optimizers.SGD(LEARNING_RATE), 1)

    def _step(self, strategy: Any, model: Any, optimizer: Any, replicas: int) -> Callable[[], Any]:
        tf = self.tf
        x, y, batch = self.x, self.y, self.spec["batch"]

        def replica_step() -> Any:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(model(x, training=True) - y)) / (batch * replicas)
            variables = model.trainable_variables
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))
            return loss

        @tf.function
        def step() -> Any:
            return replica_step() if strategy is None else strategy.run(replica_step)

        return step

    def run(self) -> None:
        self._build()
        harness.emit(event="ready")
        harness.emit(event="model", params=self.params, grad_bytes=sum(p.nbytes for p in self.initial))
        blocks = {"gloo": self._train_block, "hook": self._train_block, "raw": self._raw_block, "compute": self._compute_block}
        run_blocks(self.spec, blocks)

    def _barrier(self) -> None:
        self._barriers += 1
        self.client.barrier(key=("bench-barrier", self._barriers), timeout=self.timeout)

    def _timed(self, step: Callable[[int], None]) -> tuple[list[float], harness.CpuMeter]:
        return harness.timed_steps(step, warmup=self.spec["warmup"], steps=self.spec["steps"], barrier=self._barrier,
                                   reducer_pids=self.spec["reducer_pids"])

    def _weights(self, mode: str) -> list[Any]:
        """This worker's parameters as init_params lays them out (kernels back to out x in)."""
        return [w.T if w.ndim == 2 else w for w in self.models[mode].get_weights()]

    def _run_step(self, mode: str) -> None:
        # Eager function calls return when the function has run (TensorFlow's default synchronous
        # execution); reading the loss waits for it explicitly.
        loss = self.steps[mode]()
        for value in (self.strategies[mode].experimental_local_results(loss) if mode in self.strategies else [loss]):
            value.numpy()

    def _train_block(self, mode: str, rnd: int) -> dict[str, Any]:
        times, meter = self._timed(lambda _i: self._run_step(mode))
        if mode == "hook":
            self.redsrv.check()
        mine = self._weights(mode)
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
        return self.raw.block(self.client, self.recorder.layout, params=self.params, wire_dtype=self.spec["wire_dtype"],
                              timeout=self.timeout, rnd=rnd, timed=self._timed)

    def _compute_block(self, mode: str, rnd: int) -> dict[str, Any]:
        model = self.models["compute"]
        model.set_weights(self.models["hook"].get_weights())  # start where the hook model is, every round
        start = self._weights("hook")
        times, meter = self._timed(lambda _i: self._run_step("compute"))
        return local_block(times, meter, self._weights("compute"), start, *self.own,
                           self.spec["warmup"] + self.spec["steps"], self.spec["tolerance"])

    def _ranks_identical(self, params: Sequence[Any]) -> bool:
        """Bit-identical models on every rank: each rank's digest, all-gathered by the client."""
        from redsrv.core import collectives

        np = self.np
        self._barriers += 1
        mine = np.frombuffer(bytes.fromhex(params_digest(params)), dtype=np.uint8)
        gathered = collectives.allgather(self.client, mine, key=("bench-digest", self._barriers), timeout=self.timeout)
        return all(np.array_equal(g, mine) for g in gathered)

    def _hook_vs_gloo(self, hook: Sequence[Any]) -> dict[str, Any]:
        """As the torch worker's (:func:`redsrv.bench.train.hook_vs_gloo`)."""
        return hook_vs_gloo(hook, self._weights("gloo"), self.initial, self.spec["tolerance"])
