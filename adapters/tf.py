"""TensorFlow adapter: Keras ``fit`` over many worker processes, the cross-worker sum done by the reducers.

Each worker process replicates the model over its own devices in-graph (as ``MirroredStrategy``
does); gradients are summed over those devices locally and then over the workers by the reducer
fleet. Write the Keras program as for ``MultiWorkerMirroredStrategy``::

    import keras, redsrv.tf

    strategy = redsrv.tf.ReductionServerStrategy()   # TF_CONFIG / CLUSTER_SPEC / REDSRV_* say who is who
    with strategy.scope():
        model = make_model()                          # every worker starts from worker 0's weights
        model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=256, epochs=5,         # 256 is the global batch: each worker reads its shard
              callbacks=strategy.chief_only(keras.callbacks.ModelCheckpoint("ckpt.keras")))
    strategy.close()

Two public pieces:

* :class:`ReductionServerCrossDeviceOps` is a plain :class:`tf.distribute.CrossDeviceOps`: give it
  to ``tf.distribute.MirroredStrategy(cross_device_ops=...)`` and that strategy's reductions also
  sum over the other processes. ``MirroredStrategy`` itself still believes it is alone
  (``num_replicas_in_sync`` is local, datasets are not sharded): fine for custom loops that scale
  their loss themselves, not for Keras ``fit``.
* :class:`ReductionServerStrategy` is the multi-worker strategy Keras ``fit`` needs, answering as
  ``MultiWorkerMirroredStrategy`` (MWMS) does: global ``num_replicas_in_sync`` (Keras divides the
  loss by it), per-worker dataset shards (:class:`tf.distribute.InputContext`), global replica ids,
  initial values broadcast from worker 0, epoch metrics and losses reduced over every worker,
  partial last batches handled globally, ``should_checkpoint``/``should_save_summary`` true on worker
  0 only, ``strategy.gather``/``all_gather`` over every worker (through the core's all-gather), and
  Keras's multi-worker paths: ``predict`` returns every row on every worker, per-step logs (the
  progress bar) are reduced over every replica.
* :class:`BackupAndRestore` is Keras's callback made multi-worker: the chief writes, every worker
  resumes from the chief's backup.

How a reduction runs: at trace time each ``batch_reduce`` sums every value over the local devices
(``tf.add_n``), packs the sums into one flat vector per dtype and calls **one** host function,
``tf.numpy_function(..., stateful=True)``. Stateful host calls run in program order, so every worker
issues its exchanges in the same order (unordered blocking host calls can deadlock or pair the wrong
operations). The key of an exchange is ``(call site, counter, dtype group)``: the call site is the
Python stack at trace time, outside TensorFlow, the standard library and generated code (module,
function, line); the counter, kept in the host function, counts that site's executions. Retracing
(one worker seeing a partial batch, say) therefore never shifts keys, and a worker that sends a
different length or dtype under a key gets the reducer's mismatch error instead of a wrong sum.

Errors: an exchange that fails raises inside the step, so ``fit`` raises TensorFlow's error whose
message carries redsrv's (type, peer, job, rank, phase, timeout); :meth:`ReductionServerStrategy.check`
raises the original typed :class:`redsrv.RedsrvError`. Every exchange is bounded by the client's
deadlines; nothing waits forever. A failed exchange closes the client this adapter created (the
adapters' one rule, ``redsrv.core.commons``), so the reducers fail the step for every other worker
at once instead of at their timeout.

Limits: XLA (``jit_compile=True``) cannot contain host calls and is refused with
:class:`redsrv.ConfigError`. Every worker must have the same number of local devices (checked at
start-up) and run the same number of steps. In-memory arrays passed to ``fit(shuffle=True)`` are
shuffled before sharding: give every worker the same shuffle seed (``keras.utils.set_random_seed``)
or pass a ``tf.data.Dataset``. IndexedSlices gradients are summed densely. Variables that each
replica updates on its own, without aggregation (Keras 3 ``BatchNormalization``'s moving
statistics), stay per replica as under ``MirroredStrategy``; worker 0, which writes the checkpoints,
holds what a single-process ``MirroredStrategy``'s first replica would.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from redsrv.core import Client, Config, ConfigError, LocalProtocolError, RedsrvError, collectives, commons, fusion, wire

from . import _tf_internals

__all__ = [
    "BackupAndRestore",  # noqa: F822 - defined by the module __getattr__ (loads Keras on first use)
    "ReductionServerCrossDeviceOps",
    "ReductionServerStrategy",
    "SUPPORTED_DTYPES",
    "TESTED_TF",
]

#: TensorFlow dtypes the reducers sum (the core's numeric wire dtypes, ``redsrv.core.wire``);
#: anything else is a ``TypeError`` at trace time.
SUPPORTED_DTYPES = tuple(tf.as_dtype(name) for name in wire.NUMERIC_DTYPE_NAMES)

#: The TensorFlow minor release the adapter is tested on (the ``tf`` extra pins it).
TESTED_TF = _tf_internals.TESTED_TF

#: Namespace of every key this adapter sends, so they never collide with a user's own keys.
_KEY_PREFIX = "redsrv.tf"

# Frames from these modules are left out of a call site (besides the standard library and redsrv's,
# commons.call_site): they differ between the first trace and a retrace (TensorFlow), or between
# processes (autograph writes converted code to uniquely named temporary modules).
_SITE_SKIPPED = ("tensorflow", "__autograph_generated")


def __getattr__(name: str) -> Any:
    # Keras-dependent pieces load Keras on first use only.
    if name == "BackupAndRestore":
        from ._tf_keras import BackupAndRestore

        return BackupAndRestore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- the cross-device ops ----------------------------------------------------------------------


class ReductionServerCrossDeviceOps(_tf_internals.CrossDeviceOpsBase):
    """A :class:`tf.distribute.CrossDeviceOps` that sums over this process's devices and then over
    every worker of the job through the reducers.

    ``client`` is a connected :class:`redsrv.Client` (one per process: its rank is this worker's
    index, its world size the number of workers). Without one, ``client_args`` build one
    (:class:`redsrv.Client`'s arguments: ``reducers``, ``rank``, ``world_size``, ``job``, ``config``
    or any :class:`redsrv.Config` field; missing values come from ``REDSRV_*``), which :meth:`close`
    closes. ``timeout`` bounds each exchange (default: the config's ``op_timeout``);
    ``wire_dtype="bf16"``/``"fp16"`` compresses floats on the wire (sums accumulate in fp32).

    ``MEAN`` divides the sum by (local replicas x workers): every worker must have as many local
    devices as this one.
    """

    def __init__(self, client: Client | None = None, *, timeout: float | None = None, wire_dtype: str | None = None,
                 **client_args: Any) -> None:
        super().__init__()
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if client is not None and client_args:
            raise TypeError(f"pass either a client or the arguments to build one ({', '.join(client_args)}), not both")
        self._owns_client = client is None
        self.client = Client(**client_args) if client is None else client
        self.timeout = timeout
        self.wire_dtype = wire_dtype
        self._redsrv_num_workers = self.client.world_size
        self._keys = commons.KeySpace(_KEY_PREFIX)
        self._lock = threading.Lock()  # guards _error
        self._error: BaseException | None = None

    @property
    def num_workers(self) -> int:
        return int(self.client.world_size)

    @property
    def worker_index(self) -> int:
        return int(self.client.rank)

    @property
    def error(self) -> BaseException | None:
        """The first error an exchange raised, as redsrv raised it (``None`` if none)."""
        return self._error

    def check(self) -> None:
        """Raise the first exchange error (typed as redsrv raised it), or the client's."""
        if self._error is not None:
            raise self._error
        self.client.check()

    def close(self) -> None:
        """Close the client if this object created it. Idempotent."""
        if self._owns_client:
            self.client.close()

    def __deepcopy__(self, memo: dict[int, Any]) -> ReductionServerCrossDeviceOps:
        # A handle on a connection: copies of a strategy share it (there is one rank per process).
        return self

    def __repr__(self) -> str:
        return (f"<redsrv.tf.ReductionServerCrossDeviceOps job={self.client.config.job!r} "
                f"worker {self.worker_index}/{self.num_workers}>")

    # --- tf.distribute.CrossDeviceOps ---

    def reduce_implementation(self, reduce_op: Any, per_replica_value: Any, destinations: Any, options: Any) -> Any:
        return self.batch_reduce_implementation(reduce_op, [(per_replica_value, destinations)], options)[0]

    def batch_reduce_implementation(self, reduce_op: Any, value_destination_pairs: Any, options: Any) -> list[Any]:
        _refuse_xla()
        reduce_op = _reduce_op(reduce_op)
        per_value = [[_dense(v) for v in _tf_internals.local_values(value)] for value, _ in value_destination_pairs]
        local_sums = []
        for values in per_value:
            with tf.device(values[0].device):
                local_sums.append(tf.math.add_n(values) if len(values) > 1 else tf.identity(values[0]))
        totals = self._exchange(_call_site(), local_sums, self._timeout_for(options))
        results = []
        for (_, destinations), values, total in zip(value_destination_pairs, per_value, totals):
            if reduce_op == tf.distribute.ReduceOp.MEAN:
                total = _divide(total, len(values) * self.num_workers)
            results.append(self.broadcast_implementation(total, destinations))
        return results

    def _gather_implementation(self, per_replica_value: Any, destinations: Any, axis: Any, options: Any) -> Any:
        """Every replica's value concatenated along ``axis`` in global replica order (this worker's
        devices in order, the workers in index order), on every worker: ``strategy.gather`` and
        ``ReplicaContext.all_gather``. Sizes along ``axis`` may differ per replica; the other
        dimensions and the dtype must agree (else :class:`redsrv.ContributionMismatchError` on
        every worker, raised inside the step)."""
        _refuse_xla()
        values = [tf.convert_to_tensor(v) for v in _tf_internals.local_values(per_replica_value)]
        first = values[0]
        rank = first.shape.rank
        if rank is None or rank == 0:
            raise ValueError(f"gather/all_gather needs tensors of known, non-zero rank (got shape {first.shape}); "
                             "use tf.expand_dims before gathering scalars")
        axis = _static_axis(axis, rank)
        if first.dtype in (tf.string, tf.resource, tf.variant):
            raise TypeError(f"redsrv cannot gather {first.dtype.name} tensors: only fixed-size dtypes travel as bytes")
        with tf.device(first.device):
            local = tf.concat(values, axis) if len(values) > 1 else tf.identity(first)
            # The core gathers along the first dimension: move the gathered axis there and back.
            order = [axis, *(d for d in range(rank) if d != axis)]
            leading = tf.transpose(local, order) if axis else local
            host = functools.partial(self._host_allgather, _call_site(), self._timeout_for(options))
            (gathered,) = _host_call(host, [leading], "redsrv_allgather")
            gathered.set_shape(tf.TensorShape([None]).concatenate(leading.shape[1:]))
            if axis:
                gathered = tf.transpose(gathered, [order.index(d) for d in range(rank)])
        return self.broadcast_implementation(gathered, destinations)

    # --- the fused host exchange ---

    def _timeout_for(self, options: Any) -> float | None:
        """A call's ``CommunicationOptions(timeout_seconds=...)`` bounds its exchange, as under MWMS."""
        seconds = getattr(options, "timeout_seconds", None)
        return float(seconds) if seconds else self.timeout

    def _exchange(self, site: str, tensors: Sequence[tf.Tensor], timeout: float | None) -> list[tf.Tensor]:
        """Sum ``tensors`` over the workers with one stateful host call: one flat vector per dtype."""
        for i, t in enumerate(tensors):
            if t.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"redsrv cannot reduce {t.dtype.name} (tensor {t.name if not tf.executing_eagerly() else i}); "
                                f"supported: {', '.join(d.name for d in SUPPORTED_DTYPES)}")
        # The core's grouping rule; fusing and splitting are TensorFlow ops (shapes may be known
        # only when the step runs).
        groups = [members for _, members in fusion.members_by_dtype([t.dtype.as_numpy_dtype for t in tensors])]
        flats = [tf.concat([tf.reshape(tensors[i], [-1]) for i in members], 0) for members in groups]
        outs = _host_call(functools.partial(self._host_allreduce, site, timeout), flats, "redsrv_allreduce")
        results: list[Any] = [None] * len(tensors)
        for members, flat, out in zip(groups, flats, outs):
            out = tf.reshape(out, tf.shape(flat))
            sizes = [tensors[i].shape.num_elements() for i in members]
            if any(s is None for s in sizes):
                pieces = tf.split(out, tf.stack([tf.size(tensors[i]) for i in members]), num=len(members))
            else:
                pieces = tf.split(out, sizes)
            for i, piece in zip(members, pieces):
                results[i] = tf.reshape(piece, tf.shape(tensors[i]))
        return results

    def _host_allreduce(self, site: str, timeout: float | None, *arrays: np.ndarray) -> list[np.ndarray]:
        call = self._keys.next_call(site)
        try:
            # One exchange per dtype group (almost always one: the gradients' dtype), all in flight.
            futures = [self.client.allreduce_async(np.asarray(a), key=self._keys.key(site, call, g),
                                                   wire_dtype=self.wire_dtype, timeout=timeout)
                       for g, a in enumerate(arrays)]
            return [self.client.wait(f, timeout=timeout) for f in futures]
        except RedsrvError as exc:
            self._fail(exc, f"all-reduce at {site}, call {call}")
            raise

    def _host_allgather(self, site: str, timeout: float | None, array: np.ndarray) -> np.ndarray:
        call = self._keys.next_call("gather", site)
        try:
            parts = collectives.allgather(self.client, _wire_view(array), key=self._keys.key("gather", site, call),
                                          timeout=timeout)
        except RedsrvError as exc:
            self._fail(exc, f"all-gather at {site}, call {call}")
            raise
        return np.concatenate([_from_wire_view(part, array.dtype) for part in parts], axis=0)

    def broadcast_initial_value(self, value: tf.Tensor) -> tf.Tensor:
        """Worker 0's ``value`` on every worker (exact, any numeric dtype). Used for the initial
        values of variables, created in the same order on every worker (as in MultiWorkerMirroredStrategy)."""
        if self.num_workers == 1 or not _has_bytes(value.dtype):
            return value
        (out,) = _host_call(self._host_broadcast, [value], "redsrv_broadcast")
        out.set_shape(value.shape)
        return out

    def _host_broadcast(self, array: np.ndarray) -> np.ndarray:
        call = self._keys.next_call("broadcast")
        try:
            return collectives.broadcast_exact(self.client, np.asarray(array), root=0, key=self._keys.key("broadcast", call),
                                               timeout=self.timeout)
        except RedsrvError as exc:
            self._fail(exc, f"broadcast of an initial value, call {call}")
            raise

    def _fail(self, exc: BaseException, where: str) -> None:
        with self._lock:
            if self._error is not None:
                return
            self._error = exc
        if hasattr(exc, "add_note"):
            exc.add_note(f"raised on the host by redsrv.tf ({where}); strategy.check() re-raises it")
        commons.abandon(self.client, owned=self._owns_client)


