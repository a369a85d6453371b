"""Property tests of the decoder: arbitrary bytes give frames or RemoteProtocolError, nothing
else; decoding whole equals decoding in arbitrary pieces; the native plane's C parser
(native/frames.c) gives the same events and errors as the Python one. ``tox -e fuzz`` runs a long
budget."""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redsrv.core import plane, wire
from redsrv.core.constants import DEFAULT_MAX_FRAME_PAYLOAD, MAX_ERROR_MESSAGE_BYTES, MAX_JOB_ID_BYTES, MAX_WORLD_SIZE
from redsrv.core.errors import RemoteProtocolError

EXAMPLES = int(os.environ.get("REDSRV_TEST_FUZZ_EXAMPLES", "300"))
CAP = 1 << 16
fuzz = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

dtypes = st.sampled_from(list(wire.DType))


@st.composite
def pushes(draw: st.DrawFn) -> wire.Push:
    dtype = draw(dtypes)
    count = draw(st.integers(1, 64))
    offset = draw(st.integers(0, 1000))
    itemsize = wire.numpy_dtype(dtype).itemsize
    return wire.Push(draw(st.integers(0, 2**64 - 1)), draw(st.integers(0, 2**64 - 1)), offset + count + draw(st.integers(0, 9)),
                     offset, count, draw(st.integers(0, 2**32 - 1)), dtype, wire.ReduceOp.SUM, 0,
                     draw(st.binary(min_size=count * itemsize, max_size=count * itemsize)))


@st.composite
def results(draw: st.DrawFn) -> wire.Result:
    dtype = draw(dtypes)
    count = draw(st.integers(0, 64))
    itemsize = wire.numpy_dtype(dtype).itemsize
    bitmap = draw(st.binary(max_size=8))
    return wire.Result(draw(st.integers(0, 2**64 - 1)), draw(st.integers(0, 2**40)), count, draw(st.integers(0, 2**32 - 1)),
                       dtype, draw(st.integers(0, 65535)), bitmap,
                       draw(st.binary(min_size=count * itemsize, max_size=count * itemsize)))


frames = st.one_of(
    pushes(), results(), st.just(wire.Heartbeat()),
    st.builds(wire.Error, st.sampled_from(list(wire.ErrorCode)), st.booleans(), st.text(max_size=50),
              st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1)),
    st.builds(wire.Hello, st.text(min_size=1, max_size=30).filter(lambda s: len(s.encode()) <= 128), st.just(0),
              st.integers(1, 65535), st.integers(0, 2**64 - 1), st.binary(min_size=32, max_size=32)),
)


def _norm(frame: wire.Frame) -> wire.Frame:
    if isinstance(frame, (wire.Push, wire.Result)):
        return type(frame)(**{**frame.__dict__, "payload": bytes(frame.payload)})
    return frame


@fuzz
@given(st.lists(frames, max_size=6), st.data())
def test_round_trip_in_arbitrary_pieces(batch: list[wire.Frame], data: st.DataObject) -> None:
    encoded = b"".join(wire.encode(f) for f in batch)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(encoded)), max_size=8)))
    decoder = wire.FrameDecoder(max_payload=CAP)
    out = []
    for a, b in zip([0, *cuts], [*cuts, len(encoded)]):
        if a == b:
            continue  # an empty read means EOF to the decoder
        decoder.receive_data(encoded[a:b])
        while (f := decoder.next_frame()) is not None:
            out.append(_norm(f))
    assert out == [_norm(f) for f in batch]
    assert decoder.buffered == 0


#: A small payload cap, so that inputs of a few hundred bytes can exceed it.
SMALL_CAP = 32
#: The most a decoder may hold once it has handed out every complete frame: the start of a prefix
#: and header, or (the header parsed and dropped) the start of a payload no larger than the cap.
HELD_AT_MOST = max(wire.PREFIX.size + wire.MAX_HEADER_SIZE, SMALL_CAP)


