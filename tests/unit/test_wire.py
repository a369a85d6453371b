"""The sans-IO wire protocol, fed whole, byte by byte, and with trailing bytes (h11 style)."""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest

from redsrv.core import wire
from redsrv.core.constants import MAGIC, PROTOCOL_VERSION
from redsrv.core.errors import LocalProtocolError, RemoteProtocolError

NONCE = bytes(range(32))

FRAMES = [
    wire.Hello("run-17", 2, 4, 0xDEADBEEF, NONCE, wire.StragglerMode.FIRST_M, 3, 0, 300_000),
    wire.Hello("j\u00f6b", 0, 1, 1, NONCE),
    wire.Challenge(0x1234, NONCE, bytes(32), True),
    wire.Proof(bytes(range(32, 64))),
    wire.Welcome(0x1234, 1 << 26, 1000),
    wire.Push(7, 0x1234, 100, 10, 3, 1, wire.DType.FLOAT32, wire.ReduceOp.SUM, 0, np.arange(3, dtype="<f4").tobytes()),
    wire.Push(7, 1, 100, 10, 3, 1, wire.DType.FLOAT32, wire.ReduceOp.BROADCAST, 2, b""),
    wire.Push(2**64 - 1, 1, 5, 0, 5, 0, wire.DType.BFLOAT16, payload=np.ones(5, ml_dtypes.bfloat16).tobytes()),
    wire.Result(7, 10, 3, 1, wire.DType.FLOAT32, 2, b"\x05", np.arange(3, dtype="<f4").tobytes()),
    wire.Result(9, 0, 0, 0, wire.DType.INT64, 0, b"", b""),
    wire.Error(wire.ErrorCode.CONTRIBUTION_MISMATCH, False, "rank 0 sent float32[4], rank 1 sent float16[4]", 7, 2),
    wire.Error(wire.ErrorCode.PROTOCOL, True, ""),
    wire.Heartbeat(),
    wire.Hello("recovering", 1, 3, 5, NONCE, reconnect_window_ms=120_000),
    wire.Push(8, 0x1234, 4, 0, 4, 0, wire.DType.INT8, wire.ReduceOp.SETTLED, 0, bytes(4)),
    wire.Push(9, 0x1234, 2, 0, 2, 0, wire.DType.BOOL, wire.ReduceOp.BXOR, 0, bytes(2)),
    wire.Ack(2**40),
    wire.Safe(17),
]


def _normalise(frame: wire.Frame) -> wire.Frame:
    """Payloads come back as bytes or memoryviews; compare as bytes."""
    if isinstance(frame, (wire.Push, wire.Result)):
        return type(frame)(**{**frame.__dict__, "payload": bytes(frame.payload)})
    return frame


def _decode_all(data: bytes, step: int | None = None) -> list[wire.Frame]:
    decoder = wire.FrameDecoder()
    frames = []
    pieces = [data] if step is None else [data[i : i + step] for i in range(0, len(data), step)]
    for piece in pieces:
        decoder.receive_data(piece)
        while (frame := decoder.next_frame()) is not None:
            frames.append(_normalise(frame))
    return frames


@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: type(f).__name__)
def test_round_trip_whole(frame: wire.Frame) -> None:
    assert _decode_all(wire.encode(frame)) == [_normalise(frame)]


def test_all_frames_byte_by_byte() -> None:
    data = b"".join(wire.encode(f) for f in FRAMES)
    assert _decode_all(data, step=1) == [_normalise(f) for f in FRAMES]


def test_trailing_bytes_wait_for_the_rest() -> None:
    data = wire.encode(FRAMES[5]) + wire.encode(FRAMES[8])
    decoder = wire.FrameDecoder()
    decoder.receive_data(data[:-3])
    assert _normalise(decoder.next_frame()) == _normalise(FRAMES[5])  # type: ignore[arg-type]
    assert decoder.next_frame() is None
    decoder.receive_data(data[-3:])
    assert _normalise(decoder.next_frame()) == _normalise(FRAMES[8])  # type: ignore[arg-type]
    assert decoder.next_frame() is None


