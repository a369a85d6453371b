"""The native result receiver (``native/receiver.c``) against the reference decoder.

Two ``transport.FrameReader``s read the same byte stream from TCP connections, split the same
way: one with the receiver (the native plane's client), one without (the Python plane's). Each
has an owner that does what ``ClientCore`` does with RESULT pieces: a piece lands where it
continues its chunk, anything else is skipped. Both must end with the same output bytes, chunk
progress, frame count, last SAFE, ERROR frames and connection outcome, whatever the stream holds:
pieces in and out of order, pieces of unknown chunks or another dtype, SAFE frames, heartbeats,
ERROR frames, corrupted prefixes and headers, and bytes cut anywhere. The receiver's own
outcomes and bounds have tests of their own below.
"""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import weakref

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redsrv.core import plane, transport, wire
from redsrv.core.constants import MAX_RECEIVE_LOWAT_BYTES
from redsrv.core.transport import SKIP, ConnectionBroken, FrameReader

from tests_support import tcp_pair

native = plane._native
pytestmark = pytest.mark.skipif(native is None, reason="redsrv.core._plane is not built")

EXAMPLES = int(os.environ.get("REDSRV_TEST_FUZZ_EXAMPLES", "300"))
fuzz = settings(max_examples=max(EXAMPLES // 3, 20), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

F32 = wire.DType.FLOAT32
#: (key, chunk index) -> (first element, elements): three chunks of one operation, one of another.
CHUNKS = {(7, 0): (0, 40), (7, 1): (40, 300), (7, 2): (340, 20000), (9, 0): (0, 16)}
TOTAL = 20340


class Owner:
    """What the client core does with one stream's RESULT pieces, for the test (ClientCore's
    frame_header, payload_landed, results_landed and safe, minus operations)."""

    def __init__(self, sock: socket.socket, fast: bool) -> None:
        self.out = {key: np.zeros(TOTAL if key == 7 else 16, np.float32) for key in (7, 9)}
        self.done = dict.fromkeys(CHUNKS, 0)
        self.contributors: dict[tuple[int, int], list[int]] = {place: [] for place in CHUNKS}
        self.bitmaps: dict[tuple[int, int], int] = dict.fromkeys(CHUNKS, -1)
        self.frames = 0
        self.safe: int | None = None
        self.errors: list[tuple[int, str]] = []
        self.landing: tuple[tuple[int, int], int, int, int, int] | None = None
        self.in_bitmap = False
        self.bitmap = bytearray(8)
        self.slots: dict[tuple[int, int], object] | None = None
        receiver = None
        if fast:
            self.slots = {}
            for (key, index), (start, count) in CHUNKS.items():
                view = self.out[key][start : start + count].view(np.uint8)
                self.slots[(key, index)] = native.ResultSlot(view, start, count, 4, int(F32), (key, index))
            receiver = native.ResultReceiver(sock.fileno(), 1 << 20, self.slots, MAX_RECEIVE_LOWAT_BYTES)
        self.reader = FrameReader(sock, max_payload=1 << 20, now=0.0, data_frame=wire.FrameType.RESULT, sender="a reducer",
                                  on_header=self.on_header, on_payload=self.on_payload, on_error=self.on_error,
                                  on_count=self.on_count, parser=plane.NativeKernels().frames, fast=receiver,
                                  on_fast=self.on_fast if fast else None)

    def _take_over(self, place: tuple[int, int]) -> None:
        if self.slots is not None and place in self.slots:
            slot = self.slots.pop(place)
            slot.cancel()
            self._fold(place, slot)

    def _fold(self, place: tuple[int, int], slot: object) -> None:
        if slot.pieces:  # type: ignore[attr-defined]
            self.done[place] = slot.done  # type: ignore[attr-defined]
            self.contributors[place] += [slot.min_contributors, slot.max_contributors]  # type: ignore[attr-defined]
            self.bitmaps[place] &= int.from_bytes(slot.bitmap, "little")  # type: ignore[attr-defined]

    def on_header(self, header: wire.FrameHeader) -> object:
        key, offset, count, index, dtype, contributors, bitmap_len = header.fields
        place = (key, index)
        self._take_over(place)
        if place not in CHUNKS:
            self.frames += 1
            return SKIP
        start, total = CHUNKS[place]
        done = self.done[place]
        if offset != start + done or not 0 < count <= total - done or dtype != F32:
            self.frames += 1
            return SKIP
        self.landing = (place, offset, count, contributors, bitmap_len)
        self.in_bitmap = bitmap_len > 0
        if self.in_bitmap:
            return memoryview(self.bitmap)[:bitmap_len], "a result bitmap"
        return self.out[key][offset : offset + count].view(np.uint8).data, "result"

    def on_payload(self) -> object:
        assert self.landing is not None
        place, offset, count, contributors, bitmap_len = self.landing
        if self.in_bitmap:
            self.in_bitmap = False
            return self.out[place[0]][offset : offset + count].view(np.uint8).data, "result"
        self.done[place] += count
        self.contributors[place] += [contributors, contributors]
        self.bitmaps[place] &= int.from_bytes(self.bitmap[:bitmap_len], "little")
        self.frames += 1
        self.landing = None
        return None

    def on_error(self, frame: wire.Error) -> None:
        self.errors.append((int(frame.code), frame.message))

    def on_count(self, frame_type: wire.FrameType, frames: int) -> None:
        if frame_type is not wire.FrameType.SAFE:
            raise ConnectionBroken("protocol", f"unexpected {frame_type.name} frame from a reducer")
        self.safe = frames

    def on_fast(self) -> None:
        fast = self.reader.fast
        landed = fast.take_landed()
        frames, nbytes, safe = fast.take_counts()
        self.frames += frames
        for slot in landed:
            place = slot.tag
            assert self.slots is not None and self.slots.pop(place) is slot
            self._fold(place, slot)
        if safe is not None:
            self.safe = safe

    def progress(self) -> dict[tuple[int, int], int]:
        done = dict(self.done)
        for place, slot in (self.slots or {}).items():
            if slot.pieces:  # type: ignore[attr-defined]
                done[place] = slot.done  # type: ignore[attr-defined]
        return done

    def summary(self) -> tuple[object, ...]:
        contributors = {place: (min(c), max(c)) if c else None for place, c in self.contributors.items()}
        for place, slot in (self.slots or {}).items():
            if slot.pieces:  # type: ignore[attr-defined]
                mine = self.contributors[place] + [slot.min_contributors, slot.max_contributors]  # type: ignore[attr-defined]
                contributors[place] = (min(mine), max(mine))
        bitmaps = dict(self.bitmaps)
        for place, slot in (self.slots or {}).items():
            if slot.pieces:  # type: ignore[attr-defined]
                bitmaps[place] &= int.from_bytes(slot.bitmap, "little")  # type: ignore[attr-defined]
        return (self.out[7].tobytes(), self.out[9].tobytes(), self.progress(), self.frames, self.safe, self.errors,
                contributors, bitmaps)


def run(stream: bytes, cuts: list[int], fast: bool) -> tuple[object, ...]:
    """Feed ``stream`` cut at ``cuts`` to a reader; its owner's summary and how the reading ended."""
    sender, sock = tcp_pair()
    owner = Owner(sock, fast)
    ended: tuple[str, str] | None = None
    try:
        at = 0
        for cut in sorted(set(cuts)) + [len(stream)]:
            if cut > at:
                sender.sendall(stream[at:cut])
                at = cut
                try:
                    owner.reader.read(0.0, 64)
                except ConnectionBroken as exc:
                    ended = (exc.kind, exc.detail)
                    break
        if ended is None:
            sender.shutdown(socket.SHUT_WR)
            for _ in range(10_000):
                try:
                    owner.reader.read(0.0, 64)
                except ConnectionBroken as exc:
                    ended = (exc.kind, exc.detail if exc.kind != "eof" else "")
                    break
            else:
                raise AssertionError("the reader never saw the end of the stream")
    finally:
        owner.reader.release()
        sender.close()
        sock.close()
    return owner.summary() + (ended,)


def result(key: int, index: int, offset: int, count: int, *, dtype: wire.DType = F32, contributors: int = 3,
           bitmap: bytes = b"\x07", seed: int = 0) -> bytes:
    data = (np.arange(count, dtype=np.float32) + offset + seed).astype(wire.numpy_dtype(dtype))
    return wire.encode(wire.Result(key, offset, count, index, dtype, contributors, bitmap, data.tobytes()))


def pieces(key: int, index: int, sizes: list[int], **kw: object) -> list[bytes]:
    start, count = CHUNKS[(key, index)]
    frames, at = [], 0
    for size in sizes:
        size = min(size, count - at)
        if size <= 0:
            break
        frames.append(result(key, index, start + at, size, **kw))  # type: ignore[arg-type]
        at += size
    if at < count:
        frames.append(result(key, index, start + at, count - at, **kw))  # type: ignore[arg-type]
    return frames


def same(stream: bytes, cuts: list[int]) -> tuple[object, ...]:
    reference = run(stream, cuts, fast=False)
    native_run = run(stream, cuts, fast=True)
    assert native_run == reference
    return native_run


def test_the_outcomes_agree_with_the_transport() -> None:
    outcomes = transport.ReceiverOutcome
    assert (native.RECEIVE_DRAINED, native.RECEIVE_LIMIT, native.RECEIVE_HANDOFF, native.RECEIVE_CLOSED,
            native.RECEIVE_FAILED) == (outcomes.DRAINED, outcomes.LIMIT, outcomes.HANDOFF, outcomes.CLOSED, outcomes.FAILED)


def test_steady_pieces_land_in_c_and_every_other_frame_in_the_reference() -> None:
    stream = b"".join(pieces(7, 0, [40]) + pieces(7, 1, [100, 100]) + [wire.encode(wire.Safe(2))]
                      + [wire.encode(wire.Heartbeat())] + pieces(9, 0, [16])
                      + [wire.encode(wire.Error(wire.ErrorCode.TIMEOUT, False, "slow", 7, 2))]
                      + pieces(7, 2, [5000, 5000, 5000]) + [wire.encode(wire.Safe(5))])
    summary = same(stream, [])
    assert summary[2] == {(7, 0): 40, (7, 1): 300, (7, 2): 20000, (9, 0): 16}
    assert summary[3] == 9 and summary[4] == 5 and summary[5] == [(int(wire.ErrorCode.TIMEOUT), "slow")]
    expected = np.arange(TOTAL, dtype=np.float32)
    assert summary[0] == expected.tobytes()


def test_a_stream_cut_at_every_byte_lands_the_same() -> None:
    stream = b"".join(pieces(7, 0, [13, 13]) + [wire.encode(wire.Safe(1))] + pieces(9, 0, [16]))
    same(stream, list(range(1, len(stream))))


def test_the_receiver_lands_without_the_decoder() -> None:
    """The steady pieces never reach the reference owner's callbacks."""
    sender, sock = tcp_pair()
    owner = Owner(sock, fast=True)
    calls = []
    owner.reader.on_header = lambda header: calls.append(header)  # type: ignore[assignment]
    try:
        sender.sendall(b"".join(pieces(7, 2, [4096] * 5) + [wire.encode(wire.Safe(3))]))
        sender.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionBroken, match="closed the connection$"):
            for _ in range(1000):
                owner.reader.read(0.0, 64)
        assert calls == [] and owner.done[(7, 2)] == 20000 and owner.frames == 5 and owner.safe == 3
    finally:
        owner.reader.release()
        sender.close()
        sock.close()


def test_a_cancelled_slot_and_a_piece_out_of_order_go_to_the_reference() -> None:
    stream = b"".join(pieces(7, 1, [100]) [:1] + [result(7, 1, 240, 10)] + pieces(7, 0, [40]))
    summary = same(stream, [])
    assert summary[2][(7, 1)] == 100 and summary[2][(7, 0)] == 40
    sender, sock = tcp_pair()
    owner = Owner(sock, fast=True)
    assert owner.slots is not None
    owner.slots[(7, 0)].cancel()  # type: ignore[attr-defined]
    seen = []
    reference_header = owner.on_header
    owner.reader.on_header = lambda header: seen.append(header.fields[0]) or reference_header(header)  # type: ignore[assignment]
    try:
        sender.sendall(b"".join(pieces(7, 0, [40])))
        owner.reader.read(0.0, 64)
        assert seen == [7] and owner.done[(7, 0)] == 40
    finally:
        owner.reader.release()
        sender.close()
        sock.close()


def test_a_mean_slot_takes_pieces_of_its_first_count_only() -> None:
    """A mean divides a whole chunk by one count (ClientCore._finish_slot): a piece with another
    count goes to the reference, and so does the rest of the chunk."""
    sender, sock = tcp_pair()
    owner = Owner(sock, fast=True)
    assert owner.slots is not None
    start, count = CHUNKS[(7, 1)]
    view = owner.out[7][start : start + count].view(np.uint8)
    owner.slots[(7, 1)] = slot = native.ResultSlot(view, start, count, 4, int(F32), (7, 1), one_count=True)
    seen = []
    reference_header = owner.on_header
    owner.reader.on_header = lambda header: seen.append(header.fields[1]) or reference_header(header)  # type: ignore[assignment]
    try:
        sender.sendall(result(7, 1, start, 100, contributors=3) + result(7, 1, start + 100, 100, contributors=3)
                       + result(7, 1, start + 200, 100, contributors=2))
        owner.reader.read(0.0, 64)
        assert slot.done == 200 and slot.cancelled and seen == [start + 200] and owner.done[(7, 1)] == 300
        assert owner.contributors[(7, 1)] == [3, 3, 2, 2]
    finally:
        owner.reader.release()
        sender.close()
        sock.close()


def test_a_piece_longer_than_its_slot_never_lands_there() -> None:
    """Nothing from the wire sizes a copy: a piece that claims more elements than its chunk has
    left goes to the reference (which skips it), and the memory after the slot stays untouched."""
    start, count = CHUNKS[(7, 0)]
    stream = result(7, 0, start, count + 1) + b"".join(pieces(7, 1, [300]))
    summary = same(stream, [])
    assert summary[2][(7, 0)] == 0 and summary[2][(7, 1)] == 300
    assert np.frombuffer(summary[0], np.float32)[:40].tolist() == [0.0] * 40
    # A first piece, then one that runs 5 elements past the chunk's end (into the next chunk's
    # memory, which a bad bound would overwrite without a crash).
    stream = result(7, 0, start, 10) + result(7, 0, start + 10, count - 10 + 5, seed=100)
    summary = same(stream, [])
    assert summary[2][(7, 0)] == 10
    assert np.frombuffer(summary[0], np.float32)[10:45].tolist() == [0.0] * 35


def test_the_connection_ending_in_a_piece_says_so() -> None:
    stream = b"".join(pieces(7, 2, [20000]))
    for cut in (5, 30, 44, 45, 1000):
        native_run = run(stream[:cut], [], fast=True)
        assert native_run[-1] == ("eof", "")
        assert native_run[:-1] == run(stream[:cut], [], fast=False)[:-1]


def test_slot_and_receiver_refuse_what_does_not_fit() -> None:
    out = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="40 bytes for 9 elements"):
        native.ResultSlot(out.view(np.uint8), 0, 9, 4, int(F32), None)
    with pytest.raises(ValueError):
        native.ResultSlot(out.view(np.uint8), 0, 10, 0, int(F32), None)
    with pytest.raises(BufferError):
        native.ResultSlot(bytes(40), 0, 10, 4, int(F32), None)
    with pytest.raises(ValueError):
        native.ResultReceiver(-1, 1 << 20, {}, 1)
    with pytest.raises(TypeError):
        native.ResultReceiver(0, 1 << 20, [], 1)


