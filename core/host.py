"""Host-level reduction as a state machine: the workers of one host reduce inside the host
first, then each sends 1/L of the host's sum across hosts, so the host's NIC carries the buffer
once however many workers (GPUs) it has (docs/architecture.md, "Several workers per host").

The L workers of a host share memory: each has a staging area (its *slot*) that every other
worker of the host has mapped too, cut into equal *frames*. An operation travels in *pieces* of
at most one frame, each through four steps on every local worker:

1. **Stage.** The worker copies its piece of the input into a free frame of its own slot and tells
   the others (INPUT, naming the frame and what it passes: element count, dtype, op, root).
2. **Reduce its share.** Local worker ``l`` owns share ``l`` of every piece (the piece's elements
   split in L near-equal runs). Once every local worker's INPUT is in, it combines share ``l`` of
   every slot in local-rank order (:class:`~redsrv.core.combine.Combiner`, the reducers' own rule)
   into local rank 0's frame and hands that run to the cross-host all-reduce, whose result lands in
   its own frame. In the cross-host job the reducers see one contribution per host.
3. **Gather.** When its share's result is in, the owner takes the mean if asked and says DONE;
   once every share of a piece is DONE, every worker copies the whole piece out of the owners'
   frames into its result, then says RELEASED.
4. **Free.** A worker reuses a frame only once every local worker RELEASED its piece: nobody reads
   it any more (a worker says RELEASED only after its own cross-host transfer of the piece ended,
   so the transport no longer reads or writes the frames either).

When the job has one host (every worker shares it), the all-reduce across hosts of a share is the
identity: step 2 ends where the combining ends, nothing is submitted, and the result is read where
it lies (local rank 0's frame, or the broadcast root's). The reducers never see such a job. There a
small piece (:data:`WHOLE_PIECE_BYTES`) skips the sharing: each worker combines all of it straight
into its own result once every INPUT is in, and no DONE is sent for it.

Sums are therefore combined in local-rank order inside a host and in host order across hosts,
16-bit floats rounded once per host and once across hosts: every worker receives the same bytes,
run after run, though not the bytes of the flat path's rank order.

:class:`HostCore` makes every decision and does the arithmetic on the slots it is given; it owns
no socket, thread or clock (the engine in :mod:`host_client` feeds it events and executes its
actions). Messages between the workers of a host are fixed little-endian structs
(:func:`encode` / :func:`decode`), one per packet of a ``SOCK_SEQPACKET`` socket.
"""

from __future__ import annotations

import collections
import enum
import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import errors, wire
from .client_ops import Contributors, ReduceFuture, label
from .combine import Combiner
from .errors import (
    ClientClosedError,
    ContributionMismatchError,
    PeerLostError,
    PeerTimeoutError,
    RedsrvError,
    RemoteProtocolError,
)
from .plane import Kernels

__all__ = ["HostCore", "HostOp", "Placement", "share_reducers", "Hello", "Input", "Done", "Released", "Fail", "Bye", "Message",
           "SubmitShare", "SendToPeers", "Settle", "Action", "encode", "decode", "MAX_MESSAGE_BYTES"]


# --- messages between the workers of one host ------------------------------------------------------


class _Type(enum.IntEnum):
    HELLO = 1
    INPUT = 2
    DONE = 3
    RELEASED = 4
    FAIL = 5
    BYE = 6


@dataclass(frozen=True)
class Hello:
    """The first message each way on a local link (the staging area's file descriptor travels
    beside it): who the sender is and the sizes every worker of the host must share."""

    local_rank: int
    local_size: int
    rank: int
    world_size: int
    pid: int
    slot_bytes: int
    frame_bytes: int


@dataclass(frozen=True)
class Input:
    """Piece ``piece`` of operation ``key`` is in frame ``frame`` of the sender's slot; the rest
    is what the sender passed, which every worker of the host must agree on."""

    key: int
    piece: int
    frame: int
    total: int
    dtype: int
    op: int
    root: int
    mean: bool
    wire_dtype: int


@dataclass(frozen=True)
class Done:
    """The sender's share of piece ``piece`` is reduced across hosts, in its own frame; who
    contributed to it, as host indices (min and max count over the chunks, hosts in all)."""

    key: int
    piece: int
    min_hosts: int
    max_hosts: int
    hosts: bytes  # bitmap of the hosts present in every chunk


@dataclass(frozen=True)
class Released:
    """The sender reads nothing of piece ``piece`` any more."""

    key: int
    piece: int


@dataclass(frozen=True)
class Fail:
    """Operation ``key`` failed on the sender; ``kind`` names the exception class."""

    key: int
    kind: str
    text: str


@dataclass(frozen=True)
class Bye:
    """The sender closed its client."""


Message = Hello | Input | Done | Released | Fail | Bye

