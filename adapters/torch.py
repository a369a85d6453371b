"""PyTorch adapter: a DDP communication hook and a ``"redsrv"`` c10d backend.

The hook is the one-line switch for an existing DDP job::

    import redsrv.torch
    state = redsrv.torch.HookState()  # REDSRV_REDUCERS, REDSRV_JOB, torchrun's RANK/WORLD_SIZE
    ddp.register_comm_hook(state, redsrv.torch.redsrv_hook)
    # or, 16-bit floats on the wire (sums still accumulate in float32 on the reducers):
    ddp.register_comm_hook(state, redsrv.torch.bf16_compress_wrapper(redsrv.torch.redsrv_hook))

The backend runs every c10d operation gloo runs on CPU: reductions (every op), broadcast and
barrier through the reducers, so plain DDP needs no hook; point-to-point, gather, scatter,
all-to-all, all-gather and reduce-scatter over links between the workers (docs/torch_backend.md)::

    redsrv.torch.register_backend()
    dist.init_process_group("redsrv")

Both translate tensors to flat NumPy views of their memory and hand them to
:class:`redsrv.Client`; chunking, deadlines, retries and connections are the core's business.
Errors are redsrv's typed exceptions; through DDP they reach the training loop as the
``RuntimeError`` that ``backward()`` raises, carrying the redsrv message.
"""

# No `from __future__ import annotations`: DDP compares the hook's annotations with real
# objects (`torch.futures.Future[torch.Tensor]`), and string annotations would fail that check.

import concurrent.futures
import hashlib
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (  # type: ignore[attr-defined]
    AllgatherOptions,
    AllToAllOptions,
    ReduceScatterOptions,
)

from ..core import collectives, commons, wire
from ..core.client import Client, ReduceFuture
from ..core.config import Config
from ..core.errors import ConfigError, ContributionMismatchError
from ..core.host_client import HostClient, host_identity
from . import _torch_c10d

__all__ = [
    "HookState",
    "redsrv_hook",
    "fp16_compress_wrapper",
    "bf16_compress_wrapper",
    "register_backend",
    "RedsrvProcessGroup",
    "BACKEND_NAME",
]

#: The name ``register_backend()`` registers, for ``dist.init_process_group(BACKEND_NAME)``.
BACKEND_NAME = "redsrv"
#: On one host, all-gathers and reduce-scatters of at least this many bytes per rank go through
#: the group's shared memory instead of its peer links: there they are memory copies, not TCP
#: over loopback (docs/torch_backend.md, "One host", has the measurements that set it).
ONE_HOST_GATHER_BYTES = 2 << 20

_BF16 = np.dtype(ml_dtypes.bfloat16)
#: torch dtypes the reducers take as they are: the core's wire dtypes, which torch names as NumPy
#: does (bf16 is handed over as ml_dtypes.bfloat16).
_ON_WIRE = tuple(getattr(torch, name) for name in wire.DTYPE_NAMES)


# --- tensors <-> NumPy --------------------------------------------------------------------


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's data as a flat contiguous CPU tensor: a view when it already is one."""
    flat = tensor.detach()
    if flat.device.type != "cpu":
        # The core works on host memory; accelerator tensors are staged through it.
        flat = flat.cpu()
    return flat.contiguous().view(-1)


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy array sharing ``tensor``'s memory (flat, contiguous, CPU, native dtype)."""
    if tensor.dtype is torch.bfloat16:
        # NumPy has no bfloat16; reinterpret the 16-bit words as ml_dtypes' bfloat16.
        return tensor.view(torch.int16).numpy().view(_BF16)
    return tensor.numpy()


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``array``'s memory (the inverse of :func:`_numpy`)."""
    if array.dtype == _BF16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _flat_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A flat NumPy view of a CPU, contiguous tensor whose dtype NumPy has (:data:`_AS_THEMSELVES`)."""
    return (tensor.detach() if tensor.requires_grad else tensor).numpy().reshape(-1)


def _any_numpy(host: torch.Tensor) -> np.ndarray:
    """A NumPy array sharing the memory of ``host`` (flat, contiguous, CPU): of its own dtype where
    NumPy has one, else its bytes (float8, ...). For the core's exact broadcast, which moves any
    fixed-size dtype bit for bit."""
    try:
        return _numpy(host)
    except TypeError:  # a dtype NumPy lacks
        return host.view(torch.uint8).numpy()


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    """``tensor``'s raw bytes (``uint8``): gathering bytes is exact for every dtype (booleans,
    complex, -0.0, NaN payloads), and ranks whose sizes differ are a mismatch on every rank."""
    return _host(tensor).view(torch.uint8).numpy()


def _from_bytes(raw: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_bytes`: a CPU tensor shaped and typed like ``like``."""
    if not raw.size:  # torch cannot reinterpret an empty byte tensor (its stride is 0)
        return torch.empty(like.shape, dtype=like.dtype)
    return torch.from_numpy(np.ascontiguousarray(raw)).view(like.dtype).view(like.shape)


# --- DDP communication hook ---------------------------------------------------------------


class _Progress:
    """The step counter, shared by a state and the views its wrappers derive from it."""

    __slots__ = ("step",)

    def __init__(self) -> None:
        self.step = 0