@st.composite
def hostile_streams(draw: st.DrawFn) -> bytes:
    """Random bytes; or the right magic, then random bytes; or a real frame's prefix and header
    announcing a random payload length (the cap's edge, which random bytes alone almost never
    reach), then random bytes."""
    size = draw(st.integers(0, 512))  # uniform sizes: long tails past the cap are common
    blob = draw(st.binary(min_size=size, max_size=size))
    start = draw(st.sampled_from(["none", "magic", "frame"]))
    if start == "magic":
        return wire.encode(wire.Heartbeat())[:4] + blob
    if start == "frame":
        encoded = bytearray(wire.encode(draw(frames)))
        frame_type, header_len, _ = wire.PREFIX.unpack(encoded[: wire.PREFIX.size])[2:]
        announced = draw(st.integers(0, 8 * SMALL_CAP))
        encoded[: wire.PREFIX.size] = wire.PREFIX.pack(wire.MAGIC, wire.PROTOCOL_VERSION, frame_type, header_len, announced)
        return bytes(encoded[: wire.PREFIX.size + header_len]) + blob
    return blob


@fuzz
@given(hostile_streams())
def test_arbitrary_bytes_give_frames_or_remote_protocol_error_and_stay_under_the_cap(data: bytes) -> None:
    decoder = wire.FrameDecoder(max_payload=SMALL_CAP)
    try:
        decoder.receive_data(data)
        while decoder.next_frame() is not None:
            pass
        # Every complete frame is out: what is left is part of one frame, so never a payload
        # beyond the cap (a header that announces one is refused before its payload is held).
        assert decoder.buffered < HELD_AT_MOST, f"{decoder.buffered} bytes held with a cap of {SMALL_CAP}"
        decoder.receive_data(b"")
        while decoder.next_frame() is not None:
            pass
    except RemoteProtocolError:
        assert decoder.buffered == 0, "a dead decoder keeps no bytes"


@fuzz
@given(frames, st.integers(0, 200), st.binary(min_size=1, max_size=4))
def test_corrupting_one_byte_never_escapes_as_another_exception(frame: wire.Frame, position: int, junk: bytes) -> None:
    encoded = bytearray(wire.encode(frame))
    position %= len(encoded)
    encoded[position : position + len(junk)] = junk
    decoder = wire.FrameDecoder(max_payload=CAP)
    try:
        decoder.receive_data(bytes(encoded))
        decoder.receive_data(b"")
        while decoder.next_frame() is not None:
            pass
    except RemoteProtocolError:
        pass


def test_payload_views_are_raw_little_endian() -> None:
    values = np.array([1.5, -2.25], dtype="<f4")
    push = wire.Push(1, 1, 2, 0, 2, 0, wire.DType.FLOAT32, payload=values.tobytes())
    decoder = wire.FrameDecoder()
    decoder.receive_data(wire.encode(push))
    frame = decoder.next_frame()
    assert isinstance(frame, wire.Push)
    assert np.array_equal(np.frombuffer(frame.payload, "<f4"), values)



@fuzz
@given(st.lists(frames, max_size=6), st.data())
def test_in_place_decoding_lands_every_payload_where_the_receiver_said(batch: list[wire.Frame], data: st.DataObject) -> None:
    # The data path's way to drive the decoder (core.transport.FrameReader): bytes arrive in
    # arbitrary amounts into the buffer it names, and data frames' payloads land in parts whose
    # sizes the receiver chooses. The frames equal the encoded ones, and no byte is left over.
    encoded = b"".join(wire.encode(f) for f in batch)
    decoder = wire.FrameDecoder(max_payload=CAP, data_frames=frozenset({wire.FrameType.PUSH, wire.FrameType.RESULT}))
    out: list[wire.Frame] = []
    landed, part = bytearray(), bytearray()
    position = 0
    for _ in range(4 * len(encoded) + 4 * len(batch) + 4):  # each turn moves a byte or ends a step
        event = decoder.next_event()
        if event is None:
            room = decoder.buffer()
            if position == len(encoded):
                break
            n = data.draw(st.integers(1, min(len(room), len(encoded) - position)), label="bytes arriving")
            room[:n] = encoded[position : position + n]
            position += n
            decoder.filled(n)
            continue
        if isinstance(event, (wire.PayloadWanted, wire.PayloadLanded)):
            if isinstance(event, wire.PayloadWanted):
                landed.clear()
            else:
                landed += part
            left = event.header.payload_len - len(landed)
            if isinstance(event, wire.PayloadLanded) and not left:
                out.append(wire.parse_payload(event.header, bytes(landed)))
                decoder.end_payload()
                continue
            part = bytearray(data.draw(st.integers(min(1, left), left), label="part size"))
            decoder.land_payload(memoryview(part), "a part")
            continue
        assert not isinstance(event, wire.PayloadSkipped)
        out.append(event)
    assert position == len(encoded) and decoder.between_frames
    assert [_norm(f) for f in out] == [_norm(f) for f in batch]