_HEADER = struct.Struct("<B")
_STRUCTS: dict[_Type, struct.Struct] = {
    _Type.HELLO: struct.Struct("<IIIIIQQ"),
    _Type.INPUT: struct.Struct("<QIIQBBIBB"),
    _Type.DONE: struct.Struct("<QIIIH"),
    _Type.RELEASED: struct.Struct("<QI"),
    _Type.FAIL: struct.Struct("<QHH"),
    _Type.BYE: struct.Struct("<"),
}
#: The largest message: a FAIL's text is cut to wire.MAX_ERROR_MESSAGE_BYTES, a DONE's bitmap
#: has a bit per host.
MAX_MESSAGE_BYTES = 1 + 8 + 4 + 4096 + 64 + 8192
#: A FAIL names the error's class; the other workers raise the same class (any of redsrv's).
_FAIL_KINDS: dict[str, type[RedsrvError]] = {name: getattr(errors, name) for name in errors.__all__}
_MAX_TEXT = 4096
#: Keys whose messages may arrive before this worker submits them (another worker is ahead by at
#: most its staging area's pieces), and keys remembered after they retired so that their late
#: messages are dropped rather than kept.
_MAX_EARLY_KEYS = 4096
_MAX_RETIRED_KEYS = 4096
#: Who contributed to a share's all-reduce across hosts when the job has one host: that host.
_ONE_HOST = Contributors(1, 1, (0,))
#: On one host, a piece whose frames hold at most this many bytes in all (its size times the
#: local workers) is combined whole by every worker, straight into its result: reading every
#: worker's frame costs less than the round of DONE messages that sharing the work needs
#: (docs/torch_backend.md, "Small operations, second step", has the measurements). Larger pieces are shared.
WHOLE_PIECE_BYTES = 2 << 20


def encode(message: Message) -> bytes:
    """The packet of ``message``.

    >>> decode(encode(Released(key=7, piece=2)))
    Released(key=7, piece=2)
    """
    if isinstance(message, Hello):
        return _pack(_Type.HELLO, message.local_rank, message.local_size, message.rank, message.world_size, message.pid,
                     message.slot_bytes, message.frame_bytes)
    if isinstance(message, Input):
        return _pack(_Type.INPUT, message.key, message.piece, message.frame, message.total, message.dtype, message.op,
                     message.root, message.mean, message.wire_dtype)
    if isinstance(message, Done):
        return _pack(_Type.DONE, message.key, message.piece, message.min_hosts, message.max_hosts,
                     len(message.hosts)) + message.hosts
    if isinstance(message, Released):
        return _pack(_Type.RELEASED, message.key, message.piece)
    if isinstance(message, Fail):
        kind, text = message.kind.encode(), message.text.encode("utf-8")[:_MAX_TEXT]
        return _pack(_Type.FAIL, message.key, len(kind), len(text)) + kind + text
    return _pack(_Type.BYE)


def _pack(kind: _Type, *fields: Any) -> bytes:
    return _HEADER.pack(kind) + _STRUCTS[kind].pack(*fields)


def decode(packet: bytes) -> Message:
    """The message in ``packet``; :class:`RemoteProtocolError` for anything else."""
    if not packet or len(packet) > MAX_MESSAGE_BYTES:
        raise RemoteProtocolError(f"local message of {len(packet)} bytes")
    try:
        kind = _Type(packet[0])
    except ValueError:
        raise RemoteProtocolError(f"unknown local message type {packet[0]}") from None
    body = _STRUCTS[kind]
    if len(packet) < 1 + body.size:
        raise RemoteProtocolError(f"truncated local {kind.name} message ({len(packet)} bytes)")
    fields = body.unpack_from(packet, 1)
    rest = packet[1 + body.size :]
    if rest and kind not in (_Type.DONE, _Type.FAIL):
        raise RemoteProtocolError(f"local {kind.name} message with {len(rest)} trailing bytes")
    if kind is _Type.HELLO:
        return Hello(*fields)
    if kind is _Type.INPUT:
        key, piece, frame, total, dtype, op, root, mean, wire_dtype = fields
        return Input(key, piece, frame, total, dtype, op, root, bool(mean), wire_dtype)
    if kind is _Type.DONE:
        key, piece, min_hosts, max_hosts, bitmap_len = fields
        if len(rest) != bitmap_len:
            raise RemoteProtocolError(f"local DONE message: bitmap of {len(rest)} bytes, header says {bitmap_len}")
        return Done(key, piece, min_hosts, max_hosts, rest)
    if kind is _Type.RELEASED:
        return Released(*fields)
    if kind is _Type.FAIL:
        key, kind_len, text_len = fields
        if len(rest) != kind_len + text_len:
            raise RemoteProtocolError(f"local FAIL message: {len(rest)} bytes of text, header says {kind_len + text_len}")
        return Fail(key, rest[:kind_len].decode("ascii", "replace"), rest[kind_len:].decode("utf-8", "replace"))
    return Bye()


# --- actions ---------------------------------------------------------------------------------------


