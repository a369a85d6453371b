"""The worker client: the one API every adapter uses.

``Client.allreduce_async`` splits a flat array across the reducers (:mod:`chunker`), queues each
chunk on the least-loaded stream to its reducer, and returns at once. The calling thread writes
what each socket takes at once; the client's I/O loops (``selectors``; one by default,
``REDSRV_IO_THREADS`` of them, each owning the streams of a fixed subset of the reducers) write
the rest as the sockets drain and pull finished chunks straight into the result array, so both
directions of the link stay busy. Operations are matched by key, never by arrival order; every
one has a deadline, and the loops keep them all.

The client is split in two, as the reducer is (:mod:`reducer` and :mod:`daemon`); :class:`Client`
here is the facade (the public API, argument checks, keys) over:

- :mod:`client_core`: ``ClientCore``, every decision as one sans-IO state machine (operations,
  push windows, where results land, ACK/SAFE bookkeeping, reconnect and resend decisions,
  deadlines), fed events and returning actions; no socket, thread, lock or clock;
- :mod:`client_engine`: ``ClientEngine``, the ``redsrv-io`` thread or threads (selectors,
  sockets, readers and writers) that drive the core and execute its actions, under the one
  locking rule written in its docstring;
- :mod:`client_connect`: ``Connector``, connecting and the handshake (for the engine, which
  also runs the ``redsrv-reconnect`` thread);
- :mod:`client_ops`: the futures, the plain data of an operation, and the completion thread
  that runs futures' done-callbacks (``Completions``).

Threads: callers' threads submit and write what the sockets take at once; ``redsrv-io`` (with k
loops ``redsrv-io-0`` .. ``redsrv-io-{k-1}``) does all reading and the rest of the writing, each
loop for its own reducers; ``redsrv-reconnect`` runs only while a reducer is lost;
``redsrv-done`` (started at the first done-callback) runs done-callbacks, so no user code runs on
an I/O loop.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import hashlib
import itertools
import logging
import selectors
import socket
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import chunker, wire
from . import constants as C
from .client_connect import Connector
from .client_core import ClientCore
from .client_engine import ClientEngine
from .client_ops import Completions, Contributors, Op, PendingPush, ReduceFuture, label
from .config import WIRE_DTYPES, Config
from .errors import ClientClosedError, ConfigError, LocalProtocolError, PeerTimeoutError
from .timeline import Timeline

__all__ = ["Client", "ReduceFuture", "Contributors", "OPS"]

log = logging.getLogger("redsrv.client")

#: The reduction ops by name; "mean" is a sum divided by the number of contributors.
_WIRE_OPS = {"sum": wire.ReduceOp.SUM, "mean": wire.ReduceOp.SUM, "min": wire.ReduceOp.MIN, "max": wire.ReduceOp.MAX,
             "product": wire.ReduceOp.PRODUCT, "band": wire.ReduceOp.BAND, "bor": wire.ReduceOp.BOR,
             "bxor": wire.ReduceOp.BXOR}
OPS = tuple(_WIRE_OPS)
_COMPRESSED = {"bfloat16": wire.numpy_dtype(wire.DType.BFLOAT16), "float16": wire.numpy_dtype(wire.DType.FLOAT16)}
_AUTO_KEY_BIT = 1 << 63

# Clients still open when the interpreter exits are closed by an atexit hook, while their I/O
# threads still run. Later, during finalisation, Python ends a daemon thread the moment it asks
# for the GIL, and one that held the dispatcher's lock then would leave a close() from __del__
# waiting on that lock forever (seen with JAX, whose threads keep the process busy at exit).
_open_clients: weakref.WeakSet[Client] = weakref.WeakSet()


@atexit.register
def _close_open_clients() -> None:
    for client in list(_open_clients):
        try:
            client.close()
        except Exception as exc:  # one client's failure must not keep the others open
            log.warning("closing a redsrv client at exit: %s", exc)


class Client:
    """A worker's connection to the reducer fleet (not a doctest: it needs running reducers)::

        with Client(["10.0.0.5:29600", "10.0.0.6:29600"], rank=0, world_size=4, job="run-17") as c:
            total = c.allreduce(grads)
            mean = c.allreduce(grads, op="mean")

    Settings not given here come from ``REDSRV_*`` variables (see :class:`Config`). The client
    is thread-safe; many operations may be in flight, each under its own key.
    """

    def __new__(cls, reducers: Sequence[str] | str | None = None, *, rank: int | None = None,
                world_size: int | None = None, job: str | None = None, config: Config | None = None,
                **options: Any) -> Client:
        """A worker that shares its host with others (``Config.host_level``) gets the host-level
        client (:mod:`host_client`), with this same API."""
        if cls is Client and resolve_config(reducers, rank, world_size, job, config, options).host_level:
            from .host_client import HostClient

            return super().__new__(HostClient)
        return super().__new__(cls)

    def __init__(self, reducers: Sequence[str] | str | None = None, *, rank: int | None = None,
                 world_size: int | None = None, job: str | None = None, config: Config | None = None,
                 **options: Any) -> None:
        config = resolve_config(reducers, rank, world_size, job, config, options)
        self.config = config
        self._auto_keys = itertools.count()
        self._timeline = Timeline(config.timeline, rank=config.rank, job=config.job) if config.timeline else None
        self._completions = Completions("redsrv-done")
        self._machine = ClientCore(config, [0] * len(config.reducers), tracing=self._timeline is not None)
        self._connector = Connector(config)
        self._engine = ClientEngine(config, self._machine, self._connector, self._timeline)
        try:
            self._engine.connect_all()
        except BaseException:
            self._teardown()
            raise
        self._engine.start()
        _open_clients.add(self)

    # --- public API ---

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def num_reducers(self) -> int:
        return len(self.config.reducers)

    @property
    def _closed(self) -> bool:
        return self._machine.closed

    @property
    def session(self) -> int:
        """This client's session id, sent in every handshake: a reconnect is the same session."""
        return self._connector.id

    @property
    def bytes_pushed(self) -> int:
        return self._machine.bytes_pushed

    @property
    def bytes_pulled(self) -> int:
        return self._machine.bytes_pulled

    @property
    def ops_completed(self) -> int:
        return self._machine.completed

    @property
    def ops_failed(self) -> dict[str, int]:
        """Failed operations by error type, for metrics."""
        with self._engine.lock:
            return dict(self._machine.failed)

    def connections(self) -> list[ConnectionInfo]:
        """What each connection to the reducers is doing, for diagnostics and tests (a snapshot;
        the sockets are the client's: read their options, never write or close them)."""
        engine = self._engine
        infos = []
        with engine.lock:
            streams = engine.all_streams()
            recovering = set(self._machine.recovering)
            kept = {id(s): sum(k.data.nbytes for k in s.channel.copies.values()) for s in streams}
        for stream in streams:
            loops = tuple(i for i, loop in enumerate(engine.loops) if _registered(loop.selector, stream.sock))
            infos.append(ConnectionInfo(stream.reducer, stream.channel.index, engine.loops[stream.loop].name, loops,
                                        stream.sock, bool(stream.writer.out), stream.reader.lowat,
                                        kept[id(stream)], stream.reducer in recovering))
        return infos

    @property
    def io_threads(self) -> list[threading.Thread]:
        """The client's I/O loop threads (``redsrv-io``, or ``redsrv-io-0`` .. with several)."""
        return self._engine.threads

    def allreduce(self, x: np.ndarray, *, op: str = "sum", key: Any = None, wire_dtype: str | None = None,
                  timeout: float | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """``op`` (sum, mean, min, max, product, band, bor, bxor) of ``x`` over the ranks; same
        shape and dtype as ``x``. Blocks."""
        future = self.allreduce_async(x, op=op, key=key, wire_dtype=wire_dtype, timeout=timeout, out=out)
        return self.wait(future, timeout=timeout)

    def allreduce_async(self, x: np.ndarray, *, op: str = "sum", key: Any = None, wire_dtype: str | None = None,
                        timeout: float | None = None, out: np.ndarray | None = None) -> ReduceFuture:
        """Start an all-reduce and return a future of the result (a new array, or ``out``).

        ``key`` identifies the operation across ranks and must be the same on every rank and
        unique within the job (ints, strings, bytes or tuples of them); by default each client
        numbers its operations, which requires every rank to issue them in the same order.
        ``op="mean"`` divides by the number of ranks that actually contributed (straggler modes).
        ``wire_dtype`` ("bf16"/"fp16") sends floating data compressed; sums accumulate in float32.
        ``x`` must not be modified until the future completes.

        ``out``: a C-contiguous writeable array of ``x``'s dtype and size that receives the
        result (results are received straight into it, so a training loop that passes the same
        buffer every step allocates nothing); it may be ``x`` itself for an in-place reduction.
        Its contents are undefined if the operation fails. Without ``out`` the result is a new
        array; one of 128 KiB or more may use the memory of a result the caller dropped
        (``buffer_pool.OutputPool``: no page faults for a fresh mapping every step) and then does
        not own its data (``flags.owndata`` is False). Nothing else uses that memory while any
        array of it lives.
        """
        if op not in OPS:
            raise LocalProtocolError(f"op must be one of {OPS}, got {op!r}")
        arr = _as_flat(x)
        if op == "mean" and not np.issubdtype(arr.dtype, np.floating) and arr.dtype.name != "bfloat16":
            raise LocalProtocolError(f"op='mean' needs floating-point data, got {arr.dtype}")
        op_code = _WIRE_OPS[op]
        if op_code in wire.BITWISE_OPS and wire.dtype_code(arr.dtype) not in wire.INTEGER_DTYPES:
            raise LocalProtocolError(f"op={op!r} needs integer or bool data, got {arr.dtype}")
        wire_dt = self._wire_dtype(arr.dtype, wire_dtype)
        return self._submit(arr, np.shape(x), key, wire_dt, op_code, 0, op == "mean", timeout,
                            None if out is None else _checked_out(out, arr))

    def broadcast(self, x: np.ndarray, *, root: int = 0, key: Any = None, timeout: float | None = None) -> np.ndarray:
        """Rank ``root``'s ``x`` on every rank (exact: never compressed). Every rank passes an
        array of the same shape and dtype; only the root's contents travel."""
        return self.wait(self.broadcast_async(x, root=root, key=key, timeout=timeout), timeout=timeout)

    def broadcast_async(self, x: np.ndarray, *, root: int = 0, key: Any = None, timeout: float | None = None,
                        out: np.ndarray | None = None) -> ReduceFuture:
        """Start a broadcast; ``out`` as in :meth:`allreduce_async` (it may be ``x`` itself)."""
        if not 0 <= root < self.world_size:
            raise LocalProtocolError(f"root {root} is not a rank of this {self.world_size}-rank job")
        arr = _as_flat(x)
        return self._submit(arr, np.shape(x), key, arr.dtype, wire.ReduceOp.BROADCAST, root, False, timeout,
                            None if out is None else _checked_out(out, arr))

    def barrier(self, *, key: Any = None, timeout: float | None = None) -> None:
        """Return once every rank reached the barrier (an all-reduce of one element)."""
        self.allreduce(np.ones(1, dtype=np.int32), key=key, timeout=timeout)

    def wait(self, future: ReduceFuture, *, timeout: float | None = None) -> np.ndarray:
        """The result of an ``*_async`` future, or its error. ``timeout`` is the one the operation
        was started with (default: the configured operation timeout).

        The client fails each operation at its own deadline; the bound here is a backstop that
        holds even if that machinery were stuck, so this call never blocks indefinitely."""
        bound = (self.config.op_timeout if timeout is None else timeout) + self.config.heartbeat_timeout + 1.0
        try:
            result: np.ndarray = future.result(timeout=bound)
        except concurrent.futures.TimeoutError:
            if future.done():
                raise  # our own PeerTimeoutError is a TimeoutError too: the operation's real error
            raise PeerTimeoutError("all-reduce did not complete", job=self.config.job, rank=self.rank,
                                   key=label(future.key), phase="wait for result", timeout=bound) from None
        return result

    def check(self) -> None:
        """Raise the error that broke this client, if any."""
        if self._machine.closed:
            raise ClientClosedError(f"client for job {self.config.job!r} rank {self.rank} is closed")
        if self._machine.broken is not None:
            raise self._machine.broken

    def close(self) -> None:
        """Idempotent and bounded by ``close_timeout``. Pending operations fail with
        :class:`ClientClosedError`."""
        error = ClientClosedError(f"client for job {self.config.job!r} rank {self.rank} was closed with the operation pending")
        _open_clients.discard(self)
        with self._engine.lock:
            actions = self._machine.close(error)
        if actions is not None:
            self._engine.run(actions)
            self._teardown()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if sys.is_finalizing():
            return  # the atexit hook closed every open client; threads may be gone by now (see _open_clients)
        machine = self.__dict__.get("_machine")
        if machine is not None and not machine.closed:
            try:
                self.close()
            except Exception:
                pass

    # --- submission ---

    def _wire_dtype(self, dtype: np.dtype, requested: str | None) -> np.dtype:
        name = requested if requested is not None else self.config.wire_dtype
        if name is None or name in ("none", "fp32", "float32"):
            return dtype
        if name not in WIRE_DTYPES:
            raise LocalProtocolError(f"wire_dtype must be one of {sorted(WIRE_DTYPES)}, got {name!r}")
        target = _COMPRESSED[WIRE_DTYPES[name]]
        is_float = np.issubdtype(dtype, np.floating)
        if not is_float or dtype.itemsize <= target.itemsize:
            if requested is not None and not is_float:
                raise LocalProtocolError(f"wire_dtype={requested!r} applies to floating-point data, got {dtype}")
            return dtype
        return target

    def _key(self, key: Any) -> int:
        if key is None:
            return _AUTO_KEY_BIT | next(self._auto_keys)
        if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < _AUTO_KEY_BIT:
            return key
        digest = hashlib.blake2b(_canonical(key), digest_size=8).digest()
        return int.from_bytes(digest, "little") & (_AUTO_KEY_BIT - 1)

    def _submit(self, arr: np.ndarray, shape: tuple[int, ...], key: Any, wire_dt: np.dtype, op_code: wire.ReduceOp,
                root: int, mean: bool, timeout: float | None, out: np.ndarray | None = None, *,
                ramp: bool = True) -> ReduceFuture:
        """``ramp=False`` cuts each span into full chunks only: for the host-level path, whose
        pieces are a pipeline of their own (core/host_client.py), so that a ramp would only add
        chunks. Every rank of a job must submit a key the same way."""
        self.check()
        wire_code = wire.dtype_code(wire_dt)
        wire.dtype_code(arr.dtype)  # the caller's dtype must be supported too
        key_u64 = self._key(key)
        future = ReduceFuture()
        future.key = key
        future._completions = self._completions
        given_out = out
        out = self._engine.outputs.empty(arr.size, arr.dtype) if given_out is None else given_out.reshape(-1)
        item = wire_dt.itemsize
        reducers = chunker.placement(arr.size * item, self.num_reducers, C.MIN_SPAN_BYTES, key_u64)
        largest = self.config.largest_chunk_bytes
        chunk_elements = chunker.full_chunk(arr.size, len(reducers), max(1, largest // item),
                                            C.MIN_FULL_CHUNK_BYTES // item, self._chunks_per_span(op_code))
        ramp_from = max(1, min(C.RAMP_FIRST_CHUNK_BYTES, largest // 8) // item) if ramp else chunk_elements
        ramp_until = max(1, C.DEFAULT_RESULT_PIECE_BYTES // item) if self._cuts_through(op_code) else None
        plan = chunker.plan(arr.size, len(reducers), chunk_elements, ramp_from, reducers, ramp_until)
        if not plan:
            # An empty contribution still makes the round trip, as one empty chunk where every
            # non-empty contribution under this key has a chunk 0 (chunker.placement): a rank
            # that passes nothing against one that passes data is then a mismatch on every rank
            # (R23), never a success on one and a timeout on the other.
            plan = [chunker.Chunk(reducers[0], 0, 0, 0)]
        now = time.monotonic()
        timeout = self.config.op_timeout if timeout is None else timeout
        op = Op(key_u64, key, out, wire_dt, mean, {(c.reducer, c.index): c for c in plan}, future, now + timeout, now,
                 shape, given_out, in_place=given_out is not None and np.shares_memory(out, arr))
        sends_payload = op_code is not wire.ReduceOp.BROADCAST or self.rank == root
        # Round-robin across reducers (chunk 0 of every reducer, then chunk 1, ...): with the push
        # window this keeps every reducer's flows in step (see DEFAULT_PUSH_WINDOW_CHUNKS).
        pushes = [PendingPush(op, c, arr, wire_dt, wire_code, op_code, root, sends_payload)
                  for c in sorted(plan, key=lambda c: (c.index, c.reducer))]
        engine = self._engine
        with engine.lock:
            actions = self._machine.submit(op, pushes)
        # The calling thread writes what the sockets take at once (a small operation then leaves
        # without waking a loop); the loops write the rest as the sockets drain.
        engine.run(actions)
        return future

    def _chunks_per_span(self, op_code: wire.ReduceOp) -> int:
        """Full chunks per reducer span: the configured number, else 32 where the reducers send
        results in whole chunks (their tail is one full chunk) and 1 (chunks of
        ``Config.largest_chunk_bytes``) where they cut through, so that an operation of a few MiB
        is not cut into chunks whose per-chunk work costs more than the tail it no longer has
        (constants.CHUNKS_PER_SPAN).

        Decided from what every worker of a job shares (its straggler mode, the operation), never
        from a reducer setting: every worker must cut a buffer the same way. Reducers run with
        pieces off (``result_piece_bytes=0``) then leave a tail of one largest chunk."""
        if self.config.chunks_per_span is not None:
            return self.config.chunks_per_span
        return 1 if self._cuts_through(op_code) else C.CHUNKS_PER_SPAN

    def _cuts_through(self, op_code: wire.ReduceOp) -> bool:
        """Whether the reducers return this operation's sums in pieces as every rank's bytes
        arrive (the default straggler mode, any op but a broadcast). Its chunks' ramp then stops
        below the default piece (constants.DEFAULT_RESULT_PIECE_BYTES, chunker's module
        docstring): a larger chunk starts and ends its results no sooner than a piece does, so
        ramp chunks of a piece or more only add per-chunk work. The default, not a reducer's
        setting, so that every worker cuts a buffer the same way."""
        return self.config.straggler_mode == "all" and op_code is not wire.ReduceOp.BROADCAST

    def _teardown(self) -> None:
        """Stop the loop, the reconnect thread and the completion thread, each within the close timeout."""
        deadline = time.monotonic() + self.config.close_timeout
        self._engine.begin_close(deadline)  # first: the reconnect path and connection failures stand down
        self._engine.close(deadline)
        self._engine.close_reconnector(deadline)
        self._engine.close_selectors()
        self._completions.close(max(0.0, deadline - time.monotonic()))
        if self._timeline is not None:
            try:
                self._timeline.write()
            except OSError as exc:
                log.warning("could not write the timeline to %s: %s", self._timeline.path, exc)



@dataclass(frozen=True)
class ConnectionInfo:
    """One connection to a reducer, as :meth:`Client.connections` sees it."""

    reducer: int
    index: int  # the stream's number among its reducer's
    loop: str  # the name of the I/O loop thread that serves it
    registered: tuple[int, ...]  # the loops whose selectors watch its socket (its own, unless it was dropped)
    sock: socket.socket
    queued: bool  # frames wait in its writer for the socket to drain
    receive_lowat: int  # the reader's low-water mark: above 1 while waiting for the rest of a result
    kept_bytes: int  # whole results kept for recovery until the reducer's SAFE
    recovering: bool  # its reducer was lost and the client is reconnecting to it


def _registered(selector: selectors.BaseSelector, sock: socket.socket) -> bool:
    try:
        return sock in selector.get_map()
    except (KeyError, ValueError, TypeError, RuntimeError):  # a closed selector has no map
        return False


def resolve_config(reducers: Sequence[str] | str | None, rank: int | None, world_size: int | None, job: str | None,
                   config: Config | None, options: dict[str, Any]) -> Config:
    """The settings a client is built with: ``config`` with the arguments given beside it, or
    :meth:`Config.from_env` of the arguments."""
    if config is None:
        config = Config.from_env(reducers=reducers, rank=rank, world_size=world_size, job=job, **options)
    elif reducers is not None or rank is not None or world_size is not None or job is not None or options:
        given = dict(reducers=reducers, rank=rank, world_size=world_size, job=job, **options)
        config = config.replace(**{k: v for k, v in given.items() if v is not None})
    if not config.reducers:
        raise ConfigError("no reducers given: pass reducers=[...], set REDSRV_REDUCERS, or list them in TF_CONFIG's "
                          '"reducer" task list')
    return config


def _checked_out(out: Any, arr: np.ndarray) -> np.ndarray:
    if not isinstance(out, np.ndarray):
        raise LocalProtocolError(f"out must be a NumPy array, got {type(out).__name__}")
    if out.dtype != arr.dtype or out.size != arr.size:
        raise LocalProtocolError(f"out must match the input: {arr.size} elements of {arr.dtype}, got {out.size} of {out.dtype}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise LocalProtocolError("out must be a C-contiguous, writeable array")
    return out


def _as_flat(x: Any) -> np.ndarray:
    arr = np.asarray(x)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr.reshape(-1)


def _canonical(key: Any) -> bytes:
    """Stable bytes for a structured key (no pickle, no hash randomisation)."""
    if isinstance(key, bool):
        return b"b1" if key else b"b0"
    if isinstance(key, int):
        return b"i" + str(key).encode()
    if isinstance(key, str):
        return b"s" + str(len(key)).encode() + b":" + key.encode("utf-8")
    if isinstance(key, bytes):
        return b"y" + str(len(key)).encode() + b":" + key
    if isinstance(key, tuple):
        return b"t(" + b",".join(_canonical(k) for k in key) + b")"
    raise LocalProtocolError(f"operation keys must be ints, strings, bytes or tuples of them, got {type(key).__name__}")