# --- the C parser against the reference ---------------------------------------------------------
# The native plane's decoders parse each prefix and header in C (native/frames.c); the Python
# functions are the spec. Both decoders get the same bytes, whole, one byte at a time and in place,
# and must give the same events and the same errors (class and message). tox -e native-asan runs
# these under the sanitizers; tests/unit/test_plane.py fails CI where the plane was not built.

NATIVE_PARSER = plane.kernels_for("native").frames if plane.native_unavailable() is None else None
needs_native = pytest.mark.skipif(NATIVE_PARSER is None, reason=str(plane.native_unavailable()))
DATA_FRAMES = frozenset({wire.FrameType.PUSH, wire.FrameType.RESULT})
#: Caps around the payloads drawn here, plus one beyond 64 bits (the C side takes it as no cap).
max_payloads = st.sampled_from([0, SMALL_CAP, CAP, DEFAULT_MAX_FRAME_PAYLOAD, 2**70])
accepts = st.sampled_from([None, frozenset(wire.FrameType), DATA_FRAMES | {wire.FrameType.HEARTBEAT, wire.FrameType.ERROR}])


#: Every frame type: the handshake's and the acknowledgements too.
any_frames = st.one_of(
    frames, st.builds(wire.Ack, st.integers(0, 2**64 - 1)), st.builds(wire.Safe, st.integers(0, 2**64 - 1)),
    st.builds(wire.Proof, st.binary(min_size=32, max_size=32)),
    st.builds(wire.Welcome, st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)),
    st.builds(wire.Challenge, st.integers(0, 2**64 - 1), st.binary(min_size=32, max_size=32),
              st.binary(min_size=32, max_size=32), st.booleans()),
)

@st.composite
def mutated_streams(draw: st.DrawFn) -> bytes:
    """Valid frames with a few bytes overwritten, mostly in the prefixes and headers, where the
    parser looks (a random length, type, dtype or op), then maybe cut short or given junk."""
    encoded = bytearray(b"".join(wire.encode(f) for f in draw(st.lists(any_frames, min_size=1, max_size=4))))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.one_of(st.integers(0, wire.PREFIX.size + wire.MAX_HEADER_SIZE), st.integers(0, len(encoded))))
        junk = draw(st.binary(min_size=1, max_size=8))
        encoded[at : at + len(junk)] = junk
    return bytes(encoded[: draw(st.integers(0, len(encoded)))]) + draw(st.binary(max_size=16))


streams = st.one_of(st.lists(any_frames, max_size=4).map(lambda batch: b"".join(wire.encode(f) for f in batch)),
                    mutated_streams(), hostile_streams())


def _outcome(error: Exception) -> tuple[str, str, str]:
    return ("error", type(error).__name__, str(error))


def _event(event: wire.Event) -> object:
    # repr too: equal values of another type (a bool for an int) would be a difference
    if isinstance(event, (wire.PayloadWanted, wire.PayloadLanded, wire.PayloadSkipped)):
        return (type(event).__name__, event.header, repr(event.header))
    return (_norm(event), repr(_norm(event)))


def _fed(data: bytes, parser: wire.FrameParser, max_payload: int, accept: frozenset[wire.FrameType] | None,
         step: int) -> list[object]:
    """What a decoder fed ``step`` bytes at a time, then EOF, yields: frames, then maybe an error."""
    decoder = wire.FrameDecoder(max_payload, accept=accept, parser=parser)
    out: list[object] = []
    try:
        for piece in [*(data[i : i + step] for i in range(0, len(data), step)), b""]:
            decoder.receive_data(piece)
            while (frame := decoder.next_frame()) is not None:
                out.append(_event(frame))
            out.append(("held", decoder.buffered))
    except RemoteProtocolError as exc:
        out.append(_outcome(exc))
        with pytest.raises(RemoteProtocolError) as again:  # dead, and says so with the same error
            decoder.next_frame()
        out.append(_outcome(again.value))
    return out


