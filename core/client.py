"""The worker client: the one API every adapter uses.

``Client.allreduce_async`` splits a flat array across the reducers (:mod:`chunker`), queues each
chunk on the least-loaded stream to its reducer, and returns at once. The calling thread writes
what each socket takes at once; one I/O loop per client (``selectors``) writes the rest as the
sockets drain and pulls finished chunks straight into the result array, so both directions of
the link stay busy. Operations are matched by key, never by arrival order; every one has a
deadline, and the loop keeps them all.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import hashlib
import itertools
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import auth, chunker, wire
from . import constants as C
from .config import WIRE_DTYPES, Config
from .errors import (
    AuthenticationError,
    ClientClosedError,
    ContributionMismatchError,
    JobMismatchError,
    LocalProtocolError,
    PeerError,
    PeerLostError,
    PeerTimeoutError,
    RedsrvError,
    ReducerShutdownError,
    RemoteProtocolError,
    StaleContributionError,
)
from .handshake import ClientHandshake, HandshakeFailure, HandshakeState
from .timeline import Timeline
from .transport import (
    SKIP,
    ConnectionBroken,
    FrameReader,
    FrameWriter,
    HeaderStep,
    Waker,
    choose_congestion_control,
    configure_socket,
    peer_name,
    set_send_lowat,
    watch,
)

__all__ = ["Client", "ReduceFuture", "Contributors", "OPS"]

log = logging.getLogger("redsrv.client")

#: The reduction ops by name; "mean" is a sum divided by the number of contributors.
_WIRE_OPS = {"sum": wire.ReduceOp.SUM, "mean": wire.ReduceOp.SUM, "min": wire.ReduceOp.MIN, "max": wire.ReduceOp.MAX,
             "product": wire.ReduceOp.PRODUCT, "band": wire.ReduceOp.BAND, "bor": wire.ReduceOp.BOR,
             "bxor": wire.ReduceOp.BXOR}
OPS = tuple(_WIRE_OPS)
_COMPRESSED = {"bfloat16": wire.numpy_dtype(wire.DType.BFLOAT16), "float16": wire.numpy_dtype(wire.DType.FLOAT16)}
_AUTO_KEY_BIT = 1 << 63
_HEARTBEAT = wire.encode(wire.Heartbeat())
#: Frames read from one stream per wake-up before the loop serves the others.
_FRAMES_PER_TURN = 16


@dataclass(frozen=True)
class Contributors:
    """Who contributed to an operation. In straggler modes chunks may close with different
    sets of ranks; ``min_count`` is the smallest set, ``ranks`` those present in every chunk."""

    min_count: int
    max_count: int
    ranks: tuple[int, ...]


class ReduceFuture(concurrent.futures.Future):  # type: ignore[type-arg]
    """A :class:`concurrent.futures.Future` of the reduced array, plus who contributed."""

    key: Any = None
    contributors: Contributors | None = None


@dataclass
class _Op:
    key: int
    label: Any  # the caller's key, for messages
    out: np.ndarray  # flat result, caller's dtype
    wire_dtype: np.dtype
    mean: bool
    chunks: dict[tuple[int, int], chunker.Chunk]  # (reducer, index) -> chunk, still outstanding
    future: ReduceFuture
    deadline: float
    started: float
    shape: tuple[int, ...] = ()  # the caller's shape, restored on the result
    given_out: np.ndarray | None = None  # the caller's ``out`` array, returned as it was passed
    min_count: int = 1 << 30
    max_count: int = 0
    all_ranks: int = -1  # intersection of contributor bitmaps
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Chunks whose result is arriving in pieces (cut-through), touched on the I/O loop only:
    # (reducer, index) -> elements received so far, and when the first piece arrived.
    received: dict[tuple[int, int], tuple[int, float]] = field(default_factory=dict)
    # What it takes to send each outstanding chunk again after a reconnect (R22).
    pushes: dict[tuple[int, int], _PendingPush] = field(default_factory=dict)
    in_place: bool = False  # results land in the input: keep a chunk's input before its result lands


@dataclass
class _PendingPush:
    """A chunk waiting for room in its reducer's push window."""

    op: _Op
    chunk: chunker.Chunk
    arr: np.ndarray
    wire_dt: np.dtype
    wire_code: wire.DType
    op_code: wire.ReduceOp
    root: int
    sends_payload: bool
    # The chunk's input, copied before an in-place result overwrote it, for a resend (R22).
    saved: np.ndarray | None = None


class _Stream:
    """One connection to one reducer: its reader and writer (both driven by the client's I/O
    loop; callers' threads may write too, under the client's I/O lock) and the result frame being
    received."""

    def __init__(self, client: Client, reducer: int, index: int, sock: socket.socket, incarnation: int,
                 heartbeat: float, now: float) -> None:
        self.client = client
        self.reducer = reducer
        self.index = index
        self.sock = sock
        self.peer = peer_name(sock)
        self.incarnation = incarnation
        self.heartbeat = heartbeat
        self.queued = 0  # chunks handed to the writer and not yet written (the push window)
        self.scratch = np.empty(0, dtype=np.uint8)  # for widening compressed results
        self.push_scratch = np.empty(0, dtype=np.uint8)
        self.reader = FrameReader(sock, max_payload=client.config.max_frame_payload, now=now,
                                  data_frame=wire.FrameType.RESULT, sender="a reducer",
                                  on_header=functools.partial(client._on_result_header, self),
                                  on_payload=functools.partial(client._on_payload, self),
                                  on_error=functools.partial(client._on_error, self),
                                  on_count=functools.partial(client._on_count, self))
        self.writer = FrameWriter(sock, now)
        self.events = 0  # what the loop's selector watches
        self.want_write = False  # the writer holds frames the socket did not take (guarded by the I/O lock)
        self.dead = False
        self.frames_received = 0  # RESULT frames read (or skipped) whole: what ACK frames report
        self.frames_acked = 0
        # Copies of whole results, kept until the reducer says every rank has them (wire.Safe),
        # to give a restarted reducer the results it lost (R22): (key, chunk index) -> copy.
        self.copies: dict[tuple[int, int], _Copy] = {}
        self.partial_copies: dict[tuple[int, int], _Copy] = {}
        # The result frame being received (see Client._on_result_header).
        self.result: _Incoming | None = None
        self.bitmap = bytearray(0)

    def take_scratch(self, nbytes: int, push: bool = False) -> np.ndarray:
        name = "push_scratch" if push else "scratch"
        buf = getattr(self, name)
        if buf.nbytes < nbytes:
            buf = np.empty(nbytes, dtype=np.uint8)
            setattr(self, name, buf)
        view: np.ndarray = buf[:nbytes]
        return view