def test_header_helpers_match_full_encoding() -> None:
    push = FRAMES[5]
    assert isinstance(push, wire.Push)
    assert wire.push_header(push, len(push.payload)) + push.payload == wire.encode(push)
    result = FRAMES[8]
    assert isinstance(result, wire.Result)
    assert wire.result_header(result, len(result.payload)) + bytes(result.payload) == wire.encode(result)
    fields = (result.key, result.offset, result.count, result.chunk, result.dtype, result.contributors, result.bitmap)
    assert wire.result_header_of(*fields, len(result.payload)) == wire.result_header(result, len(result.payload))
    with pytest.raises(LocalProtocolError, match="expected"):
        wire.result_header_of(*fields, len(result.payload) + 1)
    with pytest.raises(LocalProtocolError, match="count"):
        wire.result_header_of(result.key, result.offset, 1 << 32, *fields[3:], (1 << 32) * 4)


def _prefix(frame_type: int, header_len: int, payload_len: int, magic: bytes = MAGIC, version: int = PROTOCOL_VERSION) -> bytes:
    return wire.PREFIX.pack(magic, version, frame_type, header_len, payload_len)


def _push_header(**over: int) -> bytes:
    fields = dict(key=1, inc=1, total=10, offset=0, count=2, chunk=0, dtype=1, op=0, root=0)
    fields.update(over)
    return struct.pack("<QQQQIIBBH", *fields.values())


def _hello_frame(job: bytes, *, rank: int = 0, world_size: int = 4, mode: int = 0) -> bytes:
    """A HELLO built by hand, as core/wire.py declares its header (rank, world_size, mode,
    min_contributors, deadline_ms, op_timeout_ms, session, nonce), so that it can carry what the
    encoder refuses to write."""
    header = struct.pack("<IIBxxxIIIQ32s", rank, world_size, mode, 0, 0, 1, 1, NONCE)
    return _prefix(wire.FrameType.HELLO, len(header), len(job)) + header + job


MALFORMED = {
    "bad magic": b"HTTP" + wire.encode(wire.Heartbeat())[4:],
    "unsupported version": _prefix(wire.FrameType.HEARTBEAT, 0, 0, version=99),
    "unknown frame type": _prefix(200, 0, 0),
    "header length mismatch": _prefix(wire.FrameType.PUSH, 3, 0) + b"abc",
    "oversized payload": _prefix(wire.FrameType.PUSH, 44, 2**31) + _push_header(),
    "unknown dtype": _prefix(wire.FrameType.PUSH, 44, 8) + _push_header(dtype=77) + bytes(8),
    "unknown op": _prefix(wire.FrameType.PUSH, 44, 8) + _push_header(op=9) + bytes(8),
    "payload does not match count": _prefix(wire.FrameType.PUSH, 44, 12) + _push_header() + bytes(12),
    "chunk beyond total": _prefix(wire.FrameType.PUSH, 44, 8) + _push_header(offset=9) + bytes(8),
    "payload on a heartbeat": _prefix(wire.FrameType.HEARTBEAT, 0, 4) + b"abcd",
    "unknown error code": _prefix(wire.FrameType.ERROR, 16, 0) + struct.pack("<HBxQI", 999, 0, 0, 0),
    "rank beyond world size": _hello_frame(b"j", rank=5, world_size=4),
    "empty job id": _hello_frame(b""),
    "unknown straggler mode": _hello_frame(b"j", mode=9),
    "job id not utf-8": _hello_frame(b"\xff\xfe"),
    "result bitmap larger than payload":
        _prefix(wire.FrameType.RESULT, 32, 4) + struct.pack("<QQIIBxHI", 1, 0, 1, 0, 1, 1, 8) + bytes(4),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_frames_are_rejected(name: str) -> None:
    decoder = wire.FrameDecoder(max_payload=1 << 20)
    decoder.receive_data(MALFORMED[name])
    with pytest.raises(RemoteProtocolError):
        decoder.next_frame()
    # After an error the decoder is dead and says so again.
    with pytest.raises(RemoteProtocolError):
        decoder.next_frame()
    with pytest.raises(RemoteProtocolError):
        decoder.receive_data(wire.encode(wire.Heartbeat()))


def test_truncation_at_eof_is_an_error() -> None:
    data = wire.encode(FRAMES[5])
    decoder = wire.FrameDecoder()
    decoder.receive_data(data[:-1])
    assert decoder.next_frame() is None
    decoder.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="closed in the middle"):
        decoder.next_frame()