def _in_place(data: bytes, parser: wire.FrameParser, max_payload: int, accept: frozenset[wire.FrameType] | None,
              sizes: list[int]) -> list[object]:
    """The data path's way (core.transport.FrameReader): bytes arrive in the sizes given (cycled)
    into the buffer the decoder names; PUSH payloads land in parts of 3 bytes, RESULT ones are
    skipped."""
    decoder = wire.FrameDecoder(max_payload, data_frames=DATA_FRAMES, accept=accept, parser=parser)
    out: list[object] = []
    position = turn = left = 0
    try:
        for _ in range(4 * len(data) + 16):
            event = decoder.next_event()
            if event is None:
                if position == len(data):
                    break
                room = decoder.buffer()
                n = min(len(room), len(data) - position, sizes[turn % len(sizes)])
                turn += 1
                room[:n] = data[position : position + n]
                position += n
                decoder.filled(n)
                continue
            out.append(_event(event))
            if isinstance(event, wire.PayloadWanted) and event.header.type is wire.FrameType.RESULT:
                decoder.skip_payload()
            elif isinstance(event, (wire.PayloadWanted, wire.PayloadLanded)):
                if isinstance(event, wire.PayloadWanted):
                    left = event.header.payload_len
                if left:
                    part = min(3, left)
                    left -= part
                    decoder.land_payload(memoryview(bytearray(part)))
                else:
                    decoder.end_payload()
        out.append(("between frames", decoder.between_frames, position))
    except RemoteProtocolError as exc:
        out.append(_outcome(exc))
    return out


@needs_native
@fuzz
@given(streams, max_payloads, accepts)
def test_the_c_parser_gives_the_same_frames_and_errors_fed_whole_and_byte_by_byte(
        data: bytes, max_payload: int, accept: frozenset[wire.FrameType] | None) -> None:
    assert NATIVE_PARSER is not None
    for step in (max(1, len(data)), 1):
        assert _fed(data, NATIVE_PARSER, max_payload, accept, step) == _fed(data, wire.PYTHON_PARSER, max_payload, accept, step)


@needs_native
@fuzz
@given(streams, max_payloads, accepts, st.lists(st.integers(1, 64), min_size=1, max_size=4))
def test_the_c_parser_gives_the_same_events_and_errors_in_place(
        data: bytes, max_payload: int, accept: frozenset[wire.FrameType] | None, sizes: list[int]) -> None:
    assert NATIVE_PARSER is not None
    native = _in_place(data, NATIVE_PARSER, max_payload, accept, sizes)
    assert native == _in_place(data, wire.PYTHON_PARSER, max_payload, accept, sizes)