@dataclass
class _Copy:
    """A chunk's result as it came off the wire (wire dtype, before any mean is taken), with what
    it takes to push it as ReduceOp.SETTLED."""

    key: int
    total: int
    offset: int
    index: int
    dtype: wire.DType
    data: np.ndarray
    frame: int = 0  # the stream's RESULT frame count once the chunk was whole


@dataclass
class _Incoming:
    """A result frame whose header is in and whose payload is being received."""

    op: _Op
    chunk: chunker.Chunk
    start: int  # the elements this frame carries: all of the chunk or its next piece
    stop: int
    contributors: int
    bitmap_len: int
    data_len: int
    arrived: float  # when the chunk's first piece arrived
    in_bitmap: bool


class Client:
    """A worker's connection to the reducer fleet.

    >>> with Client(["10.0.0.5:29600", "10.0.0.6:29600"], rank=0, world_size=4, job="run-17") as c:  # doctest: +SKIP
    ...     total = c.allreduce(grads)
    ...     mean = c.allreduce(grads, op="mean")

    Settings not given here come from ``REDSRV_*`` variables (see :class:`Config`). The client
    is thread-safe; many operations may be in flight, each under its own key.
    """

    def __init__(self, reducers: Sequence[str] | str | None = None, *, rank: int | None = None,
                 world_size: int | None = None, job: str | None = None, config: Config | None = None,
                 **options: Any) -> None:
        if config is None:
            config = Config.from_env(reducers=reducers, rank=rank, world_size=world_size, job=job, **options)
        elif reducers is not None or rank is not None or world_size is not None or job is not None or options:
            given = dict(reducers=reducers, rank=rank, world_size=world_size, job=job, **options)
            config = config.replace(**{k: v for k, v in given.items() if v is not None})
        if not config.reducers:
            raise LocalProtocolError("no reducers given: pass reducers=[...] or set REDSRV_REDUCERS")
        self.config = config
        self.session = int.from_bytes(os.urandom(8), "little")
        self._lock = threading.Lock()
        self._ops: dict[int, _Op] = {}
        # Chunks not yet handed to a stream, in sending order (see _dispatch). Re-entrant: a
        # failed stream completes a chunk (and its callback takes this lock) inside send().
        self._pending: collections.deque[_PendingPush] = collections.deque()
        self._dispatch_lock = threading.RLock()
        self._dispatching = False  # guarded by _dispatch_lock
        self._auto_keys = itertools.count()
        self._broken: BaseException | None = None
        self._closed = False
        self._streams: list[list[_Stream]] = []
        self._incarnations: list[int] = []
        # Transparent recovery (R22), guarded by _dispatch_lock: reducer -> when its reconnect
        # window closes; the thread that reconnects; streams it made, for the loop to install.
        self._recovering: dict[int, float] = {}
        self._reconnector: threading.Thread | None = None
        self._reconnected: collections.deque[tuple[int, list[_Stream]]] = collections.deque()
        # Keep each result until every rank has it, for a reducer that restarts before they do.
        self._keep_copies = config.reconnect_window > 0 and config.mode is wire.StragglerMode.ALL
        self._stop = threading.Event()
        self.bytes_pushed = 0
        self.bytes_pulled = 0
        self.ops_completed = 0
        self.ops_failed: dict[str, int] = {}  # by error type, for metrics
        self._timeline = Timeline(config.timeline, rank=config.rank, job=config.job) if config.timeline else None
        self._pushed_at: dict[tuple[int, int, int], float] = {}  # (key, reducer, chunk) -> push end, for the timeline
        self._congestion_warned = False
        # One I/O loop serves every stream: reads results, writes what callers' threads could not
        # write at once, sends heartbeats and keeps every deadline.
        self._io_lock = threading.Lock()  # the streams' writers; taken after _dispatch_lock, never before
        self._selector = selectors.DefaultSelector()
        self._waker = Waker()
        self._selector.register(self._waker.read_end, selectors.EVENT_READ, None)
        self._wants_write: list[_Stream] = []  # streams whose writer a caller's thread left with frames
        self._now = time.monotonic()
        self._loop: threading.Thread | None = None
        self._teardown_on_loop = False
        try:
            self._connect_all()
        except BaseException:
            self._teardown()
            raise
        self._loop = threading.Thread(target=self._io_loop, name="redsrv-io", daemon=True)
        self._loop.start()

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
        Its contents are undefined if the operation fails.
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
                                   key=_label(future.key), phase="wait for result", timeout=bound) from None
        return result

    def check(self) -> None:
        """Raise the error that broke this client, if any."""
        if self._closed:
            raise ClientClosedError(f"client for job {self.config.job!r} rank {self.rank} is closed")
        if self._broken is not None:
            raise self._broken

    def close(self) -> None:
        """Idempotent and bounded by ``close_timeout``. Pending operations fail with
        :class:`ClientClosedError`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ops = list(self._ops.values())
            self._ops.clear()
        error = ClientClosedError(f"client for job {self.config.job!r} rank {self.rank} was closed with the operation pending")
        for op in ops:
            _set_exception(op.future, error)
        self._teardown()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
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
                root: int, mean: bool, timeout: float | None, out: np.ndarray | None = None) -> ReduceFuture:
        self.check()
        wire_code = wire.dtype_code(wire_dt)
        wire.dtype_code(arr.dtype)  # the caller's dtype must be supported too
        key_u64 = self._key(key)
        future = ReduceFuture()
        future.key = key
        given_out = out
        out = np.empty(arr.size, dtype=arr.dtype) if given_out is None else given_out.reshape(-1)
        item = wire_dt.itemsize
        reducers = chunker.placement(arr.size * item, self.num_reducers, C.MIN_SPAN_BYTES, key_u64)
        chunk_elements = chunker.full_chunk(arr.size, len(reducers), max(1, self.config.chunk_bytes // item),
                                            C.MIN_FULL_CHUNK_BYTES // item, self.config.chunks_per_span)
        ramp_from = max(1, min(C.RAMP_FIRST_CHUNK_BYTES, self.config.chunk_bytes // 8) // item)
        plan = chunker.plan(arr.size, len(reducers), chunk_elements, ramp_from, reducers)
        if not plan:
            # An empty contribution still makes the round trip, as one empty chunk where every
            # non-empty contribution under this key has a chunk 0 (chunker.placement): a rank
            # that passes nothing against one that passes data is then a mismatch on every rank
            # (R23), never a success on one and a timeout on the other.
            plan = [chunker.Chunk(reducers[0], 0, 0, 0)]
        now = time.monotonic()
        timeout = self.config.op_timeout if timeout is None else timeout
        op = _Op(key_u64, key, out, wire_dt, mean, {(c.reducer, c.index): c for c in plan}, future, now + timeout, now,
                 shape, given_out, in_place=given_out is not None and np.shares_memory(out, arr))
        with self._lock:
            if self._closed:
                raise ClientClosedError(f"client for job {self.config.job!r} rank {self.rank} is closed")
            if key_u64 in self._ops:
                raise LocalProtocolError(f"operation key {key!r} is already in flight on this client")
            self._ops[key_u64] = op
        sends_payload = op_code is not wire.ReduceOp.BROADCAST or self.rank == root
        # Round-robin across reducers (chunk 0 of every reducer, then chunk 1, ...): with the push
        # window this keeps every reducer's flows in step (see DEFAULT_PUSH_WINDOW_CHUNKS).
        pushes = [_PendingPush(op, c, arr, wire_dt, wire_code, op_code, root, sends_payload)
                  for c in sorted(plan, key=lambda c: (c.index, c.reducer))]
        op.pushes = {(p.chunk.reducer, p.chunk.index): p for p in pushes}
        with self._dispatch_lock:
            self._pending.extend(pushes)
            self._dispatch()
        return future

    def _dispatch(self) -> None:
        """Hand queued chunks, in order, to streams with room in their push window. Called after
        a submission and whenever a stream finished writing a chunk."""
        window = self.config.push_window_chunks
        with self._dispatch_lock:
            if self._dispatching:
                return  # a chunk written inline by the loop below: the loop goes on by itself
            self._dispatching = True
            try:
                pending = self._pending
                while pending:
                    push = pending[0]
                    if push.op.future.done():  # failed or timed out meanwhile: its chunks stay home
                        pending.popleft()
                        continue
                    if push.chunk.reducer in self._recovering:
                        return  # in order: everything waits until that reducer is back
                    stream = min(self._streams[push.chunk.reducer], key=lambda s: s.queued)
                    if window and stream.queued >= window:
                        return  # in order: a chunk for another reducer must not overtake this one
                    pending.popleft()
                    stream.queued += 1
                    self._send_push(stream, push)
            finally:
                self._dispatching = False

    def _send_push(self, stream: _Stream, p: _PendingPush) -> None:
        c, wire_dt = p.chunk, p.wire_dt
        if p.saved is not None:  # the input was overwritten by part of its result: send the copy
            arr, c = p.saved, chunker.Chunk(c.reducer, c.index, 0, c.count)
        else:
            arr = p.arr
        nbytes = c.count * wire_dt.itemsize if p.sends_payload else 0
        header = wire.push_header(wire.Push(p.op.key, stream.incarnation, p.arr.size, p.chunk.start, c.count, c.index,
                                            p.wire_code, p.op_code, p.root), nbytes)
        payload: Any
        if not p.sends_payload:
            payload = None
        elif wire_dt == arr.dtype:
            payload = arr.view(np.uint8)[c.start * arr.itemsize : c.stop * arr.itemsize].data
        else:
            payload = _Converter(arr, c.start, c.stop, wire_dt, stream)
        timed_done = None
        if self._timeline is not None:
            payload, timed_done = self._timed_push(payload, p.op, c, stream)

        def written(ok: bool) -> None:
            with self._dispatch_lock:
                stream.queued -= 1
            if timed_done is not None:
                timed_done(ok)
            if ok:
                self._dispatch()

        views: Any
        if payload is None:
            views = [memoryview(header)]
        elif callable(payload):
            views = _Frame(header, payload)
        else:
            views = [memoryview(header), payload]
        # The calling thread writes what the socket takes at once (a small operation then leaves
        # without waking the loop); the loop writes the rest as the socket drains.
        self._send_frame(stream, views, written)
        self.bytes_pushed += nbytes

    # --- receiving ---

    def _timed_push(self, payload: Any, op: _Op, c: chunker.Chunk, stream: _Stream) -> tuple[Any, Any]:
        timeline = self._timeline
        assert timeline is not None
        box: list[float] = []

        def produce() -> Any:
            box.append(timeline.now())
            return payload() if callable(payload) else payload

        def done(ok: bool) -> None:
            end = timeline.now()
            self._pushed_at[(op.key, c.reducer, c.index)] = end
            if box:
                timeline.span(f"push {_label(op.label)}", f"reducer {c.reducer} stream {stream.index}", box[0], end,
                              chunk=c.index, elements=c.count, ok=ok)

        return (produce if payload is not None else None), done

    def _on_error(self, stream: _Stream, frame: wire.Error) -> None:
        self._on_error_frame(stream, frame)
        if frame.fatal:
            stream.reader.stopped = True  # the reducer closes the connection after a fatal error

    def _on_result_header(self, stream: _Stream, header: wire.FrameHeader) -> HeaderStep:
        """A result header is in (on the I/O loop): where its bitmap and data go."""
        arrived = time.monotonic()
        key, offset, count, chunk_index, raw_dtype, contributors, bitmap_len = header.fields
        with self._lock:
            op = self._ops.get(key)
        chunk = op.chunks.get((stream.reducer, chunk_index)) if op is not None else None
        if op is None or chunk is None:
            stream.frames_received += 1
            return SKIP  # an operation that already failed or timed out
        # A chunk's result comes whole or in pieces that tile it in order.
        done, first_arrived = op.received.get((stream.reducer, chunk_index), (0, arrived))
        if (offset != chunk.start + done or not (0 < count <= chunk.count - done or count == chunk.count == 0)
                or wire.numpy_dtype(wire.DType(raw_dtype)) != op.wire_dtype):
            self._fail_op(op, RemoteProtocolError(
                f"reducer {stream.peer} answered with {count} elements at offset {offset}, expected at most "
                f"{chunk.count - done} at {chunk.start + done}", peer=stream.peer, job=self.config.job, rank=self.rank,
                key=_label(op.label), chunk=chunk_index))
            stream.frames_received += 1
            return SKIP
        if not done and op.in_place and self.config.reconnect_window > 0:
            push = op.pushes.get((stream.reducer, chunk_index))
            if push is not None and push.saved is None:  # keep the input this result overwrites (R22)
                push.saved = push.arr[chunk.start : chunk.stop].copy()
        incoming = stream.result = _Incoming(op, chunk, offset, offset + count, contributors, bitmap_len,
                                             header.payload_len - bitmap_len, first_arrived, in_bitmap=bitmap_len > 0)
        if incoming.in_bitmap:
            if len(stream.bitmap) < bitmap_len:
                stream.bitmap = bytearray(bitmap_len)
            return memoryview(stream.bitmap)[:bitmap_len], "a result bitmap"
        return self._result_target(stream, incoming)

    def _result_target(self, stream: _Stream, incoming: _Incoming) -> tuple[memoryview, str]:
        op, chunk = incoming.op, incoming.chunk
        what = f"result (key {op.label!r} chunk {chunk.index})"
        if op.wire_dtype == op.out.dtype:
            return op.out[incoming.start : incoming.stop].view(np.uint8).data, what
        return stream.take_scratch(incoming.data_len).data, what

    def _on_payload(self, stream: _Stream) -> tuple[memoryview, str] | None:
        incoming = stream.result
        assert incoming is not None
        if incoming.in_bitmap:
            incoming.in_bitmap = False
            return self._result_target(stream, incoming)
        stream.result = None
        stream.frames_received += 1
        self._finish_result(stream, incoming)
        if incoming.stop < incoming.chunk.stop:  # more pieces of this chunk: one wake-up for all of them
            stream.reader.expect_at_least((incoming.chunk.stop - incoming.stop) * incoming.op.wire_dtype.itemsize)
        return None

    def _finish_result(self, stream: _Stream, incoming: _Incoming) -> None:
        op, chunk, contributors, chunk_index = incoming.op, incoming.chunk, incoming.contributors, incoming.chunk.index
        target = op.out[incoming.start : incoming.stop]
        if op.wire_dtype != op.out.dtype:
            np.copyto(target, stream.take_scratch(incoming.data_len).view(op.wire_dtype), casting="unsafe")
        if self._keep_copies:
            self._copy_piece(stream, incoming, target)
        if op.mean and contributors > 1:
            np.divide(target, contributors, out=target, casting="unsafe")
        self.bytes_pulled += incoming.data_len
        place = (stream.reducer, chunk_index)
        whole = incoming.stop == chunk.stop
        if whole:
            op.received.pop(place, None)
            kept = stream.partial_copies.pop((op.key, chunk_index), None)
            if kept is not None:
                kept.frame = stream.frames_received
                stream.copies[(op.key, chunk_index)] = kept
        else:  # more pieces of this chunk to come
            op.received[place] = (incoming.stop - chunk.start, incoming.arrived)
        if whole and self._timeline is not None:
            track = f"reducer {stream.reducer} stream {stream.index}"
            pushed = self._pushed_at.pop((op.key, stream.reducer, chunk_index), None)
            if pushed is not None and pushed < incoming.arrived:
                self._timeline.span(f"wait {_label(op.label)}", track, pushed, incoming.arrived, chunk=chunk_index)
            self._timeline.span(f"pull {_label(op.label)}", track, incoming.arrived, time.monotonic(), chunk=chunk_index,
                                contributors=contributors)
        ranks = int.from_bytes(stream.bitmap[: incoming.bitmap_len], "little")
        with op.lock:
            op.min_count = min(op.min_count, contributors)
            op.max_count = max(op.max_count, contributors)
            op.all_ranks &= ranks
            if not whole or op.chunks.pop(place, None) is None:
                return
            op.pushes.pop(place, None)
            done = not op.chunks
        if done:
            with self._lock:
                owned = self._ops.get(op.key) is op
                if owned:
                    del self._ops[op.key]
            if not owned:
                return  # failed or timed out meanwhile; the future already holds that error
            if self._timeline is not None:
                self._timeline.span(f"allreduce {_label(op.label)}", "operations", op.started, time.monotonic(),
                                    bytes=op.out.nbytes, contributors=op.min_count)
            self.ops_completed += 1
            op.future.contributors = Contributors(
                op.min_count, op.max_count, tuple(r for r in range(self.world_size) if op.all_ranks >> r & 1))
            if op.future.set_running_or_notify_cancel():
                op.future.set_result(op.out.reshape(op.shape) if op.given_out is None else op.given_out)

    def _copy_piece(self, stream: _Stream, incoming: _Incoming, target: np.ndarray) -> None:
        """Keep this piece of a result as it came off the wire (before a mean is taken)."""
        op, chunk = incoming.op, incoming.chunk
        place = (op.key, chunk.index)
        kept = stream.partial_copies.get(place)
        if kept is None:
            kept = stream.partial_copies[place] = _Copy(op.key, op.out.size, chunk.start, chunk.index,
                                                        wire.dtype_code(op.wire_dtype), np.empty(chunk.count, op.wire_dtype))
        piece = kept.data[incoming.start - chunk.start : incoming.stop - chunk.start]
        if op.wire_dtype != op.out.dtype:
            np.copyto(piece, stream.take_scratch(incoming.data_len).view(op.wire_dtype))
        else:
            np.copyto(piece, target)

    def _on_count(self, stream: _Stream, frame_type: wire.FrameType, frames: int) -> None:
        """A SAFE from the reducer: every rank has the results up to ``frames``; drop their copies."""
        if frame_type is not wire.FrameType.SAFE:
            raise ConnectionBroken("protocol", f"unexpected {frame_type.name} frame from a reducer")
        for place in [place for place, kept in stream.copies.items() if kept.frame <= frames]:
            del stream.copies[place]

    def _on_error_frame(self, stream: _Stream, frame: wire.Error) -> None:
        if frame.code is wire.ErrorCode.SHUTDOWN and self.config.reconnect_window > 0:
            # The reducer is stopping (a restart, a rolling update): what it failed is resent to
            # it, or to its successor on the same address, once we are back (R22).
            if frame.fatal:
                self._lose_reducer(stream.reducer, f"reducer {stream.peer} is shutting down: {frame.message}")
            return
        exc = self._error_from_frame(stream, frame)
        if frame.fatal:
            self._break(exc)
            return
        with self._lock:
            op = self._ops.get(frame.key)
        if op is not None:
            self._fail_op(op, exc)
        else:
            # Usually the other chunks of an operation that already failed: one error is enough.
            log.debug("reducer %s reported an error for no pending operation: %s", stream.peer, frame.message)

    def _error_from_frame(self, stream: _Stream, frame: wire.Error) -> RedsrvError:
        with self._lock:
            op = self._ops.get(frame.key)
        ctx: dict[str, Any] = dict(peer=stream.peer, job=self.config.job, rank=self.rank,
                   key=None if op is None else _label(op.label),
                   chunk=None if frame.chunk == 0xFFFFFFFF else frame.chunk)
        elapsed = None if op is None else time.monotonic() - op.started
        code = frame.code
        text = f"reducer {stream.peer}: {frame.message}"
        if code is wire.ErrorCode.TIMEOUT:
            return PeerTimeoutError(text, phase="wait for contributions", elapsed=elapsed, timeout=self.config.op_timeout, **ctx)
        if code is wire.ErrorCode.PEER_LOST:
            return PeerLostError(text, phase="wait for contributions", elapsed=elapsed, **ctx)
        if code is wire.ErrorCode.SHUTDOWN:
            return ReducerShutdownError(text, elapsed=elapsed, **ctx)
        if code in (wire.ErrorCode.CONTRIBUTION_MISMATCH, wire.ErrorCode.DUPLICATE):
            return ContributionMismatchError(text, **ctx)
        if code is wire.ErrorCode.STALE:
            return StaleContributionError(text, **ctx)
        if code is wire.ErrorCode.JOB_MISMATCH:
            return JobMismatchError(text, **ctx)
        if code is wire.ErrorCode.AUTHENTICATION:
            return AuthenticationError(f"authentication with reducer {stream.peer} failed", **ctx)
        if code is wire.ErrorCode.PROTOCOL:
            return RemoteProtocolError(f"{text} (the reducer rejected our frame: version mismatch?)", **ctx)
        return PeerError(text, elapsed=elapsed, **ctx)

    def _fail_connection(self, stream: _Stream, exc: ConnectionBroken, direction: str) -> None:
        if self._closed or self._stop.is_set():
            return
        ctx: dict[str, Any] = dict(peer=stream.peer, job=self.config.job, rank=self.rank, phase=direction)
        error: RedsrvError
        if exc.kind == "timeout":
            bound = self.config.heartbeat_timeout if direction == "pull" else self.config.op_timeout
            error = PeerTimeoutError(f"reducer {stream.peer} is unresponsive: {exc.detail}", timeout=bound, **ctx)
        elif exc.kind == "protocol":
            error = RemoteProtocolError(f"reducer {stream.peer} sent an invalid frame: {exc.detail}", **ctx)
        else:
            error = PeerLostError(f"lost reducer {stream.peer}: {exc.detail}", **ctx)
        if self.config.reconnect_window > 0 and exc.kind not in ("protocol", "internal"):  # a bug is not a lost reducer
            self._lose_reducer(stream.reducer, str(error))
            return
        self._break(error)

    # --- transparent recovery (RELIABILITY R22) ---

    def _lose_reducer(self, reducer: int, why: str) -> None:
        """A connection to ``reducer`` broke: close its streams and reconnect within the reconnect
        window, then resend every chunk it has not answered. Any thread."""
        with self._dispatch_lock:
            if reducer in self._recovering or self._stop.is_set() or self._broken is not None:
                return
            self._recovering[reducer] = time.monotonic() + self.config.reconnect_window
            if self._reconnector is None:
                self._reconnector = threading.Thread(target=self._reconnect_loop, name="redsrv-reconnect", daemon=True)
                self._reconnector.start()
        log.warning("rank %d: %s; reconnecting (for up to %.0fs)", self.rank, why, self.config.reconnect_window)
        for stream in self._streams[reducer]:
            _shutdown(stream.sock)  # the loop sees it end and stops serving it

    def _reconnect_loop(self) -> None:
        """The reconnect thread: runs only while some reducer is lost."""
        cfg = self.config
        backoff = C.CONNECT_BACKOFF_INITIAL_S
        while not self._stop.is_set():
            with self._dispatch_lock:
                lost = {r: d for r, d in self._recovering.items() if all(r != done for done, _ in self._reconnected)}
                if not self._recovering:
                    self._reconnector = None
                    return
            for reducer, deadline in lost.items():
                address = cfg.reducers[reducer]
                now = time.monotonic()
                if now >= deadline:
                    self._break(PeerLostError(f"lost reducer {address} and could not reconnect within the reconnect "
                                              f"window of {cfg.reconnect_window:.1f}s", peer=address, job=cfg.job,
                                              rank=cfg.rank, phase="reconnect", timeout=cfg.reconnect_window))
                    with self._dispatch_lock:
                        self._reconnector = None
                    return
                host, port = cfg.addresses()[reducer]
                streams: list[_Stream] = []
                try:
                    attempt_deadline = min(deadline, now + cfg.connect_timeout)
                    for index in range(cfg.streams_per_reducer):
                        streams.append(self._connect_one(reducer, index, host, port, attempt_deadline, register=False))
                    if len({st.incarnation for st in streams}) != 1:
                        raise PeerLostError(f"reducer {address} restarted while we reconnected", peer=address)
                except (AuthenticationError, JobMismatchError) as exc:
                    self._close_streams(streams)
                    self._break(exc)  # reconnecting cannot fix these
                    with self._dispatch_lock:
                        self._reconnector = None
                    return
                except RedsrvError as exc:
                    self._close_streams(streams)
                    log.info("rank %d: reconnecting to %s: %s", cfg.rank, address, exc)
                    continue
                with self._dispatch_lock:
                    if self._stop.is_set():
                        self._close_streams(streams)
                        return
                    self._reconnected.append((reducer, streams))
                self._waker.wake()
                backoff = C.CONNECT_BACKOFF_INITIAL_S
            self._stop.wait(backoff)
            backoff = min(backoff * 2, C.CONNECT_BACKOFF_MAX_S)

    @staticmethod
    def _close_streams(streams: list[_Stream]) -> None:
        for stream in streams:
            _shutdown(stream.sock)
            stream.sock.close()

    def _install_reconnected(self) -> None:
        """On the loop: serve the streams the reconnect thread made, and resend, in their
        original order and ahead of newer work, the chunks of the reducer that are unanswered."""
        while True:
            with self._dispatch_lock:
                if not self._reconnected:
                    return
                reducer, streams = self._reconnected.popleft()
                old = self._streams[reducer]
                self._streams[reducer] = streams
            for stream in old:
                self._abandon(stream)
                try:
                    stream.sock.close()
                except OSError:
                    pass
            for stream in streams:
                self._set_events(stream, selectors.EVENT_READ)
            restarted = streams[0].incarnation != self._incarnations[reducer]
            self._incarnations[reducer] = streams[0].incarnation
            copies = [kept for stream in old for kept in stream.copies.values()]
            for stream in old:
                stream.copies.clear()
                stream.partial_copies.clear()
            if restarted:  # it lost what it had: give it the results some ranks may still lack
                for i, kept in enumerate(copies):
                    target = streams[i % len(streams)]
                    header = wire.push_header(wire.Push(kept.key, target.incarnation, kept.total, kept.offset,
                                                        kept.data.size, kept.index, kept.dtype, wire.ReduceOp.SETTLED),
                                              kept.data.nbytes)
                    self._send_frame(target, [memoryview(header), kept.data.view(np.uint8).data], None)
            with self._lock:
                ops = list(self._ops.values())
            with self._dispatch_lock:
                queued = {(id(p.op), p.chunk.reducer, p.chunk.index) for p in self._pending}
                resend: list[_PendingPush] = []
                for op in ops:
                    with op.lock:
                        places = [place for place in op.chunks if place[0] == reducer]
                    for place in places:
                        op.received.pop(place, None)  # its result comes again from the chunk's start
                        push = op.pushes.get(place)
                        if push is not None and (id(op), *place) not in queued:
                            resend.append(push)
                resend.sort(key=lambda p: (p.op.started, p.chunk.index))
                self._pending.extendleft(reversed(resend))
                del self._recovering[reducer]
            log.warning("rank %d: reconnected to reducer %s (%s); resending %d chunk(s)%s", self.rank,
                        self.config.reducers[reducer], "restarted" if restarted else "same incarnation", len(resend),
                        f" and {len(copies)} result(s) it may have lost" if restarted else "")
            self._dispatch()

    def _break(self, error: BaseException) -> None:
        """A connection failed: the client is broken. Fail everything, close every stream."""
        with self._lock:
            if self._broken is None:
                self._broken = error
            ops = list(self._ops.values())
            self._ops.clear()
            if ops:
                self.ops_failed[type(error).__name__] = self.ops_failed.get(type(error).__name__, 0) + len(ops)
        for op in ops:
            _set_exception(op.future, error)
        with self._dispatch_lock:
            self._pending.clear()
        for streams in self._streams:
            for s in streams:
                _shutdown(s.sock)

    def _fail_op(self, op: _Op, error: BaseException) -> None:
        with self._lock:
            if self._ops.get(op.key) is not op:
                return
            del self._ops[op.key]
            self.ops_failed[type(error).__name__] = self.ops_failed.get(type(error).__name__, 0) + 1
        _set_exception(op.future, error)

    def _check_deadlines(self, now: float) -> None:
        with self._lock:
            expired = [op for op in self._ops.values() if now > op.deadline]
        for op in expired:
            with op.lock:
                missing = sorted(op.chunks)
            reducers = sorted({r for r, _ in missing})
            where = ", ".join(f"{self.config.reducers[r]} ({sum(1 for x, _ in missing if x == r)} chunk(s))" for r in reducers)
            self._fail_op(op, PeerTimeoutError(
                f"all-reduce did not complete: still waiting for {where}",
                peer=self.config.reducers[reducers[0]] if reducers else None, job=self.config.job, rank=self.rank,
                key=_label(op.label), chunk=missing[0][1] if missing else None, phase="wait for result",
                elapsed=now - op.started, timeout=op.deadline - op.started))

    # --- the I/O loop ---

    def _io_loop(self) -> None:
        selector = self._selector
        next_tick = time.monotonic() + C.TICK_INTERVAL_S
        try:
            while not self._stop.is_set():
                events = selector.select(max(0.0, next_tick - time.monotonic()))
                self._now = time.monotonic()
                for key, mask in events:
                    stream = key.data
                    if stream is None:
                        self._waker.drain()
                    else:
                        self._serve(stream, mask)
                if self._wants_write:
                    self._watch_writes()
                if self._reconnected:
                    self._install_reconnected()
                if self._now >= next_tick:
                    next_tick = self._now + C.TICK_INTERVAL_S
                    self._tick()
        except Exception as exc:  # never let a bug leave a future unresolved
            log.exception("the I/O loop of rank %d failed", self.rank)
            self._break(PeerError(f"internal error in the client's I/O loop: {exc!r}", job=self.config.job, rank=self.rank))
        finally:
            for streams in self._streams:
                for stream in streams:
                    self._abandon(stream)
            if self._teardown_on_loop:  # close() ran on this thread: the selector was left to us
                self._close_selector()

    def _serve(self, stream: _Stream, mask: int) -> None:
        direction = "push"
        try:
            if mask & selectors.EVENT_WRITE:
                self._flush(stream)
            direction = "pull"
            if mask & selectors.EVENT_READ and not stream.dead:
                stream.reader.read(self._now, _FRAMES_PER_TURN)
        except ConnectionBroken as exc:
            self._stream_broken(stream, exc, direction)
        except Exception as exc:  # a bug while serving one stream must still fail its operations
            log.exception("serving reducer %s failed", stream.peer)
            self._stream_broken(stream, ConnectionBroken("internal", f"internal error: {exc!r}"), direction)

    def _tick(self) -> None:
        """Deadlines: operations, reducers that went silent or stopped reading, heartbeats."""
        now = self._now
        self._check_deadlines(now)
        silent_for = self.config.heartbeat_timeout
        for streams in self._streams:
            for stream in streams:
                if stream.dead:
                    continue
                writer, reader = stream.writer, stream.reader
                try:
                    if writer.out and now - writer.last_progress > self.config.op_timeout:
                        stalled = ConnectionBroken("timeout", f"{stream.peer} stopped reading: send timed out")
                        self._stream_broken(stream, stalled, "push")
                        continue
                    if reader.lowat > 1:  # waiting for the rest of a chunk: an ERROR that came instead wakes nobody
                        reader.read(now, _FRAMES_PER_TURN)
                    if now - reader.last_recv > silent_for:
                        reader.read(now, _FRAMES_PER_TURN)  # a low-water mark may hide bytes that did arrive
                        if now - reader.last_recv > silent_for:
                            raise ConnectionBroken("timeout", f"no data from {stream.peer} while reading {reader.what}")
                except ConnectionBroken as exc:
                    self._stream_broken(stream, exc, "pull")
                    continue
                if stream.partial_copies:  # pieces of results whose operation failed meanwhile
                    with self._lock:
                        gone = [place for place in stream.partial_copies if place[0] not in self._ops]
                    for place in gone:
                        del stream.partial_copies[place]
                if stream.frames_received != stream.frames_acked and self.config.reconnect_window > 0:
                    # The reducer keeps each result until it hears we have it (R22).
                    stream.frames_acked = stream.frames_received
                    self._send_frame(stream, [memoryview(wire.encode(wire.Ack(stream.frames_acked)))], None)
                elif not writer.out and now - writer.last_send >= stream.heartbeat:
                    self._send_frame(stream, [memoryview(_HEARTBEAT)], None)

    def _send_frame(self, stream: _Stream, views: Any, done: Any) -> None:
        """Write a frame from any thread: now, as far as the socket takes it without blocking,
        the rest from the loop as the socket drains. ``done(ok)`` runs once the frame is out."""
        finished: list[Any] = []
        broken: ConnectionBroken | None = None
        wake = False
        with self._io_lock:
            if stream.dead:
                broken = ConnectionBroken("reset", "stream closed")
            else:
                try:
                    stream.writer.send(views, done, time.monotonic(), finished)
                except ConnectionBroken as exc:
                    broken = exc
                if broken is None and stream.writer.out and not stream.want_write:
                    stream.want_write = True
                    if threading.current_thread() is self._loop:
                        self._set_events(stream, selectors.EVENT_READ | selectors.EVENT_WRITE)
                    else:
                        self._wants_write.append(stream)
                        wake = True
        for callback in finished:
            callback(True)
        if broken is not None:
            if done is not None:
                done(False)
            if not stream.dead:
                self._fail_connection(stream, broken, "push")  # breaks the client; the loop cleans up
        if wake:
            self._waker.wake()

    def _flush(self, stream: _Stream) -> None:
        finished: list[Any] = []
        try:
            with self._io_lock:
                stream.writer.flush(self._now, finished)
        finally:
            for callback in finished:
                callback(True)  # may queue the next chunk: then the socket stays watched for writing
        with self._io_lock:
            if not stream.writer.out and stream.want_write:
                stream.want_write = False
                self._set_events(stream, selectors.EVENT_READ)

    def _watch_writes(self) -> None:
        with self._io_lock:
            streams, self._wants_write = self._wants_write, []
            for stream in streams:
                if stream.want_write and not stream.dead:
                    self._set_events(stream, selectors.EVENT_READ | selectors.EVENT_WRITE)

    def _set_events(self, stream: _Stream, events: int) -> None:
        """On the loop only (the selector is not shared with callers' threads)."""
        if not stream.dead:
            stream.events = watch(self._selector, stream.sock, stream, stream.events, events)

    def _stream_broken(self, stream: _Stream, exc: ConnectionBroken, direction: str) -> None:
        """On the loop: stop serving ``stream`` and fail the client (one broken stream means the
        reducer, or the path to it, is gone)."""
        self._abandon(stream)
        self._fail_connection(stream, exc, direction)

    def _abandon(self, stream: _Stream) -> None:
        with self._io_lock:
            if stream.events:
                try:
                    self._selector.unregister(stream.sock)
                except (KeyError, ValueError, OSError):
                    pass
            stream.events = 0
            stream.dead = True
            stream.reader.stopped = True
            leftovers = stream.writer.abandon()
        for done in leftovers:
            done(False)

    def _close_selector(self) -> None:
        self._selector.close()
        self._waker.close()

    # --- connections ---

    def _connect_all(self) -> None:
        cfg = self.config
        deadline = time.monotonic() + cfg.connect_timeout
        for r, (host, port) in enumerate(cfg.addresses()):
            streams: list[_Stream] = []
            self._streams.append(streams)
            for s in range(cfg.streams_per_reducer):
                streams.append(self._connect_one(r, s, host, port, deadline))
            incarnations = {st.incarnation for st in streams}
            if len(incarnations) != 1:
                raise PeerLostError(f"reducer {cfg.reducers[r]} restarted while connecting", peer=cfg.reducers[r],
                                    job=cfg.job, rank=cfg.rank, phase="connect")
            self._incarnations.append(streams[0].incarnation)

    def _connect_one(self, reducer: int, index: int, host: str, port: int, deadline: float, *,
                     register: bool = True) -> _Stream:
        cfg = self.config
        address = cfg.reducers[reducer]
        backoff = C.CONNECT_BACKOFF_INITIAL_S
        started = time.monotonic()
        while True:
            remaining = deadline - time.monotonic()
            try:
                sock = socket.create_connection((host, port), timeout=max(0.05, remaining))
                break
            except OSError as exc:
                if time.monotonic() + backoff > deadline:
                    raise PeerTimeoutError(f"cannot connect to reducer {address}: {exc.strerror or exc}", peer=address,
                                           job=cfg.job, rank=cfg.rank, phase="connect",
                                           elapsed=time.monotonic() - started, timeout=cfg.connect_timeout) from None
                time.sleep(backoff)
                backoff = min(backoff * 2, C.CONNECT_BACKOFF_MAX_S)
        try:
            configure_socket(sock)
            refused = choose_congestion_control(sock, cfg.tcp_congestion)
            if refused and not self._congestion_warned:
                self._congestion_warned = True  # once per client, not once per stream
                log.warning("rank %d, reducer %s: %s", cfg.rank, address, refused)
            incarnation, heartbeat = self._handshake(sock, address)
            set_send_lowat(sock, cfg.send_lowat_bytes)
            sock.setblocking(False)
            stream = _Stream(self, reducer, index, sock, incarnation, heartbeat, time.monotonic())
            if register:
                self._set_events(stream, selectors.EVENT_READ)  # before the loop starts: no race
            return stream
        except BaseException:
            _shutdown(sock)
            sock.close()
            raise

    def _handshake(self, sock: socket.socket, address: str) -> tuple[int, float]:
        """Drive :class:`ClientHandshake` on a blocking socket within one deadline for the whole
        exchange; returns the reducer's incarnation and the heartbeat interval to use."""
        cfg = self.config
        hello = wire.Hello(cfg.job, cfg.rank, cfg.world_size, self.session, auth.new_nonce(), cfg.mode,
                           cfg.min_contributors, int(cfg.deadline * 1000), int(cfg.op_timeout * 1000),
                           int(cfg.reconnect_window * 1000))
        ctx: dict[str, Any] = dict(peer=address, job=cfg.job, rank=cfg.rank, phase="handshake", timeout=cfg.handshake_timeout)
        handshake = ClientHandshake(hello, secret=cfg.secret)
        deadline = time.monotonic() + cfg.handshake_timeout
        try:
            sock.settimeout(cfg.handshake_timeout)
            sock.sendall(handshake.data_to_send())
            while handshake.state is HandshakeState.RUNNING:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                sock.settimeout(remaining)
                data = sock.recv(handshake.bytes_needed or 1)
                handshake.receive_data(data)
                reply = handshake.data_to_send()
                if reply:
                    sock.sendall(reply)
        except TimeoutError:
            raise PeerTimeoutError(f"handshake with reducer {address} timed out", elapsed=time.monotonic() - deadline
                                   + cfg.handshake_timeout, **ctx) from None
        except OSError as exc:
            raise PeerLostError(f"handshake with reducer {address} failed: {exc}", **ctx) from None
        finally:
            sock.settimeout(None)
        if handshake.state is HandshakeState.FAILED:
            assert handshake.failure is not None
            raise self._handshake_error(handshake.failure, address)
        accepted = handshake.accepted
        assert accepted is not None
        heartbeat = min(cfg.heartbeat_interval, accepted.heartbeat_ms / 1000 or cfg.heartbeat_interval)
        return accepted.incarnation, heartbeat

    def _handshake_error(self, failure: HandshakeFailure, address: str) -> RedsrvError:
        cfg = self.config
        ctx: dict[str, Any] = dict(peer=address, job=cfg.job, rank=self.rank, phase="handshake")
        code = failure.code
        if code is wire.ErrorCode.AUTHENTICATION:
            return AuthenticationError(f"authentication with reducer {address} failed", **ctx)
        if not failure.remote:  # we refused the reducer, or it closed the connection
            if "closed the connection" in failure.message:
                hint = "" if cfg.secret is not None else " (does it require a secret?)"
                return PeerLostError(f"reducer {address} closed the connection during the handshake{hint}", **ctx)
            return RemoteProtocolError(f"reducer {address}: {failure.message}", **ctx)
        if code is wire.ErrorCode.JOB_MISMATCH:
            return JobMismatchError(f"reducer {address}: {failure.message}", **ctx)
        if code is wire.ErrorCode.PROTOCOL:
            return RemoteProtocolError(f"reducer {address} rejected the handshake: {failure.message}", **ctx)
        if code is wire.ErrorCode.SHUTDOWN:
            return ReducerShutdownError(f"reducer {address} is shutting down: {failure.message}", **ctx)
        return PeerError(f"reducer {address} refused the connection: {failure.message}", **ctx)

    def _teardown(self) -> None:
        self._stop.set()
        with self._dispatch_lock:
            self._pending.clear()
        with self._io_lock:
            for streams in self._streams:
                for s in streams:
                    _say_goodbye(s)
        for streams in self._streams:
            for s in streams:
                _shutdown(s.sock)
        deadline = time.monotonic() + self.config.close_timeout
        loop = self._loop
        on_loop = loop is threading.current_thread()
        if loop is not None and not on_loop:
            self._waker.wake()
            loop.join(max(0.0, deadline - time.monotonic()))
        elif loop is None:
            for streams in self._streams:
                for s in streams:
                    self._abandon(s)
        for streams in self._streams:
            for s in streams:
                try:
                    s.sock.close()
                except OSError:
                    pass
        reconnector = self._reconnector
        if reconnector is not None and reconnector is not threading.current_thread():
            reconnector.join(max(0.0, deadline - time.monotonic()))  # it sees _stop within a connect attempt
        with self._dispatch_lock:
            for _reducer, streams in self._reconnected:
                self._close_streams(streams)
            self._reconnected.clear()
        if on_loop:
            self._teardown_on_loop = True  # the loop returns after this turn and closes the selector
        else:
            self._close_selector()
        if getattr(self, "_timeline", None) is not None:
            try:
                self._timeline.write()  # type: ignore[union-attr]
            except OSError as exc:
                log.warning("could not write the timeline to %s: %s", self._timeline.path, exc)  # type: ignore[union-attr]


class _Frame:
    """A push whose payload is produced when the frame is about to be written (on the writing
    thread: a conversion to the wire dtype then overlaps with sending the previous chunk)."""

    __slots__ = ("header", "produce")

    def __init__(self, header: bytes, produce: Any) -> None:
        self.header, self.produce = header, produce

    def __call__(self) -> list[memoryview]:
        return [memoryview(self.header), memoryview(self.produce()).cast("B")]


class _Converter:
    """Converts one chunk to its wire dtype on the writing thread, into that stream's scratch."""

    __slots__ = ("arr", "start", "stop", "dtype", "stream")

    def __init__(self, arr: np.ndarray, start: int, stop: int, dtype: np.dtype, stream: _Stream) -> None:
        self.arr, self.start, self.stop, self.dtype, self.stream = arr, start, stop, dtype, stream

    def __call__(self) -> memoryview:
        count = self.stop - self.start
        buf = self.stream.take_scratch(count * self.dtype.itemsize, push=True).view(self.dtype)
        np.copyto(buf, self.arr[self.start : self.stop], casting="unsafe")
        return buf.view(np.uint8).data



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


def _label(key: Any) -> Any:
    return key if key is not None else "auto"


def _set_exception(future: concurrent.futures.Future, error: BaseException) -> None:  # type: ignore[type-arg]
    try:
        if future.set_running_or_notify_cancel():
            future.set_exception(error)
    except (concurrent.futures.InvalidStateError, RuntimeError):
        pass


_GOODBYE = wire.encode(wire.Error(wire.ErrorCode.CLOSED, True, "the client was closed"))


def _say_goodbye(stream: _Stream) -> None:
    """Tell the reducer this client is closing, so that it keeps no place for a reconnect (a new
    client for the rank would otherwise look like a restarted worker and void what the job's
    other new clients already sent). Best effort, without blocking: only between whole frames,
    and a reducer that does not get it keeps the rank's place for its rejoin grace instead."""
    if stream.dead or stream.writer.out:
        return
    try:
        stream.sock.send(_GOODBYE, socket.MSG_DONTWAIT)
    except OSError:
        pass


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
