"""The client core's view of one connection to a reducer (:class:`Channel`), of a result frame
being received on it (:class:`Landing`: the views its bytes land in, and the byte work left once
they are in), and of a push converted to its wire dtype as it is written (:class:`ConvertedFrame`).
Plain data and byte work for :mod:`client_core`; no sockets, threads, locks or clocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import chunker
from .client_ops import Copy, Op, PendingPush
from .plane import Kernels, kernels_for

__all__ = ["Channel", "Landing", "ConvertedFrame", "SKIP"]

SKIP = "skip"  # read the payload and drop it (transport.SKIP)


class Channel:
    """The core's side of one connection to a reducer: its push window, the result frame being
    received and the results kept for recovery. ``link`` is the engine's, opaque here."""

    __slots__ = ("reducer", "index", "incarnation", "peer", "loop", "queued", "frames_received", "frames_acked",
                 "bytes_unacked", "ack_queued", "copies", "partial_copies", "result", "bitmap", "scratch",
                 "push_scratch", "gone", "link", "kernels", "slots")

    def __init__(self, reducer: int, index: int, incarnation: int, peer: str, loop: int = 0,
                 kernels: Kernels | None = None) -> None:
        self.reducer = reducer
        self.index = index
        self.incarnation = incarnation
        self.peer = peer
        self.loop = loop  # the engine's loop that serves it
        self.queued = 0  # chunks handed to the writer and not yet written (the push window)
        self.frames_received = 0  # RESULT frames read (or skipped) whole: what ACK frames report
        self.frames_acked = 0
        self.bytes_unacked = 0  # result payload received since the last ACK (C.PROMPT_ACK_BYTES)
        self.ack_queued = False  # an ACK waits in the writer: the next one waits for it
        # Copies of whole results, kept until the reducer says every rank has them (wire.Safe),
        # to give a restarted reducer the results it lost (R22): (key, chunk index) -> copy.
        self.copies: dict[tuple[int, int], Copy] = {}
        self.partial_copies: dict[tuple[int, int], Copy] = {}
        self.result: Landing | None = None  # the result frame being received
        self.bitmap = bytearray(0)
        self.scratch = np.empty(0, dtype=np.uint8)  # for widening compressed results
        self.push_scratch = np.empty(0, dtype=np.uint8)  # for compressing pushes (on the writing thread)
        self.gone = False  # lost or replaced: the core sends nothing more on it
        self.link: Any = None
        self.kernels = kernels or kernels_for("auto")  # the data plane's widening, narrowing and mean (core/plane.py)
        # Where the plane has a result receiver (native/receiver.c): (key, chunk index) -> the
        # ResultSlot a chunk's result lands in without the interpreter (ClientCore._push_frame).
        self.slots: dict[tuple[int, int], Any] | None = {} if self.kernels.result_receiver is not None else None

    def take_scratch(self, nbytes: int, push: bool = False) -> np.ndarray:
        buf = self.push_scratch if push else self.scratch
        if buf.nbytes < nbytes:
            buf = np.empty(nbytes, dtype=np.uint8)
            if push:
                self.push_scratch = buf
            else:
                self.scratch = buf
        view: np.ndarray = buf[:nbytes]
        return view


class Landing:
    """A result frame whose header is in: where its bitmap and data land (views the core hands
    out), and the byte work left once they are in (:meth:`finish_bytes`, which the engine runs
    outside its lock: widening, the mean, the copy kept for recovery)."""

    __slots__ = ("op", "chunk", "start", "stop", "contributors", "bitmap_len", "data_len", "arrived", "in_bitmap",
                 "data", "kept", "into_copy", "save", "keep")

    def __init__(self, op: Op, chunk: chunker.Chunk, start: int, stop: int, contributors: int, bitmap_len: int,
                 data_len: int, arrived: float) -> None:
        self.op, self.chunk, self.start, self.stop = op, chunk, start, stop
        self.contributors, self.bitmap_len, self.data_len, self.arrived = contributors, bitmap_len, data_len, arrived
        self.in_bitmap = bitmap_len > 0
        self.data: tuple[memoryview, str] = (memoryview(b""), "")
        self.kept: Copy | None = None  # the chunk's copy kept for recovery
        self.into_copy = False  # the payload lands in ``kept``, not in ``out``
        self.save: PendingPush | None = None  # copy this chunk's input before the result overwrites it
        self.keep = False

    def save_input(self, copy: Callable[[np.ndarray], np.ndarray]) -> None:
        """Before the first piece of an in-place result lands: keep the input it overwrites (R22),
        copied by ``copy``."""
        push = self.save
        if push is not None and push.saved is None:
            push.saved = copy(push.arr[self.chunk.start : self.chunk.stop])

    def finish_bytes(self, channel: Channel) -> None:
        """The payload is in: widen it, take the mean, keep the copy for recovery."""
        op, chunk, contributors = self.op, self.chunk, self.contributors
        target = op.out[self.start : self.stop]
        if self.into_copy:
            assert self.kept is not None
            as_came = self.kept.data[self.start - chunk.start : self.stop - chunk.start]
            if contributors > 1:
                channel.kernels.divide(target, as_came, contributors)
            else:
                np.copyto(target, as_came)
            return
        widened = op.wire_dtype != op.out.dtype
        if widened:
            channel.kernels.cast(target, channel.take_scratch(self.data_len).view(op.wire_dtype))
        kept = self.kept
        if kept is not None and kept.lender is None:  # a lent copy views ``out``, where the piece already is
            piece = kept.data[self.start - chunk.start : self.stop - chunk.start]
            if widened:
                np.copyto(piece, channel.take_scratch(self.data_len).view(op.wire_dtype))
            else:
                np.copyto(piece, target)
        if op.mean and contributors > 1:
            channel.kernels.divide(target, target, contributors)


class ConvertedFrame:
    """A push whose payload is converted to its wire dtype when the frame is about to be written
    (on the writing thread, into its channel's scratch: the conversion then overlaps with sending
    the previous chunk)."""

    __slots__ = ("header", "arr", "start", "stop", "dtype", "channel")

    def __init__(self, header: bytes, arr: np.ndarray, start: int, stop: int, dtype: np.dtype, channel: Channel) -> None:
        self.header, self.arr, self.start, self.stop, self.dtype, self.channel = header, arr, start, stop, dtype, channel

    def __call__(self) -> list[memoryview]:
        count = self.stop - self.start
        buf = self.channel.take_scratch(count * self.dtype.itemsize, push=True).view(self.dtype)
        self.channel.kernels.cast(buf, self.arr[self.start : self.stop])
        return [memoryview(self.header), buf.view(np.uint8).data]
