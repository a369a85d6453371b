"""Horovod's TensorFlow collectives on tensors, eagerly and inside ``tf.function``.

Each collective is one host call: eagerly a plain call on the tensors' NumPy values, in a graph
``tf.numpy_function(..., stateful=True)``. Stateful host calls run in program order, so every
rank issues its operations in the same order, and the key of an operation (kind, name, count of
earlier ones with that name, see :mod:`redsrv.adapters.horovod.common`) is taken when the host call runs,
not when the function is traced: a retrace never shifts keys. XLA (``jit_compile=True``) cannot
contain host calls and is refused with a clear error. The ``*_op`` queries (``rank_op``, ``size_op``, ...)
are host calls too, so a traced function reads the rank and size when it runs. ``allreduce``, ``allgather``,
``broadcast``, ``alltoall`` and ``reducescatter`` (and their grouped forms) are differentiable with Horovod's
gradients.

Ranks that disagree on a collective (shape, dtype, root rank, operation) fail it as Horovod's
TensorFlow ops do, with ``tf.errors.FailedPreconditionError`` in both modes; the message is the
redsrv error's, and eagerly that error (a :class:`HorovodInternalError` that is also a
``ContributionMismatchError``) is the cause. See :func:`_host` for how a graph gets that code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from redsrv.adapters._tf_internals import in_xla_context
from redsrv.core.errors import ConfigError, ContributionMismatchError

from .. import common
from ..common import ProcessSet, global_process_set

__all__ = ["Compression", "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall",
           "reducescatter", "grouped_reducescatter", "broadcast_",
           "broadcast_variables", "broadcast_global_variables", "broadcast_object", "allgather_object", "barrier", "join",
           "size_op", "local_size_op", "rank_op", "local_rank_op", "process_set_included_op"]


class _NoneCompressor:
    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class _CastCompressor:
    wire: tf.DType

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:
        tensor = tf.convert_to_tensor(tensor)
        if tensor.dtype.is_floating:
            return tf.cast(tensor, cls.wire), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor if ctx is None else tf.cast(tensor, ctx)


class _FP16Compressor(_CastCompressor):
    wire = tf.float16


class _BF16Compressor(_CastCompressor):
    wire = tf.bfloat16


class Compression:
    """``Compression.none``, ``Compression.fp16`` (Horovod's) and ``Compression.bf16``: floating
    tensors cast for the trip (the reducers accumulate 16-bit floats in float32)."""

    none = _NoneCompressor
    fp16 = _FP16Compressor
    bf16 = _BF16Compressor


# --- host calls -----------------------------------------------------------------------------


def _host(function: Callable[..., Any], inputs: Sequence[tf.Tensor], out_dtypes: Sequence[tf.DType],
          name: str) -> list[tf.Tensor]:
    """``function(*arrays) -> arrays`` on the host: eagerly a plain call, in a graph one stateful
    ``tf.numpy_function`` (program order on every rank). Ranks that disagree raise
    ``tf.errors.FailedPreconditionError`` either way (:func:`_precondition_check`)."""
    if tf.executing_eagerly():
        try:
            results = function(*[t.numpy() for t in inputs])
        except ContributionMismatchError as exc:
            raise tf.errors.FailedPreconditionError(None, None, str(exc)) from exc
        except ValueError as exc:
            if type(exc) is not ValueError:  # ConfigError and other redsrv errors keep their type
                raise
            raise _InvalidArgument(None, None, str(exc)) from exc
        return [tf.convert_to_tensor(r, dtype=d) for r, d in zip(results, out_dtypes)]
    if in_xla_context():
        raise ConfigError("redsrv.horovod cannot run inside an XLA-compiled function: its collectives are host calls "
                          "(tf.numpy_function), which XLA cannot contain. Use jit_compile=False (Keras: "
                          "model.compile(..., jit_compile=False)).")
    previous: list[tf.Operation] = []
    if not tf.inside_function():
        # A TensorFlow 1 graph (tf.compat.v1 sessions) orders stateful ops only by their data
        # dependencies, unlike tf.function: chain the host calls in the order they were built,
        # so that every rank runs them in that order (keys match) and none waits, blocking one
        # of the session's few threads, for a collective the others run later. Running one
        # therefore runs those built before it again, on every rank alike.
        graph = tf.compat.v1.get_default_graph()
        previous = graph.get_collection(_HOST_CALLS)[-1:]

    def guarded(*arrays: np.ndarray) -> list[Any]:
        try:
            return [*function(*arrays), np.bytes_(b"")]
        except ContributionMismatchError as exc:
            # placeholders that nothing reads: the check below fails the step
            return [*(np.zeros((), d.as_numpy_dtype) for d in out_dtypes), np.bytes_(str(exc).encode())]

    with tf.control_dependencies(previous):
        *outs, disagreement = tf.numpy_function(guarded, list(inputs), Tout=[*out_dtypes, tf.string], stateful=True,
                                                name=name)
    if not tf.inside_function():
        graph.add_to_collection(_HOST_CALLS, disagreement.op)
    with tf.control_dependencies([_precondition_check(disagreement)]):
        return [tf.identity(out) for out in outs]


def _precondition_check(message: tf.Tensor) -> tf.Tensor:
    """An op that fails with ``FailedPreconditionError`` carrying ``message`` when it is not empty.

    A host call cannot choose its error's code: TensorFlow's py_func turns every exception but a
    few built-in ones (ValueError, TypeError, StopIteration, MemoryError, NotImplementedError)
    into ``UnknownError``, a ``tf.errors.OpError`` included (``DoCallPyFunc`` in
    tensorflow/python/lib/core/py_func.cc). Reading a variable that does not exist is TensorFlow's
    documented ``FailedPreconditionError`` and names the variable, so the failing branch reads
    one named by the message (its handle made on the host, where the name is known)."""

    def fail() -> tf.Tensor:
        handle = tf.py_function(lambda text: tf.raw_ops.VarHandleOp(dtype=tf.int32, shape=[],
                                                                     shared_name=text.numpy().decode()),
                                [message], tf.resource, name="hvd_disagreement")
        return tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.int32)

    return tf.cond(tf.equal(message, ""), lambda: tf.constant(0), fail)


class _InvalidArgument(tf.errors.InvalidArgumentError, ValueError):
    """A host call's ``ValueError`` (an argument the collective refuses, such as alltoall splits
    that do not add up), eagerly: TensorFlow's ``InvalidArgumentError``, as a graph reports it
    (py_func maps ``ValueError`` to that code) and as Horovod's ops do, and still a ``ValueError``."""


