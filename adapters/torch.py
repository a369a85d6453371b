"""PyTorch adapter: a DDP communication hook and a ``"redsrv"`` c10d backend.

The hook is the one-line switch for an existing DDP job::

    import redsrv.torch
    state = redsrv.torch.HookState()  # REDSRV_REDUCERS, REDSRV_JOB, torchrun's RANK/WORLD_SIZE
    ddp.register_comm_hook(state, redsrv.torch.redsrv_hook)
    # or, 16-bit floats on the wire (sums still accumulate in float32 on the reducers):
    ddp.register_comm_hook(state, redsrv.torch.bf16_compress_wrapper(redsrv.torch.redsrv_hook))

The backend sends every collective of a process group to the reducers, so plain DDP (and
``dist.all_reduce``, ``broadcast``, ``all_gather``, ``barrier``) needs no hook and no links
between workers::

    redsrv.torch.register_backend()
    dist.init_process_group("redsrv")

Both translate tensors to flat NumPy views of their memory and hand them to
:class:`redsrv.Client`; chunking, deadlines, retries and connections are the core's business.
Errors are redsrv's typed exceptions; through DDP they reach the training loop as the
``RuntimeError`` that ``backward()`` raises, carrying the redsrv message.
"""

# No `from __future__ import annotations`: DDP compares the hook's annotations with real
# objects (`torch.futures.Future[torch.Tensor]`), and string annotations would fail that check.

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist

from ..core.client import Client, ReduceFuture
from ..core.config import Config
from ..core.errors import LocalProtocolError
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

_BF16 = np.dtype(ml_dtypes.bfloat16)
#: torch dtypes the core sums natively (bf16 is handed over as ml_dtypes.bfloat16).
_NATIVE = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


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