class HookState:
    """State for :func:`redsrv_hook`: the client, the step counter and per-hook options.

    Build it from explicit settings or from the launcher's environment (``REDSRV_REDUCERS``,
    ``REDSRV_JOB``, torchrun's ``RANK``/``WORLD_SIZE``; see :class:`redsrv.Config`), or hand it a
    :class:`redsrv.Client` you manage yourself. Any other keyword is a :class:`redsrv.Config`
    field (``wire_dtype="bf16"``, ``op_timeout=60``, ``secret=...``).

    Operation keys are ``(key_prefix, step, bucket index)``: the same on every rank, unique in
    the job. Two DDP models sharing one job (or one client) need different ``key_prefix`` values.
    ``timeout`` bounds each bucket's reduction (default: the config's ``op_timeout``); the
    hook's future fails with the timeout error, so ``backward()`` raises instead of hanging.
    Close the state (or use it as a context manager) to close a client it created; a failed
    bucket leaves it open, since you decide whether to go on (:meth:`replace_client`). A client
    passed in is never closed here (the adapters' rule, ``redsrv.core.commons``).
    """

    def __init__(self, reducers: Sequence[str] | str | None = None, *, rank: int | None = None,
                 world_size: int | None = None, job: str | None = None, client: Client | None = None,
                 timeout: float | None = None, key_prefix: str = "ddp", **config: Any) -> None:
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if client is not None:
            given = [name for name, value in (("reducers", reducers), ("rank", rank), ("world_size", world_size),
                                              ("job", job)) if value is not None] + sorted(config)
            if given:
                raise TypeError(f"HookState got client= and also {', '.join(given)}: configure the client instead")
            self.client = client
            self._owns_client = False
        else:
            settings = Config.from_env(reducers=reducers, rank=rank, world_size=world_size, job=job, **config)
            self.client = Client(config=settings)
            self._owns_client = True
        self.timeout = timeout
        self.keys = commons.KeySpace(key_prefix)
        #: Wire format asked of the core for every bucket; None: the client's default
        #: (``wire_dtype`` in its config). The compress wrappers set it on derived views.
        self.wire_dtype: str | None = None
        self._progress = _Progress()
        self._staging = _CudaStaging()
        self._views: dict[str, HookState] = {}

    @property
    def key_prefix(self) -> str:
        return self.keys.namespace

    @property
    def step(self) -> int:
        """Synchronised steps so far (``no_sync()`` micro-batches do not count)."""
        return self._progress.step

    def with_wire_dtype(self, wire_dtype: str) -> "HookState":
        """A view of this state that asks for ``wire_dtype`` ("bf16"/"fp16") on the wire; it
        shares the client and the step counter. Used by the compress wrappers."""
        view = self._views.get(wire_dtype)
        if view is None:
            view = object.__new__(HookState)
            view.__dict__.update(self.__dict__)
            view.wire_dtype = wire_dtype
            view._views = {}
            view._owns_client = False
            self._views[wire_dtype] = view
        return view

    def close(self) -> None:
        """Close the client if this state created it. Idempotent."""
        if self._owns_client:
            self.client.close()

    def replace_client(self, client: Client | None = None) -> None:
        """Swap the client the hook uses, keeping the step counter (so keys stay aligned with the
        other ranks), for a DDP model whose hook cannot be registered again.

        A client rides through a lost reducer by itself (``REDSRV_RECONNECT_WINDOW``); replace it
        only when it is broken for good (the window passed, or reconnects are off). Every rank
        must then replace its client before its next step: each gets a new session, and the
        reducers answer the operations of the new sessions only. A worker *process* that
        restarted cannot rejoin a step the others are in; restart the whole job from a
        checkpoint instead. ``client=None`` builds a new client from the old one's settings."""
        old, owned = self.client, self._owns_client
        self.client = Client(config=old.config) if client is None else client
        self._owns_client = client is None
        for view in self._views.values():
            view.client = self.client
        if owned:
            old.close()

    def __enter__(self) -> "HookState":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        cfg = self.client.config
        return (f"HookState(job={cfg.job!r}, rank={cfg.rank}, world_size={cfg.world_size}, "
                f"reducers={len(cfg.reducers)}, step={self.step}, wire_dtype={self.wire_dtype or cfg.wire_dtype})")


class _CudaTrip:
    """One CUDA bucket's trip through host memory (:class:`_CudaStaging`)."""

    __slots__ = ("host", "stream")

    def __init__(self, host: torch.Tensor, stream: Any) -> None:
        self.host, self.stream = host, stream

    def to_device(self, buffer: torch.Tensor, future: torch.futures.Future[torch.Tensor]) -> None:
        """Copy the result back on the side stream and complete ``future`` there: a CUDA-aware
        future records the side stream, and DDP's stream waits for it, not the host."""
        with torch.cuda.stream(self.stream):
            buffer.copy_(self.host.view(buffer.shape), non_blocking=True)
            future.set_result(buffer)