def test_clean_eof_between_frames_is_not_an_error() -> None:
    decoder = wire.FrameDecoder()
    decoder.receive_data(wire.encode(wire.Heartbeat()))
    decoder.receive_data(b"")
    assert decoder.next_frame() == wire.Heartbeat()
    assert decoder.next_frame() is None


def test_decoder_never_buffers_beyond_the_cap() -> None:
    """A length field promising a huge payload is refused before the payload is buffered."""
    decoder = wire.FrameDecoder(max_payload=1024)
    decoder.receive_data(_prefix(wire.FrameType.PUSH, 44, 4096) + _push_header(count=1024, total=1024))
    with pytest.raises(RemoteProtocolError, match="exceeds the cap"):
        decoder.next_frame()


# --- in place: how the event loops drive the decoder (core.transport.FrameReader) ---------------


def _fill(decoder: wire.FrameDecoder, data: bytes) -> int:
    """Move bytes into the decoder's buffer as a socket read would; returns how many it took."""
    room = decoder.buffer()
    n = min(len(room), len(data))
    room[:n] = data[:n]
    if n:
        decoder.filled(n)
    return n


def _events_in_place(decoder: wire.FrameDecoder, data: bytes) -> list[wire.Event]:
    events: list[wire.Event] = []
    for _ in range(len(data) + 100):
        event = decoder.next_event()
        if event is None:
            if not data:
                return events
            data = data[_fill(decoder, data) :]
            continue
        events.append(event)
        if isinstance(event, (wire.PayloadWanted, wire.PayloadLanded)):
            return events
    raise AssertionError("the decoder made no progress")


def test_a_data_frames_header_is_asked_again_until_the_receiver_answers() -> None:
    push = FRAMES[5]
    encoded = wire.encode(push)
    decoder = wire.FrameDecoder(data_frames=frozenset({wire.FrameType.PUSH}))
    [wanted] = _events_in_place(decoder, encoded[:-12])  # the header alone has arrived
    assert isinstance(wanted, wire.PayloadWanted) and wanted.header.fields[0] == 7
    assert not decoder.buffer(), "no byte of the payload is taken before the receiver names its place"
    assert decoder.next_event() == wanted  # a receiver out of memory answers later (WAIT)
    first, second = bytearray(4), bytearray(8)
    decoder.land_payload(memoryview(first), "the first element")
    payload = encoded[-12:]
    _fill(decoder, payload)
    assert isinstance(decoder.next_event(), wire.PayloadLanded) and first == payload[:4]
    decoder.land_payload(memoryview(second), "the rest")
    assert decoder.what == "the rest"
    assert decoder.next_event() is None
    _fill(decoder, payload[4:])
    assert isinstance(decoder.next_event(), wire.PayloadLanded) and second == payload[4:]
    decoder.end_payload()
    assert decoder.between_frames and decoder.what == "a frame"