#: The graph collection holding a TensorFlow 1 graph's host calls, in the order built.
_HOST_CALLS = "redsrv_horovod_host_calls"


def _dense(tensor: Any) -> tf.Tensor:
    return tf.convert_to_tensor(tensor)


def _wait(future: Any, process_set: ProcessSet) -> Any:
    return common.wait_future(future, process_set.client())


# --- allreduce ------------------------------------------------------------------------------


def _reduce_all(tensors: Sequence[tf.Tensor], op: common.ReduceOp, name: str | None, prescale_factor: float,
                postscale_factor: float, process_set: ProcessSet, kind: str) -> list[tf.Tensor]:
    def host(*arrays: np.ndarray) -> list[np.ndarray]:
        # check_shape: ranks whose shapes differ with the same number of elements fail, as in Horovod
        futures = [common.allreduce_async(process_set, np.asarray(a), op, kind=kind, prescale_factor=prescale_factor,
                                          postscale_factor=postscale_factor, check_shape=True,
                                          name=None if name is None else (name if len(arrays) == 1 else f"{name}.{i}"))
                   for i, a in enumerate(arrays)]
        return [np.asarray(_wait(f, process_set)).reshape(np.shape(a)) for f, a in zip(futures, arrays)]

    outs = _host(host, tensors, [t.dtype for t in tensors], f"hvd_{kind}")
    for out, t in zip(outs, tensors):
        out.set_shape(t.shape)
    return outs


def _differentiable_reduce(tensors: list[tf.Tensor], op: common.ReduceOp, name: str | None, prescale_factor: float,
                           postscale_factor: float, process_set: ProcessSet, kind: str) -> list[tf.Tensor]:
    @tf.custom_gradient
    def reduce(*xs: tf.Tensor) -> Any:
        ys = _reduce_all(xs, op, name, prescale_factor, postscale_factor, process_set, kind)

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            return _reduce_all([tf.convert_to_tensor(d) for d in dys], op, None, prescale_factor, postscale_factor,
                               process_set, kind + "_grad")

        return ys, grad

    return list(reduce(*tensors))


def _check_sparse(op: common.ReduceOp, prescale_factor: float, postscale_factor: float) -> None:
    """Horovod's limits for ``tf.IndexedSlices``, checked before anything is sent."""
    if op not in (common.Sum, common.Average):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")


