"""The native push receiver (``native/pushes.c``) against the reference decoder.

Two ``transport.FrameReader``s read the same byte stream from TCP connections, split the same
way: one with the push receiver (the native plane's reducer), one without (the Python plane's).
Each has an owner that answers as ``ReducerDaemon`` does: a push's payload lands in views it
hands out one part at a time, or is skipped, and the owner may say WAIT (no memory yet) and be
asked again. Both owners must be asked the same questions in the same order, knowing the same
acknowledgements when asked, and end with the same payload bytes, ERROR frames and connection
outcome, whatever the stream holds: pushes of every size, ACKs, heartbeats, ERROR and SAFE
frames, corrupted prefixes and headers, payloads the rules refuse, and bytes cut anywhere. The
receiver coalesces ACKs, so the owners are compared on the largest ACK they were told, not on
each call.
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

from redsrv.core import plane, wire
from redsrv.core.constants import MAX_RECEIVE_LOWAT_BYTES
from redsrv.core.transport import SKIP, WAIT, ConnectionBroken, FrameReader

from tests_support import tcp_pair

native = plane._native
pytestmark = pytest.mark.skipif(native is None, reason="redsrv.core._plane is not built")

EXAMPLES = int(os.environ.get("REDSRV_TEST_FUZZ_EXAMPLES", "300"))
fuzz = settings(max_examples=max(EXAMPLES // 3, 20), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

F32 = wire.DType.FLOAT32
INC = 0x5EED
MAX_PAYLOAD = 1 << 20


class Owner:
    """What the reducer daemon does with one connection's frames, for the test: the push with key
    k is skipped when k % 5 == 0, waits once for memory at its header when k % 7 == 0 and once at
    its first full view when k % 11 == 0, and lands in three parts when k is odd (else whole)."""

    def __init__(self, sock: socket.socket, fast: bool, *, max_lowat: int = MAX_RECEIVE_LOWAT_BYTES,
                 close_at: int | None = None, parser: wire.FrameParser | None = None) -> None:
        self.close_at = close_at  # the key of a push at whose header the owner closes the connection
        self.asked: list[tuple[object, ...]] = []  # every question, with the largest ACK known then
        self.payloads: list[tuple[tuple[int, ...], bytes]] = []
        self.errors: list[tuple[int, str]] = []
        self.acked: int | None = None
        self.waited: set[tuple[int, ...]] = set()
        self.push: tuple[int, ...] | None = None
        self.buffer = bytearray()
        self.parts: list[tuple[int, int]] = []
        receiver = None
        if fast:
            receiver = native.PushReceiver(sock.fileno(), MAX_PAYLOAD, MAX_RECEIVE_LOWAT_BYTES, self.on_header,
                                           self.on_payload, self.on_count, WAIT, SKIP)
        self.reader = FrameReader(sock, max_payload=MAX_PAYLOAD, now=0.0, data_frame=wire.FrameType.PUSH,
                                  sender="a worker", on_header=self.on_header, on_payload=self.on_payload,
                                  on_error=self.on_error, on_count=self.on_count,
                                  parser=parser or plane.NativeKernels().frames, fast=receiver)
        self.reader.max_lowat = max_lowat

    def on_header(self, header: wire.FrameHeader) -> object:
        fields = tuple(header.fields)
        key = fields[0]
        self.asked.append(("header", fields, header.payload_len, self.acked))
        if key == self.close_at:
            self.reader.release()  # what ReducerDaemon._close does, from inside the callback
            return SKIP
        if key % 7 == 0 and ("header",) + fields not in self.waited:
            self.waited.add(("header",) + fields)
            return WAIT
        if key % 5 == 0:
            self.payloads.append((fields, b"skipped"))
            return SKIP
        size = header.payload_len
        self.push, self.buffer = fields, bytearray(size)
        cuts = [0, size // 3, 2 * size // 3, size] if key % 2 else [0, size]
        self.parts = list(zip(cuts, cuts[1:], strict=False))
        return self._next_part()

    def _next_part(self) -> tuple[memoryview, str]:
        start, stop = self.parts.pop(0)
        return memoryview(self.buffer)[start:stop], f"push payload (key {self.push[0]:#x})"  # type: ignore[index]

    def on_payload(self) -> object:
        assert self.push is not None
        self.asked.append(("payload", self.push, len(self.parts), self.acked))
        if self.push[0] % 11 == 0 and ("payload",) + self.push not in self.waited:
            self.waited.add(("payload",) + self.push)
            return WAIT
        if self.parts:
            return self._next_part()
        self.payloads.append((self.push, bytes(self.buffer)))
        self.push = None
        return None

    def on_error(self, frame: wire.Error) -> None:
        self.errors.append((int(frame.code), frame.message))

    def on_count(self, frame_type: wire.FrameType, value: int) -> None:
        if frame_type is not wire.FrameType.ACK:
            raise ConnectionBroken("protocol", f"unexpected {frame_type.name} frame from a worker")
        self.acked = value if self.acked is None else max(self.acked, value)

    def summary(self) -> tuple[object, ...]:
        return (self.asked, self.payloads, self.errors, self.acked)


def run(stream: bytes, cuts: list[int], fast: bool, max_frames: int = 64) -> tuple[object, ...]:
    """Feed ``stream`` cut at ``cuts`` to a reader, reading three times after each part (a WAIT
    is asked again by the next read); the owner's summary and how the reading ended."""
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
                    for _ in range(3):
                        owner.reader.read(0.0, max_frames)
                except ConnectionBroken as exc:
                    ended = (exc.kind, exc.detail)
                    break
        if ended is None:
            sender.shutdown(socket.SHUT_WR)
            for _ in range(10_000):
                try:
                    owner.reader.read(0.0, max_frames)
                except ConnectionBroken as exc:
                    ended = (exc.kind, exc.detail)
                    break
            else:
                raise AssertionError("the reader never saw the end of the stream")
    finally:
        owner.reader.release()
        sender.close()
        sock.close()
    if ended is not None:  # the two runs' connections have their own ports
        ended = (ended[0], ended[1].replace(owner.reader.peer, "PEER"))
    return owner.summary() + (ended,)