def _words(tensor: torch.Tensor) -> np.ndarray:
    """``tensor``'s raw bytes as int32 words, zero-padded to a whole word.

    Broadcasting or gathering raw words is exact for every dtype (booleans, int8, complex,
    -0.0, NaN payloads), since a sum with zeros never changes an integer.
    """
    raw = _host(tensor).view(torch.uint8).numpy()
    if raw.nbytes % 4 == 0:
        return raw.view(np.int32)
    padded = np.zeros((raw.nbytes + 3) // 4, dtype=np.int32)
    padded.view(np.uint8)[: raw.nbytes] = raw
    return padded


def _unwords(words: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_words`: a CPU tensor shaped and typed like ``like``."""
    nbytes = like.numel() * like.element_size()
    raw = torch.from_numpy(np.ascontiguousarray(words).view(np.uint8)[:nbytes])
    return raw.view(like.dtype).view(like.shape)


def _check_dtype(tensor: torch.Tensor, what: str) -> None:
    if tensor.dtype not in _NATIVE:
        names = ", ".join(str(d).removeprefix("torch.") for d in _NATIVE)
        raise TypeError(f"redsrv {what} supports {names}; got a {str(tensor.dtype).removeprefix('torch.')} tensor")


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
    Close the state (or use it as a context manager) to close a client it created.
    """

    def __init__(self, reducers: Sequence[str] | str | None = None, *, rank: int | None = None,
                 world_size: int | None = None, job: str | None = None, client: Client | None = None,
                 timeout: float | None = None, key_prefix: str = "ddp", **config: Any) -> None:
        if timeout is not None and not timeout > 0:
            raise LocalProtocolError(f"timeout must be positive, got {timeout}")
        if client is not None:
            given = [name for name, value in (("reducers", reducers), ("rank", rank), ("world_size", world_size),
                                              ("job", job)) if value is not None] + sorted(config)
            if given:
                raise LocalProtocolError(f"HookState got client= and also {', '.join(given)}: configure the client instead")
            self.client = client
            self._owns_client = False
        else:
            settings = Config.from_env(reducers=reducers, rank=rank, world_size=world_size, job=job, **config)
            self.client = Client(config=settings)
            self._owns_client = True
        self.timeout = timeout
        self.key_prefix = key_prefix
        #: Wire format asked of the core for every bucket; None: the client's default
        #: (``wire_dtype`` in its config). The compress wrappers set it on derived views.
        self.wire_dtype: str | None = None
        self._progress = _Progress()
        self._views: dict[str, HookState] = {}

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


def redsrv_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:  # type: ignore[name-defined]
    """DDP communication hook: the mean of the bucket over the ranks that contributed.

    Hands the bucket's memory to the core without copying and returns at once; the mean is
    received straight back into the bucket (as torch's own allreduce hook does, in place), and
    the future is completed from redsrv's transport thread. The step advances after the bucket DDP marks
    last, so keys stay aligned across ranks through bucket rebuilds and ``no_sync()``.
    """
    index = bucket.index()
    # DDP launches a step's buckets in index order under its reducer's lock, the last one
    # flagged, so a plain counter advanced there is race-free and the same on every rank.
    step = state._progress.step
    if bucket.is_last():
        state._progress.step = step + 1
    buffer = bucket.buffer()
    host = _host(buffer)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    try:
        # In place is safe: a chunk's sum comes back only after our copy of it reached the reducer.
        array = _numpy(host)
        reduced = state.client.allreduce_async(array, op="mean", key=(state.key_prefix, step, index),
                                               wire_dtype=state.wire_dtype, timeout=state.timeout, out=array)
    except Exception as exc:
        # A broken client (lost reducer, closed) fails this step's backward(), not the hook.
        future.set_exception(exc)  # type: ignore[arg-type]  # torch's stub says T
        return _torch_c10d.settle(future)

    def complete(done: ReduceFuture) -> None:
        try:
            done.result()  # raises the operation's error
            if host.data_ptr() != buffer.data_ptr():  # an accelerator bucket, staged through host memory
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


class _Join:
    """Completes one torch future once every part of a collective finished (or one failed)."""

    def __init__(self, what: str, parts: int, value: Any) -> None:
        self.what = what
        self.future: torch.futures.Future[Any] = torch.futures.Future()
        self._remaining = parts
        self._value = value
        self._lock = threading.Lock()
        self._failed = False
        if parts == 0:
            self.future.set_result(value)

    def add(self, reduced: ReduceFuture, write: Callable[[np.ndarray], None]) -> None:
        def done(finished: ReduceFuture) -> None:
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

        reduced.add_done_callback(done)

    def work(self) -> Any:
        return _torch_c10d.FutureWork(self.future, lambda: self.what)


def _copy_into(tensor: torch.Tensor) -> Callable[[np.ndarray], None]:
    def write(result: np.ndarray) -> None:
        tensor.copy_(_tensor(result).view(tensor.shape))

    return write


def _copy_words_into(tensor: torch.Tensor) -> Callable[[np.ndarray], None]:
    def write(result: np.ndarray) -> None:
        tensor.copy_(_unwords(result, tensor))

    return write


def _ignore(_result: np.ndarray) -> None:
    pass


def _reduce_op(opts: Any) -> str:
    op = opts.reduceOp
    if op == dist.ReduceOp.SUM:
        return "sum"
    if op == dist.ReduceOp.AVG:
        return "mean"
    name = str(getattr(op, "op", op)).rpartition(".")[2]
    raise ValueError(f"the redsrv backend reduces with SUM or AVG only, got {name}: reducers add, they do not compare")


class RedsrvProcessGroup(_torch_c10d.ProcessGroupBase):
    """A c10d process group whose collectives go through the reducers.

    Made by ``dist.init_process_group("redsrv")`` / ``dist.new_group(backend="redsrv")`` after
    :func:`register_backend`. Each group is its own redsrv job (``<job>.pg<group name>``) with
    its own client; operations are keyed by a per-group sequence number, which c10d's rule that
    every rank issues a group's collectives in the same order makes identical across ranks.
    All collectives are in place and asynchronous: the returned ``Work`` completes from the
    transport thread. Supported: ``allreduce`` (SUM, AVG), ``allreduce_coalesced``,
    ``broadcast``, ``allgather``, ``all_gather_single`` (``all_gather_into_tensor``), ``barrier``.
    """

    def __init__(self, client: Client, *, rank: int, size: int) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the Python trampoline's constructor
        self.client = client
        self._sequence = itertools.count()
        self._sequence_lock = threading.Lock()

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return BACKEND_NAME

    def _join(self, what: str, parts: int, value: Any) -> tuple[int, "_Join"]:
        # DDP issues collectives from the autograd thread while user code may use the main
        # thread; c10d already demands one order per group, the lock keeps numbering atomic.
        with self._sequence_lock:
            seq = next(self._sequence)
        cfg = self.client.config
        return seq, _Join(f"redsrv {what} #{seq} (job {cfg.job!r}, rank {cfg.rank})", parts, value)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        op = "sum" if opts is None else _reduce_op(opts)
        for tensor in tensors:
            _check_dtype(tensor, "all_reduce")
            if op == "mean" and tensor.dtype not in _FLOATS:
                raise TypeError(f"ReduceOp.AVG needs floating-point tensors, got {tensor.dtype}")
        seq, join = self._join("all_reduce", len(tensors), tensors)
        for i, tensor in enumerate(tensors):
            join.add(self.client.allreduce_async(_numpy(_host(tensor)), op=op, key=("c10d", seq, i)), _copy_into(tensor))
        return join.work()

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:  # type: ignore[override]
        root = int(opts.rootRank)
        seq, join = self._join("broadcast", len(tensors), tensors)
        for i, tensor in enumerate(tensors):
            # Dtypes the core knows travel as themselves (checked across ranks); others as raw words.
            native = tensor.dtype in _NATIVE
            data = _numpy(_host(tensor)) if native else _words(tensor)
            reduced = self.client.broadcast_async(data, root=root, key=("c10d", seq, i))
            if self.rank() == root:
                join.add(reduced, _ignore)
            else:
                join.add(reduced, _copy_into(tensor) if native else _copy_words_into(tensor))
        return join.work()

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],  # type: ignore[override]
                  opts: Any = None) -> Any:
        for outputs, tensor in zip(output_tensors, input_tensors, strict=True):
            if len(outputs) != self.size():
                raise ValueError(f"all_gather needs {self.size()} output tensors, got {len(outputs)}")
            for out in outputs:
                if out.dtype != tensor.dtype or out.numel() != tensor.numel():
                    raise ValueError(f"all_gather output {tuple(out.shape)} {out.dtype} does not match input "
                                     f"{tuple(tensor.shape)} {tensor.dtype}")
        seq, join = self._join("all_gather", len(input_tensors), output_tensors)
        for i, (outputs, tensor) in enumerate(zip(output_tensors, input_tensors, strict=True)):
            join.add(self._gather_words(tensor, ("c10d", seq, i)), _split_into(outputs))
        return join.work()

    def all_gather_single(self, output: torch.Tensor, tensor: torch.Tensor, opts: Any = None) -> Any:
        """``dist.all_gather_single`` (``all_gather_into_tensor`` before torch 2.13)."""
        if output.dtype != tensor.dtype or output.numel() != tensor.numel() * self.size() or not output.is_contiguous():
            raise ValueError(f"all_gather_single needs a contiguous {tensor.dtype} output of "
                             f"{tensor.numel() * self.size()} elements, got {output.dtype} with {output.numel()}")
        seq, join = self._join("all_gather_single", 1, [output])
        join.add(self._gather_words(tensor, ("c10d", seq, 0)), _split_into(list(output.view(self.size(), -1))))
        return join.work()

    _allgather_base = all_gather_single  # type: ignore[assignment]  # the name older torch releases call

    def _gather_words(self, tensor: torch.Tensor, key: Any) -> ReduceFuture:
        # A sum to which every other rank contributes zeros gathers exactly: each rank's words
        # sit in its own slot (one operation instead of world_size broadcasts).
        words = _words(tensor)
        slots = np.zeros(self.size() * words.size, dtype=np.int32)
        slots[self.rank() * words.size : (self.rank() + 1) * words.size] = words
        return self.client.allreduce_async(slots, key=key)

    def barrier(self, opts: Any = None) -> Any:
        seq, join = self._join("barrier", 1, [])
        join.add(self.client.allreduce_async(np.ones(1, dtype=np.int32), key=("c10d", seq, 0)), _ignore)
        return join.work()

    def shutdown(self) -> None:
        """Called by ``dist.destroy_process_group()``: close the client."""
        self.client.close()

    def abort(self) -> None:
        self.client.close()

    def __repr__(self) -> str:
        cfg = self.client.config
        return f"RedsrvProcessGroup(job={cfg.job!r}, rank={self.rank()}, size={self.size()}, reducers={len(cfg.reducers)})"


def _split_into(outputs: list[torch.Tensor]) -> Callable[[np.ndarray], None]:
    def write(result: np.ndarray) -> None:
        per_rank = result.size // len(outputs)
        for r, out in enumerate(outputs):
            out.copy_(_unwords(result[r * per_rank : (r + 1) * per_rank], out))

    return write


def register_backend(reducers: Sequence[str] | str | None = None, *, job: str | None = None, **config: Any) -> None:
    """Register the ``"redsrv"`` c10d backend (CPU tensors).

    Settings not given here come from the environment when a group is created (see
    :class:`redsrv.Config`); rank and world size come from the group. Each group is the job
    ``<job>.pg<group name>``, so a hook and the backend can share one ``REDSRV_JOB``. The
    per-operation deadline is the stricter of redsrv's ``op_timeout`` and the group's
    ``timeout=``. Calling it again replaces the settings for groups created afterwards.
    """
    _torch_c10d.check()
    Config.from_env(reducers=reducers, job=job, rank=0, world_size=1, **config)  # fail now, not at init

    def create(spec: _torch_c10d.GroupSpec) -> RedsrvProcessGroup:
        base = Config.from_env(reducers=reducers, job=job, rank=spec.rank, world_size=spec.size, **config)
        op_timeout = base.op_timeout
        if spec.timeout is not None and spec.timeout.total_seconds() > 0:
            op_timeout = min(op_timeout, spec.timeout.total_seconds())
        settings = base.replace(job=f"{base.job}.pg{spec.group_name}", op_timeout=op_timeout)
        return RedsrvProcessGroup(Client(config=settings), rank=spec.rank, size=spec.size)

    _torch_c10d.register(BACKEND_NAME, create)