def test_a_slot_in_a_reference_cycle_is_collected() -> None:
    """A slot's tag holds its operation, which holds its slots: the collector must see through it."""

    class Marker:
        pass

    marker = Marker()
    tag: list[object] = [marker]
    slot = native.ResultSlot(np.zeros(4, np.float32).view(np.uint8), 0, 4, 4, int(F32), tag)
    tag.append(slot)
    sender, sock = tcp_pair()
    table = {(1, 0): slot}
    receiver = native.ResultReceiver(sock.fileno(), 1 << 20, table, 1)
    table[(0, 0)] = receiver  # type: ignore[assignment]  # a receiver in a cycle too
    gone = weakref.ref(marker)
    del marker, tag, slot, table, receiver
    gc.collect()
    sender.close()
    sock.close()
    assert gone() is None


def test_a_stalled_piece_raises_the_low_water_mark_for_its_rest() -> None:
    sender, sock = tcp_pair()
    owner = Owner(sock, fast=True)
    frame = pieces(7, 2, [20000])[0]
    try:
        sender.sendall(frame[:1000])
        owner.reader.read(0.0, 64)
        assert owner.reader.fast.busy and owner.reader.lowat == min(len(frame) - 1000, MAX_RECEIVE_LOWAT_BYTES)
        assert "RESULT payload" in owner.reader.what
        sender.sendall(frame[1000:])
        for _ in range(1000):
            owner.reader.read(0.0, 64)
            if not owner.reader.fast.busy:
                break
        assert owner.done[(7, 2)] == 20000 and owner.reader.lowat == 1
    finally:
        owner.reader.release()
        sender.close()
        sock.close()