def test_a_frame_read_with_its_header_waits_in_the_read_ahead_buffer_for_its_place() -> None:
    # Between frames the decoder offers its read-ahead buffer, so prefix, header and the start of
    # the payload come in one read. The payload bytes wait there, at most READ_AHEAD_BYTES of
    # them, until the receiver names their place, and land there in order.
    push = FRAMES[5]
    encoded = wire.encode(push) + wire.encode(FRAMES[10])
    decoder = wire.FrameDecoder(data_frames=frozenset({wire.FrameType.PUSH}))
    assert len(decoder.buffer()) == wire.READ_AHEAD_BYTES
    [wanted] = _events_in_place(decoder, encoded)
    assert isinstance(wanted, wire.PayloadWanted)
    assert decoder.held == 12 + len(wire.encode(FRAMES[10])) and not decoder.buffer()
    assert not decoder.between_frames, "bytes of a frame are held"
    assert decoder.next_event() == wanted  # WAIT: the held bytes stay held
    first, second = bytearray(4), bytearray(8)
    decoder.land_payload(memoryview(first), "the first element")
    assert isinstance(decoder.next_event(), wire.PayloadLanded) and first == encoded[-12 - len(wire.encode(FRAMES[10])) :][:4]
    decoder.land_payload(memoryview(second), "the rest")
    assert isinstance(decoder.next_event(), wire.PayloadLanded)
    decoder.end_payload()
    assert decoder.next_event() == FRAMES[10], "the frame behind it was read ahead too"
    assert decoder.between_frames and not decoder.held


def test_the_read_ahead_takes_at_most_its_size_of_a_large_payload() -> None:
    big = wire.Result(3, 0, 4096, 0, wire.DType.INT32, 1, b"\x01", bytes(range(256)) * 64)
    encoded = wire.encode(big)
    decoder = wire.FrameDecoder(data_frames=frozenset({wire.FrameType.RESULT}))
    taken = _fill(decoder, encoded)
    assert taken == wire.READ_AHEAD_BYTES
    wanted = decoder.next_event()
    assert isinstance(wanted, wire.PayloadWanted)
    header_bytes = len(encoded) - wanted.header.payload_len
    assert decoder.held == wire.READ_AHEAD_BYTES - header_bytes
    payload = bytearray(wanted.header.payload_len)
    decoder.land_payload(memoryview(payload))
    assert decoder.next_event() is None and not decoder.held, "the held bytes are placed, the rest is wanted"
    assert len(decoder.buffer()) == len(payload) - (wire.READ_AHEAD_BYTES - header_bytes)
    _fill(decoder, encoded[taken:])
    assert isinstance(decoder.next_event(), wire.PayloadLanded)
    assert bytes(payload) == encoded[header_bytes:]


def test_a_receiver_cannot_land_more_or_less_than_the_payload() -> None:
    decoder = wire.FrameDecoder(data_frames=frozenset({wire.FrameType.PUSH}))
    _events_in_place(decoder, wire.encode(FRAMES[5]))
    with pytest.raises(ValueError, match="13 bytes for the 12 left"):
        decoder.land_payload(memoryview(bytearray(13)))
    decoder.land_payload(memoryview(bytearray(4)))
    with pytest.raises(ValueError, match="filled"):
        decoder.filled(5)
    decoder.filled(4)
    assert isinstance(decoder.next_event(), wire.PayloadLanded)
    with pytest.raises(ValueError, match="8 bytes of the payload still to land"):
        decoder.end_payload()


def test_a_skipped_payload_longer_than_the_discard_buffer_is_dropped_and_the_next_frame_decoded() -> None:
    big = wire.Result(3, 0, 200_000, 0, wire.DType.INT32, 1, b"\x01", bytes(800_000))
    decoder = wire.FrameDecoder(data_frames=frozenset({wire.FrameType.RESULT}))
    data = wire.encode(big) + wire.encode(FRAMES[10])
    header_len = len(wire.encode(big)) - 800_001
    [wanted] = _events_in_place(decoder, data[:header_len])
    assert isinstance(wanted, wire.PayloadWanted)
    decoder.skip_payload()
    events = _events_in_place(decoder, data[header_len:])
    assert [type(e) for e in events] == [wire.PayloadSkipped, wire.Error]
    assert events[1] == FRAMES[10]


