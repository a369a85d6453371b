"""JAX adapter: cross-host ``psum``/``pmean`` for ``jax.shard_map`` and ``jax.pmap`` through the reducers.

Replace ``lax.psum(g, "i")`` with ``redsrv.jax.psum(g, "i")`` (or add one optax transform) and the
sum runs over every device of every process: each process reduces its own devices in XLA, and the
reducer fleet adds the processes together::

    import redsrv.jax
    comm = redsrv.jax.init()                      # REDSRV_REDUCERS, REDSRV_JOB, RANK, WORLD_SIZE ...
    params = comm.broadcast_tree(params)          # every process starts from rank 0's weights
    tx = optax.chain(redsrv.jax.allreduce_gradients("batch"), optax.adam(1e-3))

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("batch")), out_specs=(P(), P()))
    def train_step(params, opt_state, batch):
        grads = jax.grad(loss)(lax.pcast(params, "batch", to="varying"), batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for batch in data:
        params, opt_state = train_step(params, opt_state, batch)
        comm.check()                              # raises a failed exchange as its redsrv error

How one collective runs (no host-side rendezvous between the device threads):

1. The leaves of the pytree are concatenated into one flat vector per dtype ("one fused exchange
   per dtype"), except leaves of at least :data:`UNFUSED_BYTES`, which travel alone (their copy
   into a fused vector and back costs more than it saves: :func:`redsrv.core.fusion.unfuse_large`).
   Each vector is padded to a multiple of the local axis size, and ``lax.psum_scatter`` leaves each
   local device with the local sum of its own slice.
2. Each vector of each device starts in a ``buffer_callback`` of its own as soon as XLA has
   produced it (so the exchange overlaps the rest of the backward pass), under the key
   ``(call site, phase, vector, dtype, device, counter)``; one blocking ``buffer_callback`` per
   device then waits for every vector and writes the sums over all processes into XLA's buffers
   (each result aliases its slice; nothing is transferred to the host and back). The call site
   (module, function, line) is fixed at trace time, the counter counts executions of that site
   on that device, so keys are identical on every process without any agreement at run time.
   Two tiny ``ordered=True`` ``io_callback`` calls bracket each call: the ticket numbers it, the
   receipt takes the wait's status. So the counters advance identically everywhere whatever
   order the vectors start in, and each device runs its waits, the only blocking part, in
   program order: no two processes can block in a different order (INTEGRATION: the deadlock
   hazard of unordered blocking callbacks). The client moves the bytes through staging buffers
   of the communicator's own (twice each vector's size while a call is in flight, kept for the
   next call), since XLA's buffers are valid only while a callback runs (:meth:`Communicator._submit`).
3. ``lax.all_gather`` puts the slices back together on every device.

Errors: a callback must not raise (XLA's behaviour is undefined), so a failed exchange stores its
:class:`redsrv.RedsrvError`, poisons the result (NaN for floats, zero for integers), makes every
later exchange return poisoned results at once instead of waiting, and closes the client that
:func:`init` opened, so the reducers fail the step for the other ranks too. :meth:`Communicator.check`
(after the step) raises the stored error itself, typed as the core raised it, with a note naming
the call site, device and call. Nothing ever hangs: every exchange is bounded by the client's
deadlines.

Semantics match ``lax.psum``/``lax.pmean`` over one axis that spans the devices of every process,
gradients included: a ``jax.custom_vjp`` does what ``lax.psum``'s transpose does, a sum of the
cotangents under ``pmap`` and ``check_vma=False``, and no exchange under ``check_vma=True``, where
the cotangent of an invariant result is already the total.
Under ``jax.shard_map(check_vma=True)`` (the default) an input that is *invariant* over the axis is
rejected: JAX has then already summed it over this process's devices (typically the gradient of a
replicated parameter), and no type tells a replicated value from such a partial sum. Take gradients
with respect to ``lax.pcast(params, axis, to="varying")`` (as above), or use ``check_vma=False``.

Why there is a default communicator: a drop-in ``psum(x, axis_name)`` has nowhere to carry state,
yet the callback must reach a client. :func:`init` creates the one default explicitly (never on
import, never implicitly); every function also takes ``comm=`` to bypass it, and
:class:`Communicator` has the same functions as methods. Compiled steps that use the default look it
up when they run, so after ``close()`` and a new ``init()`` cached executables use the new client.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

from redsrv.core import Client, collectives, commons, fusion, wire

from . import _jax_internals

__all__ = [
    "Communicator",
    "init",
    "default_communicator",
    "psum",
    "pmean",
    "allreduce_gradients",
    "broadcast_tree",
    "check",
    "checked",
    "SUPPORTED_DTYPES",
    "UNFUSED_BYTES",
]

#: dtypes the reducers sum (the core's numeric wire dtypes, ``redsrv.core.wire``). ``float64``/``int64``
#: need ``jax_enable_x64``.
SUPPORTED_DTYPES = tuple(wire.numpy_dtype(wire.DTYPE_NAMES[name]) for name in wire.NUMERIC_DTYPE_NAMES)

#: Leaves of at least this many bytes are exchanged alone, not fused with the others of their dtype:
#: fused, each step would copy them into a fresh vector and out again, which XLA's CPU allocator
#: pays in page faults (docs/performance.md, "End-to-end training: JAX and Keras").
UNFUSED_BYTES = 4 << 20

#: Namespace of every key this adapter sends, so they never collide with a user's own client keys.
_KEY_PREFIX = "redsrv.jax"

# Frames of JAX itself are left out of a call site (commons.call_site): they differ between JAX
# releases and between the first trace and a retrace.
_SITE_SKIPPED = ("jax.", "jaxlib.", "jax_plugins.")


class Communicator:
    """The adapter's state: a :class:`redsrv.Client`, the per-site call counters and the first
    error a callback stored. Thread-safe: every local device's callback thread uses it at once.

    Create one with :func:`init` (or wrap an existing client: ``Communicator(client)``). Its methods
    are the module-level functions with ``comm=self``.
    """

    def __init__(self, client: Client, *, timeout: float | None = None, owns_client: bool = False) -> None:
        _check_timeout(timeout)
        self.client = client
        self.timeout = timeout
        self._owns_client = owns_client
        self._lock = threading.Lock()  # guards _error, _closed, _in_flight and _spare
        self._keys = commons.KeySpace(_KEY_PREFIX)
        self._error: BaseException | None = None
        self._closed = False
        # Exchanges started and not yet finished, by (site, vector, device, call), and the staging
        # buffers finished calls gave back, by (site, vector, device): see _submit.
        self._in_flight: dict[tuple[Any, ...], tuple[Any, tuple[np.ndarray, np.ndarray]]] = {}
        self._spare: dict[tuple[Any, ...], list[tuple[np.ndarray, np.ndarray]]] = {}

    @property
    def rank(self) -> int:
        return int(self.client.rank)

    @property
    def world_size(self) -> int:
        return int(self.client.world_size)

    # --- collectives (inside shard_map / pmap) ---

    def psum(self, x: Any, axis_name: Any, *, wire_dtype: str | None = None) -> Any:
        """:func:`psum` with this communicator."""
        return _collective(x, axis_name, "sum", _Target(self), wire_dtype)

    def pmean(self, x: Any, axis_name: Any, *, wire_dtype: str | None = None) -> Any:
        """:func:`pmean` with this communicator."""
        return _collective(x, axis_name, "mean", _Target(self), wire_dtype)

    def allreduce_gradients(self, axis_name: Any, *, op: str = "mean", wire_dtype: str | None = None) -> Any:
        """:func:`allreduce_gradients` with this communicator."""
        return _gradient_transformation(axis_name, op, _Target(self), wire_dtype)

    # --- host side ---

    def broadcast_tree(self, tree: Any, *, root: int = 0) -> Any:
        """:func:`broadcast_tree` with this communicator."""
        return _broadcast_tree(self, tree, root)

    def check(self, *trees: Any) -> None:
        """Raise the first error any exchange stored, after waiting for the dispatched steps.

        ``trees`` (e.g. a step's outputs) are waited for first; then every ordered callback already
        dispatched is waited for (``jax.effects_barrier``). The error is the core's own
        (:class:`redsrv.PeerLostError`, :class:`redsrv.PeerTimeoutError`, ...) with a note naming
        the call site, device and call; it stays raised: results after it are poisoned, so create
        a new communicator to continue. A broken or closed client is reported too.
        """
        if trees:
            jax.block_until_ready(trees)
        jax.effects_barrier()
        with self._lock:
            error = self._error
        if error is not None:
            raise error
        self.client.check()

    def checked(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap ``step`` so that each call waits for its outputs and then :meth:`check`\\ s.

        The wait gives up JAX's asynchronous dispatch for that step; call :meth:`check` every few
        steps instead where that matters.
        """

        @functools.wraps(step)
        def run_and_check(*args: Any, **kwargs: Any) -> Any:
            out = step(*args, **kwargs)
            self.check(out)
            return out

        return run_and_check

    def close(self) -> None:
        """Close the client (if :func:`init` created it) and stop being the default. Idempotent."""
        global _default
        with _default_lock:
            if _default is self:
                _default = None
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with self._lock:
            self._in_flight.clear()
            self._spare.clear()
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("failed" if self._error is not None else "open")
        return f"<redsrv.jax.Communicator job={self.client.config.job!r} rank={self.rank}/{self.world_size} {state}>"

    # --- called from the callbacks (XLA threads) ---

    def _ticket(self, site: tuple[str, str], device: int) -> int:
        """The call number of this execution of ``site`` on ``device`` (ordered io_callback)."""
        return self._keys.next_call(site, device)

    def _submit(self, op: str, site: tuple[str, str], vector: int, device: int, call: int, piece: np.ndarray,
                wire_dtype: str | None) -> None:
        """Start one vector's exchange (buffer_callback; never blocks, never raises).

        ``piece`` is XLA's own buffer, valid only until this returns, while a failed exchange
        may leave an I/O thread of the client still reading its input or landing a result after
        that. So the client moves the bytes between buffers of the communicator's own
        (:meth:`_staging`), which outlive any thread: copied in here and out in :meth:`_finish`,
        and after a failure (which poisons every later exchange) never used again.
        """
        with self._lock:
            failed = self._error is not None
        if failed:
            return  # the step is lost already; _finish poisons it without waiting on peers
        try:
            staged_in, staged_out = self._staging((site, vector, device), piece)
            np.copyto(staged_in, piece)
            key = self._keys.key(*site, vector, piece.dtype.name, device, call)
            future = self.client.allreduce_async(staged_in, op=op, key=key, wire_dtype=wire_dtype,
                                                 timeout=self.timeout, out=staged_out)
            with self._lock:
                self._in_flight[(site, vector, device, call)] = (future, (staged_in, staged_out))
        except Exception as exc:  # a callback must not raise: store it for check()
            self._fail(exc, f"redsrv.jax.p{op} at {site[0]} ({site[1]}) on local device {device}, call {call}")

    def _finish(self, op: str, site: tuple[str, str], device: int, call: int, results: Sequence[np.ndarray]) -> bool:
        """Wait for every vector of one call and write the sums into ``results`` (XLA's buffers);
        never raises. False when the exchange failed and ``results`` hold poison."""
        with self._lock:
            started = [self._in_flight.pop((site, vector, device, call), None) for vector in range(len(results))]
            failed = self._error is not None
        try:
            if failed or any(entry is None for entry in started):
                raise _Poisoned()
            for entry, result in zip(started, results):
                assert entry is not None
                np.copyto(result, self.client.wait(entry[0], timeout=self.timeout))
            with self._lock:
                for vector, entry in enumerate(started):
                    assert entry is not None
                    self._spare.setdefault((site, vector, device), []).append(entry[1])
            return True
        except Exception as exc:  # a callback must not raise: store it for check()
            if not isinstance(exc, _Poisoned):
                self._fail(exc, f"redsrv.jax.p{op} at {site[0]} ({site[1]}) on local device {device}, call {call}")
            _poison(results)
            return False

    def _staging(self, place: tuple[Any, ...], like: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """An input and a result buffer of the communicator's own for one vector of a call
        site: a spare pair a finished call gave back, else a new one (two calls of one site may
        be in flight at once when executions overlap)."""
        with self._lock:
            spares = self._spare.get(place, [])
            while spares:
                pair = spares.pop()
                if pair[0].shape == like.shape and pair[0].dtype == like.dtype:
                    return pair
        return np.empty(like.shape, like.dtype), np.empty(like.shape, like.dtype)

    def _fail(self, exc: BaseException, where: str) -> None:
        with self._lock:
            if self._error is not None:
                return
            if hasattr(exc, "add_note"):  # Python 3.11+: keep the core's type, add where it happened
                exc.add_note(f"raised on the host by redsrv.jax.check(); the exchange was {where}")
            self._error = exc
            # An I/O thread may still touch the staging buffers of what was in flight: drop them all.
            self._in_flight.clear()
            self._spare.clear()
        # This process sends nothing more for the step: the adapters' one rule (redsrv.core.commons)
        # closes a client init() opened, so the reducers fail the open step for every rank now
        # instead of leaving them to wait for contributions until their timeout.
        commons.abandon(self.client, owned=self._owns_client)


# The default communicator, set only by init(); see the module docstring for why it exists.
_default: Communicator | None = None
_default_lock = threading.Lock()


def init(reducers: Sequence[str] | str | None = None, *, rank: int | None = None, world_size: int | None = None,
         job: str | None = None, timeout: float | None = None, set_default: bool = True,
         **config_fields: Any) -> Communicator:
    """Connect this process to the reducer fleet and return its :class:`Communicator`.

    Arguments not given come from the environment through :meth:`redsrv.Config.from_env`
    (``REDSRV_REDUCERS``, ``REDSRV_JOB``, ``RANK``/``WORLD_SIZE`` ...); ``config_fields`` are any
    other :class:`redsrv.Config` fields (``wire_dtype="bf16"``, ``op_timeout=60`` ...). One process
    is one rank, whatever its number of local devices. ``timeout`` bounds each exchange (default:
    the config's ``op_timeout``). With ``set_default`` (the default) the module-level functions use
    this communicator until it is closed; a second default while one is open is an error.
    """
    global _default
    _check_timeout(timeout)
    if set_default:
        with _default_lock:
            if _default is not None:
                raise ValueError(f"redsrv.jax is already initialised ({_default!r}): close() it first, "
                                 "or pass set_default=False and comm= explicitly")
    client = Client(reducers, rank=rank, world_size=world_size, job=job, **config_fields)
    comm = Communicator(client, timeout=timeout, owns_client=True)
    if set_default:
        with _default_lock:
            if _default is not None:  # another thread won the race
                comm.close()
                raise ValueError("redsrv.jax was initialised concurrently by another thread")
            _default = comm
    return comm


def default_communicator() -> Communicator:
    """The communicator :func:`init` made the default; a clear error if there is none."""
    comm = _default
    if comm is None:
        raise ValueError("redsrv.jax is not initialised: call redsrv.jax.init() first, or pass comm=")
    return comm


def psum(x: Any, axis_name: Any, *, comm: Communicator | None = None, wire_dtype: str | None = None) -> Any:
    """Sum ``x`` (an array or any pytree) over ``axis_name`` on every device of every process.

    Use inside ``jax.shard_map`` or ``jax.pmap`` (also under ``jit``) where you would use
    ``lax.psum``; differentiable like it. The tree travels as one flat vector per dtype (leaves of
    :data:`UNFUSED_BYTES` or more alone).
    ``wire_dtype="bf16"``/``"fp16"`` compresses floats on the wire (sums still accumulate in fp32).
    Supported dtypes: :data:`SUPPORTED_DTYPES`; anything else is a ``TypeError`` at trace time.
    """
    return _collective(x, axis_name, "sum", _Target(comm), wire_dtype)


def pmean(x: Any, axis_name: Any, *, comm: Communicator | None = None, wire_dtype: str | None = None) -> Any:
    """Mean of ``x`` over ``axis_name`` on every device of every process (floating dtypes only).

    Across processes it divides by the ranks that actually contributed (straggler modes), within a
    process by the local axis size: every process must have the same number of local devices.
    """
    return _collective(x, axis_name, "mean", _Target(comm), wire_dtype)


def allreduce_gradients(axis_name: Any, *, op: str = "mean", comm: Communicator | None = None,
                        wire_dtype: str | None = None) -> Any:
    """An optax ``GradientTransformation`` that all-reduces the updates over ``axis_name``.

    Put it first in the chain, inside the mapped training step::

        tx = optax.chain(redsrv.jax.allreduce_gradients("batch"), optax.adam(1e-3))

    ``op="mean"`` (the default) averages the gradients over every device of every process, as
    ``lax.pmean`` would over one big axis; ``op="sum"`` adds them. Stateless.
    """
    return _gradient_transformation(axis_name, op, _Target(comm), wire_dtype)


def broadcast_tree(tree: Any, *, root: int = 0, comm: Communicator | None = None) -> Any:
    """Rank ``root``'s values of ``tree`` on every process (host side, outside ``jit``): call it on
    the initial parameters (and optimiser state) so every process starts identically.

    Every process passes a tree of the same structure, shapes and dtypes; only the root's contents
    travel, exactly (never compressed), whatever the dtype (PRNG key data, bool masks included).
    One exchange per dtype. Leaves come back as the type they
    went in (``jax.Array`` on the default device, or ``numpy.ndarray``). Blocks; raises the core's
    typed errors directly.
    """
    return _broadcast_tree(comm if comm is not None else default_communicator(), tree, root)


def check(*trees: Any, comm: Communicator | None = None) -> None:
    """:meth:`Communicator.check` on ``comm`` or the default communicator."""
    (comm if comm is not None else default_communicator()).check(*trees)


def checked(step: Callable[..., Any], *, comm: Communicator | None = None) -> Callable[..., Any]:
    """:meth:`Communicator.checked` on ``comm``, or on the default communicator at each call."""

    @functools.wraps(step)
    def run_and_check(*args: Any, **kwargs: Any) -> Any:
        out = step(*args, **kwargs)
        (comm if comm is not None else default_communicator()).check(out)
        return out

    return run_and_check


# --- implementation ---


class _Target:
    """Which communicator a traced collective talks to when it runs: the explicit one, or the
    default at run time (falling back to the one current at trace time, so that an error after
    ``close()`` still lands somewhere check() can see it)."""

    def __init__(self, comm: Communicator | None) -> None:
        self.explicit = comm
        self.traced = comm if comm is not None else default_communicator()  # no init(): fail at trace time

    def resolve(self) -> Communicator:
        if self.explicit is not None:
            return self.explicit
        return _default if _default is not None else self.traced


def _gradient_transformation(axis_name: Any, op: str, target: _Target, wire_dtype: str | None) -> Any:
    try:
        import optax
    except ImportError as exc:  # optax is optional for psum/pmean users
        raise ImportError("redsrv.jax.allreduce_gradients needs optax: pip install 'redsrv[jax]'") from exc
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")

    def init_fn(params: Any) -> Any:
        del params
        return optax.EmptyState()

    def update_fn(updates: Any, state: Any, params: Any = None) -> Any:
        del params
        return _collective(updates, axis_name, op, target, wire_dtype), state

    return optax.GradientTransformation(init_fn, update_fn)


def _collective(tree: Any, axis_name: Any, op: str, target: _Target, wire_dtype: str | None) -> Any:
    """Trace-time entry of psum/pmean: validate, split differentiable leaves from the rest."""
    where = _call_site()
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    for leaf in leaves:
        if leaf.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"redsrv.jax.p{op} at {where}: dtype {leaf.dtype} is not supported by the reducers "
                            f"(supported: {', '.join(d.name for d in SUPPORTED_DTYPES)})")
        if op == "mean" and not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise TypeError(f"redsrv.jax.pmean at {where}: needs floating-point data, got {leaf.dtype}")
    vma = _vma_checked(axes)
    if vma:
        for leaf in leaves:
            missing = [a for a in axes if a not in _jax_internals.varying_axes(leaf)]
            if missing:
                raise TypeError(
                    f"redsrv.jax.p{op} at {where}: a {leaf.dtype}{list(leaf.shape)} value is invariant over axis "
                    f"{missing[0]!r} under shard_map(check_vma=True). JAX has then already combined it over this "
                    "process's devices only (e.g. the gradient of a replicated parameter), and redsrv cannot tell a "
                    "replicated value from such a partial sum. Differentiate with respect to "
                    f"lax.pcast(params, {missing[0]!r}, to='varying') so gradients stay per device, or use "
                    "shard_map(check_vma=False).")
    if not leaves:
        return tree
    floating = [i for i, leaf in enumerate(leaves) if jnp.issubdtype(leaf.dtype, jnp.floating)]
    integral = sorted(set(range(len(leaves))) - set(floating))
    out: list[Any] = list(leaves)
    if floating:
        reduce = _differentiable(axes, op, target, where, wire_dtype, vma)
        for i, value in zip(floating, reduce(tuple(leaves[i] for i in floating))):
            out[i] = value
    if integral:
        reduced = _exchange_leaves([leaves[i] for i in integral], axes, op, target, (where, "int"),
                                   None, vma)  # wire compression is for floats; integers travel exact
        for i, value in zip(integral, reduced):
            out[i] = value
    return jax.tree.unflatten(treedef, out)


def _differentiable(axes: tuple[Any, ...], op: str, target: _Target, where: str,
                    wire_dtype: str | None, vma: bool) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """The collective as a custom_vjp: io_callback is not differentiable, the collective is."""

    def primal(leaves: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(_exchange_leaves(list(leaves), axes, op, target, (where, "fwd"), wire_dtype, vma))

    def fwd(leaves: tuple[Any, ...]) -> tuple[tuple[Any, ...], None]:
        return primal(leaves), None

    def bwd(_: None, cts: tuple[Any, ...]) -> tuple[tuple[Any, ...]]:
        if vma:
            # With varying-axis types lax.psum transposes to pcast(to="varying"): the cotangent of
            # an invariant result is already the total; nothing to exchange.
            scale = _global_size(axes, target) if op == "mean" else 1
            return (tuple(_to_varying(ct, axes) / jnp.asarray(scale, ct.dtype) if scale != 1 else _to_varying(ct, axes)
                          for ct in cts),)
        # Without them (pmap, check_vma=False) lax.psum transposes to psum, pmean to pmean.
        return (tuple(_exchange_leaves(list(cts), axes, op, target, (where, "bwd"), wire_dtype, vma)),)

    reduce = jax.custom_vjp(primal)
    reduce.defvjp(fwd, bwd)
    return reduce


def _exchange_leaves(leaves: list[Any], axes: tuple[Any, ...], op: str, target: _Target, site: tuple[str, str],
                     wire_dtype: str | None, vma: bool) -> list[Any]:
    """psum_scatter over the local devices, one callback per device, all_gather back."""
    local = _local_size(axes)
    slices, layouts = [], []
    for group in fusion.unfuse_large(fusion.group_by_dtype(leaves), UNFUSED_BYTES):
        if group.total == 0:
            continue
        if len(group.members) == 1:
            flat = leaves[group.members[0]].reshape(-1)  # a bitcast in XLA: no copy
        else:
            flat = jnp.concatenate([leaves[i].reshape(-1) for i in group.members])  # fusion.fuse, traced
        padded = -(-group.total // local) * local  # psum_scatter needs a multiple of the axis size
        if padded != group.total:
            flat = jnp.pad(flat, (0, padded - group.total))
        slices.append(lax.psum_scatter(flat, axes, scatter_dimension=0, tiled=True))
        layouts.append(group)
    out = list(leaves)
    if not slices:
        return out
    # XLA hands the exchange its own buffers (no transfer to the host and back: the copies the
    # io_callback route paid, docs/performance.md "End-to-end training: JAX and Keras"). Each
    # vector starts as soon as XLA has it, so the exchange overlaps the rest of the backward
    # pass, and one wait per device takes every result. buffer_callbacks have no ordered
    # effect, so two tiny ordered io_callbacks bracket the whole: the ticket numbers the call
    # (the keys then agree on every process whatever order the vectors start in) and the
    # receipt takes the wait's status, which keeps every device's waits, the only blocking
    # part, in program order, as the deadlock hazard of INTEGRATION requires.
    call = io_callback(functools.partial(_issue_ticket, target, site), jax.ShapeDtypeStruct((2,), np.int32),
                       _device_index(), ordered=True)
    started = [_jax_internals.buffer_callback(functools.partial(_run_submit, target, op, site, vector, wire_dtype),
                                              jax.ShapeDtypeStruct((), np.int32), has_side_effect=True)(call, piece)
               for vector, piece in enumerate(slices)]
    shapes = tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in slices)
    finish = _jax_internals.buffer_callback(
        functools.partial(_run_finish, target, op, site), (shapes, jax.ShapeDtypeStruct((), np.int32)),
        has_side_effect=True,
        # each result replaces its slice: XLA's buffer is warm, where a fresh one would fault
        input_output_aliases={1 + len(started) + i: i for i in range(len(slices))})
    results, status = finish(call, *started, *slices)
    io_callback(_receipt, None, status, ordered=True)
    for result, piece, group in zip(results, slices, layouts):
        if vma:
            # The callback's result is typed invariant; it differs per device until gathered.
            result = lax.pcast(result, tuple(sorted(_jax_internals.varying_axes(piece), key=str)), to="varying")
        full = lax.all_gather(result, axes, tiled=True, **({"to": "invarying"} if vma else {}))
        if op == "mean":
            full = full / jnp.asarray(local, group.dtype)  # the reducers divided by the processes
        for i, value in zip(group.members, fusion.split(full, group)):  # the padding is left out
            out[i] = value
    return out


class _Poisoned(Exception):
    """An exchange that is not waited for: the communicator failed earlier."""


def _issue_ticket(target: _Target, site: tuple[str, str], device: np.ndarray) -> np.ndarray:
    """The ordered io_callback before an exchange: (device, its call number on this device).
    The number wraps at 2**31 executions of one site, long after any key could still be in flight."""
    number = target.resolve()._ticket(site, int(device)) % (1 << 31)
    return np.array([int(device), number], dtype=np.int32)


def _receipt(status: np.ndarray) -> None:
    """The ordered io_callback after an exchange (a failure is in check()'s stored error)."""
    del status


def _run_submit(target: _Target, op: str, site: tuple[str, str], vector: int, wire_dtype: str | None, ctx: Any,
                out: Any, call: Any, piece: Any) -> None:
    """A buffer_callback on an XLA thread: start one vector of one device's exchange."""
    del ctx
    device, number = (int(v) for v in np.asarray(call))
    target.resolve()._submit(op, site, vector, device, number, np.asarray(piece), wire_dtype)
    np.asarray(out)[...] = 0


def _run_finish(target: _Target, op: str, site: tuple[str, str], ctx: Any, out: Any, call: Any,
                *started_and_slices: Any) -> None:
    """A buffer_callback on an XLA thread: wait for one device's exchange, write its sums."""
    del ctx
    results, status = out
    device, number = (int(v) for v in np.asarray(call))
    ok = target.resolve()._finish(op, site, device, number, [np.asarray(r) for r in results])
    np.asarray(status)[...] = 1 if ok else 0


def _poison(results: Sequence[np.ndarray]) -> None:
    """What a failed exchange leaves in its results: NaN makes a result that was used anyway obvious."""
    for r in results:
        r[...] = np.nan if np.issubdtype(r.dtype, np.floating) or r.dtype.name == "bfloat16" else 0


def _broadcast_tree(comm: Communicator, tree: Any, root: int) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    host = [np.asarray(jax.device_get(leaf)) for leaf in leaves]
    out: list[Any] = list(leaves)
    for group in fusion.group_by_dtype(host):  # any fixed-size dtype: a broadcast moves bits exactly
        call = comm._keys.next_call("broadcast_tree")
        result = collectives.broadcast_exact(comm.client, fusion.fuse(host, group), root=root, timeout=comm.timeout,
                                             key=comm._keys.key("broadcast_tree", group.dtype.name, call))
        for i, value in zip(group.members, fusion.split(result, group)):
            out[i] = jnp.asarray(value) if isinstance(leaves[i], jax.Array) else value.copy()
    return jax.tree.unflatten(treedef, out)


def _call_site() -> str:
    """Where the collective was called from, fixed at trace time (:func:`redsrv.core.commons.call_site`)."""
    return commons.call_site(_SITE_SKIPPED)


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout}")


def _local_size(axes: tuple[Any, ...]) -> int:
    return int(np.prod([lax.axis_size(a) for a in axes]))


def _global_size(axes: tuple[Any, ...], target: _Target) -> int:
    return _local_size(axes) * target.traced.world_size


def _device_index() -> Any:
    """This device's position among the local devices of the mapped computation, as a traced int.

    Counts every manual mesh axis, not only the reduced ones: with a (data, model) mesh and a
    psum over "data", devices that differ in "model" send different slices under their own keys.
    """
    names = _jax_internals.manual_axis_names()
    if not names:
        raise ValueError("redsrv.jax collectives run inside jax.shard_map or jax.pmap (no mapped axis here)")
    index = lax.axis_index(names[0])
    for name in names[1:]:
        index = index * lax.axis_size(name) + lax.axis_index(name)
    return index


# Varying-manual-axes types: read through adapters/_jax_internals.py, whose canary test says when
# JAX moves them.


def _vma_checked(axes: tuple[Any, ...]) -> bool:
    """Whether shard_map(check_vma=True) types values over these axes (axis_index then varies)."""
    return all(a in _jax_internals.varying_axes(lax.axis_index(a)) for a in axes)


def _to_varying(x: Any, axes: tuple[Any, ...]) -> Any:
    missing = tuple(a for a in axes if a not in _jax_internals.varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x