def push(key: int, count: int, *, chunk: int = 0, offset: int = 0, total: int | None = None, seed: int = 0,
         payload: bytes | None = None) -> bytes:
    data = (np.arange(count, dtype=np.float32) + seed).tobytes() if payload is None else payload
    total = offset + count if total is None else total
    return wire.encode(wire.Push(key, INC, total, offset, count, chunk, F32, wire.ReduceOp.SUM, 0, data))


def ack(n: int) -> bytes:
    return wire.encode(wire.Ack(n))


def same(stream: bytes, cuts: list[int], max_frames: int = 64) -> tuple[object, ...]:
    reference = run(stream, cuts, fast=False, max_frames=max_frames)
    native_run = run(stream, cuts, fast=True, max_frames=max_frames)
    assert native_run == reference
    return native_run


def test_pushes_acks_and_heartbeats_are_read_in_c_and_the_rest_by_the_reference() -> None:
    stream = b"".join([push(1, 1000), ack(3), ack(5), push(2, 10), wire.encode(wire.Heartbeat()), push(5, 40), ack(4),
                       push(7, 300), push(11, 2000), push(14, 70000), push(3, 0),
                       wire.encode(wire.Error(wire.ErrorCode.TIMEOUT, False, "slow", 1, 0)), ack(9), push(9, 33)])
    asked, payloads, errors, acked, ended = same(stream, [])
    assert [fields[0] for fields, _ in payloads] == [1, 2, 5, 7, 11, 14, 3, 9]
    assert payloads[0][1] == np.arange(1000, dtype=np.float32).tobytes() and payloads[2][1] == b"skipped"
    assert errors == [(int(wire.ErrorCode.TIMEOUT), "slow")] and acked == 9
    assert ("header", (2, INC, 10, 0, 10, 0, int(F32), int(wire.ReduceOp.SUM), 0), 40, 5) in asked
    assert ended == ("eof", "PEER closed the connection")


def test_a_stream_cut_at_every_byte_reads_the_same() -> None:
    stream = b"".join([push(1, 7), ack(1), push(7, 5), wire.encode(wire.Heartbeat()), push(11, 3), ack(2)])
    same(stream, list(range(1, len(stream))))