def test_a_skipped_payload_read_ahead_with_its_header_is_dropped_too() -> None:
    small = wire.Result(3, 0, 4, 0, wire.DType.INT32, 1, b"\x01", bytes(16))
    decoder = wire.FrameDecoder(data_frames=frozenset({wire.FrameType.RESULT}))
    [wanted] = _events_in_place(decoder, wire.encode(small) + wire.encode(FRAMES[10]))
    assert isinstance(wanted, wire.PayloadWanted) and decoder.held
    decoder.skip_payload()
    events = _events_in_place(decoder, b"")
    assert [type(e) for e in events] == [wire.PayloadSkipped, wire.Error] and events[1] == FRAMES[10]
    assert decoder.between_frames


def test_a_type_the_receiver_does_not_accept_is_refused_at_its_prefix() -> None:
    decoder = wire.FrameDecoder(accept=frozenset({wire.FrameType.RESULT, wire.FrameType.HEARTBEAT}))
    _fill(decoder, wire.encode(FRAMES[5])[: wire.PREFIX.size])
    with pytest.raises(RemoteProtocolError, match="unexpected PUSH frame"):
        decoder.next_event()
    with pytest.raises(RemoteProtocolError, match="unexpected PUSH frame"):
        decoder.next_event()  # dead: the same error again
    assert not decoder.buffer(), "a dead decoder holds nothing"


def test_a_decoder_fed_bytes_decodes_whole_frames_only() -> None:
    decoder = wire.FrameDecoder(data_frames=frozenset({wire.FrameType.PUSH}))
    decoder.receive_data(wire.encode(FRAMES[5]))
    with pytest.raises(TypeError, match="whole frames"):
        decoder.next_frame()


@pytest.mark.parametrize(
    "frame",
    [
        wire.Push(1, 1, 10, 0, 3, 0, wire.DType.FLOAT32, payload=b"short"),
        wire.Push(-1, 1, 10, 0, 0, 0, wire.DType.FLOAT32),
        wire.Hello("", 0, 1, 1, NONCE),
        wire.Hello("j", 3, 2, 1, NONCE),
        wire.Hello("j", 0, 1, 1, b"short nonce"),
        wire.Result(1, 0, 2, 0, wire.DType.FLOAT32, 1, b"\x01", b"\x00" * 4),
    ],
)
def test_encoding_invalid_frames_is_a_local_error(frame: wire.Frame) -> None:
    with pytest.raises(LocalProtocolError):
        wire.encode(frame)


def test_dtype_codes_round_trip() -> None:
    for code in wire.DType:
        assert wire.dtype_code(wire.numpy_dtype(code)) is code
    assert wire.dtype_code(np.dtype(">f4")) is wire.DType.FLOAT32
    with pytest.raises(LocalProtocolError, match="not supported"):
        wire.dtype_code(np.complex64)


def test_bitmaps() -> None:
    assert wire.ranks_from_bitmap(wire.bitmap_from_ranks(0b1011, 12)) == [0, 1, 3]
    assert len(wire.bitmap_from_ranks(1, 9)) == 2


def test_no_code_bearing_serialisation_in_core() -> None:
    """RELIABILITY R9: no pickle, marshal or eval anywhere in core/."""
    import pathlib
    import re

    import redsrv.core

    core_dir = pathlib.Path(redsrv.core.__file__).parent
    pattern = re.compile(r"\b(import pickle|import marshal|from pickle|from marshal|eval\(|exec\(|pickle\.|marshal\.)")
    offenders = [f"{p.name}:{i}" for p in core_dir.glob("*.py") for i, line in enumerate(p.read_text().splitlines(), 1)
                 if pattern.search(line)]
    assert not offenders, offenders