def test_the_plane_refuses_to_load_where_wire_moved_a_field_the_receiver_reads() -> None:
    """The receiver reads RESULT and SAFE headers by position: an import that finds another
    layout fails (``auto`` then runs the Python plane) instead of landing bytes in the wrong
    place."""
    script = """
import importlib, importlib.abc, struct, sys
class HoldBack(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "redsrv.core._plane":
            raise ImportError("held back")
sys.meta_path.insert(0, hold := HoldBack())
from redsrv.core import wire
sys.meta_path.remove(hold)
wire._HEADER_STRUCTS[wire.FrameType.RESULT] = struct.Struct("<QQIIBBHI")  # the pad byte made a field
try:
    importlib.import_module("redsrv.core._plane")
except ImportError as exc:
    print(exc)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "update native/receiver.c" in done.stdout


# --- the differential fuzz -----------------------------------------------------------------

@st.composite
def frames(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["steady", "steady", "steady", "odd", "safe", "heartbeat", "error", "ack", "garbage"]))
    if kind == "steady":
        place = draw(st.sampled_from(sorted(CHUNKS)))
        start, count = CHUNKS[place]
        offset = start + draw(st.integers(0, count - 1))
        size = draw(st.integers(1, start + count - offset))
        bitmap = draw(st.binary(max_size=3))
        return result(*place, offset, size, bitmap=bitmap, contributors=draw(st.integers(0, 65535)),
                      seed=draw(st.integers(0, 3)))
    if kind == "odd":  # unknown chunk, other dtype, beyond the chunk's end
        key, index = draw(st.sampled_from([(7, 5), (8, 0), (7, 0), (9, 0)]))
        dtype = draw(st.sampled_from([F32, F32, wire.DType.FLOAT64, wire.DType.INT32]))
        return result(key, index, draw(st.integers(0, 50)), draw(st.integers(1, 60)), dtype=dtype)
    if kind == "safe":
        return wire.encode(wire.Safe(draw(st.integers(0, 2**64 - 1))))
    if kind == "heartbeat":
        return wire.encode(wire.Heartbeat())
    if kind == "error":
        return wire.encode(wire.Error(wire.ErrorCode.STALE, draw(st.booleans()), draw(st.text(max_size=20)), 7, 1))
    if kind == "ack":
        return wire.encode(wire.Ack(3))
    return draw(st.binary(min_size=1, max_size=60))


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    parts = draw(st.lists(frames(), min_size=1, max_size=12))
    stream = bytearray(b"".join(parts))
    for _ in range(draw(st.integers(0, 2))):  # corrupt a byte somewhere (prefixes and headers most often)
        at = draw(st.integers(0, min(len(stream) - 1, 200)))
        stream[at] = draw(st.integers(0, 255))
    cuts = draw(st.lists(st.integers(1, max(1, len(stream) - 1)), max_size=8))
    return bytes(stream), cuts


@fuzz
@given(streams())
def test_the_receiver_and_the_reference_agree_on_any_stream(case: tuple[bytes, list[int]]) -> None:
    stream, cuts = case
    same(stream, cuts)