@dataclass
class SendToPeers:
    """Send ``message`` to every other worker of the host. ``then_here``: then hand it to this
    worker's own :meth:`HostCore.receive`, after the send: a staged piece's INPUT can complete
    the piece here and start its combine, which must not hold the others' news back (every
    worker combines a whole piece, in parallel)."""

    message: Message
    then_here: bool = False


@dataclass
class SubmitShare:
    """Start the cross-host all-reduce of one share: ``x`` in, the result into ``out`` (frames of
    the slots; ``out`` may be ``x``), ``op`` as the wire code (``mean``: divided by the contributing
    hosts). ``poison``: this host's workers disagreed, and this contribution is meant to make the
    other hosts' operation fail too (see :meth:`HostCore._poison`)."""

    key: int
    piece: int
    x: np.ndarray
    out: np.ndarray
    wire_dtype: np.dtype
    op: wire.ReduceOp
    root: int
    mean: bool
    deadline: float
    poison: bool = False


@dataclass
class Settle:
    """Complete ``future`` with ``result`` (an array) or fail it with ``error``; the engine does it
    outside its own state, like a done-callback."""

    key: int
    future: ReduceFuture
    result: np.ndarray | None = None
    contributors: Contributors | None = None
    error: BaseException | None = None


Action = SendToPeers | SubmitShare | Settle


# --- operations ------------------------------------------------------------------------------------


def share_reducers(reducers: int, local_size: int) -> list[list[int]]:
    """The reducers each local worker's share goes to. With at least as many reducers as local
    workers each gets its own (reducer j to local worker j mod L), so every reducer serves one
    share's job and sees one connection per host, as in the flat path, and a host's NIC carries
    one flow per reducer; shares are then weighted by these counts so every reducer carries the
    same load. With fewer reducers, local workers share them.

    >>> share_reducers(4, 2), share_reducers(3, 2), share_reducers(2, 4)
    ([[0, 2], [1, 3]], [[0, 2], [1]], [[0], [1], [0], [1]])
    """
    if reducers >= local_size:
        return [list(range(lr, reducers, local_size)) for lr in range(local_size)]
    return [[lr % reducers] for lr in range(local_size)]


@dataclass(frozen=True)
class Placement:
    """Which workers share which host: ``block`` (host h holds ranks h*L .. h*L+L-1, as torchrun,
    horovodrun and mpirun's default place them) or strided (host h holds h, h+H, h+2H, ...)."""

    local_size: int
    hosts: int
    block: bool

    def rank(self, host: int, local_rank: int) -> int:
        """The global rank of ``local_rank`` on ``host``.

        >>> Placement(2, 3, block=True).rank(1, 1), Placement(2, 3, block=False).rank(1, 1)
        (3, 4)
        """
        return host * self.local_size + local_rank if self.block else host + local_rank * self.hosts

    @classmethod
    def of(cls, ranks_by_local_rank: Sequence[int], world_size: int) -> tuple[Placement, int] | None:
        """The placement and this host's index, from the global ranks of its workers in local-rank
        order; ``None`` if they follow neither pattern.

        >>> Placement.of([2, 3], 4), Placement.of([1, 3], 4), Placement.of([3, 1], 4)
        ((Placement(local_size=2, hosts=2, block=True), 1), (Placement(local_size=2, hosts=2, block=False), 1), None)
        """
        size = len(ranks_by_local_rank)
        hosts, first = world_size // size, ranks_by_local_rank[0]
        if world_size % size:
            return None
        if first % size == 0 and list(ranks_by_local_rank) == [first + i for i in range(size)]:
            return cls(size, hosts, True), first // size
        if first < hosts and list(ranks_by_local_rank) == [first + i * hosts for i in range(size)]:
            return cls(size, hosts, False), first
        return None


@dataclass
class _Piece:
    index: int
    start: int  # elements of the operation
    stop: int
    frame: int | None = None  # this worker's frame, once staged
    inputs: dict[int, Input] = field(default_factory=dict)  # local rank -> its INPUT
    submitted: bool = False  # this worker's share went to the cross-host all-reduce
    share_over: bool = False  # ... and that transfer ended (or never started): its frames are no longer read
    done: dict[int, Done] = field(default_factory=dict)
    released: set[int] = field(default_factory=set)
    copied_out: bool = False
    whole: bool = False  # combined whole by every worker (one host, small: :data:`WHOLE_PIECE_BYTES`)
    told_released: bool = False
    freed: bool = False  # every worker released it (and this worker's frame, if any, is free again)

    def share(self, local_rank: int, bounds: Sequence[int]) -> tuple[int, int]:
        """Elements ``[start, stop)`` of share ``local_rank``, relative to the piece: ``bounds``
        are the cumulative share weights (see :class:`HostCore`)."""
        count, total = self.stop - self.start, bounds[-1]
        return count * bounds[local_rank] // total, count * bounds[local_rank + 1] // total