def _sparse_reduce(slices: tf.IndexedSlices, op: common.ReduceOp, name: str | None,
                   process_set: ProcessSet) -> tf.IndexedSlices:
    """Horovod's reduction of ``tf.IndexedSlices``: every rank's values and indices gathered
    (the represented tensor's sum, its rows uncoalesced), the values divided by the set's size
    for ``Average``."""
    values = allgather(slices.values, name=None if name is None else f"{name}.values", process_set=process_set)
    indices = allgather(slices.indices, name=None if name is None else f"{name}.indices", process_set=process_set)
    if op == common.Average:
        values = values / tf.cast(process_set.size() or 1, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "", device_sparse: str = "",
              compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              name: str | None = None, process_set: ProcessSet = global_process_set,
              ignore_name_scope: bool = False) -> Any:
    """``op`` (default Average) of ``tensor`` over the ranks, combined in rank order (identical on
    every rank). A ``tf.IndexedSlices`` is gathered, as in Horovod (Sum or Average only), and
    stays one. ``device_*`` and ``ignore_name_scope`` are accepted for Horovod's signature."""
    chosen = common.resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        _check_sparse(chosen, prescale_factor, postscale_factor)
        return _sparse_reduce(tensor, chosen, name, process_set)
    compressed, ctx = compression.compress(_dense(tensor))
    (reduced,) = _differentiable_reduce([compressed], chosen, name, prescale_factor, postscale_factor, process_set, "allreduce")
    return compression.decompress(reduced, ctx)


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None, device_dense: str = "", device_sparse: str = "",
                      compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[Any]:
    """:func:`allreduce` of every tensor of the list, the dense ones in one host call (the
    ``tf.IndexedSlices`` among them gathered first, as in Horovod)."""
    if not tensors:
        return []
    chosen = common.resolve_op(op, average)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    if sparse:
        _check_sparse(chosen, prescale_factor, postscale_factor)
    out: list[Any] = list(tensors)
    for i in sparse:
        out[i] = _sparse_reduce(tensors[i], chosen, None if name is None else f"{name}.{i}", process_set)
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    if dense:
        compressed = [compression.compress(_dense(tensors[i])) for i in dense]
        reduced = _differentiable_reduce([c for c, _ in compressed], chosen, name, prescale_factor, postscale_factor,
                                         process_set, "grouped_allreduce")
        for i, r, (_, ctx) in zip(dense, reduced, compressed):
            out[i] = compression.decompress(r, ctx)
    return out


# --- allgather, broadcast, alltoall, reducescatter -----------------------------------------


def _gather(tensor: tf.Tensor, name: str | None, process_set: ProcessSet) -> tf.Tensor:
    def host(array: np.ndarray) -> list[np.ndarray]:
        return [np.concatenate(_wait(common.allgather_async(process_set, np.asarray(array), name=name), process_set))]

    (out,) = _host(host, [tensor], [tensor.dtype], "hvd_allgather")
    out.set_shape([None, *tensor.shape[1:]])
    return out


def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension (which may differ)."""
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0:
        raise ValueError("allgather needs a tensor with at least one dimension (it concatenates along the first)")

    @tf.custom_gradient
    def gather(x: tf.Tensor) -> Any:
        y = _gather(x, name, process_set)

        def grad(dy: tf.Tensor) -> tf.Tensor:
            # each rank's rows of the averaged gradient (Horovod's _allgather_grad averages)
            averaged = _reduce_all([tf.convert_to_tensor(dy)], common.Average, None, 1.0, 1.0, process_set,
                                   "allgather_grad")[0]
            rows = _gather(tf.shape(x)[:1], None, process_set)
            start = tf.reduce_sum(rows[: process_set.rank()])
            return averaged[start : start + tf.shape(x)[0]]

        return y, grad

    return gather(tensor)


def _broadcast(tensor: tf.Tensor, root_rank: int, name: str | None, process_set: ProcessSet) -> tf.Tensor:
    def host(array: np.ndarray) -> list[np.ndarray]:
        return [np.asarray(_wait(common.broadcast_async(process_set, np.asarray(array), root_rank, name=name), process_set))
                .reshape(np.shape(array))]

    (out,) = _host(host, [tensor], [tensor.dtype], "hvd_broadcast")
    out.set_shape(tensor.shape)
    return out


def broadcast(tensor: Any, root_rank: int, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Global rank ``root_rank``'s ``tensor`` on every rank, bit for bit."""
    tensor = tf.convert_to_tensor(tensor)

    @tf.custom_gradient
    def bcast(x: tf.Tensor) -> Any:
        def grad(dy: tf.Tensor) -> tf.Tensor:
            # Horovod's _broadcast_grad: the root gets the average of the gradients, the others zeros
            averaged = _reduce_all([tf.convert_to_tensor(dy)], common.Average, None, 1.0, 1.0, process_set,
                                   "broadcast_grad")[0]
            # times zero, not zeros_like: a graph must still run the host call on every rank
            return averaged if common.rank() == root_rank else averaged * 0

        return _broadcast(x, root_rank, name, process_set), grad

    return bcast(tensor)