def _host_call(function: Any, tensors: Sequence[tf.Tensor], name: str) -> list[tf.Tensor]:
    """``function(*arrays) -> arrays`` as one stateful host op (run in program order in a graph);
    eagerly, a plain call (TensorFlow's eager host op would add nothing but copies and warnings)."""
    if tf.executing_eagerly():
        results = function(*[t.numpy() for t in tensors])
        return [tf.convert_to_tensor(r) for r in (results if isinstance(results, (list, tuple)) else [results])]
    outs = tf.numpy_function(function, list(tensors), Tout=[t.dtype for t in tensors], stateful=True, name=name)
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


def _refuse_xla() -> None:
    if _tf_internals.in_xla_context():
        raise ConfigError("redsrv.tf cannot run inside an XLA-compiled function: the reduction is a host "
                          "call (tf.numpy_function), which XLA cannot contain. Compile the model with "
                          "jit_compile=False (Keras: model.compile(..., jit_compile=False)).")


def _reduce_op(op: Any) -> tf.distribute.ReduceOp:
    if isinstance(op, str):
        op = tf.distribute.ReduceOp(op.upper())
    if op not in (tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN):
        raise ValueError(f"reduce_op must be SUM or MEAN, got {op!r}")
    return op


def _dense(value: Any) -> tf.Tensor:
    # Sparse gradients (embedding lookups) are summed densely: the reducers add flat arrays.
    return tf.convert_to_tensor(value)