@dataclass
class HostOp:
    """One host-level all-reduce or broadcast, as the caller submitted it."""

    key: int
    label: Any
    x: np.ndarray  # flat input
    out: np.ndarray  # flat result
    wire_dtype: np.dtype
    op: wire.ReduceOp
    root: int  # global rank of a broadcast's root
    mean: bool
    future: ReduceFuture
    deadline: float
    started: float
    shape: tuple[int, ...] = ()
    given_out: np.ndarray | None = None
    pieces: list[_Piece] = field(default_factory=list)
    staged: int = 0  # pieces staged so far, in order
    copied: int = 0  # pieces copied out
    failed: bool = False
    settled: bool = False
    min_hosts: int = 1 << 30
    max_hosts: int = 0
    hosts_in_all: int = -1

    @property
    def signature(self) -> tuple[int, int, int, int, bool, int]:
        return (self.x.size, wire.dtype_code(self.x.dtype), int(self.op), self.root, self.mean,
                wire.dtype_code(self.wire_dtype))

    def describe(self) -> str:
        return _describe(*self.signature[:5])


def _describe(total: int, dtype: int, op: int, root: int, mean: bool) -> str:
    """What a worker passed, for messages: "1000 x float32 sum", "8 x int64 broadcast from rank 2"."""
    code = wire.ReduceOp(op)
    what = "broadcast" if code is wire.ReduceOp.BROADCAST else ("mean" if mean else code.name.lower())
    return f"{total} x {wire.numpy_dtype(wire.DType(dtype))} {what}" \
        + (f" from rank {root}" if code is wire.ReduceOp.BROADCAST else "")