def test_the_limit_on_frames_per_read_reads_the_same() -> None:
    stream = b"".join([ack(i) for i in range(1, 40)] + [push(k, 9) for k in range(1, 30)])
    for max_frames in (1, 2, 7):
        same(stream, [len(stream) // 2], max_frames=max_frames)


def test_the_receiver_reads_without_the_decoder() -> None:
    """Pushes, ACKs and heartbeats never reach the reference decoder."""
    sender, sock = tcp_pair()
    events: list[int] = []
    reference = plane.NativeKernels().frames
    counting = wire.FrameParser(lambda *a: events.append(1) or reference.parse_prefix(*a),  # type: ignore[func-returns-value]
                                reference.parse_header)
    owner = Owner(sock, fast=True, parser=counting)
    try:
        sender.sendall(b"".join([push(1, 50_000), ack(2), wire.encode(wire.Heartbeat()), push(3, 5), ack(7)]))
        sender.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionBroken, match="closed the connection$"):
            for _ in range(1000):
                owner.reader.read(0.0, 64)
        assert events == [] and [f[0] for f, _ in owner.payloads] == [1, 3] and owner.acked == 7
    finally:
        owner.reader.release()
        sender.close()
        sock.close()


def test_acks_in_a_row_are_told_once_with_the_largest_before_the_next_question() -> None:
    sender, sock = tcp_pair()
    owner = Owner(sock, fast=False)
    told: list[int] = []

    def count(frame_type: wire.FrameType, value: int) -> None:
        told.append(value)
        owner.on_count(frame_type, value)

    fast = native.PushReceiver(sock.fileno(), MAX_PAYLOAD, MAX_RECEIVE_LOWAT_BYTES, owner.on_header,
                               owner.on_payload, count, WAIT, SKIP)
    try:
        sender.sendall(ack(3) + ack(9) + ack(4) + push(1, 10) + ack(12) + ack(11))
        for _ in range(1000):
            fast.receive(64)
            if len(told) == 2:
                break
        assert told == [9, 12] and owner.asked[0][3] == 9 and owner.payloads[0][0][0] == 1
    finally:
        fast.release()
        owner.reader.release()
        sender.close()
        sock.close()


def test_refused_frames_and_other_types_go_to_the_reference_with_its_message() -> None:
    bad_length = bytearray(push(1, 10))
    bad_length[8:12] = (36).to_bytes(4, "little")  # the header says 10 floats, the prefix 36 bytes
    corrupt_magic = b"XXXX" + push(2, 4)[4:]
    cases = {
        "payload the rules refuse": push(3, 2) + bytes(bad_length),
        "SAFE from a worker": push(1, 2) + wire.encode(wire.Safe(3)),
        "RESULT from a worker": wire.encode(wire.Result(1, 0, 1, 0, F32, 1, b"\x01", b"\0" * 4)),
        "bad magic": push(1, 3) + corrupt_magic,
        "heartbeat with a payload": ack(1) + wire.encode(wire.Heartbeat())[:8] + (4).to_bytes(4, "little") + b"abcd",
        "payload over the cap": push(1, 2) + push(3, (MAX_PAYLOAD // 4) + 1),
        "a closing ERROR": push(1, 2) + wire.encode(wire.Error(wire.ErrorCode.CLOSED, True, "bye")),
    }
    for name, stream in cases.items():
        summary = same(stream, [])
        assert summary[4] is not None, name


def test_the_connection_ending_inside_a_frame_says_where() -> None:
    stream = push(1, 20_000) + ack(3) + push(2, 8)
    for cut in (5, 12, 40, 70, 1000, 50_000, len(stream) - 3):
        summary = same(stream[:cut], [])
        assert summary[4][0] == "eof" and "in the middle of" in summary[4][1], (cut, summary[4])


def test_a_payload_lands_with_a_low_water_mark_for_the_rest_of_a_large_view() -> None:
    sender, sock = tcp_pair()
    owner = Owner(sock, fast=True, max_lowat=256 * 1024)
    try:
        frame = push(2, 200_000)  # 800 KB, landed whole
        sender.sendall(frame[:100_000])
        owner.reader.read(0.0, 64)
        assert owner.reader.lowat == 256 * 1024 and owner.reader.payload_received > 0
        assert owner.reader.what == "push payload (key 0x2)"
        sender.sendall(frame[100_000:])
        for _ in range(100):
            owner.reader.read(0.0, 64)
            if owner.payloads:
                break
        assert owner.payloads[0][1] == np.arange(200_000, dtype=np.float32).tobytes() and owner.reader.lowat == 1
    finally:
        owner.reader.release()
        sender.close()
        sock.close()


def test_a_view_larger_than_the_payload_left_is_refused() -> None:
    """Nothing from the wire sizes a copy, and no owner's view may run past its payload."""
    sender, sock = tcp_pair()
    big = bytearray(100)
    fast = native.PushReceiver(sock.fileno(), MAX_PAYLOAD, MAX_RECEIVE_LOWAT_BYTES,
                               lambda header: (memoryview(big), "too big"), lambda: None, lambda *a: None, WAIT, SKIP)
    try:
        sender.sendall(push(1, 10))
        with pytest.raises(ValueError, match="a buffer of 100 bytes for the 40 left of the payload"):
            for _ in range(100):
                fast.receive(64)
        assert big == bytearray(100)
    finally:
        fast.release()
        sender.close()
        sock.close()


def test_the_owner_closing_from_a_callback_stops_the_receiver() -> None:
    sender, sock = tcp_pair()
    owner = Owner(sock, fast=True, close_at=3)
    fast = owner.reader.fast
    try:
        sender.sendall(push(1, 4) + ack(2) + push(3, 4) + push(13, 4) + ack(5))
        for _ in range(100):
            if owner.reader.stopped:
                break
            owner.reader.read(0.0, 64)
        assert [f[0] for f, _ in owner.payloads] == [1] and owner.reader.stopped and owner.acked == 2
        with pytest.raises(ValueError, match="released"):
            fast.receive(64)
    finally:
        sender.close()
        sock.close()


def test_the_receiver_and_its_owner_are_collected() -> None:
    """The receiver holds the owner's bound methods and the owner holds the receiver: the
    collector must see the cycle (the daemon lets go of it at once with FrameReader.release)."""
    sender, sock = tcp_pair()
    try:
        owner = Owner(sock, fast=True)
        ref = weakref.ref(owner)
        del owner
        gc.collect()
        assert ref() is None
    finally:
        sender.close()
        sock.close()


def test_the_plane_refuses_to_load_where_wire_moved_the_ack_count() -> None:
    """The receiver reads an ACK's count by position: an import that finds another layout fails
    (``auto`` then runs the Python plane) instead of acknowledging the wrong results."""
    script = """
import importlib, importlib.abc, struct, sys
class HoldBack(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "redsrv.core._plane":
            raise ImportError("held back")
sys.meta_path.insert(0, hold := HoldBack())
from redsrv.core import wire
sys.meta_path.remove(hold)
wire._HEADER_STRUCTS[wire.FrameType.ACK] = struct.Struct("<II")
try:
    importlib.import_module("redsrv.core._plane")
except ImportError as exc:
    print(exc)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "update native/pushes.c" in done.stdout


# --- fuzz -------------------------------------------------------------------------------------

frames = st.one_of(
    st.builds(lambda key, count, seed: push(key, count, seed=seed), st.integers(1, 40), st.integers(0, 3000),
              st.integers(0, 9)),
    st.builds(ack, st.integers(0, 2**64 - 1)),
    st.just(wire.encode(wire.Heartbeat())),
    st.builds(lambda code, message: wire.encode(wire.Error(code, False, message)),
              st.sampled_from([wire.ErrorCode.TIMEOUT, wire.ErrorCode.STALE]), st.text(max_size=20)),
    st.just(wire.encode(wire.Safe(1))),
)


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    parts = draw(st.lists(frames, min_size=1, max_size=12))
    stream = bytearray(b"".join(parts))
    for _ in range(draw(st.integers(0, 2))):  # overwrite bytes anywhere: prefixes, headers, payloads
        at = draw(st.integers(0, len(stream) - 1))
        stream[at] = draw(st.integers(0, 255))
    cuts = draw(st.lists(st.integers(1, max(1, len(stream) - 1)), max_size=8))
    return bytes(stream), cuts


@fuzz
@given(streams(), st.sampled_from([1, 3, 64]))
def test_any_stream_reads_the_same_with_and_without_the_receiver(case: tuple[bytes, list[int]], max_frames: int) -> None:
    stream, cuts = case
    same(stream, cuts, max_frames=max_frames)