def _divide(total: tf.Tensor, count: int) -> tf.Tensor:
    if total.dtype.is_integer:
        return tf.truncatediv(total, tf.cast(count, total.dtype))  # as TensorFlow's collective MEAN
    return total / tf.cast(count, total.dtype)


def _static_axis(axis: Any, rank: int) -> int:
    value = tf.get_static_value(axis)
    if value is None or np.ndim(value) != 0:
        raise ValueError(f"gather/all_gather needs an axis known when the function is traced, got {axis!r}")
    value = int(value)
    if not -rank <= value < rank:
        raise ValueError(f"axis {value} is out of range for tensors of rank {rank}")
    return value % rank


def _wire_view(array: np.ndarray) -> np.ndarray:
    """``array`` as the core can move it: itself for the wire's dtypes, else its bytes with one
    trailing dimension of the item size (uint16, complex, ... arrive bit for bit)."""
    array = np.ascontiguousarray(array)
    try:
        wire.dtype_code(array.dtype)
    except LocalProtocolError:
        return array.reshape(-1).view(np.uint8).reshape(*array.shape, array.dtype.itemsize)
    return array


def _from_wire_view(part: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if part.dtype == dtype:
        return part
    return np.ascontiguousarray(part).reshape(-1).view(dtype).reshape(part.shape[:-1])


def _has_bytes(dtype: tf.DType) -> bool:
    return dtype.is_numpy_compatible and dtype not in (tf.string, tf.resource, tf.variant)


def _call_site() -> str:
    """This trace's call site (:func:`redsrv.core.commons.call_site`): identical on every worker
    running the same program, and across retraces of one function."""
    return commons.call_site(_SITE_SKIPPED, context="eager" if tf.executing_eagerly() else None)


# --- the strategy --------------------------------------------------------------------------------


class _Hooks(_tf_internals.Hooks):
    def __init__(self, ops: ReductionServerCrossDeviceOps) -> None:
        self.cross_device_ops = ops
        self.num_workers = ops.num_workers
        self.worker_index = ops.worker_index

    def broadcast_initial_value(self, value: Any) -> Any:
        return self.cross_device_ops.broadcast_initial_value(value)


class ReductionServerStrategy(tf.distribute.MirroredStrategy):  # type: ignore[misc]
    """A multi-worker ``MirroredStrategy``: this process's ``devices`` in-graph, the workers summed
    by the reducers. Keras ``fit`` behaves as under ``MultiWorkerMirroredStrategy``.

    Arguments not given come from the environment through :meth:`redsrv.Config.from_env`:
    ``TF_CONFIG`` (its ``"reducer"`` task list next to ``"chief"``/``"worker"``; the chief is worker
    0), Vertex AI's ``CLUSTER_SPEC`` (``workerpool2`` are the reducers), ``REDSRV_*``, or
    ``RANK``/``WORLD_SIZE``; ``environ`` replaces ``os.environ``. ``devices`` defaults to the local
    GPUs, or the CPU. ``config_fields`` are other :class:`redsrv.Config` fields (``op_timeout=60``,
    ``secret=...``); ``timeout`` and ``wire_dtype`` as for :class:`ReductionServerCrossDeviceOps`.

    Construction connects to the reducers and waits for every worker (a barrier that also checks
    they all have the same number of devices). Call :meth:`close` when done. One strategy per job
    at a time: keys restart with each strategy, so start another under a new job name.
    """

    def __init__(self, reducers: Sequence[str] | str | None = None, num_workers: int | None = None,
                 worker_index: int | None = None, devices: Sequence[str] | None = None, *, job: str | None = None,
                 timeout: float | None = None, wire_dtype: str | None = None,
                 environ: Mapping[str, str] | None = None, cluster_resolver: Any = None,
                 communication_options: Any = None, **config_fields: Any) -> None:
        if cluster_resolver is not None:
            raise ConfigError("ReductionServerStrategy does not take MultiWorkerMirroredStrategy's cluster_resolver: "
                              "it reads TF_CONFIG (with a \"reducer\" task list), CLUSTER_SPEC or REDSRV_*; pass "
                              "reducers=, num_workers= and worker_index= to say who is who explicitly")
        if timeout is None and communication_options is not None and communication_options.timeout_seconds:
            # MWMS's CommunicationOptions: the timeout bounds every exchange; implementation (RING,
            # NCCL) and bytes_per_pack choose collective algorithms the reducers do not use.
            timeout = float(communication_options.timeout_seconds)
        # The one read of the environment (REDSRV_*, TF_CONFIG / CLUSTER_SPEC, RANK / WORLD_SIZE),
        # by the core's discovery: explicit arguments win, conflicting sources are an error.
        config = Config.from_env(environ, reducers=reducers, rank=worker_index, world_size=num_workers, job=job,
                                 **config_fields)
        ops = ReductionServerCrossDeviceOps(config=config, timeout=timeout, wire_dtype=wire_dtype)
        self._redsrv_ops = ops
        try:
            extended = _tf_internals.ReductionServerExtended(self, _Hooks(ops), devices)
            _tf_internals.init_strategy(self, extended)
            _tf_internals.install_keras_multi_worker_paths()
            self._check_devices(len(extended.worker_devices))
        except BaseException:
            ops.close()
            raise

    def _redsrv_keras_reduce(self, reduce_op: str, values: Any) -> Any:
        """Keras 3's per-step logs reduced over every replica of every worker, as Keras means to
        under MultiWorkerMirroredStrategy: one fused exchange for all of them (each tensor
        elementwise; ``MEAN`` divides by the global replica count)."""
        leaves = tf.nest.flatten(values)
        reducible = [i for i, v in enumerate(leaves) if isinstance(v, (tf.Tensor, tf.Variable, tf.distribute.DistributedValues))]
        if not reducible:
            return values
        reduced = self._redsrv_ops.batch_reduce(reduce_op, [(leaves[i], "/cpu:0") for i in reducible])
        for i, value in zip(reducible, reduced):
            leaves[i] = self.experimental_local_results(value)[0]
        return tf.nest.pack_sequence_as(values, leaves)

    def _check_devices(self, local: int) -> None:
        counts = np.zeros(self.num_workers, dtype=np.int64)
        counts[self.worker_index] = local
        ops = self._redsrv_ops
        counts = ops.client.allreduce(counts, key=ops._keys.key("devices"), timeout=ops.timeout)
        if len(set(counts.tolist())) != 1:
            raise ConfigError("every worker needs the same number of devices; local devices per worker: "
                              + ", ".join(f"worker {i}: {int(n)}" for i, n in enumerate(counts)))

    @property
    def cross_device_ops(self) -> ReductionServerCrossDeviceOps:
        return self._redsrv_ops

    @property
    def num_workers(self) -> int:
        return self._redsrv_ops.num_workers

    @property
    def worker_index(self) -> int:
        return self._redsrv_ops.worker_index

    @property
    def cluster_resolver(self) -> tf.distribute.cluster_resolver.SimpleClusterResolver:
        """This worker's place, as ``MultiWorkerMirroredStrategy.cluster_resolver`` gives it: task type
        ``"worker"`` (a TF_CONFIG ``"chief"`` is worker 0), ``task_id`` the worker index, one entry per
        worker in ``cluster_spec()``. Programs written for MWMS pick their chief with it. The
        entries are names, not addresses: workers never connect to each other."""
        workers = [f"worker{i}" for i in range(self.num_workers)]
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({"worker": workers}), task_type="worker", task_id=self.worker_index)

    @property
    def is_chief(self) -> bool:
        """Worker 0: the one that writes checkpoints and summaries."""
        return self.worker_index == 0

    def chief_only(self, *callbacks: Any) -> list[Any]:
        """``callbacks`` (or lists of them) on worker 0, ``[]`` elsewhere: for Keras 3 callbacks that
        only write (``ModelCheckpoint``, ``TensorBoard``, ``CSVLogger``), which Keras 3 runs on every
        worker. Callbacks that steer training (``EarlyStopping``, ``ReduceLROnPlateau``) must run
        everywhere: they see the same global epoch logs, so every worker decides alike.

        Keras 2 (``tf_keras``) callbacks are kept on every worker: Keras 2 consults
        ``should_checkpoint`` itself, has the other workers write to a temporary directory, and its
        saving reduces over every worker, so it must not run on worker 0 alone."""
        flat: list[Any] = []
        for c in callbacks:
            flat.extend(c if isinstance(c, (list, tuple)) else [c])
        return [c for c in flat if self.is_chief or type(c).__module__.startswith("tf_keras.")]

    def check(self) -> None:
        """Raise the first exchange error as its :class:`redsrv.RedsrvError` (after ``fit`` raised
        TensorFlow's error for it), or the client's error if it broke."""
        self._redsrv_ops.check()

    def close(self) -> None:
        """Close the connection to the reducers. Idempotent; the strategy is unusable afterwards."""
        self._redsrv_ops.close()

    def __repr__(self) -> str:
        return (f"<redsrv.tf.ReductionServerStrategy job={self._redsrv_ops.client.config.job!r} "
                f"worker {self.worker_index}/{self.num_workers}, {len(self.extended.worker_devices)} local device(s)>")