class HostCore:
    """The host-level protocol of one worker: operations, the frames of its slot, and the
    messages of its host's other workers. See the module docstring; every method returns the
    actions for the engine to carry out, in order.

    ``slots[i]`` is local worker i's staging area (``uint8``, ``frames`` frames of
    ``frame_bytes``); ``job``, ``rank`` and ``peers`` (local rank -> "rank R, pid P") name things in
    messages. ``all_mode``: every host contributes to every chunk (straggler mode "all"), so a mean
    divides by the world size once. ``weights``: how much of each piece each local worker owns
    (default: equal shares), in proportion to the reducers its cross-host client reaches
    (:func:`share_reducers`). ``kernels``: the data plane that combines (core/plane.py).
    ``whole_piece_bytes``: on one host, pieces up to this size times the local workers are
    combined whole by every worker (:data:`WHOLE_PIECE_BYTES`; 0 shares every piece)."""

    def __init__(self, *, local_rank: int, placement: Placement, host: int, slots: Sequence[np.ndarray],
                 frame_bytes: int, job: str, rank: int, peers: dict[int, str], all_mode: bool,
                 weights: Sequence[int] | None = None, kernels: Kernels | None = None,
                 whole_piece_bytes: int = WHOLE_PIECE_BYTES) -> None:
        self.local_rank = local_rank
        self.local_size = placement.local_size
        self.placement = placement
        self.host = host
        self.slots = list(slots)
        self.frame_bytes = frame_bytes
        self.free_frames = list(range(len(self.slots[local_rank]) // frame_bytes))[::-1]
        self.job = job
        self.rank = rank
        self.peers = peers
        self.all_mode = all_mode
        self.bounds = [0, *itertools.accumulate(weights if weights is not None else [1] * self.local_size)]
        self.ops: dict[int, HostOp] = {}  # key -> operation, in submission order, until every frame is free
        self.early: dict[int, list[tuple[int, Message]]] = {}  # messages for keys not submitted here yet
        self.retired: collections.OrderedDict[int, None] = collections.OrderedDict()  # keys whose late messages are dropped
        self.broken: RedsrvError | None = None
        self._combiner = Combiner(kernels)
        self.whole_piece_bytes = whole_piece_bytes

    # --- events ---

    def submit(self, op: HostOp) -> list[Action]:
        """A new operation (the caller checked that its key is not in :attr:`ops`)."""
        if self.broken is not None:
            return [Settle(op.key, op.future, error=self.broken)]
        piece_elements = max(1, self.frame_bytes // op.x.dtype.itemsize)
        op.pieces = [_Piece(i, start, min(start + piece_elements, op.x.size))
                     for i, start in enumerate(range(0, max(op.x.size, 1), piece_elements))]
        if self.one_host:
            for piece in op.pieces:
                # Every worker decides alike: the same signature cuts the same pieces, and a
                # different one fails as a mismatch before any piece is combined.
                read = (piece.stop - piece.start) * op.x.dtype.itemsize * self.local_size
                piece.whole = 0 < self.whole_piece_bytes and read <= self.whole_piece_bytes
        self.ops[op.key] = op
        actions: list[Action] = []
        for sender, message in self.early.pop(op.key, []):
            actions += self.receive(sender, message)
        return actions

    def receive(self, sender: int, message: Message) -> list[Action]:
        """A message from local worker ``sender`` (this worker's own messages come back through
        here too, so that every worker goes through the same steps)."""
        if isinstance(message, (Hello, Bye)):
            return []  # Hello belongs to the rendezvous; a Bye is handled by peer_lost
        op = self.ops.get(message.key)
        if op is None:
            if self.broken is None and message.key not in self.retired and len(self.early) < _MAX_EARLY_KEYS:
                self.early.setdefault(message.key, []).append((sender, message))
            return []
        if isinstance(message, Fail):
            return self._fail(op, _rebuild(message), tell=False)
        if not isinstance(message, (Input, Done, Released)) or message.piece >= len(op.pieces):
            actions = self._fail(op, ContributionMismatchError(
                f"local rank {sender} ({self.peers.get(sender)}) sent piece {getattr(message, 'piece', '?')} of an "
                f"operation that has {len(op.pieces)} here: the workers of this host disagree on {op.describe()}",
                job=self.job, rank=self.rank, key=label(op.label), phase="host-level reduction"))
            if isinstance(message, Input) and sender != self.local_rank:
                # A piece this worker does not have (a size or dtype that cuts the operation into
                # more pieces): it reads nothing of it, and the sender's frame waits for its word.
                actions.append(SendToPeers(Released(op.key, message.piece)))
            return actions
        piece = op.pieces[message.piece]
        if isinstance(message, Input):
            piece.inputs[sender] = message
            return self._try_reduce(op, piece)
        if isinstance(message, Done):
            piece.done[sender] = message
            return self._try_copy_out(op, piece)
        piece.released.add(sender)
        return self._try_free(op, piece)

    def share_finished(self, key: int, piece_index: int, now: float, contributors: Contributors | None = None,
                       error: BaseException | None = None) -> list[Action]:
        """This worker's cross-host all-reduce of its share of a piece ended."""
        op = self.ops.get(key)
        if op is None:
            return []
        piece = op.pieces[piece_index]
        piece.share_over = True
        actions: list[Action] = []
        if error is not None or contributors is None:
            if not op.failed:
                actions += self._fail(op, _across_hosts(error, self, op))
        elif not op.failed:
            actions += self._finish_share(op, piece, contributors)
        return actions + self._try_release(op, piece) + self._try_free(op, piece)

    def peer_lost(self, local_rank: int, why: str) -> list[Action]:
        """A local worker's link broke or it said goodbye (every message it sent before is in):
        every operation that still needs its INPUT or DONE fails, and so does every later one
        (its share of each piece can no longer be reduced). An operation it has done its part
        of completes: a worker that finished and closed first leaves the others to finish too."""
        if self.broken is None:
            self.broken = PeerLostError(f"local rank {local_rank} ({self.peers.get(local_rank)}) on this host {why}; "
                                        "the host-level reduction of every worker of this host fails from now on",
                                        job=self.job, rank=self.rank, phase="host-level reduction")
        actions: list[Action] = []
        for op in list(self.ops.values()):
            if op.settled:
                del self.ops[op.key]  # its frames wait for a RELEASED that may never come: a broken host frees nothing
            elif any(local_rank not in piece.inputs or (local_rank not in piece.done and not piece.whole)
                     for piece in op.pieces):
                actions += self._fail(op, self.broken, tell=False)
        self.early.clear()
        return actions

    @property
    def busy(self) -> bool:
        """Some operation is not settled yet."""
        return any(not op.settled for op in self.ops.values())

    def tick(self, now: float) -> list[Action]:
        """Operations past their deadline fail, naming what this host still waits for."""
        actions: list[Action] = []
        for op in list(self.ops.values()):
            if not op.failed and not op.settled and now >= op.deadline:
                actions += self._fail(op, PeerTimeoutError(
                    f"host-level {op.describe()} did not complete: {self._waiting_for(op)}", job=self.job, rank=self.rank,
                    key=label(op.label), phase="host-level reduction", elapsed=now - op.started,
                    timeout=op.deadline - op.started))
        return actions

    def close(self, error: ClientClosedError) -> list[Action]:
        """The client closes: every operation fails with ``error``."""
        self.broken = self.broken or error
        return [a for op in list(self.ops.values()) if not op.failed for a in self._fail(op, error, tell=False)]

    # --- the steps ---

    def _next_to_stage(self) -> tuple[HostOp, _Piece] | None:
        """The next piece to copy in, operations in submission order (a later operation never
        takes a frame before an earlier one has all of its own: every worker of the host stages
        in the same order, so no two wait for each other's frames)."""
        if not self.free_frames:
            return None
        for op in self.ops.values():
            if not op.failed and op.staged < len(op.pieces):
                return op, op.pieces[op.staged]
        return None

    @property
    def can_stage(self) -> bool:
        """A piece waits to be staged and a frame is free: the engine should call :meth:`stage`."""
        return self._next_to_stage() is not None

    def stage(self) -> list[Action]:
        """Copy the next piece into a free frame and announce it. One piece per call, so that
        the engine reads the other workers' messages between pieces: their reductions start
        while this worker is still copying."""
        found = self._next_to_stage()
        if found is None:
            return []
        op, piece = found
        piece.frame = self.free_frames.pop()
        op.staged += 1
        if op.op is not wire.ReduceOp.BROADCAST or op.root == self.rank:
            data = op.x[piece.start : piece.stop].view(np.uint8)
            self._frame(self.local_rank, piece.frame)[: data.size] = data
        total, dtype, code, root, mean, wire_dtype = op.signature
        return [SendToPeers(Input(op.key, piece.index, piece.frame, total, dtype, code, root, mean, wire_dtype),
                            then_here=True)]

    def _try_reduce(self, op: HostOp, piece: _Piece) -> list[Action]:
        if len(piece.inputs) < self.local_size or piece.submitted or op.failed:
            return []
        mine = op.signature
        for local_rank in sorted(piece.inputs):
            other = piece.inputs[local_rank]
            if (other.total, other.dtype, other.op, other.root, other.mean, other.wire_dtype) != mine:
                return self._mismatch(op, local_rank, other)
        piece.submitted = True
        if piece.whole:
            return self._combine_whole(op, piece)
        start, stop = piece.share(self.local_rank, self.bounds)
        item = op.x.dtype.itemsize
        assert piece.frame is not None  # staged before its own INPUT went out
        mine_out = self._frame(self.local_rank, piece.frame)[start * item : stop * item].view(op.x.dtype)
        if op.op is wire.ReduceOp.BROADCAST:
            root_host, root_local = self._locate(op.root)
            if self.one_host:
                return self._identity_across_hosts(op, piece)
            if root_host == self.host:
                frame = piece.inputs[root_local].frame
                x = self._frame(root_local, frame)[start * item : stop * item].view(op.x.dtype)
            else:
                x = mine_out  # a non-root host sends nothing: only the shape matters
            return [SubmitShare(op.key, piece.index, x, mine_out, op.wire_dtype, op.op, root_host, False, op.deadline)]
        runs = [self._frame(r, piece.inputs[r].frame)[start * item : stop * item] for r in range(self.local_size)]
        self._combiner.combine_into_first(runs, wire.DType(wire.dtype_code(op.x.dtype)), op.op)
        if self.one_host:
            return self._identity_across_hosts(op, piece)
        x = runs[0].view(op.x.dtype)
        inner_mean = op.mean and not self.all_mode  # "all": one division by the world size in _finish_share
        return [SubmitShare(op.key, piece.index, x, mine_out, op.wire_dtype, op.op, 0, inner_mean, op.deadline)]

    def _identity_across_hosts(self, op: HostOp, piece: _Piece) -> list[Action]:
        """On one host the all-reduce across hosts has one contribution, this host's: its result
        is its input, so the share is finished where it lies (:meth:`_result`) and nothing is
        submitted. The reducers never see the operation; the bytes are those of combining in
        local-rank order, which on one host is rank order, as the reducers combine."""
        piece.share_over = True  # no transfer reads the frames
        return self._finish_share(op, piece, _ONE_HOST)

    def _combine_whole(self, op: HostOp, piece: _Piece) -> list[Action]:
        """One host, a small piece: this worker combines every worker's frame in local-rank
        order (rank order, the reducers' order) straight into its own result, with the same
        kernels and rounding as a shared piece (bitwise the same bytes), and needs nobody's
        DONE. It only reads the frames, so each worker's frame stays as staged until all
        released it."""
        piece.share_over = True  # no transfer reads the frames
        target = op.out[piece.start : piece.stop].view(np.uint8)
        length = target.size

        def staged(local_rank: int) -> np.ndarray:
            return self._frame(local_rank, piece.inputs[local_rank].frame)[:length]

        if op.op is wire.ReduceOp.BROADCAST:
            root_local = self._locate(op.root)[1]
            # The root's own in-place broadcast: its frame holds a copy of the very bytes of its
            # result (``x`` may not change while the operation runs), so there is nothing to copy back.
            if root_local != self.local_rank or target.ctypes.data != op.x[piece.start : piece.stop].ctypes.data:
                target[:] = staged(root_local)
        else:
            target[:] = staged(0)
            runs = [target, *(staged(r) for r in range(1, self.local_size))]
            self._combiner.combine_into_first(runs, wire.DType(wire.dtype_code(op.x.dtype)), op.op)
            if op.mean and self.local_size > 1:
                result = target.view(op.x.dtype)
                self._combiner.kernels.divide(result, result, self.local_size)
        return self._piece_copied(op, piece, _ONE_HOST.min_count, _ONE_HOST.max_count, 1)

    def _finish_share(self, op: HostOp, piece: _Piece, contributors: Contributors) -> list[Action]:
        result = self._result(op, piece, self.local_rank).view(op.x.dtype)
        if op.mean:
            # all mode: every host's L workers are in every chunk; otherwise the cross-host all-reduce
            # already divided each chunk by its own contributing hosts.
            divisor = contributors.max_count * self.local_size if self.all_mode else self.local_size
            if divisor > 1:
                self._combiner.kernels.divide(result, result, divisor)
        hosts = 0
        for h in contributors.ranks:
            hosts |= 1 << h
        message = Done(op.key, piece.index, contributors.min_count, contributors.max_count,
                       hosts.to_bytes((self.placement.hosts + 7) // 8, "little"))
        return [SendToPeers(message), *self.receive(self.local_rank, message)]

    def _try_copy_out(self, op: HostOp, piece: _Piece) -> list[Action]:
        if len(piece.done) < self.local_size or piece.copied_out or op.failed:
            return []
        item = op.x.dtype.itemsize
        target = op.out[piece.start : piece.stop].view(np.uint8)
        min_hosts, max_hosts, hosts = op.min_hosts, op.max_hosts, -1
        for owner in range(self.local_size):
            start, stop = piece.share(owner, self.bounds)
            done = piece.done[owner]
            target[start * item : stop * item] = self._result(op, piece, owner)
            min_hosts = min(min_hosts, done.min_hosts)
            max_hosts = max(max_hosts, done.max_hosts)
            hosts &= int.from_bytes(done.hosts, "little")
        return self._piece_copied(op, piece, min_hosts, max_hosts, hosts)

    def _piece_copied(self, op: HostOp, piece: _Piece, min_hosts: int, max_hosts: int, hosts: int) -> list[Action]:
        """``piece`` is in this worker's result; ``hosts`` (a bitmap) contributed to all of it."""
        op.min_hosts = min(op.min_hosts, min_hosts)
        op.max_hosts = max(op.max_hosts, max_hosts)
        op.hosts_in_all &= hosts
        piece.copied_out = True
        op.copied += 1
        actions: list[Action] = []
        if op.copied == len(op.pieces):
            op.settled = True
            if self.broken is not None:
                del self.ops[op.key]
            size = self.local_size
            ranks = tuple(sorted(self.placement.rank(h, lr) for h in range(self.placement.hosts)
                                 if op.hosts_in_all >> h & 1 for lr in range(size)))
            actions.append(Settle(op.key, op.future, result=op.out.reshape(op.shape) if op.given_out is None else op.given_out,
                                  contributors=Contributors(op.min_hosts * size, op.max_hosts * size, ranks)))
        return actions + self._try_release(op, piece)

    def _try_release(self, op: HostOp, piece: _Piece) -> list[Action]:
        """Say RELEASED once this worker reads nothing of the piece any more: it copied the piece
        out, or the operation failed, and its own share's cross-host transfer is over. A failed
        operation's pieces that this worker never staged are released at once: the other
        workers may have staged them, and their frames wait for every worker's word."""
        if piece.told_released or not (piece.copied_out or op.failed) or (piece.submitted and not piece.share_over):
            return []
        piece.told_released = True
        message = Released(op.key, piece.index)
        return [SendToPeers(message), *self.receive(self.local_rank, message)]

    def _try_free(self, op: HostOp, piece: _Piece) -> list[Action]:
        if piece.freed or (piece.submitted and not piece.share_over):
            return []
        # A failed operation's piece that this worker never staged holds none of its frames: no
        # other worker's word is needed (and one with fewer pieces will never give it).
        if len(piece.released) < self.local_size and not (op.failed and piece.frame is None):
            return []
        if piece.frame is not None:
            self.free_frames.append(piece.frame)
            piece.frame = None
        piece.freed = True
        if op.settled and all(p.freed for p in op.pieces):
            del self.ops[op.key]
            self.retired[op.key] = None
            while len(self.retired) > _MAX_RETIRED_KEYS:
                self.retired.popitem(last=False)
        return []

    # --- failures ---

    def _fail(self, op: HostOp, error: RedsrvError, *, tell: bool = True, poison: bool | None = None) -> list[Action]:
        """Fail ``op`` here (and, ``tell``, on the host's other workers). Its frames stay taken
        until every worker released them: a cross-host transfer may still read them.

        ``poison`` (by default where every host must contribute, straggler mode "all"): make
        the other hosts fail the operation now rather than at their deadline, since this host
        will not send the shares it has not sent (:meth:`_poison`). In the straggler modes the
        other hosts close their chunks without this host, as they would without a flat worker."""
        actions: list[Action] = []
        if op.failed:
            return actions
        op.failed = True
        if poison if poison is not None else self.all_mode and self.broken is None:
            actions += self._poison(op)
        if tell and self.broken is None:
            actions.append(SendToPeers(Fail(op.key, type(error).__name__, error.detail)))
        if not op.settled:
            op.settled = True
            actions.append(Settle(op.key, op.future, error=error))
        if self.broken is not None:
            del self.ops[op.key]  # a broken host frees nothing more: its lost worker will not say RELEASED
            return actions
        op.staged = len(op.pieces)  # nothing more is staged
        for piece in op.pieces:
            actions += self._try_release(op, piece)
        return actions

    def _mismatch(self, op: HostOp, local_rank: int, other: Input) -> list[Action]:
        theirs = _describe(other.total, other.dtype, other.op, other.root, other.mean)
        error = ContributionMismatchError(
            f"the workers of this host disagree: local rank {self.local_rank} (rank {self.rank}) passed {op.describe()}, "
            f"local rank {local_rank} ({self.peers.get(local_rank)}) passed {theirs}",
            job=self.job, rank=self.rank, key=label(op.label), phase="host-level reduction")
        return self._fail(op, error, tell=False, poison=True)

    def _poison(self, op: HostOp) -> list[Action]:
        """Make the other hosts' operation fail as this host's did (RELIABILITY R23), instead of
        waiting for this host's shares until their deadline: push, for every piece whose share
        this worker has not sent, a one-element contribution under the share's key with another
        op than any host could pass. Every non-empty contribution under a key has a chunk 0 on
        the same reducer (chunker.placement), so it meets theirs there, and the reducer fails that
        chunk for every host (a mismatch of shape), which fails their share, their piece and their
        operation, and ends their transfers, so their frames are free again. Every worker of this
        host fails the operation, so every one of them poisons its own share, whatever it
        passed."""
        if self.one_host:
            return []  # no other host to tell
        flipped = wire.ReduceOp.SUM if op.op is wire.ReduceOp.BROADCAST else wire.ReduceOp.BROADCAST
        token = np.zeros(1, dtype=np.uint8)
        return [SubmitShare(op.key, piece.index, token, token, token.dtype, flipped, self.host, False, op.deadline,
                            poison=True) for piece in op.pieces if not piece.submitted]

    def _waiting_for(self, op: HostOp) -> str:
        for piece in op.pieces:
            if piece.frame is None and not piece.copied_out:
                return f"piece {piece.index} waits for a free frame of this worker's staging area"
            missing = [r for r in range(self.local_size) if r not in piece.inputs]
            if missing:
                who = ", ".join(self.peers.get(r, "?") for r in missing)
                return f"piece {piece.index} waits for local ranks {missing} ({who})"
            missing = [r for r in range(self.local_size) if r not in piece.done]
            if missing:
                return (f"piece {piece.index} waits for the cross-host all-reduce of the shares of local ranks {missing} "
                        f"(job {self.job!r}, host {self.host} of {self.placement.hosts})")
        return "every piece is in"

    # --- helpers ---

    @property
    def one_host(self) -> bool:
        """The job is this host's workers alone (``placement.hosts == 1``): operations finish
        inside the host, with no cross-host submission (:meth:`_identity_across_hosts`)."""
        return self.placement.hosts == 1

    def _result(self, op: HostOp, piece: _Piece, owner: int) -> np.ndarray:
        """The bytes of share ``owner`` of ``piece``'s result: in the owner's own frame, where
        its cross-host all-reduce put them; on one host, where the identity left them (local rank
        0's frame for a reduction, combined into it; the root's frame for a broadcast)."""
        start, stop = piece.share(owner, self.bounds)
        item = op.x.dtype.itemsize
        holder = owner
        if self.one_host:
            holder = self._locate(op.root)[1] if op.op is wire.ReduceOp.BROADCAST else 0
        return self._frame(holder, piece.inputs[holder].frame)[start * item : stop * item]

    def _frame(self, local_rank: int, frame: int) -> np.ndarray:
        base = frame * self.frame_bytes
        return self.slots[local_rank][base : base + self.frame_bytes]

    def _locate(self, rank: int) -> tuple[int, int]:
        """(host, local rank) of global ``rank``."""
        p = self.placement
        return divmod(rank, p.local_size) if p.block else (rank % p.hosts, rank // p.hosts)


def _rebuild(message: Fail) -> RedsrvError:
    """The error another worker of the host failed the operation with, as the same class."""
    cls = _FAIL_KINDS.get(message.kind, PeerLostError)
    return cls(message.text)


def _across_hosts(error: BaseException | None, core: HostCore, op: HostOp) -> RedsrvError:
    """The cross-host all-reduce's error, as the same class, saying where it happened."""
    text = f"host-level {op.describe()}: the all-reduce across hosts of this worker's share failed (host {core.host} of " \
           f"{core.placement.hosts}): "
    if isinstance(error, RedsrvError):
        rebuilt = type(error)(text + str(error), job=core.job, rank=core.rank, key=label(op.label),
                              phase="host-level reduction")
        return rebuilt
    return PeerLostError(text + repr(error), job=core.job, rank=core.rank, key=label(op.label), phase="host-level reduction")