class _CudaStaging:
    """Pinned host buffers, one per bucket and reused every step, and one side stream per device,
    for CUDA buckets: the core works on host memory.

    The copy to the host runs on the side stream after the gradients' stream reached the hook,
    and the hook waits for that copy only (not the device), so the GPU goes on with the backward
    pass meanwhile, and the next bucket's copy overlaps this one's trip to the reducers. The copy
    back runs on the side stream too. A bucket's pinned buffer is written again only after the
    copy back of its previous step: both copies are on one stream, in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: dict[tuple[torch.device, int], torch.Tensor] = {}
        self._streams: dict[torch.device, Any] = {}

    def to_host(self, buffer: torch.Tensor, index: int) -> _CudaTrip:
        device = buffer.device
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            host = self._buffers.get((device, index))
            if host is None or host.numel() != buffer.numel() or host.dtype != buffer.dtype:  # DDP rebuilt its buckets
                host = self._buffers[(device, index)] = torch.empty(buffer.numel(), dtype=buffer.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            host.copy_(buffer.detach().reshape(-1), non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        buffer.record_stream(stream)  # the allocator must not hand the bucket's memory out while the side stream uses it
        copied.synchronize()
        return _CudaTrip(host, stream)


def redsrv_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:  # type: ignore[name-defined]
    """DDP communication hook: the mean of the bucket over the ranks that contributed.

    Hands the bucket's memory to the core without copying and returns at once; the mean is
    received straight back into the bucket (as torch's own allreduce hook does, in place), and
    the future is completed on the client's completion thread (``redsrv-done``). A CUDA bucket
    goes through a pinned host buffer on a side stream (:class:`_CudaStaging`). The step advances
    after the bucket DDP marks last, so keys stay aligned across ranks through bucket rebuilds
    and ``no_sync()``.
    """
    index = bucket.index()
    # DDP launches a step's buckets in index order under its reducer's lock, the last one
    # flagged, so a plain counter advanced there is race-free and the same on every rank.
    step = state._progress.step
    if bucket.is_last():
        state._progress.step = step + 1
    buffer = bucket.buffer()
    staged = state._staging.to_host(buffer, index) if buffer.device.type == "cuda" else None
    host = staged.host if staged is not None else _host(buffer)
    # A CUDA bucket's future is CUDA-aware: DDP's stream then waits for the copy back (to_device).
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=[buffer.device] if staged else None)
    try:
        # In place is safe: a chunk's sum comes back only after our copy of it reached the reducer.
        array = _numpy(host)
        reduced = state.client.allreduce_async(array, op="mean", key=state.keys.key(step, index),
                                               wire_dtype=state.wire_dtype, timeout=state.timeout, out=array)
    except Exception as exc:
        # A broken client (lost reducer, closed) fails this step's backward(), not the hook.
        future.set_exception(exc)  # type: ignore[arg-type]  # torch's stub says T
        return _torch_c10d.settle(future)

    def complete(done: ReduceFuture) -> None:
        try:
            done.result()  # raises the operation's error
            if staged is not None:
                staged.to_device(buffer, future)
                return
            if host.data_ptr() != buffer.data_ptr():  # another accelerator's bucket, staged through host memory
                buffer.copy_(host.view(buffer.shape))
            future.set_result(buffer)
        except BaseException as exc:
            future.set_exception(exc)  # type: ignore[arg-type]

    reduced.add_done_callback(complete)
    return _torch_c10d.settle(future)


def _wire_wrapper(wire_dtype: str, name: str, hook: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(state, bucket):  # type: ignore[no-untyped-def]
        if not isinstance(state, HookState):
            raise TypeError(f"{name} wraps hooks whose state is a redsrv.torch.HookState, got {type(state).__name__}")
        return hook(state.with_wire_dtype(wire_dtype), bucket)

    # DDP requires a __name__ and rejects the names of torch's own bf16 hooks on CPU ("needs
    # NCCL"), so ours get names of their own.
    wrapped.__name__ = wrapped.__qualname__ = name
    wrapped.__doc__ = f"{getattr(hook, '__name__', 'hook')} with {wire_dtype} on the wire."
    return wrapped


def fp16_compress_wrapper(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` with float16 on the wire, in the style of torch's ``fp16_compress_wrapper``.

    The core converts float32 buckets to float16 for the trip, the reducers sum in float32, and
    the result comes back in the bucket's dtype. Use as
    ``ddp.register_comm_hook(state, fp16_compress_wrapper(redsrv_hook))``.
    """
    return _wire_wrapper("fp16", "redsrv_fp16_wire_hook", hook)


def bf16_compress_wrapper(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` with bfloat16 on the wire (float32 accumulation on the reducers); see
    :func:`fp16_compress_wrapper`. Unlike torch's bf16 hooks it needs no NCCL and runs on CPU."""
    return _wire_wrapper("bf16", "redsrv_bf16_wire_hook", hook)


# --- c10d backend -------------------------------------------------------------------------

#: c10d reduce ops and the reducers' names for them.
_OPS = {
    dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "mean", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min",
    dist.ReduceOp.PRODUCT: "product", dist.ReduceOp.BAND: "band", dist.ReduceOp.BOR: "bor", dist.ReduceOp.BXOR: "bxor",
}
_BITWISE = ("band", "bor", "bxor")
#: Integer dtypes the wire lacks, carried in a wider one: sums, products and bitwise results
#: wrap the same way modulo the narrow width, and comparisons are exact.
_WIDENED = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}
#: The wire's dtypes that NumPy views as themselves (all but bfloat16), by kind: a tensor of one,
#: on the CPU and contiguous, goes to the client as a view of its memory (:class:`_Staged`).
_AS_THEMSELVES = {dtype: "float" if dtype.is_floating_point else "int" for dtype in _ON_WIRE if dtype is not torch.bfloat16}


def _op_name(op: Any) -> str:
    return str(getattr(op, "op", op)).rpartition(".")[2]


def _reduce_op(opts: Any, what: str) -> str:
    op = opts.reduceOp
    for c10d_op, name in _OPS.items():
        if op == c10d_op:
            return name
    raise ValueError(f"the redsrv backend's {what} does not support ReduceOp.{_op_name(op)}: scale the tensor "
                     "yourself and use ReduceOp.SUM (reducers combine with SUM, AVG, MAX, MIN, PRODUCT, BAND, BOR, BXOR)")


class _Staged:
    """A tensor as the reducers see it: a flat NumPy array of a wire dtype, and how to write a
    result back. A view of the tensor's memory when it is already CPU, contiguous and of a wire
    dtype; a converted copy otherwise (complex sums as their real pairs, int16 widened)."""

    def __init__(self, tensor: torch.Tensor, op: str, what: str) -> None:
        self.tensor = tensor
        kind = _AS_THEMSELVES.get(tensor.dtype)
        if kind is not None and tensor.is_cpu and tensor.is_contiguous() and not (
                (op == "mean" and kind != "float") or (op in _BITWISE and kind == "float")):
            # The common case, on every call of a training step: a view, and nothing else to decide.
            self.host = tensor
            self.array = _flat_numpy(tensor)
            self.in_place = True
            return
        host = _host(tensor)
        if tensor.is_complex():
            if op not in ("sum", "mean"):
                raise TypeError(f"redsrv {what} of complex tensors supports SUM and AVG only, got {op.upper()}")
            host = torch.view_as_real(host).view(-1)
        elif tensor.dtype in _WIDENED:
            host = host.to(_WIDENED[tensor.dtype])
        elif tensor.dtype not in _ON_WIRE:
            names = ", ".join(str(d).removeprefix("torch.") for d in (*_ON_WIRE, *_WIDENED, torch.complex64, torch.complex128))
            raise TypeError(f"redsrv {what} supports {names}; got a {str(tensor.dtype).removeprefix('torch.')} tensor")
        if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
            raise TypeError(f"redsrv {what} with ReduceOp.AVG needs floating-point tensors, got {tensor.dtype}")
        if op in _BITWISE and (tensor.is_floating_point() or tensor.is_complex()):
            raise TypeError(f"redsrv {what} with ReduceOp.{op.upper()} needs integer or bool tensors, got {tensor.dtype}")
        self.host = host
        self.array = _numpy(host)
        #: Whether the reducers' result lands straight in the tensor's memory.
        self.in_place = host.data_ptr() == tensor.data_ptr() and host.dtype == tensor.dtype

    def write(self, result: np.ndarray) -> None:
        if self.in_place and result.ctypes.data == self.tensor.data_ptr():
            return
        self.tensor.copy_(self.unstage(result).view(self.tensor.shape))

    def unstage(self, result: np.ndarray) -> torch.Tensor:
        """The reducers' result as a flat tensor of the staged tensor's dtype."""
        reduced = _tensor(result)
        if self.tensor.is_complex():
            return torch.view_as_complex(reduced.view(-1, 2))
        return reduced.to(self.tensor.dtype)


class _Join:
    """Completes one torch future once every part of a collective finished (or one failed).

    A part whose result needs no copy (``cheap``) completes on the thread that settled it, as
    long as nobody asked for the work's future: then nothing but the waiting caller is woken,
    and no callback of anyone's can run there. Otherwise, and for parts that copy, on the
    client's completion thread (core/client_ops.py, ``ReduceFuture``)."""

    def __init__(self, what: Callable[[], str], parts: int, value: Any) -> None:
        self.what = what  # the operation's name for messages, built only when one is written
        self.future: torch.futures.Future[Any] = torch.futures.Future()
        self._remaining = parts
        self._value = value
        self._lock = threading.Lock()
        self._failed = False
        self._exposed = False  # the work's future was handed out: callbacks may hang on it
        self._exposure = threading.Lock()
        if parts == 0:
            self.future.set_result(value)

    def add(self, reduced: Any, write: Callable[[Any], None], *, cheap: bool = False) -> None:
        def done(finished: Any) -> None:
            try:
                write(finished.result())
            except BaseException as exc:
                with self._lock:
                    first, self._failed = not self._failed, True
                if first:
                    self.future.set_exception(exc)
                return
            with self._lock:
                self._remaining -= 1
                last = self._remaining == 0 and not self._failed
            if last:
                self.future.set_result(self._value)

        completions = getattr(reduced, "_completions", None)
        if not cheap or completions is None:
            reduced.add_done_callback(done)
            return

        def settled(finished: Any) -> None:
            with self._exposure:
                if not self._exposed:
                    # Under the lock, so that a get_future() racing with this waits until the
                    # future is set and its callbacks then run on its own thread, not here.
                    done(finished)
                    return
            completions.submit(done, finished)

        concurrent.futures.Future.add_done_callback(reduced, settled)  # on the settling thread

    def expose(self) -> None:
        with self._exposure:
            self._exposed = True

    def work(self) -> Any:
        return _torch_c10d.FutureWork(self.future, self.what, on_get_future=self.expose)


def _ignore(_result: Any) -> None:
    pass


class RedsrvProcessGroup(_torch_c10d.ProcessGroupBase):
    """A c10d process group whose reductions go through the reducers, or through shared memory
    when every rank of the group is on one host (:attr:`one_host`; docs/torch_backend.md, "One host").

    Made by ``dist.init_process_group("redsrv")`` / ``dist.new_group(backend="redsrv")`` after
    :func:`register_backend`. Each group is its own redsrv job (``<job>.pg<group name>``) with
    its own client; operations are keyed by a per-group sequence number, which c10d's rule that
    every rank issues a group's collectives in the same order makes identical across ranks.

    Through the reducers (every reduce op, bitwise identical on every rank): ``all_reduce``,
    ``all_reduce_coalesced``, ``reduce``, ``broadcast``, ``barrier``. Through direct links
    between the workers, a gloo group built from the same store when the group is created
    (the peer links): point-to-point, ``gather``, ``scatter``, ``all_to_all``, ``all_gather``
    and ``reduce_scatter`` in every form, ``monitored_barrier``; reducers would move at least as
    many bytes for these and add a hop (docs/torch_backend.md has the measurements). On one host,
    all-gathers and reduce-scatters of :data:`ONE_HOST_GATHER_BYTES` a rank or more take the
    shared memory instead, where copies beat gloo's TCP over loopback. A group made
    with ``peer_links=False`` needs no links between workers: all-gather and reduce-scatter then
    go through the reducers too, and point-to-point, gather, scatter and all-to-all raise an
    error that says what to use instead.
    """

    def __init__(self, client: Client, *, rank: int, size: int, group_name: str = "",
                 peers: Any = None, owns_client: bool = True, verify_collectives: bool = True) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the Python trampoline's constructor
        # rank() and size() are calls into C++; a collective's path reads these instead.
        self._rank, self._size = rank, size
        self.client = client
        self._owns_client = owns_client
        self._verify = verify_collectives
        self._peers = peers
        self._group_name = group_name
        cfg = client.config
        self._links_context = _torch_c10d.LinksContext(cfg.job, cfg.rank, cfg.op_timeout)
        self._on_one_host = self.one_host
        # Operations are keyed ("c10d", sequence number, part): c10d's rule that every rank issues
        # a group's collectives in the same order makes the numbers agree.
        self._keys = commons.KeySpace("c10d")

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return BACKEND_NAME

    @property
    def group_name(self) -> str:  # type: ignore[override]
        """The c10d name of this group (``dist.destroy_process_group(group)`` and FSDP look it up)."""
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        # c10d names every group after creating it; torch's own getter would ask a C++ backend
        # that a Python group does not have.
        self._group_name = name
        super()._set_group_name(name)  # type: ignore[arg-type]  # torch's stub says GroupName, a str

    def _join(self, what: str, parts: int, value: Any) -> tuple[int, "_Join"]:
        # DDP issues collectives from the autograd thread while user code may use the main
        # thread; c10d already demands one order per group, KeySpace keeps numbering atomic.
        seq = self._keys.next_call()
        cfg = self.client.config
        return seq, _Join(lambda: f"redsrv {what} #{seq} (job {cfg.job!r}, rank {cfg.rank})", parts, value)

    # --- through the reducers

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        op = "sum" if opts is None else _reduce_op(opts, "all_reduce")
        if any(tensor.is_sparse for tensor in tensors):
            # Sparse sums exchange indices, not fixed-length arrays: nothing for the reducers to add.
            return self._delegate("sparse all_reduce", lambda peers: peers.allreduce(tensors, opts),
                                  "densify the tensor (tensor.to_dense()) to reduce it through the reducers")
        staged = [_Staged(tensor, op, "all_reduce") for tensor in tensors]
        seq, join = self._join("all_reduce", len(staged), tensors)
        for i, part in enumerate(staged):
            out = part.array if part.in_place else None
            join.add(self.client.allreduce_async(part.array, op=op, key=self._keys.key(seq, i), out=out), part.write,
                     cheap=out is not None)  # the result lands in the tensor itself
        return join.work()

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:  # type: ignore[override]
        """``dist.reduce``: an all-reduce of which only the root keeps the result (the reducers
        return it to every rank; others' tensors are left as they were)."""
        op = _reduce_op(opts, "reduce")
        root = opts.rootRank
        if not 0 <= root < self._size:
            raise ValueError(f"redsrv reduce: root {root} is not a rank of this {self._size}-rank group")
        staged = [_Staged(tensor, op, "reduce") for tensor in tensors]
        seq, join = self._join("reduce", len(staged), tensors)
        keeps = self._rank == root
        for i, part in enumerate(staged):
            # Non-roots must not see the result: reduce into a scratch copy there.
            out = part.array if part.in_place and keeps else None
            reduced = self.client.allreduce_async(part.array, op=op, key=self._keys.key(seq, i), out=out)
            join.add(reduced, part.write if keeps else _ignore, cheap=out is not None or not keeps)
        return join.work()

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:  # type: ignore[override]
        root = opts.rootRank
        if not 0 <= root < self._size:
            raise ValueError(f"redsrv broadcast: root {root} is not a rank of this {self._size}-rank group")
        seq, join = self._join("broadcast", len(tensors), tensors)
        for i, tensor in enumerate(tensors):
            # The core's exact broadcast: the wire's dtypes travel as themselves (checked across
            # ranks), others as their bytes; the result lands in the tensor's memory when it can.
            if tensor.dtype in _AS_THEMSELVES and tensor.is_cpu and tensor.is_contiguous():
                host, array = tensor, _flat_numpy(tensor)
            else:
                host = _host(tensor)
                array = _any_numpy(host)
            moved = collectives.broadcast_exact_in_place_async(self.client, array, root=root, key=self._keys.key(seq, i))
            in_place = host.data_ptr() == tensor.data_ptr()  # the result lands in the tensor itself
            join.add(moved, _ignore if in_place or self._rank == root else _copy_back(host, tensor), cheap=in_place)
        return join.work()

    def barrier(self, opts: Any = None) -> Any:
        seq, join = self._join("barrier", 1, [])
        join.add(self.client.allreduce_async(np.ones(1, dtype=np.int32), key=self._keys.key(seq, 0)), _ignore, cheap=True)
        return join.work()

    # --- through the peer links

    def _peer(self, what: str, instead: str = "") -> Any:
        """The peer links, or a ConfigError saying that ``what`` needs them and what to do
        ``instead`` (by default: links, or a gloo group)."""
        if self._peers is None:
            raise ConfigError(
                f"the redsrv backend's {what} needs links between the workers, and this group was created "
                f"without them (register_backend(peer_links=False)); "
                f"{instead or f'create the group with peer links, or use a gloo group for {what}'}")
        return self._peers

    def _delegate(self, what: str, call: Callable[[Any], Any], instead: str = "") -> Any:
        return self._linked(call(self._peer(what, instead)), what)

    def _linked(self, work: Any, op: str) -> Any:
        """The one way out of every operation over the peer links: gloo's ``work``, whose
        failures then surface as redsrv's typed errors naming ``op``."""
        return _torch_c10d.DelegatedWork(work, op, self._links_context)

    def _direct_links(self, nbytes: int = 0) -> Any:
        """The peer links when an operation of ``nbytes`` a rank goes straight to them: links
        present, no cross-rank check, and not bound for shared memory (:meth:`_shared_memory_size`;
        pass 0 for the operations that never are). Else None: the operation takes its general path,
        which raises, checks or routes as it must. The default case does nothing but this: each
        microsecond shows at 4-64 KiB, where gloo's own call takes 0.1-0.2 ms on one host
        (docs/torch_backend.md, "Where the bound stands (bfb88da)")."""
        if self._peers is None or self._verify or self._shared_memory_size(nbytes):
            return None
        return self._peers

    def _agreed(self, what: str, call: Callable[[Any], Any], describe: Callable[[], "_Signature"], instead: str = "") -> Any:
        """``_delegate`` after the ranks agreed on what they pass, when the group checks
        (docs/torch_backend.md, "Mismatched collectives"): every rank's signature (``describe()``,
        built only then) travels through the reducers as one small all-reduce under the operation's
        sequence number, and every rank judges the same table, so a mismatch is a
        ContributionMismatchError on every rank before gloo sees a byte."""
        if self._verify:
            self._peer(what, instead)
            self._check_agreement(what, describe)
        return self._delegate(what, call, instead)

    def _check_agreement(self, what: str, describe: Callable[[], "_Signature"]) -> None:
        signature = describe()
        seq = self._keys.next_call()
        key = self._keys.key(seq, 0)
        table = np.zeros((self.size(), signature.width(self.size())), dtype=np.int64)
        table[self.rank()] = signature.row(self.size())
        table = self.client.allreduce(table, key=key)
        problem = _mismatch(table, self.rank(), signature.problem)
        if problem:
            cfg = self.client.config
            raise ContributionMismatchError(f"redsrv {what} #{seq}: {problem}", job=cfg.job, rank=cfg.rank, key=key)

    def _in_shared_memory(self, what: str, nbytes: int, describe: Callable[[], "_Signature"]) -> bool:
        """Whether an all-gather or reduce-scatter of ``nbytes`` per rank goes through the group's
        shared memory instead of its peer links (one host, :data:`ONE_HOST_GATHER_BYTES`). Every
        rank decides alike when they pass the same sizes; ranks that do not are a mismatch under
        the check (which then runs first), and otherwise fail at the group's deadline."""
        if not self._shared_memory_size(nbytes):
            return False
        if self._verify:
            self._check_agreement(what, describe)
        return True

    def _shared_memory_size(self, nbytes: int) -> bool:
        """Whether an all-gather or reduce-scatter of ``nbytes`` a rank is large enough for the
        shared memory of a one-host group (:data:`ONE_HOST_GATHER_BYTES`)."""
        return self._on_one_host and nbytes >= ONE_HOST_GATHER_BYTES

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        return self._linked(self._peer("send").send(tensors, dst, tag), "send")

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        return self._linked(self._peer("recv").recv(tensors, src, tag), "recv")

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        return self._delegate("recv", lambda peers: peers.recv_anysource(tensors, tag))

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any) -> Any:  # type: ignore[override]
        links = self._direct_links()
        if links is not None:
            return self._linked(links.gather(output_tensors, input_tensors, opts), "gather")

        def describe() -> _Signature:
            root, n = int(opts.rootRank), self.size()
            x = input_tensors[0]
            problem = None
            if self.rank() == root and (len(output_tensors[0]) != n or any(_layout(o) != _layout(x) for o in output_tensors[0])):
                problem = f"the root's outputs are not {n} tensors of {x.numel()} {_dtype_name(x.dtype)} elements like its input"
            return _Signature("gather", [x], root=root, same=[x.numel()], problem=problem)

        return self._agreed("gather", lambda peers: peers.gather(output_tensors, input_tensors, opts), describe,
                            "use all_gather, which the reducers can do without links")

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any) -> Any:  # type: ignore[override]
        links = self._direct_links()
        if links is not None:
            return self._linked(links.scatter(output_tensors, input_tensors, opts), "scatter")

        def describe() -> _Signature:
            root, n = int(opts.rootRank), self.size()
            y = output_tensors[0]
            problem = None
            if self.rank() == root and (len(input_tensors[0]) != n or any(_layout(i) != _layout(y) for i in input_tensors[0])):
                problem = f"the root's inputs are not {n} tensors of {y.numel()} {_dtype_name(y.dtype)} elements like its output"
            return _Signature("scatter", [y], root=root, same=[y.numel()], problem=problem)

        return self._agreed("scatter", lambda peers: peers.scatter(output_tensors, input_tensors, opts), describe,
                            "use broadcast, which the reducers can do without links, and take your part")

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        links = self._direct_links()
        if links is not None:
            return self._linked(links.alltoall(output_tensors, input_tensors, _opts(opts, AllToAllOptions)), "all_to_all")

        def describe() -> _Signature:
            n = self.size()
            problem = None
            if len(output_tensors) != n or len(input_tensors) != n:
                problem = f"all_to_all needs {n} inputs and {n} outputs, got {len(input_tensors)} and {len(output_tensors)}"
            return _Signature("all_to_all", [*input_tensors, *output_tensors], problem=problem,
                              sends=[t.numel() for t in input_tensors], receives=[t.numel() for t in output_tensors])

        return self._agreed("all_to_all", lambda peers: peers.alltoall(output_tensors, input_tensors,
                                                                       _opts(opts, AllToAllOptions)), describe)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],  # noqa: A002 - c10d's name
                          input_split_sizes: list[int], opts: Any = None) -> Any:
        links = self._direct_links()
        if links is not None:
            return self._linked(links.alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                                    _opts(opts, AllToAllOptions)), "all_to_all_single")

        def describe() -> _Signature:
            n = self.size()
            sends, send_problem = _split_elements(input, input_split_sizes, n, "input")
            receives, receive_problem = _split_elements(output, output_split_sizes, n, "output")
            return _Signature("all_to_all_single", [input, output], sends=sends, receives=receives,
                              problem=send_problem or receive_problem)

        return self._agreed("all_to_all_single", lambda peers: peers.alltoall_base(
            output, input, output_split_sizes, input_split_sizes, _opts(opts, AllToAllOptions)), describe)

    alltoall_base = all_to_all_single  # type: ignore[assignment]  # the name gloo's backend uses

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],  # type: ignore[override]
                  opts: Any = None) -> Any:
        links = self._direct_links(_nbytes(input_tensors))
        if links is not None:
            return self._linked(links.allgather(output_tensors, input_tensors, _opts(opts, AllgatherOptions)), "all_gather")

        def describe() -> _Signature:
            return _gather_signature("all_gather", output_tensors, input_tensors, self.size())

        if self._peers is None or self._in_shared_memory("all_gather", _nbytes(input_tensors), describe):
            return self._relay_gather("all_gather", output_tensors, input_tensors)
        return self._agreed("all_gather",
                            lambda peers: peers.allgather(output_tensors, input_tensors, _opts(opts, AllgatherOptions)),
                            describe)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts: Any = None) -> Any:
        def describe() -> _Signature:
            per_input = [[outputs[i] if i < len(outputs) else outputs[0] for outputs in output_lists]
                         for i in range(len(input_list))]
            signature = _gather_signature("all_gather_coalesced", per_input, input_list, self.size())
            if any(len(outputs) != len(input_list) for outputs in output_lists):
                signature.problem = f"every rank's outputs need {len(input_list)} tensors, one per input"
            return signature

        if self._peers is None or self._in_shared_memory("all_gather_coalesced", _nbytes(input_list), describe):
            per_input = [[outputs[i] for outputs in output_lists] for i in range(len(input_list))]
            return self._relay_gather("all_gather_coalesced", per_input, input_list)
        return self._agreed("all_gather_coalesced", lambda peers: peers.allgather_coalesced(
            output_lists, input_list, _opts(opts, AllgatherOptions)), describe)

    def all_gather_single(self, output: torch.Tensor, tensor: torch.Tensor, opts: Any = None) -> Any:
        """``dist.all_gather_into_tensor``."""
        links = self._direct_links(tensor.numel() * tensor.element_size())
        if links is not None:
            return self._linked(links._allgather_base(output, tensor, _opts(opts, AllgatherOptions)),
                                "all_gather_into_tensor")

        def describe() -> _Signature:
            problem = None
            if output.numel() != tensor.numel() * self.size() or output.dtype != tensor.dtype:
                problem = (f"the output holds {output.numel()} {_dtype_name(output.dtype)} elements, not {self.size()} x "
                           f"{tensor.numel()} {_dtype_name(tensor.dtype)}")
            return _Signature("all_gather_into_tensor", [tensor, output], same=[tensor.numel()], problem=problem)

        if self._peers is None or self._in_shared_memory("all_gather_into_tensor", _nbytes([tensor]), describe):
            if output.numel() != tensor.numel() * self.size() or output.dtype != tensor.dtype:
                raise ValueError(f"redsrv all_gather_into_tensor needs an output of {self.size()} x {tensor.numel()} "
                                 f"{tensor.dtype} elements, got {output.numel()} of {output.dtype}")
            return self._relay_gather("all_gather_into_tensor", [list(output.view(self.size(), -1))], [tensor], [output],
                                      into=output)
        return self._agreed("all_gather_into_tensor",
                            lambda peers: peers._allgather_base(output, tensor, _opts(opts, AllgatherOptions)), describe)

    _allgather_base = all_gather_single  # type: ignore[assignment]  # the name older torch releases call

    # The coalesced forms are what the functional collectives (DTensor, FSDP2's full_tensor(),
    # torch.compile) call from C++. They must be defined here: torch's trampoline for them holds
    # the GIL while it falls back to the group's C++ backend, whose gloo worker threads need the
    # GIL to free a finished operation under the lock that fallback waits for, a deadlock (seen
    # in tests/adapters/torch/test_dtensor.py). From here, gloo is entered with the GIL released.

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return _torch_c10d.WorkList([self.all_gather_single(out, tensor, opts)
                                     for out, tensor in zip(outputs, inputs, strict=True)])

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return _torch_c10d.WorkList([self.reduce_scatter_single(out, tensor, opts)
                                     for out, tensor in zip(outputs, inputs, strict=True)])

    # torch 2.13 looks these names up second
    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None) -> Any:  # type: ignore[override]
        op = "sum" if opts is None else _reduce_op(opts, "reduce_scatter")  # refuses what neither path has
        links = self._direct_links(_nbytes(output_tensors[:1]))
        if links is not None:
            return self._linked(links.reduce_scatter(output_tensors, input_lists, _opts(opts, ReduceScatterOptions)),
                                "reduce_scatter")

        def describe() -> _Signature:
            y, n = output_tensors[0], self.size()
            problem = None
            if len(input_lists[0]) != n or any(_layout(i) != _layout(y) for i in input_lists[0]):
                problem = f"the inputs are not {n} tensors of {y.numel()} {_dtype_name(y.dtype)} elements like the output"
            return _Signature("reduce_scatter", [y, *input_lists[0]], reduce_op=op, same=[y.numel()], problem=problem)

        if self._peers is None or self._in_shared_memory("reduce_scatter", _nbytes(output_tensors[:1]), describe):
            whole = torch.cat([t.reshape(-1) for t in input_lists[0]])
            return self._relay_reduce_scatter("reduce_scatter", output_tensors[0], whole, opts)
        return self._agreed("reduce_scatter", lambda peers: peers.reduce_scatter(
            output_tensors, input_lists, _opts(opts, ReduceScatterOptions)), describe)

    def reduce_scatter_single(self, output: torch.Tensor, tensor: torch.Tensor, opts: Any = None) -> Any:
        """``dist.reduce_scatter_tensor``."""
        op = "sum" if opts is None else _reduce_op(opts, "reduce_scatter_tensor")
        links = self._direct_links(output.numel() * output.element_size())
        if links is not None:
            return self._linked(links._reduce_scatter_base(output, tensor, _opts(opts, ReduceScatterOptions)),
                                "reduce_scatter_tensor")

        def describe() -> _Signature:
            problem = None
            if tensor.numel() != output.numel() * self.size() or output.dtype != tensor.dtype:
                problem = (f"the input holds {tensor.numel()} {_dtype_name(tensor.dtype)} elements, not {self.size()} x "
                           f"{output.numel()} {_dtype_name(output.dtype)}")
            return _Signature("reduce_scatter_tensor", [output, tensor], reduce_op=op, same=[output.numel()], problem=problem)

        if self._peers is None or self._in_shared_memory("reduce_scatter_tensor", _nbytes([output]), describe):
            return self._relay_reduce_scatter("reduce_scatter_tensor", output, tensor, opts)
        return self._agreed("reduce_scatter_tensor", lambda peers: peers._reduce_scatter_base(
            output, tensor, _opts(opts, ReduceScatterOptions)), describe)

    # Without peer links, all-gather and reduce-scatter go through the reducers (DDP checks
    # parameter shapes with an all-gather when it starts). They move more bytes that way than
    # over links (docs/torch_backend.md), but need nothing besides the reducers.

    def _relay_gather(self, what: str, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                      value: Any = None, *, into: torch.Tensor | None = None) -> Any:
        """``into``: one contiguous tensor that the outputs are consecutive views of
        (``all_gather_into_tensor``); the ranks' bytes then land in it directly."""
        for outputs, tensor in zip(output_lists, inputs, strict=True):
            if len(outputs) != self.size() or any(o.numel() != tensor.numel() or o.dtype != tensor.dtype for o in outputs):
                raise ValueError(f"redsrv {what} needs {self.size()} outputs of {tensor.numel()} {tensor.dtype} elements "
                                 "each, like the input")
        seq, join = self._join(what, len(inputs), output_lists if value is None else value)
        for i, (outputs, tensor) in enumerate(zip(output_lists, inputs, strict=True)):
            # Raw bytes: every dtype arrives bit for bit, and sizes are checked across ranks.
            raw = _bytes(tensor)
            if into is not None and into.is_contiguous():
                reduced = collectives.allgather_into_async(self.client, raw, _bytes(into), key=self._keys.key(seq, i))
                join.add(reduced, _ignore)
                continue
            gathered = np.empty(raw.size * self.size(), dtype=np.uint8)
            reduced = collectives.allgather_into_async(self.client, raw, gathered, key=self._keys.key(seq, i))
            join.add(reduced, _split_bytes_into(outputs))
        return join.work()

    def _relay_reduce_scatter(self, what: str, output: torch.Tensor, tensor: torch.Tensor, opts: Any) -> Any:
        op = "sum" if opts is None else _reduce_op(opts, what)
        if tensor.numel() != output.numel() * self.size():
            raise ValueError(f"redsrv {what} needs an input of {self.size()} x {output.numel()} elements, got {tensor.numel()}")
        part = _Staged(tensor, op, what)
        seq, join = self._join(what, 1, output)

        def keep_mine(result: np.ndarray) -> None:
            output.copy_(part.unstage(result).view(self.size(), -1)[self.rank()].view(output.shape))

        # The sums land in a new array beside the input, which stays as it was (no copy of it
        # first); the client reuses the memory of one dropped (core/buffer_pool.py), so a
        # reduce-scatter every step maps no fresh pages.
        join.add(self.client.allreduce_async(part.array, op=op, key=self._keys.key(seq, 0)), keep_mine)
        return join.work()

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
        """gloo's barrier that names the ranks that did not arrive. ``dist.monitored_barrier``
        refuses every backend but gloo by name; call this method on the group instead."""
        peers = self._peer("monitored_barrier", "use barrier(), which goes through the reducers")
        bound = timeout if timeout is not None else timedelta(seconds=self.client.config.op_timeout)
        try:
            peers.monitored_barrier(bound, wait_all_ranks)
        except RuntimeError as exc:
            raise _torch_c10d.translate(exc, "redsrv monitored_barrier", bound.total_seconds()) from exc

    # --- lifetime

    def shutdown(self) -> None:
        """Called by ``dist.destroy_process_group()``: close the client (if the group made it) and the peer links."""
        if self._owns_client:
            self.client.close()
        if self._peers is not None:
            self._peers.shutdown()
            self._peers = None

    def abort(self) -> None:
        if self._owns_client:
            self.client.close()
        if self._peers is not None:
            self._peers.abort()
            self._peers = None

    @property
    def one_host(self) -> bool:
        """Every rank of the group is on this host: its reductions and broadcasts run in shared
        memory, and the reducers are never contacted."""
        return isinstance(self.client, HostClient) and self.client.hosts == 1

    def __repr__(self) -> str:
        cfg = self.client.config
        reducers = "none (one host: shared memory)" if self.one_host else str(len(cfg.reducers))
        return (f"RedsrvProcessGroup(job={cfg.job!r}, rank={self.rank()}, size={self.size()}, "
                f"reducers={reducers}, peer_links={self._peers is not None})")


# --- agreeing on a peer-link collective before it runs ---------------------------------------

#: The collectives whose signatures are compared (their codes travel in the table).
_SIGNED = ("gather", "scatter", "all_to_all", "all_to_all_single", "all_gather", "all_gather_coalesced",
           "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor")
#: torch's dtypes by a code every rank computes alike (sorted names; aliases share the first).
_DTYPE_CODES: dict[torch.dtype, int] = {}
for _name in sorted(dir(torch)):
    if isinstance(getattr(torch, _name), torch.dtype):
        _DTYPE_CODES.setdefault(getattr(torch, _name), len(_DTYPE_CODES) + 1)
_DTYPE_BY_CODE = {code: dtype for dtype, code in _DTYPE_CODES.items()}
_MIXED = -1
_REDUCE_CODES = {name: code for code, name in enumerate(_OPS.values(), start=1)}
_HEAD = 8  # op, root, dtype, reduce op, problem, number of shared values, the first, a digest of all


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _layout(t: torch.Tensor) -> tuple[int, torch.dtype]:
    return t.numel(), t.dtype


class _Signature:
    """What one rank passes to a collective, as one row of int64: the op, root, dtype and reduce op,
    whether its own arguments fit together (``problem``), values every rank must share (``same``:
    element counts), and for all-to-all the elements it sends to and expects from each rank."""

    def __init__(self, op: str, tensors: Sequence[torch.Tensor], *, root: int = -1, reduce_op: str = "",
                 same: Sequence[int] = (), sends: Sequence[int] | None = None, receives: Sequence[int] | None = None,
                 problem: str | None = None) -> None:
        self.op, self.root, self.reduce_op, self.same = op, root, reduce_op, [int(v) for v in same]
        self.sends, self.receives, self.problem = sends, receives, problem
        dtypes = {t.dtype for t in tensors}
        self.dtype = _DTYPE_CODES.get(dtypes.pop(), 0) if len(dtypes) == 1 else (_MIXED if dtypes else 0)

    @staticmethod
    def width(n: int) -> int:
        return _HEAD + 2 * n

    def row(self, n: int) -> np.ndarray:
        row = np.full(self.width(n), -1, dtype=np.int64)
        digest = hashlib.blake2b(",".join(map(str, self.same)).encode(), digest_size=7).digest()
        row[:_HEAD] = (_SIGNED.index(self.op) + 1, self.root, self.dtype, _REDUCE_CODES.get(self.reduce_op, 0),
                       int(self.problem is not None), len(self.same), self.same[0] if self.same else 0,
                       int.from_bytes(digest, "little"))
        for start, counts in ((_HEAD, self.sends), (_HEAD + n, self.receives)):
            if counts is not None and len(counts) == n:
                row[start : start + n] = counts
        return row


def _gather_signature(what: str, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], n: int) -> _Signature:
    problem = None
    for outputs, x in zip(output_lists, inputs):
        if len(outputs) != n or any(_layout(o) != _layout(x) for o in outputs):
            problem = f"the outputs are not {n} tensors of {x.numel()} {_dtype_name(x.dtype)} elements per input"
    return _Signature(what, [*inputs, *(o for outputs in output_lists for o in outputs)], same=[x.numel() for x in inputs],
                      problem=problem)


def _split_elements(t: torch.Tensor, splits: Sequence[int], n: int, which: str) -> tuple[list[int] | None, str | None]:
    """Elements ``t`` holds for each rank under c10d's split sizes (rows along the first
    dimension; none given: an even split), or the reason they do not fit ``t``."""
    rows = t.shape[0] if t.dim() else 1
    per_row = t.numel() // rows if rows else 0
    if not splits:
        if rows % n:
            return None, f"the {which} has {rows} rows, which do not split evenly over {n} ranks"
        return [rows // n * per_row] * n, None
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != rows:
        return None, f"the {which} split sizes {list(splits)} do not divide its {rows} rows over {n} ranks"
    return [int(s) * per_row for s in splits], None


def _mismatch(table: np.ndarray, me: int, mine: str | None) -> str | None:
    """What the ranks disagree on, judged from the table every rank holds alike (so every rank
    reaches the same verdict), or None."""
    n = table.shape[0]
    names = {code: name for code, name in enumerate(_SIGNED, start=1)}
    first = table[0]
    for r in range(n):
        if table[r, 0] != first[0]:
            return f"rank 0 called {names.get(int(first[0]), '?')}, rank {r} called {names.get(int(table[r, 0]), '?')}"
    for r in range(n):
        if table[r, 4]:
            if r == me and mine:
                return f"rank {r}: {mine}"
            return f"rank {r} passed arguments that do not fit together (its error says how)"
    for r in range(n):
        if table[r, 2] == _MIXED:
            return f"rank {r} passed tensors of different dtypes"
        if table[r, 2] != first[2]:
            return f"rank 0 passed {_code_name(first[2])} tensors, rank {r} {_code_name(table[r, 2])}"
        if table[r, 1] != first[1]:
            return f"rank 0 named root {first[1]}, rank {r} root {table[r, 1]}"
        if table[r, 3] != first[3]:
            ops = {code: name for name, code in _REDUCE_CODES.items()}
            return f"rank 0 reduces with {ops.get(int(first[3]), '?')}, rank {r} with {ops.get(int(table[r, 3]), '?')}"
        if table[r, 5] != first[5] or table[r, 6] != first[6] or table[r, 7] != first[7]:
            return (f"rank 0 passed {first[5]} tensor(s), the first of {first[6]} elements; rank {r} passed "
                    f"{table[r, 5]}, the first of {table[r, 6]} elements")
    for r in range(n):
        for j in range(n):
            sent, expected = table[r, _HEAD + j], table[j, _HEAD + n + r]
            if sent != expected:
                return f"rank {r} sends {sent} elements to rank {j}, which expects {expected} from it"
    return None


def _code_name(code: Any) -> str:
    dtype = _DTYPE_BY_CODE.get(int(code))
    return _dtype_name(dtype) if dtype is not None else "no"


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _split_bytes_into(outputs: list[torch.Tensor]) -> Callable[[np.ndarray], None]:
    def write(gathered: np.ndarray) -> None:
        for out, raw in zip(outputs, gathered.reshape(len(outputs), -1), strict=True):
            out.copy_(_from_bytes(raw, out))

    return write


def _copy_back(host: torch.Tensor, tensor: torch.Tensor) -> Callable[[Any], None]:
    """A broadcast's result is in ``host``: copy it into ``tensor`` unless that is the same memory."""
    def write(_result: Any) -> None:
        if host.data_ptr() != tensor.data_ptr():
            tensor.copy_(host.view(tensor.shape))

    return write


def _opts(opts: Any, kind: Callable[[], Any]) -> Any:
    return kind() if opts is None else opts


def register_backend(reducers: Sequence[str] | str | None = None, *, job: str | None = None, peer_links: bool = True,
                     verify_collectives: bool | None = None, **config: Any) -> None:
    """Register the ``"redsrv"`` c10d backend (CPU tensors).

    Settings not given here come from the environment when a group is created (see
    :class:`redsrv.Config`); rank and world size come from the group. With ``host_reduce`` "auto"
    (the default) and peer links, a group whose ranks find through its store that they all share
    one host reduces in shared memory and never contacts the reducers; ``host_reduce="flat"``
    (``REDSRV_HOST_REDUCE=flat``) keeps it on them. Each group is the job
    ``<job>.pg<group name>``, so a hook and the backend can share one ``REDSRV_JOB``. The
    per-operation deadline is the stricter of redsrv's ``op_timeout`` and the group's
    ``timeout=``. Calling it again replaces the settings for groups created afterwards.

    ``peer_links``: also connect the workers of each group to each other (a gloo group over the
    group's store, made when the group is), for the operations that are not reductions:
    point-to-point, gather, scatter, all-to-all, all-gather, reduce-scatter. Workers must then
    reach each other on the interface gloo picks (``GLOO_SOCKET_IFNAME``), and every rank of a
    group must create it within the deadline. Without them the workers need only reach the
    reducers: all-gather and reduce-scatter go through the reducers as well, and the other
    operations raise an error naming what to use instead.

    ``verify_collectives``: before each collective over the peer links, the ranks compare what they
    pass (op, root, dtype, sizes, reduce op) through the reducers, so a mismatch is a
    :class:`redsrv.ContributionMismatchError` on every rank instead of gloo's error on some ranks
    and a hang on others. It costs one small round trip through the reducers per collective
    (docs/torch_backend.md). ``None`` (the default, or ``REDSRV_VERIFY_COLLECTIVES=auto``) follows
    PyTorch's convention: checked only under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, as PyTorch checks
    its own backends' collectives only then. The reductions' own checks (sizes, dtypes and ops
    that disagree, through the reducers' protocol) cost nothing and are always on.

    The functional collectives (``torch.distributed._functional_collectives``, which DTensor,
    FSDP2's ``full_tensor()``, tensor parallelism and ``torch.compile`` call) take the same paths
    as the ``torch.distributed`` calls of the same names.
    """
    _torch_c10d.check()
    config = {**config, "verify_collectives": verify_collectives}
    Config.from_env(reducers=reducers, job=job, rank=0, world_size=1, **config)  # fail now, not at init

    def create(spec: _torch_c10d.GroupSpec) -> RedsrvProcessGroup:
        base = Config.from_env(reducers=reducers, job=job, rank=spec.rank, world_size=spec.size, **config)
        auto = base.host_reduce == "auto"
        launched: tuple[int, int] | None
        try:
            probe = Config.from_env(reducers=reducers, job=job, **config)
            launched = (probe.rank, probe.world_size)
        except ConfigError:
            launched = None  # the environment names a world size but no rank (c10d gave this group its ranks)
        if launched != (spec.rank, spec.size) and "host_reduce" not in config:
            # A subgroup, or a launch we cannot place: the launcher's local ranks describe the whole
            # job, not this group, so the host-level path cannot trust them.
            base = base.replace(host_reduce="flat")
        op_timeout = base.op_timeout
        if spec.timeout is not None and spec.timeout.total_seconds() > 0:
            op_timeout = min(op_timeout, spec.timeout.total_seconds())
        if auto and peer_links and spec.size > 1:
            # The group's ranks tell each other their hosts through its store (which the peer links
            # need anyway). All on one host: the group reduces in shared memory and never contacts
            # the reducers (docs/torch_backend.md, "One host").
            what = f"redsrv host rendezvous (job {base.job!r}.pg{spec.group_name}, rank {spec.rank})"
            hosts = _torch_c10d.group_hosts(spec, host_identity(base), op_timeout, what, base.restart_count)
            if max(hosts) == 0:
                base = base.replace(host_reduce="host", local_rank=spec.rank, local_size=spec.size)
        settings = base.replace(job=f"{base.job}.pg{spec.group_name}", op_timeout=op_timeout)
        client = Client(config=settings)
        try:
            what = f"redsrv peer links (job {settings.job!r}, rank {spec.rank})"
            peers = _torch_c10d.peer_group(spec, op_timeout, what, settings.restart_count) if peer_links else None
        except BaseException:
            client.close()
            raise
        verify = settings.verify_collectives
        if verify is None:
            verify = dist.get_debug_level() == dist.DebugLevel.DETAIL  # type: ignore[attr-defined]
        return RedsrvProcessGroup(client, rank=spec.rank, size=spec.size, group_name=spec.group_name, peers=peers,
                                  owns_client=True, verify_collectives=verify)

    _torch_c10d.register(BACKEND_NAME, create)