def _exchange(tensor: tf.Tensor, splits: tf.Tensor | None, name: str | None,
              process_set: ProcessSet) -> tuple[tf.Tensor, tf.Tensor]:
    inputs = [tensor] if splits is None else [tensor, splits]

    def host(array: np.ndarray, *split_array: np.ndarray) -> list[np.ndarray]:
        chosen = None if not split_array else [int(s) for s in split_array[0]]
        rows, counts = _wait(common.alltoall_async(process_set, np.asarray(array), chosen, name=name), process_set)
        return [rows, np.asarray(counts, dtype=np.int32)]

    output, received = _host(host, inputs, [tensor.dtype, tf.int32], "hvd_alltoall")
    output.set_shape([None, *tensor.shape[1:]])
    received.set_shape([None])
    return output, received


def alltoall(tensor: Any, splits: Any = None, name: str | None = None, ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> Any:
    """Horovod's alltoall: the rows received from every rank in rank order; with ``splits``,
    also how many came from each rank. Differentiable as in Horovod: the output gradients go
    back the way the rows came."""
    tensor = tf.convert_to_tensor(tensor)
    chosen = None if splits is None else tf.cast(tf.convert_to_tensor(splits), tf.int32)

    @tf.custom_gradient
    def exchange(x: tf.Tensor) -> Any:
        output, received = _exchange(x, chosen, name, process_set)

        def grad(dy: tf.Tensor, _dreceived: Any = None) -> tf.Tensor:
            return _exchange(tf.convert_to_tensor(dy), received, None, process_set)[0]

        return (output, received), grad

    output, received = exchange(tensor)
    return output if splits is None else (output, received)


def _scatter(tensor: tf.Tensor, op: common.ReduceOp, name: str | None, process_set: ProcessSet, prescale_factor: float,
             postscale_factor: float) -> tf.Tensor:
    def host(array: np.ndarray) -> list[np.ndarray]:
        return [_wait(common.reducescatter_async(process_set, np.asarray(array), op, name=name, check_shape=True,
                                                 prescale_factor=prescale_factor, postscale_factor=postscale_factor),
                      process_set)]

    (out,) = _host(host, [tensor], [tensor.dtype], "hvd_reducescatter")
    out.set_shape([None, *tensor.shape[1:]])
    return out


def reducescatter(tensor: Any, device_dense: str = "", compression: Any = Compression.none, op: Any = common.Average,
                  name: str | None = None, process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """The reduction (default Average) of which this rank keeps its rows of the first dimension.
    Differentiable as in Horovod: the output gradients gathered, times the set's size for
    ``Sum`` and times the scale factors."""
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    if compressed.shape.rank == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension (it splits the first)")
    chosen = common.resolve_op(op, None)

    @tf.custom_gradient
    def scatter(x: tf.Tensor) -> Any:
        def grad(dy: tf.Tensor) -> tf.Tensor:
            dy = tf.convert_to_tensor(dy)
            summed = (process_set.size() or 1) if chosen == common.Sum else 1
            factor = summed * prescale_factor * postscale_factor
            return _gather(dy if factor == 1 else dy * tf.cast(factor, dy.dtype), None, process_set)

        return _scatter(x, chosen, name, process_set, prescale_factor, postscale_factor), grad

    return compression.decompress(scatter(compressed), ctx)


def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "", compression: Any = Compression.none,
                          op: Any = common.Average, name: str | None = None, process_set: ProcessSet = global_process_set,
                          ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[tf.Tensor]:
    """:func:`reducescatter` of every tensor of the list (each checked before any is sent)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if any(t.shape.rank == 0 for t in tensors):
        raise ValueError("grouped_reducescatter needs tensors with at least one dimension (it splits the first)")
    return [reducescatter(t, compression=compression, op=op, name=None if name is None else f"{name}.{i}",
                          process_set=process_set, prescale_factor=prescale_factor, postscale_factor=postscale_factor)
            for i, t in enumerate(tensors)]


def grouped_allgather(tensors: Sequence[Any], name: str | None = None, ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """:func:`allgather` of every tensor of the list (each checked before any is sent)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if any(t.shape.rank == 0 for t in tensors):
        raise ValueError("grouped_allgather needs tensors with at least one dimension (it concatenates along the first)")
    return [allgather(t, name=None if name is None else f"{name}.{i}", process_set=process_set)
            for i, t in enumerate(tensors)]


# --- variables, objects, synchronisation ----------------------------------------------------


def broadcast_variables(variables: Sequence[tf.Variable], root_rank: int, process_set: ProcessSet = global_process_set,
                        inplace: bool = False) -> Any:
    """Assign rank ``root_rank``'s value to every variable (one host call for all of them)."""
    variables = list(variables)
    if not variables:
        return None

    def host(*arrays: np.ndarray) -> list[np.ndarray]:
        futures = [common.broadcast_async(process_set, np.asarray(a), root_rank, name=f"variables.{i}")
                   for i, a in enumerate(arrays)]
        return [np.asarray(_wait(f, process_set)).reshape(np.shape(a)) for f, a in zip(futures, arrays)]

    values = _host(host, [tf.convert_to_tensor(v) for v in variables], [v.dtype for v in variables], "hvd_broadcast_variables")
    return tf.group(*[v.assign(value) for v, value in zip(variables, values)])


def broadcast_(variables: Sequence[Any], root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Horovod's in-place broadcast: every variable takes rank ``root_rank``'s value (one host
    call for all of them, as :func:`broadcast_variables`); their values once assigned."""
    variables = list(variables)
    assigned = broadcast_variables(variables, root_rank, process_set=process_set)
    with tf.control_dependencies([] if assigned is None or tf.executing_eagerly() else [assigned]):
        return [tf.identity(v.read_value()) for v in variables]


def broadcast_global_variables(root_rank: int) -> Any:
    """:func:`broadcast_variables` of a TensorFlow 1 graph's global variables
    (``tf.compat.v1.global_variables()``). Eagerly there is no such collection: ``RuntimeError``,
    Horovod's type, pointing to :func:`broadcast_variables`."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution: TensorFlow 2 keeps no "
                           "collection of global variables. Use hvd.broadcast_variables(model.variables, root_rank).")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Rank ``root_rank``'s picklable ``obj`` on every rank (pickled between the job's ranks only)."""
    return common.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order."""
    return common.allgather_object(obj, name, process_set)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    common.barrier(process_set)


def join() -> int:
    """Block until every rank joined; the rank that joined last (see docs/horovod.md)."""
    return common.join_ranks(global_process_set)


# --- queries evaluated when the graph runs ---------------------------------------------------


def _query(value: Callable[[], int], name: str | None, default_name: str) -> tf.Tensor:
    """An int32 scalar tensor holding ``value()`` as it is when the op runs, not when a function
    is traced (Horovod's ``HorovodRank``... ops): a traced function or a graph built before
    ``hvd.init()`` reads the values of the process that runs it. Not differentiable (an integer
    output has no gradient). Before ``hvd.init()`` running it fails: eagerly with Horovod's
    ``ValueError``, in a graph as TensorFlow's ``InvalidArgumentError`` carrying that message."""
    (out,) = _host(lambda: [np.asarray(value(), dtype=np.int32)], [], [tf.int32], name or default_name)
    out.set_shape([])
    return out


def rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank, read when the op runs."""
    return _query(common.rank, name, "HorovodRank")


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank among the ranks on its host, read when the op runs."""
    return _query(common.local_rank, name, "HorovodLocalRank")


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The number of ranks in the registered process set ``process_set_id`` (0, the default: all
    of them), read when the op runs; Horovod's code -3 for an id no set has."""
    chosen = common.set_id(process_set_id)
    return _query(lambda: common.process_set_size(chosen), name, "HorovodSize")


def local_size_op(name: str | None = None) -> tf.Tensor:
    """The number of ranks on this process's host, read when the op runs."""
    return _query(common.local_size, name, "HorovodLocalSize")


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 when this rank belongs to the registered process set ``process_set_id``, else 0, read when
    the op runs; Horovod's code -3 for an id no set has."""
    chosen = common.set_id(process_set_id)
    return _query(lambda: common.process_set_included(chosen), name, "HorovodProcessSetIncluded")