#: The bounds the rules compare with, and one past each: the job id's and an error message's
#: lengths, the largest bitmap, the largest world.
BOUNDS = sorted({b + d for b in (MAX_JOB_ID_BYTES, MAX_ERROR_MESSAGE_BYTES, (MAX_WORLD_SIZE + 7) // 8, MAX_WORLD_SIZE)
                 for d in (0, 1)})


def _field(code: str) -> st.SearchStrategy[int]:
    """A header field of a struct code: every enum's codes (0-11), the bounds, the top, or anything."""
    top = (1 << 8 * struct.calcsize("<" + code)) - 1
    edges = [top - 1, top, *(b for b in BOUNDS if b <= top)]
    return st.one_of(st.integers(0, 11), st.sampled_from(edges), st.integers(0, top))


@st.composite
def headers(draw: st.DrawFn) -> tuple[wire.FrameType, bytes, int]:
    """A header of any type, its fields drawn one by one (dtypes, ops, counts and offsets at their
    edges, where the rules decide), with a payload length that fits it or not."""
    # The types with rules of their own more often than the rest.
    frame_type = draw(st.sampled_from([*wire.FrameType, *[wire.FrameType.PUSH, wire.FrameType.RESULT] * 3]))
    layout = wire._HEADER_STRUCTS[frame_type]
    values: list[int | bytes] = []
    for count, code in re.findall(r"(\d*)([xBHIQs])", layout.format):
        if code == "s":
            values.append(draw(st.binary(min_size=int(count), max_size=int(count))))
        elif code != "x":
            values += [draw(_field(code)) for _ in range(int(count or 1))]
    if frame_type is wire.FrameType.PUSH and draw(st.booleans()):
        # The range rule's edges, of a push the other rules let through: a total one short of
        # offset + count, or just enough, and an offset where offset + count passes 64 bits.
        count = values[4]
        assert isinstance(count, int)
        offset = draw(st.one_of(st.integers(0, 2**64 - 1), st.integers(-1, 1).map(lambda d: (2**64 - count + d) % 2**64)))
        values[2], values[3] = (offset + count + draw(st.sampled_from([-1, 0, 1]))) % 2**64, offset
        values[6], values[7] = draw(st.sampled_from(list(wire.DType))), draw(st.sampled_from(list(wire.ReduceOp)))
    ints = [v if isinstance(v, int) else 0 for v in values]
    fits = 0  # the payload length the header's rules ask for (PUSH: count x itemsize; RESULT: plus the bitmap)
    if frame_type is wire.FrameType.PUSH and ints[6] in wire.NUMPY_DTYPE_BY_CODE:
        fits = ints[4] * wire.NUMPY_DTYPE_BY_CODE[ints[6]].itemsize
    elif frame_type is wire.FrameType.RESULT and ints[4] in wire.NUMPY_DTYPE_BY_CODE:
        fits = ints[6] + ints[2] * wire.NUMPY_DTYPE_BY_CODE[ints[4]].itemsize
    payload_len = draw(st.one_of(st.just(fits % 2**32), st.sampled_from(BOUNDS), st.integers(0, 2**32 - 1), st.integers(0, 4200)))
    return frame_type, layout.pack(*values), payload_len


@needs_native
@fuzz
@given(headers())
def test_the_c_header_rules_are_the_reference_s(case: tuple[wire.FrameType, bytes, int]) -> None:
    # Each rule on its own: streams rarely reach the edges of a push's offset and count.
    assert NATIVE_PARSER is not None
    frame_type, header, payload_len = case
    outcomes = []
    for parser in (NATIVE_PARSER, wire.PYTHON_PARSER):
        try:
            parsed = parser.parse_header(frame_type, header, payload_len)
            outcomes.append((parsed, repr(parsed)))
        except RemoteProtocolError as exc:
            outcomes.append(_outcome(exc))
    assert outcomes[0] == outcomes[1], outcomes


@st.composite
def prefixes(draw: st.DrawFn) -> tuple[bytes, int]:
    """A prefix with each field right or wrong (the magic, the version, the type, its header's
    size), announcing a payload at the cap's edge or anywhere, and the cap."""
    max_payload = draw(max_payloads)
    magic = draw(st.one_of(st.just(wire.MAGIC), st.binary(min_size=4, max_size=4)))
    version = draw(st.one_of(st.just(wire.PROTOCOL_VERSION), _field("B")))
    raw_type = draw(_field("B"))
    size = wire._HEADER_STRUCTS[wire.FrameType(raw_type)].size if raw_type in set(wire.FrameType) else 0
    header_len = draw(st.one_of(st.just(size), _field("H")))
    payload_len = draw(st.one_of(st.integers(-1, 1).map(lambda d: min(max(max_payload + d, 0), 2**32 - 1)), _field("I")))
    return wire.PREFIX.pack(magic, version, raw_type, header_len, payload_len), max_payload


@needs_native
@fuzz
@given(prefixes())
def test_the_c_prefix_rules_are_the_reference_s(case: tuple[bytes, int]) -> None:
    assert NATIVE_PARSER is not None
    prefix, max_payload = case
    outcomes = []
    for parser in (NATIVE_PARSER, wire.PYTHON_PARSER):
        try:
            outcomes.append(parser.parse_prefix(prefix, max_payload))
        except RemoteProtocolError as exc:
            outcomes.append(_outcome(exc))
    assert outcomes[0] == outcomes[1]


@needs_native
def test_the_c_parser_refuses_a_buffer_of_the_wrong_size_as_struct_does() -> None:
    assert NATIVE_PARSER is not None
    for parse in ((lambda p: p.parse_prefix(bytes(11), CAP)), (lambda p: p.parse_header(wire.FrameType.ACK, bytes(9), 0))):
        errors = []
        for parser in (NATIVE_PARSER, wire.PYTHON_PARSER):
            with pytest.raises(struct.error) as caught:
                parse(parser)
            errors.append(str(caught.value))
        assert errors[0] == errors[1]


def test_each_plane_brings_its_parser() -> None:
    assert plane.kernels_for("python").frames is wire.PYTHON_PARSER
    if NATIVE_PARSER is not None:
        assert NATIVE_PARSER.parse_prefix.__module__ == "redsrv.core._plane"


#: One valid header of each type (two pushes: a broadcast's non-root sends no payload).
BASE_FRAMES = [
    wire.Hello("job", 1, 4, 7, bytes(32), wire.StragglerMode.FIRST_M, 3),
    wire.Challenge(9, bytes(32), bytes(32), True),
    wire.Proof(bytes(32)),
    wire.Welcome(9, 1 << 20, 1000),
    wire.Push(5, 9, 100, 10, 3, 1, wire.DType.FLOAT32, wire.ReduceOp.SUM, 0, bytes(12)),
    wire.Push(5, 9, 100, 10, 3, 1, wire.DType.INT8, wire.ReduceOp.BROADCAST, 0, b""),
    wire.Result(5, 10, 3, 1, wire.DType.FLOAT64, 2, b"\x03", bytes(24)),
    wire.Error(wire.ErrorCode.STALE, False, "late", 5, 1),
    wire.Heartbeat(),
    wire.Ack(3),
    wire.Safe(4),
]


def _parse_both(parse: Callable[[wire.FrameParser], object]) -> list[object]:
    outcomes = []
    for parser in (NATIVE_PARSER, wire.PYTHON_PARSER):
        assert parser is not None
        try:
            parsed = parse(parser)
            outcomes.append((parsed, repr(parsed)))
        except RemoteProtocolError as exc:
            outcomes.append(_outcome(exc))
    return outcomes


@needs_native
@pytest.mark.parametrize("base", BASE_FRAMES, ids=lambda f: type(f).__name__)
def test_the_c_header_rules_agree_at_every_edge_of_every_field(base: wire.Frame) -> None:
    # Every field of a valid header set in turn to each code of every enum, each bound and one
    # past it, and the top of its type, with payload lengths at the same edges: the mistakes of
    # one (a bound off by one, a sum that wraps) that random headers seldom reach.
    encoded = wire.encode(base)
    frame_type, header_len, payload_len = wire.parse_prefix(encoded[: wire.PREFIX.size], 2**32)
    layout = wire._HEADER_STRUCTS[frame_type]
    values = list(layout.unpack(encoded[wire.PREFIX.size : wire.PREFIX.size + header_len]))
    codes = [code for count, code in re.findall(r"(\d*)([xBHIQs])", layout.format) if code != "x"
             for _ in range(1 if code == "s" else int(count or 1))]
    lengths = {payload_len, payload_len - 1, payload_len + 1, 0, 1, 2**32 - 1, *BOUNDS}
    checked = 0
    for i, code in enumerate(codes):
        if code == "s":
            continue
        top = (1 << 8 * struct.calcsize("<" + code)) - 1
        for value in {*range(12), *(b for b in BOUNDS if b <= top), top - 1, top}:
            header = layout.pack(*values[:i], value, *values[i + 1 :])
            for length in lengths:
                if 0 <= length < 2**32:
                    outcomes = _parse_both(lambda p: p.parse_header(frame_type, header, length))  # noqa: B023
                    assert outcomes[0] == outcomes[1], (i, value, length)
                    checked += 1
    assert checked or all(code == "s" for code in codes)


@needs_native
@pytest.mark.parametrize("max_payload", [0, SMALL_CAP, CAP, DEFAULT_MAX_FRAME_PAYLOAD, 2**70])
def test_the_c_prefix_rules_agree_at_every_edge(max_payload: int) -> None:
    edges = [0, 1, 2**32 - 1, *(max_payload + d for d in (-1, 0, 1) if 0 <= max_payload + d < 2**32)]
    for magic in (wire.MAGIC, b"RDSW"):
        for version in (wire.PROTOCOL_VERSION, wire.PROTOCOL_VERSION + 1, 0):
            for raw_type in [0, *wire.FrameType, max(wire.FrameType) + 1, 255]:
                size = wire._HEADER_STRUCTS[wire.FrameType(raw_type)].size if raw_type in set(wire.FrameType) else 4
                for header_len in {max(size - 1, 0), size, size + 1, 65535}:
                    for payload_len in edges:
                        prefix = wire.PREFIX.pack(magic, version, raw_type, header_len, payload_len)
                        outcomes = _parse_both(lambda p: p.parse_prefix(prefix, max_payload))  # noqa: B023
                        assert outcomes[0] == outcomes[1], prefix
