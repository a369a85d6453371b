"""Property tests of the decoder: arbitrary bytes give frames or RemoteProtocolError, nothing
else; decoding whole equals decoding in arbitrary pieces. ``tox -e fuzz`` runs a long budget."""

from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redsrv.core import wire
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
